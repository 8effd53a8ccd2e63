"""Every route over real HTTP against the real service (Ray Serve on loopback, onnxruntime,
all-MiniLM-L6-v2), checked against the in-process references."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch

TEXTS = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "Der Himmel ist heute blau.",
    "今日はいい天気ですね。",
    "",
    " ".join(["a long text that will be truncated at the model limit"] * 40),
]


@pytest.fixture(scope="module")
def client(service_url):
    with httpx.Client(base_url=service_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def st_embeddings(checkpoint):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(checkpoint.path), device="cpu")
    return st.encode(TEXTS, convert_to_numpy=True)


@pytest.fixture(scope="module")
def bert(checkpoint):
    from transformers import BertModel

    return BertModel.from_pretrained(str(checkpoint.path), attn_implementation="eager").eval()


def bert_outputs(bert, checkpoint, text):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint.tokenizer_path))
    tok.enable_truncation(checkpoint.max_tokens)
    tok.no_padding()
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        out = bert(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
    return out.last_hidden_state[0].numpy(), torch.stack(out.attentions)[:, 0].numpy()  # (T, d), (L, H, T, T)


def cosines(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_encode_embeddings_match_sentence_transformers(client, st_embeddings):
    r = client.post("/v1/encode", json={"inputs": TEXTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "all-MiniLM-L6-v2"
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    got = np.array([d["embedding"] for d in body["data"]])
    assert got.shape == (len(TEXTS), 384)
    assert cosines(got, st_embeddings).min() >= 0.9999
    assert body["data"][-1]["n_tokens"] == 256 and body["data"][4]["n_tokens"] == 2
    assert body["usage"]["tokens"] == sum(d["n_tokens"] for d in body["data"])


def test_encode_base64_output_decodes_to_the_float_output(client):
    floats = client.post("/v1/encode", json={"inputs": TEXTS[:3], "token_embeddings": True}).json()["data"]
    r = client.post("/v1/encode", json={"inputs": TEXTS[:3], "token_embeddings": True, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    packed = r.json()["data"]
    for f, b in zip(floats, packed, strict=True):
        embedding = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        tokens = np.frombuffer(base64.b64decode(b["token_embeddings"]), dtype="<f4").reshape(b["n_tokens"], 384)
        np.testing.assert_array_equal(embedding, np.array(f["embedding"], dtype=np.float32))
        np.testing.assert_array_equal(tokens, np.array(f["token_embeddings"], dtype=np.float32))
    assert len(r.content) < len(client.post("/v1/encode", json={"inputs": TEXTS[:3], "token_embeddings": True}).content) / 2


def test_encode_single_string_input(client, st_embeddings):
    r = client.post("/v1/encode", json={"inputs": TEXTS[0]})
    assert r.status_code == 200
    assert cosines([r.json()["data"][0]["embedding"]], st_embeddings[:1])[0] >= 0.9999


def test_attention_weights_match_transformers_on_real_tokens(client, bert, checkpoint):
    texts = ["The cat sat on the mat.", "Short one", "Encoders attend to every token in the sentence at once."]
    r = client.post("/v1/encode", json={"inputs": texts, "embedding": False, "token_embeddings": True, "attention": {}})
    assert r.status_code == 200, r.text
    for text, item in zip(texts, r.json()["data"], strict=True):
        hidden, attentions = bert_outputs(bert, checkpoint, text)
        n = item["n_tokens"]
        assert "embedding" not in item
        att = item["attention"]
        assert att["shape"] == [6, 12, n, n] and att["layers"] == list(range(6)) and att["heads"] == list(range(12))
        weights = np.array(att["data"])
        assert weights.shape == (6, 12, n, n), "trimmed to the text's own tokens, not the batch's"
        assert np.abs(weights - attentions).max() <= 1e-3
        assert np.abs(np.array(item["token_embeddings"]) - hidden).max() <= 1e-3


def test_attention_selection_and_base64_formats(client, bert, checkpoint):
    text = "Select some layers and heads."
    _, attentions = bert_outputs(bert, checkpoint, text)
    for dtype, np_dtype, tol in (("float32", "<f4", 1e-3), ("float16", "<f2", 2e-3)):
        r = client.post(
            "/v1/encode",
            json={"inputs": [text], "attention": {"layers": [5, 0], "heads": [3], "format": "base64", "dtype": dtype}},
        )
        assert r.status_code == 200, r.text
        att = r.json()["data"][0]["attention"]
        n = r.json()["data"][0]["n_tokens"]
        assert att["shape"] == [2, 1, n, n] and att["dtype"] == dtype and att["format"] == "base64"
        decoded = np.frombuffer(base64.b64decode(att["data"]), dtype=np_dtype).reshape(att["shape"])
        expected = attentions[[5, 0]][:, [3]]
        assert np.abs(decoded.astype(np.float32) - expected).max() <= tol


def test_tokens_with_offsets_point_into_the_text(client):
    text = "Grüße aus Köln, 2026!"
    r = client.post("/v1/encode", json={"inputs": [text], "tokens": True, "embedding": False})
    tokens = r.json()["data"][0]["tokens"]
    assert tokens[0]["token"] == "[CLS]" and tokens[0]["special"] and tokens[-1]["token"] == "[SEP]"
    words = [t for t in tokens if not t["special"]]
    assert text[words[0]["start"] : words[0]["end"]].lower().startswith("gr")
    assert all(0 <= t["start"] <= t["end"] <= len(text) for t in words)
    assert r.json()["data"][0]["n_tokens"] == len(tokens)


def test_normalize_false_returns_the_raw_mean_pooled_vector(client):
    text = "Unnormalised vectors keep their length."
    r = client.post("/v1/encode", json={"inputs": [text], "normalize": False, "token_embeddings": True})
    item = r.json()["data"][0]
    raw = np.array(item["embedding"])
    assert abs(np.linalg.norm(raw) - 1.0) > 0.05, "a mean of token vectors is not unit length"
    np.testing.assert_allclose(raw, np.array(item["token_embeddings"]).mean(0), atol=1e-5)
    unit = np.array(client.post("/v1/encode", json={"inputs": [text]}).json()["data"][0]["embedding"])
    if client.get("/info").json()["precision"] == "fp32":
        np.testing.assert_allclose(raw / np.linalg.norm(raw), unit, atol=1e-5)
    else:  # bf16: the unit vector comes from the packed graph, the raw one from the padded graph's hidden
        # states; two bf16 computations of one text agree to bf16's gate, not to fp32's 1e-5
        assert float(raw @ unit / np.linalg.norm(raw)) >= 0.9999


def test_tokenize_route(client):
    r = client.post("/v1/tokenize", json={"inputs": ["hello world", "x " * 500]})
    assert r.status_code == 200
    first, second = r.json()["data"]
    assert [t["token"] for t in first["tokens"]] == ["[CLS]", "hello", "world", "[SEP]"]
    assert not first["truncated"] and second["truncated"] and len(second["tokens"]) == 256


def test_embeddings_route_float_and_base64(client, st_embeddings):
    r = client.post("/v1/embeddings", json={"input": TEXTS[:2], "model": "all-MiniLM-L6-v2"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
    assert [d["object"] for d in body["data"]] == ["embedding", "embedding"]
    assert cosines([d["embedding"] for d in body["data"]], st_embeddings[:2]).min() >= 0.9999
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    b64 = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (384,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    assert cosines([vec], [st_embeddings[0]])[0] >= 0.9999
    # all-MiniLM-L6-v2 was not trained for shorter vectors (matryoshka): `dimensions` is refused, as OpenAI does
    r = client.post("/v1/embeddings", json={"input": TEXTS[0], "dimensions": 64})
    assert r.status_code == 400 and "does not support dimensions" in r.json()["error"]["message"], r.text


def test_info_and_health(client):
    info = client.get("/info").json()
    assert info["model"] == "all-MiniLM-L6-v2"
    assert (info["hidden_size"], info["num_layers"], info["num_heads"], info["max_tokens"]) == (384, 6, 12, 256)
    assert info["provider"] == "CPUExecutionProvider"
    assert info["batching"]["max_batch_tokens"] > 0 and info["parity"]["passed"] is True
    assert len(info["bundle"]["sha256"]) == 64
    assert client.get("/health").json()["status"] == "ok"


def test_v2_protocol_routes(client, st_embeddings):
    assert client.get("/v2").json()["name"] == "mha-encoder-serving"
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").status_code == 200
    meta = client.get("/v2/models/all-MiniLM-L6-v2").json()
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert {o["name"] for o in meta["outputs"]} == {"sentence_embedding", "last_hidden_state", "attention_mask", "attentions"}
    assert client.get("/v2/models/all-MiniLM-L6-v2/ready").json()["ready"] is True
    r = client.post(
        "/v2/models/all-MiniLM-L6-v2/infer",
        json={"id": "req-1", "inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": TEXTS[:2]}],
              "outputs": [{"name": "sentence_embedding"}, {"name": "attention_mask"}]},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "req-1" and body["model_name"] == "all-MiniLM-L6-v2"
    emb = next(o for o in body["outputs"] if o["name"] == "sentence_embedding")
    assert emb["shape"] == [2, 384] and emb["datatype"] == "FP32"
    assert cosines(np.array(emb["data"]).reshape(2, 384), st_embeddings[:2]).min() >= 0.9999
    mask = next(o for o in body["outputs"] if o["name"] == "attention_mask")
    lengths = [len(d["tokens"]) for d in client.post("/v1/tokenize", json={"inputs": TEXTS[:2]}).json()["data"]]
    assert mask["datatype"] == "INT64" and np.array(mask["data"]).reshape(mask["shape"]).sum(1).tolist() == lengths
    assert client.get("/v2/models/nope").status_code == 404
    assert client.post("/v2/models/nope/infer", json={"inputs": []}).status_code == 404


def test_openapi_docs_are_served(client):
    spec = client.get("/openapi.json").json()
    for path in ("/v1/encode", "/v1/embeddings", "/v1/tokenize", "/v2/models/{name}/infer", "/info", "/health"):
        assert path in spec["paths"]
    assert client.get("/docs").status_code == 200


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_the_response_size_estimate_is_what_encode_will_write(client, default_bundle, encoding_format):
    """The 413 check counts what will be written: never less than the real body, and for base64 not
    the three times over it that a JSON float per value would be (which refused base64 token
    embeddings at a third of the limit)."""
    from bundle.manifest import load_bundle
    from service.apis.native.encode import encode_size
    from service.apis.native.schemas import EncodeRequest
    from service.engine.tokenization import TextTokenizer

    payload = {"inputs": TEXTS, "token_embeddings": True, "encoding_format": encoding_format}
    r = client.post("/v1/encode", json=payload)
    assert r.status_code == 200
    bundle = load_bundle(default_bundle)
    tokenized = TextTokenizer(bundle.tokenizer_path, bundle.manifest.model.max_tokens).encode(TEXTS, True)
    estimate = encode_size(EncodeRequest.model_validate(payload), tokenized, None, bundle.manifest.model.hidden_size)
    assert len(r.content) <= estimate, (len(r.content), estimate)
    if encoding_format == "base64":
        assert estimate <= 1.1 * len(r.content), (len(r.content), estimate)
