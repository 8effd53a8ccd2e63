"""The attention product over real HTTP against the real service: /v1/attention's rollout, entropy
and top-k against a direct computation from transformers' `output_attentions`, at token and word
level; /v1/similarity against sentence-transformers; the bertviz round trip; limits and errors."""

from __future__ import annotations

import base64
import math

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import deploy
from tests.metrics_scrape import poll, settled, total

TEXTS = [
    "The cat sat on the mat.",
    "Unbelievably, the tokenizer splits uncommon words like photosynthesis into pieces.",
    "Der Himmel ist heute blau, und die Vögel singen.",
    "It's 3:45pm -- don't you think e-mail addresses (like a.b@c.de) are odd?",
    "",
]
PAIRS = [
    ["A man is eating food.", "A man is eating a piece of bread."],
    ["The new movie is awesome.", "The cat plays in the garden."],
    ["Photosynthesis converts light into chemical energy.", "Plants turn sunlight into sugar."],
]


@pytest.fixture(scope="module")
def client(service_url):
    with httpx.Client(base_url=service_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def score_tol(client):
    """How far a similarity score may be from sentence-transformers' fp32: 1e-4 on an fp32 graph; where
    the default serves bf16 (OpenVINO, on CPUs with bf16 units: embeddings within cosine 0.9999 of fp32),
    the cosine of two different texts moves by up to about 1e-3."""
    return 1e-4 if client.get("/info").json()["precision"] == "fp32" else 2e-3


@pytest.fixture(scope="module")
def bert(checkpoint):
    from transformers import BertModel

    return BertModel.from_pretrained(str(checkpoint.path), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint.tokenizer_path))
    tok.enable_truncation(checkpoint.max_tokens)
    tok.no_padding()
    return tok


# ---- the reference: written out from the definitions, on transformers' attentions ----


