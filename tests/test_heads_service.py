"""Rerank and classify, served: a cross-encoder (one label) and a three-label classifier, exported by
the real pipeline from small checkpoints built locally (tests/families.py), served next to the default
embedding model in one application; answers compared with sentence-transformers' CrossEncoder and
transformers' AutoModelForSequenceClassification, through plain HTTP."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
from tests.conftest import deploy
from tests.families import classifier_labels, make_classifier

QUERY = "how do I reset my password"
DOCUMENTS = ["click forgot password on the sign in page", "the museum is closed on mondays",
             "reset it from the account settings page", "rain tomorrow", "password"]
TEXTS = ["I loved it", "it broke after a day and nobody answered", "fine"]
PREFIX = "/heads"


def make_msmarco_like(out):
    """A cross-encoder shaped as the MS MARCO ones people deploy: 512 tokens, and Identity saved as its
    activation (config.json's sentence_transformers.activation_fn), so CrossEncoder.predict gives the
    logit itself. 512 tokens is what lets one explained pair pass the service's token budget."""
    import json

    make_classifier("bert", out, 1, seed=3, max_tokens=512)
    config = json.loads((out / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def heads(ray_serve, default_bundle, exported_classifier, tmp_path_factory):
    """The app: the default embedding model first, then a BERT cross-encoder, a RoBERTa classifier (the
    session's exports, tests/conftest.py) and an MS MARCO-like cross-encoder (512 tokens, Identity as
    its saved activation)."""
    from export.pipeline import ExportOptions, build_bundle

    root = tmp_path_factory.mktemp("heads")
    checkpoints, bundles = {}, []
    for name in ("ranker", "sentiment"):
        checkpoints[name], bundle = exported_classifier(name)
        bundles.append({"path": str(bundle), "name": name})
    checkpoints["msmarco"] = make_msmarco_like(root / "msmarco-ckpt")
    build_bundle(ExportOptions(str(checkpoints["msmarco"]), root / "msmarco", DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL,
                               name="msmarco", lossy=()), progress=lambda _: None)  # fp32: compared at 1e-4
    bundles.append({"path": str(root / "msmarco"), "name": "msmarco"})
    deploy({"bundles": [{"path": str(default_bundle)}, *bundles], "num_cpus": 0.5}, "heads", PREFIX, default_bundle)
    try:
        with httpx.Client(base_url=ray_serve.url + PREFIX, timeout=60) as client:
            yield client, checkpoints
    finally:
        from ray import serve

        serve.delete("heads")


def test_rerank_is_what_cross_encoder_predicts_sorted_best_first(heads):
    from sentence_transformers import CrossEncoder

    client, checkpoints = heads
    expected = CrossEncoder(str(checkpoints["ranker"]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    r = client.post("/v1/rerank", json={"model": "ranker", "query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "ranker" and body["usage"]["total_tokens"] > 0
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    got = np.array([r["relevance_score"] for r in sorted(results, key=lambda r: r["index"])])
    np.testing.assert_allclose(got, expected, atol=1e-4)
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and "document" not in results[0]
    # top_n, the documents' texts, raw logits; the model left out: the first served classifier
    r = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": True,
                                        "raw_scores": True}).json()
    assert r["model"] == "ranker" and [x["index"] for x in r["results"]] == [x["index"] for x in results[:2]]
    assert [x["document"]["text"] for x in r["results"]] == [DOCUMENTS[x["index"]] for x in results[:2]]
    logits = np.log(expected / (1 - expected))
    np.testing.assert_allclose([x["relevance_score"] for x in r["results"]],
                               [logits[x["index"]] for x in results[:2]], atol=1e-3)


def test_classify_gives_every_label_as_transformers_computes_it(heads):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    client, checkpoints = heads
    path = str(checkpoints["sentiment"])
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokens = AutoTokenizer.from_pretrained(path)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = torch.softmax(model(**tokens).logits, dim=-1).numpy()
    r = client.post("/v1/classify", json={"model": "sentiment", "input": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["usage"]["prompt_tokens"] > 0
    labels = classifier_labels(3)
    for row, item in zip(expected, body["data"], strict=True):
        scores = [x["score"] for x in item["labels"]]
        assert scores == sorted(scores, reverse=True) and abs(sum(scores) - 1) < 1e-5
        got = {x["label"]: x["score"] for x in item["labels"]}
        np.testing.assert_allclose([got[label] for label in labels], row, atol=1e-4)
    one = client.post("/v1/classify", json={"model": "sentiment", "input": TEXTS[0]}).json()
    # alone or beside others in a packed row: the same labels in the same order, the same scores up to
    # float rounding (a row of another length sums in another order)
    alone, together = one["data"][0]["labels"], body["data"][0]["labels"]
    assert len(one["data"]) == 1 and [x["label"] for x in alone] == [x["label"] for x in together]
    np.testing.assert_allclose([x["score"] for x in alone], [x["score"] for x in together], atol=1e-6)


@pytest.mark.parametrize(("path", "payload", "status", "words"), [
    ("/v1/rerank", {"model": "all-MiniLM-L6-v2", "query": "q", "documents": ["d"]}, 422,
     ["is a model of task embedding", "/v1/embeddings", "needs a model of task classification",
      "'ranker' (classification)"]),
    ("/v1/embeddings", {"model": "ranker", "input": "x"}, 422, ["'ranker' is a model of task classification", "/v1/classify"]),
    ("/v1/encode", {"model": "sentiment", "inputs": ["x"]}, 422, ["task classification", "/v1/encode needs"]),
    ("/v1/rerank", {"model": "sentiment", "query": "q", "documents": ["d"]}, 422, ["3 labels", "use /v1/classify"]),
    ("/v1/rerank", {"model": "ranker", "query": "q", "documents": []}, 422, ["documents must not be an empty list"]),
    ("/v1/rerank", {"model": "ranker", "query": "q", "documents": ["d"] * 65}, 413, ["65 inputs; at most 64"]),
    ("/v1/rerank", {"model": "ranker", "query": "q " * 40, "documents": ["d " * 40], "truncate": False}, 413,
     ["pair 0 has", "the model's limit is 64"]),
    ("/v1/classify", {"model": "nope", "input": "x"}, 404, ["'nope' is not served here"]),
])
def test_a_route_that_does_not_fit_the_model_says_which_routes_it_serves(heads, path, payload, status, words):
    client, _ = heads
    r = client.post(path, json=payload)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_models_and_info_say_each_models_task(heads, metrics_url):
    client, _ = heads
    listed = {m["id"]: m["task"] for m in client.get("/v1/models").json()["data"]}
    assert listed == {"all-MiniLM-L6-v2": "embedding", "ranker": "classification", "sentiment": "classification",
                      "msmarco": "classification"}
    info = client.get("/info").json()
    assert info["task"] == "embedding"
    models = {m["model"]: m for m in info["models"]}
    assert models["sentiment"]["labels"] == classifier_labels(3)
    assert models["sentiment"]["problem_type"] == "single_label_classification"
    assert models["ranker"]["problem_type"] == "regression" and len(models["ranker"]["labels"]) == 1
    assert models["all-MiniLM-L6-v2"]["score_activation"] is None
    # the embedding model still serves embeddings in the same app (OpenAI's route wants the model named
    # when several are served)
    r = client.post("/v1/embeddings", json={"input": "still here", "model": "all-MiniLM-L6-v2"})
    assert r.status_code == 200 and r.json()["model"] == "all-MiniLM-L6-v2"
    # the request metrics say each request's task
    from tests.metrics_scrape import poll, total

    app = {"application": "heads"}
    seen = poll(metrics_url, lambda f: total(f, "ray_encoder_requests_total", **app, task="classification",
                                              route="/v1/rerank") >= 1
                and total(f, "ray_encoder_requests_total", **app, task="embedding", route="/v1/embeddings") >= 1,
                "requests counted with their task")
    assert total(seen, "ray_encoder_requests_total", **app, task="embedding", route="/v1/rerank") == 0


@pytest.mark.parametrize("binary", [True, False], ids=["binary-tensors", "json-tensors"])
def test_tritonclient_gets_what_transformers_and_cross_encoder_give(heads, ray_serve, binary):
    """The v2 protocol through the official tritonclient, unchanged: texts to the classifier, text
    pairs to the cross-encoder (`text` and `text_pair`)."""
    import torch
    import tritonclient.http as httpclient
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, checkpoints = heads
    client = httpclient.InferenceServerClient(url=ray_serve.url.removeprefix("http://") + PREFIX)
    assert client.is_model_ready("sentiment")
    metadata = client.get_model_metadata("sentiment")
    assert [i["name"] for i in metadata["inputs"]] == ["text", "text_pair"]
    assert metadata["parameters"]["labels"] == classifier_labels(3)

    def tensor(name, texts):
        t = httpclient.InferInput(name, [len(texts)], "BYTES")
        t.set_data_from_numpy(np.array([x.encode() for x in texts], dtype=np.object_), binary_data=binary)
        return t

    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("logits", "scores")]
    result = client.infer("sentiment", inputs=[tensor("text", TEXTS)], outputs=outputs)
    model = AutoModelForSequenceClassification.from_pretrained(str(checkpoints["sentiment"])).eval()
    tokens = AutoTokenizer.from_pretrained(str(checkpoints["sentiment"]))(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**tokens).logits.numpy()
    np.testing.assert_allclose(result.as_numpy("logits"), logits, atol=1e-4)
    np.testing.assert_allclose(result.as_numpy("scores"), torch.softmax(torch.from_numpy(logits), -1).numpy(), atol=1e-5)

    pairs = client.infer("ranker", inputs=[tensor("text", [QUERY] * len(DOCUMENTS)), tensor("text_pair", DOCUMENTS)],
                         outputs=[httpclient.InferRequestedOutput("logits", binary_data=binary)])
    expected = CrossEncoder(str(checkpoints["ranker"]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    got = 1 / (1 + np.exp(-pairs.as_numpy("logits")[:, 0].astype(np.float64)))
    np.testing.assert_allclose(got, expected, atol=1e-4)


def occlusion_rows(encoding, words: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """The pair's token ids and types, then the same without each explained word's tokens (found here
    from the tokenizer's own word ids and offsets, not from the service's grouping)."""
    word_ids = list(zip(encoding.sequence_ids, encoding.word_ids, strict=True))
    rows, types = [encoding.ids], [encoding.type_ids]
    for w in words:
        keep = [k for k, key in enumerate(word_ids) if key[0] != w["sequence"] or key[1] is None
                or encoding.offsets[k][0] < w["start"] or encoding.offsets[k][1] > w["end"]]
        rows.append([encoding.ids[k] for k in keep])
        types.append([encoding.type_ids[k] for k in keep])
    return rows, types


def hf_scores(path, rows, token_types=None):
    """transformers' logits and attention weights for token id rows, one at a time (no padding)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, attn_implementation="eager").eval()
    logits, attentions = [], []
    with torch.no_grad():
        for k, ids in enumerate(rows):
            extra = {"token_type_ids": torch.tensor([token_types[k]])} if token_types is not None else {}
            out = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                        output_attentions=True, **extra)
            logits.append(out.logits[0].numpy())
            attentions.append(torch.stack(out.attentions)[:, 0].numpy())  # (layers, heads, n, n)
    return np.array(logits, dtype=np.float64), attentions


def test_rerank_explains_each_score_word_by_word(heads):
    """Occlusion: the score minus the score of the pair without the word, computed here by transformers
    on the same token ids; rollout: from transformers' own attention weights."""
    from tokenizers import Tokenizer

    from service.engine.analysis import rollout

    client, checkpoints = heads
    r = client.post("/v1/rerank", json={"model": "ranker", "query": QUERY, "documents": DOCUMENTS[:2], "explain": True})
    assert r.status_code == 200, r.text
    tokenizer = Tokenizer.from_file(str(checkpoints["ranker"] / "tokenizer.json"))
    path = str(checkpoints["ranker"])
    for result in r.json()["results"]:
        document = DOCUMENTS[result["index"]]
        encoding = tokenizer.encode(QUERY, document)
        words = result["explanation"]["words"]
        assert [w["text"] for w in words if w["sequence"] == 0] == QUERY.split()
        assert [w["text"] for w in words if w["sequence"] == 1] == document.split()
        for w in words:
            assert (QUERY, document)[w["sequence"]][w["start"] : w["end"]] == w["text"]
        # each word's tokens removed, scored by transformers
        rows, types = occlusion_rows(encoding, words)
        word_ids = list(zip(encoding.sequence_ids, encoding.word_ids, strict=True))  # for the rollout below
        logits, attentions = hf_scores(path, rows, types)
        scores = 1 / (1 + np.exp(-logits[:, 0]))
        assert abs(result["relevance_score"] - scores[0]) < 1e-4
        np.testing.assert_allclose([w["occlusion"] for w in words], scores[0] - scores[1:], atol=1e-4)
        flow = rollout(attentions[0])[0]
        expected = [sum(flow[k] for k in range(len(encoding.ids)) if word_ids[k][0] == w["sequence"]
                        and word_ids[k][1] is not None and w["start"] <= encoding.offsets[k][0]
                        and encoding.offsets[k][1] <= w["end"]) for w in words]
        np.testing.assert_allclose([w["rollout"] for w in words], expected, atol=1e-4)


def test_classify_explains_the_top_label(heads):
    client, checkpoints = heads
    r = client.post("/v1/classify", json={"model": "sentiment", "input": TEXTS[1], "explain": True})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    top = item["labels"][0]
    explanation = item["explanation"]
    assert explanation["label"] == top["label"] and [w["text"] for w in explanation["words"]] == TEXTS[1].split()
    assert all(np.isfinite(w["occlusion"]) and 0 <= w["rollout"] <= 1 for w in explanation["words"])


def ranker_requests(client, name: str) -> int:
    """Requests the model's runner has computed in the (one) replica, from /info."""
    info = client.get("/info").json()
    return next(m for m in info["models"] if m["model"] == name)["encoder_counters"]["requests"]


def test_explain_counts_words_before_any_inference(heads):
    client, _ = heads
    documents = ["one two three four five"] * 60
    before = ranker_requests(client, "ranker")
    r = client.post("/v1/rerank", json={"model": "ranker", "query": "a query", "documents": documents, "explain": True})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["message"].startswith("explain: 420 words to occlude") and "at most 256" in r.text
    assert ranker_requests(client, "ranker") == before  # nothing ran for the refused request


def test_explain_of_a_long_pair_runs_its_variants_in_jobs_under_the_token_budget(heads):
    """A query and a 120-word document on a 512-token cross-encoder: its 130 occlusion variants are about
    17k tokens, more than one batch's budget (16384), yet under max_explain_words (256). They go in as
    several jobs, and each word's occlusion is still the score of the pair without it, as transformers
    computes it; nothing is refused for a budget the client cannot see."""
    from tokenizers import Tokenizer

    client, checkpoints = heads
    words = (DOCUMENTS[0] + " " + DOCUMENTS[2] + " ").split()
    document = " ".join(words[i % len(words)] for i in range(120))
    budget = client.get("/info").json()["limits"]["max_request_tokens"]
    tokenizer = Tokenizer.from_file(str(checkpoints["msmarco"] / "tokenizer.json"))
    encoding = tokenizer.encode(QUERY, document)
    assert len(encoding.ids) <= 512 and (len(QUERY.split()) + 120) * (len(encoding.ids) - 1) > budget
    r = client.post("/v1/rerank", json={"model": "msmarco", "query": QUERY, "documents": [document], "explain": True})
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    explained = result["explanation"]["words"]
    assert len(explained) == len(QUERY.split()) + 120
    rows, types = occlusion_rows(encoding, explained)
    logits, _ = hf_scores(str(checkpoints["msmarco"]), rows, types)
    assert abs(result["relevance_score"] - logits[0, 0]) < 1e-4  # Identity: the score is the logit
    np.testing.assert_allclose([w["occlusion"] for w in explained], logits[0, 0] - logits[1:, 0], atol=1e-4)


def test_explain_past_the_word_limit_on_a_long_model_runs_nothing(heads):
    """The same refusal on the model whose variants would fill several batches: no job of it ran."""
    client, _ = heads
    document = " ".join(["password"] * 300)
    before = ranker_requests(client, "msmarco")
    r = client.post("/v1/rerank", json={"model": "msmarco", "query": QUERY, "documents": [document], "explain": True})
    assert r.status_code == 413 and "explain: 306 words to occlude" in r.text, r.text
    assert ranker_requests(client, "msmarco") == before


def test_rerank_scores_use_the_activation_saved_with_the_model(heads):
    """An MS MARCO-like cross-encoder saves Identity: CrossEncoder.predict gives the logit, unbounded, and
    so does /v1/rerank (it applied a sigmoid whatever the model said); /info says which activation."""
    from sentence_transformers import CrossEncoder

    client, checkpoints = heads
    cross_encoder = CrossEncoder(str(checkpoints["msmarco"]), device="cpu")
    expected = cross_encoder.predict([(QUERY, d) for d in DOCUMENTS])
    assert type(cross_encoder.activation_fn).__name__ == "Identity"
    assert np.abs(1 / (1 + np.exp(-expected)) - expected).min() > 1e-2  # a sigmoid would be told apart
    r = client.post("/v1/rerank", json={"model": "msmarco", "query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    got = np.array([x["relevance_score"] for x in sorted(r.json()["results"], key=lambda x: x["index"])])
    np.testing.assert_allclose(got, expected, atol=1e-4)
    models = {m["model"]: m for m in client.get("/info").json()["models"]}
    assert models["msmarco"]["score_activation"] == "identity" and models["ranker"]["score_activation"] == "sigmoid"


def test_rerank_explorer_shows_the_ranked_list_coloured_by_attribution(heads, ray_serve):
    """The rerank explorer in headless Chromium: the documents in the API's order, each word coloured by
    its occlusion (blue adds to the score, red takes from it), no console errors."""
    from urllib.parse import quote

    from tests.test_explorer_browser import chromium_driver, console_errors, rgb

    client, _ = heads
    documents = DOCUMENTS[:3]
    expected = client.post("/v1/rerank", json={"model": "ranker", "query": QUERY, "documents": documents,
                                               "explain": True}).json()["results"]
    url = (f"{ray_serve.url}{PREFIX}/explorer/rerank?model=ranker&query={quote(QUERY)}"
           + "".join(f"&doc={quote(d)}" for d in documents))
    driver = chromium_driver()
    try:
        driver.get(url)
        from tests.conftest import wait_until

        wait_until(lambda: driver.execute_script("return document.body.dataset.analysis || null") in ("done", "error"),
                   "the rerank explorer to rank the documents", timeout=60, interval=0.1)
        error = driver.execute_script("return document.getElementById('error').textContent")
        assert driver.execute_script("return document.body.dataset.analysis") == "done", error
        items = driver.find_elements("css selector", "#ranked .ranked-item")
        assert [int(i.get_attribute("data-index")) for i in items] == [r["index"] for r in expected]
        for item, result in zip(items, expected, strict=True):
            assert item.find_element("css selector", ".ranked-score").text == f"{result['relevance_score']:.3f}"
            chips = item.find_elements("css selector", ".chip")
            words = [w for w in result["explanation"]["words"] if w["sequence"] == 1]
            assert [c.text for c in chips] == [w["text"] for w in words]
            scale = max(abs(w["occlusion"]) for r in expected for w in r["explanation"]["words"])
            for chip, word in zip(chips, words, strict=True):
                r, g, b = rgb(chip.value_of_css_property("background-color"))
                if abs(word["occlusion"]) > 0.2 * scale:
                    assert (b > r) == (word["occlusion"] > 0), (word, (r, g, b))
        assert console_errors(driver) == []
    finally:
        driver.quit()
