"""The sparse and multi-vector representations on every protocol (issue 48), against the session's /reps
app (a tiny BGE-M3 and a PyLate ColBERT, tests/conftest.py): TEI's /embed_sparse in TEI's shape and errors;
TEI's /rerank, Cohere's /v2/rerank (through the `cohere` SDK and LlamaIndex's TEI reranker) and vLLM's
/v1/score giving /v1/rerank's late-interaction scores; KServe v2 over HTTP (JSON and binary) and gRPC
(tritonclient) giving the sparse and multi-vector tensors /v1/encode gives, named in the model's metadata.
/v1/encode and /v1/rerank are held against the reference libraries in tests/test_representations.py and
the reference environments; here each protocol is held against them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.errors import error_message
from tests.conftest import encoded

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France, isn't it?", "zebra"]
QUERY = "where is the cat"
DOCUMENTS = ["The cat sat on the mat.", "Stock markets fell today.", "A cat and a dog."]


@pytest.fixture(scope="module")
def client(representations_client):
    return representations_client



def reranked(client, model: str) -> np.ndarray:
    """/v1/rerank's scores of DOCUMENTS, in their order."""
    r = client.post("/v1/rerank", json={"model": model, "query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    return np.array([x["relevance_score"] for x in sorted(r.json()["results"], key=lambda x: x["index"])])


def test_tei_embed_sparse_is_the_sparse_vector_in_teis_shape(client):
    r = client.post("/embed_sparse", json={"model": "bge-m3", "inputs": TEXTS})
    assert r.status_code == 200, r.text
    expected = encoded(client, "bge-m3", TEXTS, embedding=False, sparse=True)
    for got, item in zip(r.json(), expected, strict=True):
        assert all(set(term) == {"index", "value"} for term in got)
        assert [t["index"] for t in got] == item["sparse"]["indices"]
        np.testing.assert_allclose([t["value"] for t in got], item["sparse"]["values"], rtol=1e-6)
    one = client.post("/embed_sparse", json={"model": "bge-m3", "inputs": TEXTS[0]}).json()
    assert one == r.json()[:1]  # a single text is a list of one, as TEI answers


@pytest.mark.parametrize(("body", "status", "error_type", "words"), [
    ({"model": "colbert", "inputs": "x"}, 424, "Backend", "Model is not an embedding model with SPLADE pooling"),
    ({"model": "bge-m3", "inputs": []}, 400, "Empty", "`inputs` cannot be empty"),
    ({"model": "bge-m3", "inputs": "x", "truncate": "yes"}, 422, "Validation", "truncate"),
    ({"model": "bge-m3", "inputs": ["x"] * 65}, 413, "Validation", "65 inputs; at most 64 per request"),
])
def test_tei_embed_sparse_errors_are_teis(client, body, status, error_type, words):
    r = client.post("/embed_sparse", json=body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == error_type, r.text
    assert words in r.json()["error"], r.text


@pytest.mark.parametrize("model", ["colbert", "bge-m3"])
def test_tei_and_cohere_rerank_by_late_interaction_as_v1_rerank(client, representations_url, model):
    import cohere

    expected = reranked(client, model)
    r = client.post("/rerank", json={"model": model, "query": QUERY, "texts": DOCUMENTS, "return_text": True})
    assert r.status_code == 200, r.text
    results = r.json()
    assert [x["index"] for x in results] == np.argsort(-expected, kind="stable").tolist()
    assert all(x["text"] == DOCUMENTS[x["index"]] for x in results)
    np.testing.assert_allclose([x["score"] for x in sorted(results, key=lambda x: x["index"])], expected, rtol=1e-6)
    answer = cohere.ClientV2(base_url=representations_url, api_key="unused").rerank(
        model=model, query=QUERY, documents=DOCUMENTS, top_n=2)
    assert [x.index for x in answer.results] == np.argsort(-expected, kind="stable")[:2].tolist()
    np.testing.assert_allclose([x.relevance_score for x in answer.results], np.sort(expected)[::-1][:2], rtol=1e-6)


def test_llama_index_tei_reranker_ranks_by_maxsim(representations_url, client):
    """LlamaIndex's TEI reranker names no model: TEI's /rerank then takes the first late-interaction model."""
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.postprocessor.tei_rerank import TextEmbeddingInference

    nodes = TextEmbeddingInference(base_url=representations_url, top_n=3).postprocess_nodes(
        [NodeWithScore(node=TextNode(text=d)) for d in DOCUMENTS], query_bundle=QueryBundle(QUERY))
    got = {n.node.text: n.score for n in nodes}
    np.testing.assert_allclose([got[d] for d in DOCUMENTS], reranked(client, "bge-m3"), rtol=1e-6)


@pytest.mark.parametrize("model", ["colbert", "bge-m3"])
def test_vllm_score_is_the_late_interaction_score_with_vllms_pairing(client, model):
    expected = reranked(client, model)
    r = client.post("/v1/score", json={"model": model, "text_1": QUERY, "text_2": DOCUMENTS})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["object"] == "list" and answer["id"].startswith("score-") and answer["model"] == model
    assert [(d["index"], d["object"]) for d in answer["data"]] == [(i, "score") for i in range(3)]
    np.testing.assert_allclose([d["score"] for d in answer["data"]], expected, rtol=1e-6)
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
    # N:N: pair by pair; /score is the same route (where vLLM moved it). A document as a ColBERT's query is
    # past its query length: refused unless cut (truncate_prompt_tokens -1), as vLLM refuses a long input
    cut = {"truncate_prompt_tokens": -1}
    body = {"model": model, "text_1": [QUERY, DOCUMENTS[1]], "text_2": DOCUMENTS[:2]}
    if model == "colbert":
        assert client.post("/score", json=body).status_code == 413
    pairs = client.post("/score", json={**body, **cut})
    assert pairs.status_code == 200, pairs.text
    other = client.post("/v1/score", json={"model": model, "text_1": DOCUMENTS[1], "text_2": [DOCUMENTS[1]],
                                           **cut}).json()
    np.testing.assert_allclose([d["score"] for d in pairs.json()["data"]],
                               [expected[0], other["data"][0]["score"]], rtol=1e-6)


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, 400, "Input lengths must be either 1:1, 1:N or N:N"),
    ({"text_1": [], "text_2": ["a"]}, 400, "At least one text element must be given"),
    ({"text_1": "a", "text_2": []}, 400, "At least one text_pair element must be given"),
    ({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 3}, 400, "truncate_prompt_tokens 3"),
    ({"text_1": "a", "text_2": "b", "priority": 1}, 400, "priority"),
    ({"text_1": 3, "text_2": "b"}, 422, "text_1"),
    ({"text_1": "a", "text_2": ["b"] * 300}, 413, "inputs"),
])
def test_vllm_score_errors_are_vllms(client, body, status, words):
    r = client.post("/v1/score", json={"model": "colbert", **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(r.json()) == {"error"} and set(error) == {"message", "type", "param", "code"}, r.text
    assert error["code"] == status and error["type"].endswith("Error") and words in error["message"], r.text


@pytest.mark.parametrize("transport", ["http-json", "http-binary", "grpc"])
def test_kserve_v2_gives_sparse_and_multivector_tensors_through_tritonclient(ray_serve, client, transport):
    """tritonclient, unchanged, asks BGE-M3 for its sparse and multi-vector tensors by name: flat, with
    offsets and lengths, the values /v1/encode gives; the model's metadata names them."""
    if transport == "grpc":
        import tritonclient.grpc as triton
        triton_client, headers, binary = triton.InferenceServerClient(ray_serve.grpc_target), {"application": "reps"}, {}
    else:
        import tritonclient.http as triton
        triton_client = triton.InferenceServerClient(url=ray_serve.url.removeprefix("http://") + "/reps")
        headers, binary = {}, {"binary_data": transport == "http-binary"}
    metadata = triton_client.get_model_metadata("bge-m3", headers=headers)
    described = ({o.name: list(o.shape) for o in metadata.outputs} if transport == "grpc"
                 else {o["name"]: o["shape"] for o in metadata["outputs"]})
    assert described["sparse_indices"] == [-1] and described["multivector"] == [-1, 32], described
    assert {"sentence_embedding", "sparse_values", "sparse_offsets", "multivector_lengths"} <= set(described)
    text = triton.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_), **binary)
    names = ["sparse_indices", "sparse_values", "sparse_offsets", "multivector", "multivector_lengths"]
    result = triton_client.infer("bge-m3", [text], outputs=[triton.InferRequestedOutput(n, **binary) for n in names],
                                 headers=headers)
    expected = encoded(client, "bge-m3", TEXTS, embedding=False, sparse=True, multivector=True)
    offsets, lengths = result.as_numpy("sparse_offsets"), result.as_numpy("multivector_lengths")
    assert offsets.dtype == lengths.dtype == np.int64 and len(offsets) == len(TEXTS) + 1
    vectors, rows = result.as_numpy("multivector"), np.concatenate([[0], np.cumsum(lengths)])
    for i, item in enumerate(expected):
        assert result.as_numpy("sparse_indices")[offsets[i]:offsets[i + 1]].tolist() == item["sparse"]["indices"]
        np.testing.assert_allclose(result.as_numpy("sparse_values")[offsets[i]:offsets[i + 1]], item["sparse"]["values"],
                                   rtol=1e-5)
        assert [lengths[i], vectors.shape[1]] == item["multivector"]["shape"]
        np.testing.assert_allclose(vectors[rows[i]:rows[i + 1]], item["multivector"]["data"], atol=1e-6)


