"""Sparse and multi-vector representations through the running service (issue 48): one forward pass gives
every representation a request asks for; a representation the model lacks is a 400 naming what it has;
rerank on a late-interaction model scores by MaxSim, explained on request; the response is bounded before
inference. The references (sentence-transformers' SparseEncoder, PyLate, FlagEmbedding) judge the values in
tests/test_representation_references.py."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from bundle.representations import maxsim

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France, isn't it?", "zebra"]


@pytest.fixture(scope="module")
def client(representations_client):
    return representations_client


def test_bge_m3_gives_dense_sparse_and_multivector_from_one_call(client):
    r = client.post("/v1/encode", json={"model": "bge-m3", "inputs": TEXTS, "sparse": True, "multivector": True,
                                        "sparse_tokens": True})
    assert r.status_code == 200, r.text
    for item in r.json()["data"]:
        assert len(item["embedding"]) == 32 and abs(np.linalg.norm(item["embedding"]) - 1) < 1e-5
        sparse = item["sparse"]
        assert sparse["indices"] == sorted(sparse["indices"]) and all(v > 0 for v in sparse["values"])
        assert len(sparse["tokens"]) == len(sparse["indices"])
        vectors = np.array(item["multivector"]["data"])
        assert list(vectors.shape) == item["multivector"]["shape"] == [item["n_tokens"] - 1, 32]  # CLS left out
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    # one pass: asked alone, each representation is the same
    alone = client.post("/v1/encode", json={"model": "bge-m3", "inputs": TEXTS, "embedding": False,
                                            "sparse": True}).json()["data"]
    for a, b in zip(alone, r.json()["data"], strict=True):
        assert "embedding" not in a and a["sparse"]["indices"] == b["sparse"]["indices"]
        np.testing.assert_allclose(a["sparse"]["values"], b["sparse"]["values"], rtol=1e-5)


def test_colbert_queries_are_expanded_documents_skip_punctuation(client, representation_bundles):
    query = client.post("/v1/encode", json={"model": "colbert", "inputs": ["cat?"], "input_type": "query"}).json()
    document = client.post("/v1/encode", json={"model": "colbert", "inputs": ["cat?"],
                                               "input_type": "document"}).json()
    assert "embedding" not in query["data"][0]  # a ColBERT has no dense embedding: its token vectors by default
    assert query["data"][0]["multivector"]["shape"] == [12, 16]  # expanded to query_length with [MASK]
    assert document["data"][0]["multivector"]["shape"][0] == document["data"][0]["n_tokens"]  # marker in, "?" out
    b64 = client.post("/v1/encode", json={"model": "colbert", "inputs": ["cat?"], "input_type": "query",
                                          "encoding_format": "base64"}).json()["data"][0]["multivector"]
    decoded = np.frombuffer(base64.b64decode(b64["data"]), dtype="<f4").reshape(b64["shape"])
    np.testing.assert_allclose(decoded, query["data"][0]["multivector"]["data"], rtol=1e-6)


@pytest.mark.parametrize("model", ["colbert", "bge-m3"])
def test_rerank_by_maxsim_is_the_score_of_the_encoded_vectors(client, model):
    documents = ["The cat sat on the mat.", "Stock markets fell today.", "A cat and a dog."]
    r = client.post("/v1/rerank", json={"model": model, "query": "where is the cat", "documents": documents,
                                        "explain": True})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["relevance_score"] for x in results] == sorted((x["relevance_score"] for x in results), reverse=True)
    q = client.post("/v1/encode", json={"model": model, "inputs": ["where is the cat"], "input_type": "query",
                                        "embedding": False, "multivector": True}).json()["data"][0]
    d = client.post("/v1/encode", json={"model": model, "inputs": documents, "input_type": "document",
                                        "embedding": False, "multivector": True}).json()["data"]
    for x in results:
        match = maxsim(np.array(q["multivector"]["data"]), np.array(d[x["index"]]["multivector"]["data"]),
                       mean=model == "bge-m3")
        explanation = x["explanation"]
        assert len(explanation["maxsim"]) == len(q["multivector"]["data"])
        np.testing.assert_allclose([m["similarity"] for m in explanation["maxsim"]], match.similarity, atol=1e-5)
        if model == "colbert":
            np.testing.assert_allclose(x["relevance_score"], match.score, rtol=1e-5)
        else:
            parts = explanation["scores"]
            np.testing.assert_allclose(parts["multivector"], match.score, rtol=1e-5)
            weights = parts["weights"]
            combined = sum(weights[k] * parts[k] for k in ("dense", "sparse", "multivector")) / sum(weights.values())
            np.testing.assert_allclose(x["relevance_score"], combined, rtol=1e-6)


@pytest.mark.parametrize(("payload", "status", "words"), [
    ({"model": "colbert", "inputs": ["x"], "embedding": True}, 400, ["gives multivector, not dense"]),
    ({"model": "colbert", "inputs": ["x"], "sparse": True}, 400, ["gives multivector, not sparse"]),
    ({"model": "bge-m3", "inputs": ["x"], "top_k": 3}, 422, ["ask sparse: true"]),
    ({"model": "colbert", "inputs": ["x"], "normalize": True}, 422, ["normalize applies to the dense embedding"]),
    ({"model": "bge-m3", "inputs": ["x"], "sparse": True, "chunking": {"tokens": 16}}, 422, ["leave sparse"]),
    ({"model": "bge-m3", "inputs": ["word " * 60] * 64, "multivector": True, "truncate": True}, 413,
     ["the response would be about"]),
])
def test_what_a_model_cannot_give_is_refused_before_inference(client, payload, status, words):
    r = client.post("/v1/encode", json=payload)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


@pytest.mark.parametrize("name", ["bge-m3", "colbert", "splade"])
def test_openvino_gives_the_same_representations_within_their_gates(representation_bundles, name):
    """The replica's other runtime: OpenVINO (bf16 where the CPU has bf16 units, else f32: the same loading and
    I/O code) feeds the same numpy heads from its own outputs; its MaxSim scores and sparse vectors stay within
    the export's gates of onnxruntime fp32's (relative error 0.02, cosine 0.98)."""
    from service.config import ServiceSettings
    from service.engine.engine import load_engine
    from service.engine.runner import EncodeJob

    from bundle.manifest import load_bundle

    # OpenVINO at f32 where the bf16 gate did not publish a variant (a tiny random model can fail its retrieval
    # check): the runtime's loading and I/O are the same
    openvino = "bf16" if "bf16" in load_bundle(representation_bundles[name]).manifest.variants else "fp32"
    results = {}
    for runtime, precision in (("onnxruntime", "fp32"), ("openvino", openvino)):
        settings = ServiceSettings.model_validate({"bundle": str(representation_bundles[name]), "runtime": runtime,
                                                   "precision": precision, "warmup": False})
        engine = load_engine(settings.bundles[0], settings)
        assert engine.runtime.runtime == runtime
        model = engine.model
        ids = [t.ids for t in engine.tokenizer.encode(TEXTS, True)]
        job = EncodeJob(route="/v1/encode", ids=ids, normalize=model.normalize, sparse=model.sparse is not None,
                        multivector=model.multivector is not None)
        results[runtime] = engine.runner.compute([job])[0]
    reference, candidate = results["onnxruntime"], results["openvino"]
    if reference.multivectors is not None:
        for q in range(len(TEXTS)):
            for d in range(len(TEXTS)):
                want = maxsim(reference.multivectors[q], reference.multivectors[d]).score
                got = maxsim(candidate.multivectors[q], candidate.multivectors[d]).score
                assert abs(got - want) <= 0.02 * abs(want), (q, d, got, want)
    if reference.sparse is not None:
        width = max(int(i.max(initial=0)) for i, _ in reference.sparse + candidate.sparse) + 1
        for (ri, rv), (ci, cv) in zip(reference.sparse, candidate.sparse, strict=True):
            a, b = np.zeros(width), np.zeros(width)
            a[ri], b[ci] = rv, cv
            if not a.any():  # a text whose every token is special or weighs 0 (the tiny XLM-R's "zebra")
                assert not b.any()
                continue
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.98
