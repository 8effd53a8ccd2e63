"""The service's sparse and multi-vector outputs held against the reference libraries themselves (issue 48):
FlagEmbedding's BGEM3FlagModel (encode, compute_score) and PyLate's ColBERT (encode, rank.rerank), run in the
reference environment `make test` builds (tests/reference_env.py); sentence-transformers' SparseEncoder in
this one. The /reps app serves fp32 (strict parity): 1e-4. The same models at bf16 go through the export's
gates (their RepresentationGate rows, checked here from the manifest)."""

from __future__ import annotations

import numpy as np
import pytest

from bundle.manifest import load_bundle
from tests.conftest import encoded
from tests.reference_env import run_references

QUERIES = ["where does the cat sleep", "capital of France"]
DOCUMENTS = ["The cat sleeps on the warm mat.", "Paris is the capital of France!", "Stocks fell, again; sadly.",
             "A zebra"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def client(representations_client):
    return representations_client



def checkpoint_of(bundle) -> str:
    return str(bundle.parent / f"{bundle.name}-ckpt")


def test_bge_m3_dense_sparse_multivector_and_scores_are_flagembeddings(client, representation_bundles):
    model = checkpoint_of(representation_bundles["bge-m3"])
    texts = QUERIES + DOCUMENTS
    pairs = [[q, d] for q in QUERIES for d in DOCUMENTS]
    reference, scores = run_references([("bge-m3-encode", {"model": model, "texts": texts}),
                                        ("bge-m3-score", {"model": model, "pairs": pairs})])
    ours = encoded(client, "bge-m3", texts, sparse=True, multivector=True)
    for i, item in enumerate(ours):
        np.testing.assert_allclose(item["embedding"], reference["dense_vecs"][i], atol=ATOL)
        weights = reference["lexical_weights"][i]
        assert item["sparse"]["indices"] == sorted(int(k) for k in weights), texts[i]
        np.testing.assert_allclose(item["sparse"]["values"], [weights[str(k)] for k in item["sparse"]["indices"]],
                                   atol=ATOL)
        np.testing.assert_allclose(np.array(item["multivector"]["data"]), reference["colbert_vecs"][i], atol=ATOL)
    for q, query in enumerate(QUERIES):
        r = client.post("/v1/rerank", json={"model": "bge-m3", "query": query, "documents": DOCUMENTS})
        assert r.status_code == 200, r.text
        got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        expected = scores["colbert+sparse+dense"][q * len(DOCUMENTS):(q + 1) * len(DOCUMENTS)]
        np.testing.assert_allclose([got[d] for d in range(len(DOCUMENTS))], expected, atol=ATOL)


def test_colbert_vectors_and_rerank_are_pylates(client, representation_bundles):
    model = checkpoint_of(representation_bundles["colbert"])
    queries, documents, ranked = run_references([
        ("pylate-encode", {"model": model, "texts": QUERIES, "is_query": True}),
        ("pylate-encode", {"model": model, "texts": DOCUMENTS, "is_query": False}),
        ("pylate-rerank", {"model": model, "queries": QUERIES, "documents": [DOCUMENTS] * len(QUERIES),
                           "documents_ids": [list(range(len(DOCUMENTS)))] * len(QUERIES)}),
    ])
    for side, texts, reference in (("query", QUERIES, queries), ("document", DOCUMENTS, documents)):
        for item, expected in zip(encoded(client, "colbert", texts, input_type=side), reference, strict=True):
            got = np.array(item["multivector"]["data"])
            assert got.shape == expected.shape, (side, item["index"])
            np.testing.assert_allclose(got, expected, atol=ATOL)
    for query, hits in zip(QUERIES, ranked, strict=True):
        r = client.post("/v1/rerank", json={"model": "colbert", "query": query, "documents": DOCUMENTS})
        results = r.json()["results"]
        assert [x["index"] for x in results] == [h["id"] for h in hits]
        np.testing.assert_allclose([x["relevance_score"] for x in results], [h["score"] for h in hits], atol=ATOL)


def test_splade_sparse_vectors_are_sparse_encoders(client, representation_bundles):
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(checkpoint_of(representation_bundles["splade"]), device="cpu")
    expected = model.encode(DOCUMENTS + QUERIES, convert_to_tensor=True).to_dense().numpy()
    ours = encoded(client, "splade", DOCUMENTS + QUERIES, sparse_tokens=True)
    for item, row in zip(ours, expected, strict=True):
        assert "embedding" not in item  # a SPLADE model gives its sparse vector by default, no dense one
        assert item["sparse"]["indices"] == np.flatnonzero(row).tolist()
        np.testing.assert_allclose(item["sparse"]["values"], row[row != 0], atol=ATOL)
        assert item["sparse"]["tokens"] == model.tokenizer.convert_ids_to_tokens(item["sparse"]["indices"])
    top = encoded(client, "splade", DOCUMENTS[:1], top_k=5)[0]["sparse"]
    best = np.sort(np.argsort(-expected[0], kind="stable")[:5]).tolist()
    assert top["indices"] == best and len(top["values"]) == 5


@pytest.mark.parametrize("name", ["bge-m3", "colbert", "splade"])
def test_lossy_variants_were_gated_on_their_representations(representation_bundles, name):
    """Every lossy variant the export published passed a gate on the outputs it serves: MaxSim scores for
    token vectors, weights and top terms for a sparse vector (the export's RepresentationGate rows)."""
    manifest = load_bundle(representation_bundles[name]).manifest
    lossy = {p: v for p, v in manifest.variants.items() if p != "fp32"}
    assert lossy, "no lossy variant was published: nothing of the gate is tested"
    for precision, variant in lossy.items():
        kinds = {g.representation for g in variant.quality.representations}
        assert kinds == set(manifest.model.representations) - {"dense"}, (precision, kinds)
        assert variant.passed and all(g.passed for g in variant.quality.representations), variant.quality