def test_kserve_v2_colbert_gives_its_query_vectors_and_refuses_what_it_lacks(client):
    """A ColBERT has no dense embedding and no sparse vector: asked for none, it returns its token vectors
    (input_type query: its marker and expansion, as /v1/encode); a sparse output is v2's unknown output."""
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["cat?"]}],
            "parameters": {"input_type": "query"}}
    r = client.post("/v2/models/colbert/infer", json=body)
    assert r.status_code == 200, r.text
    got = {o["name"]: o for o in r.json()["outputs"]}
    assert set(got) == {"multivector", "multivector_lengths"}
    expected = encoded(client, "colbert", ["cat?"], input_type="query")[0]["multivector"]
    assert got["multivector"]["shape"] == expected["shape"] and got["multivector_lengths"]["data"] == [expected["shape"][0]]
    np.testing.assert_allclose(np.reshape(got["multivector"]["data"], expected["shape"]), expected["data"], atol=1e-6)
    names = [o["name"] for o in client.get("/v2/models/colbert").json()["outputs"]]
    assert "sentence_embedding" not in names and "sparse_indices" not in names and "multivector" in names
    for output in ("sparse_indices", "sentence_embedding"):
        refused = client.post("/v2/models/colbert/infer", json={**body, "outputs": [{"name": output}]})
        assert refused.status_code == 422 and f"unknown output '{output}'" in error_message(refused), refused.text


