"""Long texts as overlapping token windows (`chunking` on /v1/encode and /v1/embeddings): the windows
the tokenizer itself makes (its truncation with a stride), each chunk's embedding and character span,
the text's embedding the normalised mean of its chunks'; limits count every chunk."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer

from bundle.manifest import load_bundle
from service.runtimes.onnxruntime import OrtEncoder

WORDS = ("the committee will vote on the proposal next thursday after a public consultation while the "
         "delivery arrived two days late but support refunded the shipping cost ").split()
LONG = " ".join(WORDS[i % len(WORDS)] + ("" if i % 7 else ".") for i in range(700))  # about 750 tokens
SPEC = {"tokens": 128, "overlap": 16}


@pytest.fixture(scope="module")
def client(service_url):
    with httpx.Client(base_url=service_url, timeout=120) as c:
        yield c


def unit(x):
    x = np.asarray(x, dtype=np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_chunks_are_the_tokenizers_windows_with_their_spans_and_embeddings(client, default_bundle):
    r = client.post("/v1/encode", json={"inputs": [LONG, "a short one"], "chunking": SPEC})
    assert r.status_code == 200, r.text
    long_item, short_item = r.json()["data"]
    # the windows, made here by the bundle's tokenizer alone
    bundle = load_bundle(default_bundle)
    tokenizer = Tokenizer.from_file(str(bundle.tokenizer_path))
    tokenizer.no_truncation()
    tokenizer.enable_truncation(SPEC["tokens"], stride=SPEC["overlap"])
    first = tokenizer.encode(LONG)
    windows = [first, *first.overflowing]
    chunks = long_item["chunks"]
    assert len(windows) >= 6 and len(chunks) == len(windows)
    assert [c["n_tokens"] for c in chunks] == [len(w.ids) for w in windows]
    assert long_item["n_tokens"] == sum(len(w.ids) for w in windows) and len(short_item["chunks"]) == 1
    for before, after in zip(chunks, chunks[1:]):
        assert 0 <= before["start"] < after["start"] < before["end"] <= after["end"] <= len(LONG)  # they overlap
    assert chunks[0]["start"] == 0 and chunks[-1]["end"] == len(LONG)
    # each chunk's embedding is the model's on its window (onnxruntime fp32 in-process; the service may serve bf16)
    reference = OrtEncoder(bundle, "cpu", 1)
    expected = np.stack([reference.run(np.array([w.ids]), np.ones((1, len(w.ids)), dtype=np.int64),
                                       ["sentence_embedding"])["sentence_embedding"][0] for w in windows])
    got = np.array([c["embedding"] for c in chunks])
    assert (unit(got) * unit(expected)).sum(1).min() >= 0.9999
    # the text's embedding: the normalised mean of its chunks'
    np.testing.assert_allclose(long_item["embedding"], unit(got.mean(0)), atol=1e-6)
    assert float(unit(long_item["embedding"]) @ unit(expected.mean(0))) >= 0.9999


def test_openai_route_returns_the_chunked_texts_embedding(client):
    encode = client.post("/v1/encode", json={"inputs": LONG, "chunking": SPEC}).json()["data"][0]
    openai = client.post("/v1/embeddings", json={"input": LONG, "chunking": SPEC}).json()
    assert openai["usage"]["prompt_tokens"] == encode["n_tokens"]
    np.testing.assert_allclose(openai["data"][0]["embedding"], encode["embedding"], atol=1e-5)
    # without chunking, today's behaviour: cut at the model's limit
    plain = client.post("/v1/encode", json={"inputs": LONG}).json()["data"][0]
    assert plain["n_tokens"] == 256 and "chunks" not in plain


@pytest.mark.parametrize(("payload", "status", "words"), [
    ({"chunking": {"tokens": 512, "overlap": 0}}, 422, ["chunking.tokens 512 is past the model's limit of 256"]),
    ({"chunking": {"tokens": 16, "overlap": 14}}, 422, ["chunking.overlap 14 leaves no new tokens"]),
    ({"chunking": {"tokens": 4}}, 422, ["chunking.tokens"]),
    ({"chunking": SPEC, "tokens": True}, 422, ["chunking returns embeddings"]),
])
def test_chunking_refuses_what_it_cannot_do_with_the_reason(client, payload, status, words):
    r = client.post("/v1/encode", json={"inputs": LONG, **payload})
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


def test_every_chunk_counts_toward_the_token_budget(client):
    budget = client.get("/info").json()["limits"]["max_request_tokens"]
    text = (LONG + " ") * (budget // 700 + 2)  # more tokens than the budget once chunked
    text = text[:100_000]
    r = client.post("/v1/encode", json={"inputs": text, "chunking": SPEC})
    assert r.status_code == 413, r.text
    assert f"at most {budget} per request" in r.json()["error"]["message"] and "chunks" in r.json()["error"]["message"]


@pytest.mark.parametrize("kind", ["default", "roberta", "xlm-roberta"])
def test_window_counts_are_the_windows_the_tokenizer_makes(kind, default_bundle, tmp_path):
    """The budget is checked on counts taken before any window exists: they must be the windows and
    tokens the tokenizer's own truncation with a stride makes, for WordPiece, byte-level BPE and Unigram."""
    import random

    from service.engine.tokenization import TextTokenizer
    from tests.families import FAMILIES, _tokenizer

    path = default_bundle / "tokenizer.json"
    if kind != "default":
        path = tmp_path / "tokenizer.json"
        path.write_text(_tokenizer(FAMILIES[kind][1])[0])
    tokenizer = TextTokenizer(path, 64)
    rng = random.Random(0)
    vocabulary = WORDS + ["über", "東京", "café", "unbelievably", "."]
    texts = [" ".join(rng.choice(vocabulary) for _ in range(n)) for n in (0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 300)]
    for tokens, overlap in [(8, 0), (8, 5), (16, 3), (10, 7), (64, 16)]:
        windows = tokenizer.encode_chunks(texts, tokens, overlap)
        expected = [(len(w), sum(c.n_tokens for c in w)) for w in windows]
        assert tokenizer.chunk_counts(texts, tokens, overlap, stop_above=10**9) == expected, (tokens, overlap)


def test_a_request_of_a_quarter_million_windows_is_refused_at_once(client):
    """The request that took a worker's memory (16 texts of 100k characters, windows of 8 tokens with an
    overlap of 5): a 413 that counts the chunks of the texts it read before passing the budget."""
    text = ((" ".join(WORDS) + " ") * 600)[:100_000]
    r = client.post("/v1/embeddings", json={"input": [text] * 16, "chunking": {"tokens": 8, "overlap": 5}})
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert "chunks of its first 1 of 16 texts" in message and "per request (split it into smaller requests)" in message