def reference_attentions(bert, tokenizer, text):
    """(layers, heads, T, T) float64 from transformers, and the tokenizer's encoding."""
    enc = tokenizer.encode(text)
    ids = torch.tensor([enc.ids])
    with torch.no_grad():
        out = bert(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    return torch.stack(out.attentions)[:, 0].double().numpy(), enc


def reference_words(enc):
    """Groups of token positions: pieces with the same word id; special tokens alone."""
    groups, last = [], None
    for i, (word, special) in enumerate(zip(enc.word_ids, enc.special_tokens_mask)):
        key = ("special", i) if special or word is None else word
        if groups and key == last:
            groups[-1].append(i)
        else:
            groups.append([i])
        last = key
    return groups


def reference_to_words(att, groups):
    """Per head: to a word = sum over its pieces, from a word = mean over its pieces (explicit loops)."""
    L, H = att.shape[:2]
    m = len(groups)
    out = np.zeros((L, H, m, m))
    for u, gu in enumerate(groups):
        for v, gv in enumerate(groups):
            out[:, :, u, v] = sum(att[:, :, i, j] for i in gu for j in gv) / len(gu)
    return out


def reference_rollout(att, layers, heads):
    m = att.shape[-1]
    r = np.eye(m)
    for layer in sorted(layers):
        a = att[layer][heads].mean(axis=0)
        a = 0.5 * a + 0.5 * np.eye(m)
        a = a / a.sum(axis=1, keepdims=True)
        r = a @ r
    return r


def reference_entropy(att, layers, heads):
    out = np.zeros((len(layers), len(heads)))
    for li, layer in enumerate(sorted(layers)):
        for hi, head in enumerate(sorted(heads)):
            p = att[layer, head]
            rows = [-sum(x * math.log(x) for x in row if x > 0) for row in p]
            out[li, hi] = sum(rows) / len(rows)
    return out


@pytest.mark.parametrize("level", ["token", "word"])
def test_rollout_entropy_top_k_match_transformers(client, bert, tokenizer, level):
    r = client.post("/v1/attention", json={"inputs": TEXTS, "level": level, "top_k": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["layers"] == list(range(6)) and body["heads"] == list(range(12)) and body["level"] == level
    word_pieces_seen = 0
    for text, item in zip(TEXTS, body["data"], strict=True):
        att, enc = reference_attentions(bert, tokenizer, text)
        groups = [[i] for i in range(len(enc.ids))]
        if level == "word":
            groups = reference_words(enc)
            att = reference_to_words(att, groups)
            word_pieces_seen += sum(len(g) > 1 for g in groups)
        assert item["n_tokens"] == len(enc.ids) and item["n_units"] == len(groups)
        assert [u["tokens"] for u in item["units"]] == groups
        for u in item["units"]:
            if not u["special"]:
                expected = text[u["start"]:u["end"]] if level == "word" else enc.tokens[u["tokens"][0]]
                assert u["text"] == expected
        rollout = reference_rollout(att, range(6), list(range(12)))
        assert np.abs(np.array(item["rollout"]) - rollout).max() <= 1e-4
        np.testing.assert_allclose(np.array(item["rollout"]).sum(axis=1), 1.0, atol=1e-5)
        assert np.abs(np.array(item["entropy"]) - reference_entropy(att, range(6), range(12))).max() <= 1e-4
        for row, got in zip(rollout, item["top_k"], strict=True):
            k = min(4, len(row))
            assert len(got) == k
            np.testing.assert_allclose([w for _, w in got], np.sort(row)[::-1][:k], atol=1e-4)
            for j, w in got:  # the named units carry those weights (ties may come in any order)
                assert abs(row[int(j)] - w) <= 1e-4
    if level == "word":
        assert word_pieces_seen >= 3, "the texts must contain words split into several pieces"


def test_selected_layers_and_heads_in_model_order(client, bert, tokenizer):
    text = TEXTS[1]
    r = client.post("/v1/attention", json={"inputs": text, "layers": [4, 1, 2], "heads": [7, 0],
                                           "summaries": ["rollout", "entropy"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["layers"] == [1, 2, 4] and body["heads"] == [0, 7]
    item = body["data"][0]
    assert "top_k" not in item and "attention" not in item
    att, _ = reference_attentions(bert, tokenizer, text)
    assert np.abs(np.array(item["rollout"]) - reference_rollout(att, [1, 2, 4], [0, 7])).max() <= 1e-4
    assert np.abs(np.array(item["entropy"]) - reference_entropy(att, [1, 2, 4], [0, 7])).max() <= 1e-4


def test_weights_float_and_base64_are_the_unit_matrices(client, bert, tokenizer):
    text = TEXTS[1]
    att, enc = reference_attentions(bert, tokenizer, text)
    words = reference_to_words(att, reference_words(enc))
    r = client.post("/v1/attention", json={"inputs": text, "level": "word", "weights": True, "layers": [5],
                                           "heads": [2, 3], "summaries": []})
    assert r.status_code == 200, r.text
    a = r.json()["data"][0]["attention"]
    assert a["shape"] == [1, 2, words.shape[-1], words.shape[-1]] and a["format"] == "float"
    assert np.abs(np.array(a["data"]) - words[[5]][:, [2, 3]]).max() <= 1e-4
    r = client.post("/v1/attention", json={"inputs": text, "weights": True, "format": "base64", "dtype": "float16",
                                           "layers": [0], "summaries": ["entropy"]})
    a = r.json()["data"][0]["attention"]
    decoded = np.frombuffer(base64.b64decode(a["data"]), dtype="<f2").reshape(a["shape"])
    assert np.abs(decoded - att[[0]]).max() <= 1e-3  # float16


def test_bertviz_round_trip(client):
    """The bertviz format goes straight into the real bertviz package's head_view and model_view."""
    from bertviz import head_view, model_view

    r = client.post("/v1/attention", json={"inputs": "The cat sat on the mat.", "format": "bertviz", "level": "word"})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    tokens, attention = item["tokens"], [torch.tensor(layer) for layer in item["attention"]]
    assert tokens == ["[CLS]", "The", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    assert len(attention) == 6 and all(a.shape == (1, 12, len(tokens), len(tokens)) for a in attention)
    for view in (head_view, model_view):
        html = view(attention, tokens, html_action="return").data
        assert '"mat"' in html  # the tokens are in the page bertviz made
        # bertviz embeds the weights it was given, rounded, as JSON: the first head's first row is there
        first_row = attention[0][0, 0, 0].tolist()
        assert str(round(first_row[1], 2))[:4] in html or str(first_row[1])[:6] in html


def st_tokens(st, text):
    """sentence-transformers' token embeddings of one text (before pooling), float64."""
    return np.asarray(st.encode(text, output_value="token_embeddings").cpu(), dtype=np.float64)


def st_cosine(st, a, b):
    ea, eb = st.encode([a, b], convert_to_numpy=True).astype(np.float64)
    return float(ea @ eb / np.linalg.norm(ea) / np.linalg.norm(eb))


@pytest.fixture(scope="module")
def st(checkpoint):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(checkpoint.path), device="cpu")


@pytest.mark.parametrize("level", ["token", "word"])
def test_similarity_explained_matches_sentence_transformers(client, st, level, score_tol):
    r = client.post("/v1/similarity", json={"pairs": PAIRS, "explain": True, "level": level})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["pooling"] == "mean" and body["note"] is None
    scores = [item["score"] for item in body["data"]]
    assert scores[0] > scores[1]  # the eating pair is closer than the unrelated one
    for pair, item in zip(PAIRS, body["data"], strict=True):
        assert abs(item["score"] - st_cosine(st, *pair)) <= score_tol
        h, g = (st_tokens(st, t) for t in pair)
        a, b = h.mean(axis=0), g.mean(axis=0)
        norms = np.linalg.norm(a) * np.linalg.norm(b)
        direct = [h @ b / (len(h) * norms), g @ a / (len(g) * norms)]
        for side, text in enumerate(item["texts"]):
            shares = np.array([u["contribution"] for u in text["units"]])
            assert abs(shares.sum() - item["score"]) <= 1e-5
            per_unit = np.array([direct[side][u["tokens"]].sum() for u in text["units"]])
            assert np.abs(shares - per_unit).max() <= score_tol
            assert sum(len(u["tokens"]) for u in text["units"]) == len(direct[side])


def test_similarity_without_explain(client, st, score_tol):
    r = client.post("/v1/similarity", json={"pairs": PAIRS[:2]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert all("texts" not in item for item in data)
    for pair, item in zip(PAIRS, data):
        assert abs(item["score"] - st_cosine(st, *pair)) <= score_tol


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/v1/attention", {"inputs": "x", "layers": [6]}, 422, ["layers", "6", "0..5"]),
        ("/v1/attention", {"inputs": "x", "heads": [-1]}, 422, ["heads", "-1"]),
        ("/v1/attention", {"inputs": "x", "heads": []}, 422, ["heads", "empty"]),
        ("/v1/attention", {"inputs": "x", "summaries": ["rollout", "saliency"]}, 422, ["summaries"]),
        ("/v1/attention", {"inputs": "x", "top_k": 0}, 422, ["top_k"]),
        ("/v1/attention", {"inputs": "x", "level": "sentence"}, 422, ["level"]),
        ("/v1/attention", {"inputs": []}, 422, ["inputs"]),
        ("/v1/similarity", {"pairs": [["a", "b"], []]}, 422, ["pairs", "pair 1", "0 texts"]),
        ("/v1/similarity", {"pairs": [["a"]]}, 422, ["pairs", "1 texts"]),
        ("/v1/similarity", {"pairs": []}, 422, ["pairs"]),
        ("/v1/similarity", {"pairs": [["a", "b"]], "level": "char"}, 422, ["level"]),
        ("/v1/similarity", {"pairs": [["a", "b"]] * 33}, 413, ["33 pairs", "66 texts"]),
    ],
)
def test_bad_requests_are_4xx_naming_the_field(client, path, body, status, words):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for word in words:
        assert word in message, message


def test_attention_size_is_refused_before_inference_with_the_numbers(client, service_url):
    long_texts = [" ".join(["word"] * 300)] * 64  # 64 x 256 tokens: 6 x 12 x 256^2 x 64 values
    before = client.get("/info").json()["encoder_counters"]["texts"]
    r = client.post("/v1/attention", json={"inputs": long_texts})
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert f"{6 * 12 * 256**2 * 64} values" in message and "6 layers x 12 heads" in message and "limit" in message
    # the same numbers for /v1/encode asking for attention weights
    r = client.post("/v1/encode", json={"inputs": long_texts, "attention": {"layers": [0], "heads": [0]}})
    assert r.status_code == 413 and f"{6 * 12 * 256**2 * 64} values" in r.json()["error"]["message"]
    assert client.get("/info").json()["encoder_counters"]["texts"] == before  # nothing ran (one replica)


def max_pooling_bundle(out):
    """all-MiniLM-L6-v2's weights with sentence-transformers' pooling config set to max, exported
    by the real pipeline (no lossy variants, to keep it short)."""
    import json
    import shutil

    from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
    from export.checkpoint import resolve_checkpoint
    from export.pipeline import ExportOptions, build_bundle

    source, _ = resolve_checkpoint("default")
    checkpoint = out / "checkpoint"
    shutil.copytree(source, checkpoint, symlinks=True)
    pooling = checkpoint / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=False, pooling_mode_max_tokens=True)
    pooling.write_text(json.dumps(config))
    build_bundle(ExportOptions(str(checkpoint), out / "bundle", DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL,
                               name="minilm-max", lossy=()), progress=lambda _: None)
    return out / "bundle"


def test_max_pooling_cannot_be_explained(ray_serve, tmp_path_factory, st):
    """A bundle whose model pools with max: the score is served, explain is a 422 that says why."""
    bundle = max_pooling_bundle(tmp_path_factory.mktemp("max-pool"))
    deploy({"num_cpus": 0.5}, "max-pool", "/max-pool", bundle)
    try:
        with httpx.Client(base_url=ray_serve.url + "/max-pool", timeout=60) as c:
            r = c.post("/v1/similarity", json={"pairs": PAIRS[:1], "explain": True})
            assert r.status_code == 422, r.text
            message = r.json()["error"]["message"]
            assert message.startswith("explain: ") and "'max'" in message and "no exact per-token split" in message
            r = c.post("/v1/similarity", json={"pairs": PAIRS[:1]})
            assert r.status_code == 200, r.text
            assert r.json()["pooling"] == "max"
            ea, eb = (st_tokens(st, t).max(axis=0) for t in PAIRS[0])
            expected = float(ea @ eb / np.linalg.norm(ea) / np.linalg.norm(eb))
            assert abs(r.json()["data"][0]["score"] - expected) <= 1e-4
    finally:
        from ray import serve

        serve.delete("max-pool")


def test_new_routes_count_in_the_metrics(client, metrics_url):
    """Requests to the new routes count like every other route's, by route template and status."""
    app = {"application": "encoder"}
    routes = ("/v1/attention", "/v1/similarity")

    def counts(f):
        return {(route, status): total(f, "ray_encoder_requests_total", **app, route=route, status_class=status)
                for route in routes for status in ("2xx", "4xx")}

    before = counts(settled(metrics_url, counts))
    assert client.post("/v1/attention", json={"inputs": "metrics"}).status_code == 200
    assert client.post("/v1/similarity", json={"pairs": [["a", "b"]]}).status_code == 200
    assert client.post("/v1/attention", json={"inputs": "x", "layers": [9]}).status_code == 422
    assert client.post("/v1/similarity", json={"pairs": [["a"]]}).status_code == 422
    expected = {key: value + 1 for key, value in before.items()}
    poll(metrics_url, lambda f: counts(f) == expected,
         what=f"the 2xx and 4xx request counters of {routes} to move by one each, to {expected}")