def test_tei_embed_sparse_on_splade_is_the_vocabulary_vector(client):
    r = client.post("/embed_sparse", json={"model": "splade", "inputs": TEXTS})
    assert r.status_code == 200, r.text
    expected = encoded(client, "splade", TEXTS, sparse=True)
    for got, item in zip(r.json(), expected, strict=True):
        assert [t["index"] for t in got] == item["sparse"]["indices"]
        np.testing.assert_allclose([t["value"] for t in got], item["sparse"]["values"], rtol=1e-6)


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/v1/embeddings", {"model": "splade", "input": "x"}, 400, "'splade' gives sparse, not dense"),
    ("/v1/embeddings", {"model": "colbert", "input": "x"}, 400, "'colbert' gives multivector, not dense"),
    ("/embed", {"model": "splade", "inputs": "x"}, 422, "'splade' gives sparse, not dense"),
    ("/v2/embed", {"model": "colbert", "texts": ["x"], "input_type": "search_query", "embedding_types": ["float"]},
     400, "'colbert' gives multivector, not dense"),
    ("/v1/similarity", {"model": "splade", "pairs": [["a", "b"]]}, 400, "'splade' gives sparse, not dense"),
    ("/v1/rerank", {"model": "splade", "query": "a", "documents": ["b"]}, 422, "needs a model of task classification"),
])
def test_dense_routes_refuse_a_model_without_a_dense_embedding(client, path, body, status, words):
    """A SPLADE model's pooled output is its vocabulary vector and a ColBERT pools nothing it was trained
    for: the routes that return dense embeddings say which representation the model gives instead."""
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert words in r.text, r.text
