"""The reference environment `make test` builds: PyLate and FlagEmbedding import at their pins and every
subcommand of tests/reference/run.py runs on small random checkpoints built here, giving what the
libraries document (the facts the ColBERT and BGE-M3 tests rely on); a missing environment or a
failed build says so in one line."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests import reference_env
from tests.families import make_checkpoint
from tests.reference_env import make_bge_m3, run_reference, run_references

ROOT = Path(__file__).resolve().parents[1]
QUERIES = ["What is the capital of France?", "How do I reset my password?"]
DOCUMENTS = [
    ["Paris is the capital and largest city of France.", "Rain is expected tomorrow afternoon.",
     "Le renard brun rapide saute par-dessus le chien paresseux, n'est-ce pas ?"],
    ["How do I reset my password if I no longer have access to my email?", "def add(a, b): return a + b"],
]
DOCUMENTS_IDS = [["paris", "rain", "renard"], ["reset", "code"]]
COLBERT_OPTIONS = {"embedding_size": 16, "query_length": 12}  # shorter than a padded 32-token query: fast
PAIRS = [[QUERIES[0], DOCUMENTS[0][0]], [QUERIES[0], DOCUMENTS[0][1]], [QUERIES[1], DOCUMENTS[1][0]]]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process of the reference environment: a PyLate ColBERT saved from a tiny BERT, then every
    subcommand on it and on a tiny BGE-M3 (the imports, most of the time, paid once)."""
    tmp = tmp_path_factory.mktemp("reference")
    base = make_checkpoint("bert", tmp / "bert")
    colbert, m3 = tmp / "colbert", make_bge_m3(tmp / "bge-m3")
    texts = [text for docs in DOCUMENTS for text in docs]
    names = ["versions", "save", "queries", "documents", "rerank", "m3-encode", "m3-score"]
    results = run_references([
        ("versions", {}),
        ("pylate-save", {"base": str(base), "out": str(colbert), "seed": 0, "options": COLBERT_OPTIONS}),
        ("pylate-encode", {"model": str(colbert), "texts": QUERIES, "is_query": True}),
        ("pylate-encode", {"model": str(colbert), "texts": texts, "is_query": False}),
        ("pylate-rerank", {"model": str(colbert), "queries": QUERIES, "documents": DOCUMENTS,
                           "documents_ids": DOCUMENTS_IDS}),
        ("bge-m3-encode", {"model": str(m3), "texts": [*QUERIES, *texts]}),
        ("bge-m3-score", {"model": str(m3), "pairs": PAIRS}),
    ])
    return {"colbert": colbert, "bge-m3": m3, **dict(zip(names, results))}


def maxsim(query: np.ndarray, document: np.ndarray) -> float:
    """Late interaction: each query vector's best dot product over the document's vectors, summed."""
    return float((query @ document.T).max(axis=1).sum())


def test_the_environment_holds_the_pinned_libraries_on_dot_venvs_torch(references):
    assert references["versions"] == {
        "torch": importlib.metadata.version("torch"),  # linked from .venv, not downloaded again
        "transformers": "5.3.0", "sentence-transformers": "5.3.0", "pylate": "1.6.0", "FlagEmbedding": "1.4.2",
    }


def test_pylate_save_writes_pylates_layout(references):
    saved = references["save"]
    assert {"modules.json", "config_sentence_transformers.json", "config.json", "model.safetensors",
            "tokenizer.json", "1_Dense/config.json", "1_Dense/model.safetensors"} <= set(saved["files"])
    # the base's Pooling module is gone: token vectors through a Dense projection, no pooling
    assert [m["type"] for m in saved["modules"]] == ["sentence_transformers.models.Transformer",
                                                     "pylate.models.Dense.Dense"]
    config = saved["config_sentence_transformers"]
    assert config["model_type"] == "ColBERT" and config["similarity_fn_name"] == "MaxSim"
    assert (config["query_prefix"], config["document_prefix"]) == ("[Q] ", "[D] ")
    assert (config["query_length"], config["document_length"]) == (12, 180)
    assert config["do_query_expansion"] is True and config["attend_to_expansion_tokens"] is False
    assert "." in config["skiplist_words"] and "," in config["skiplist_words"]  # punctuation
    assert {"[Q] ", "[D] "} <= set(saved["added_tokens"])  # added to the vocabulary, embeddings resized
    dense = json.loads((references["colbert"] / "1_Dense" / "config.json").read_text())
    assert (dense["in_features"], dense["out_features"], dense["bias"]) == (32, 16, False)


def test_pylate_encode_expands_queries_and_skips_punctuation_in_documents(references):
    colbert = references["colbert"]
    tokenizer = Tokenizer.from_file(str(colbert / "tokenizer.json"))
    config = json.loads((colbert / "config_sentence_transformers.json").read_text())
    vocab = tokenizer.get_vocab()
    skip = {vocab.get(word, vocab["[UNK]"]) for word in config["skiplist_words"]}  # convert_tokens_to_ids
    for vectors in references["queries"]:  # padded with [MASK] to query_length, every position kept
        assert vectors.shape == (12, 16)
    texts = [text for docs in DOCUMENTS for text in docs]
    for text, vectors in zip(texts, references["documents"], strict=True):
        ids = tokenizer.encode(text).ids  # [CLS] ... [SEP]; PyLate puts [D] after [CLS]
        assert vectors.shape == (len(ids) + 1 - sum(i in skip for i in ids), 16), text
    for vectors in [*references["queries"], *references["documents"]]:
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_pylate_rerank_orders_by_maxsim_from_texts_and_from_vectors(references):
    documents = iter(references["documents"])
    vectors = [[next(documents) for _ in docs] for docs in DOCUMENTS]
    for query, docs, ids, ranked in zip(references["queries"], vectors, DOCUMENTS_IDS, references["rerank"]):
        expected = {doc_id: maxsim(query, doc) for doc_id, doc in zip(ids, docs)}
        assert [hit["id"] for hit in ranked] == sorted(expected, key=expected.get, reverse=True)
        for hit in ranked:
            assert hit["score"] == pytest.approx(expected[hit["id"]], abs=1e-4)
    # the same ranking from the vectors themselves (how a service's output is judged)
    from_vectors = run_reference("pylate-rerank", queries_embeddings=references["queries"],
                                 documents_embeddings=vectors, documents_ids=DOCUMENTS_IDS)
    assert [[h["id"] for h in q] for q in from_vectors] == [[h["id"] for h in q] for q in references["rerank"]]
    np.testing.assert_allclose([[h["score"] for h in q] for q in from_vectors][0],
                               [h["score"] for h in references["rerank"][0]], atol=1e-4)


def test_bge_m3_encode_gives_cls_dense_max_sparse_and_colbert_after_cls(references):
    tokenizer = Tokenizer.from_file(str(references["bge-m3"] / "tokenizer.json"))
    specials = {tokenizer.token_to_id(t) for t in ("<s>", "</s>", "<pad>", "<unk>")}
    output, texts = references["m3-encode"], [*QUERIES, *(t for docs in DOCUMENTS for t in docs)]
    dense, sparse, colbert = output["dense_vecs"], output["lexical_weights"], output["colbert_vecs"]
    assert dense.shape == (len(texts), 32)
    np.testing.assert_allclose(np.linalg.norm(dense, axis=1), 1.0, atol=1e-5)
    for text, weights, vectors in zip(texts, sparse, colbert, strict=True):
        ids = tokenizer.encode(text).ids  # <s> ... </s>
        assert vectors.shape == (len(ids) - 1, 32)  # every token after <s> (CLS), </s> included
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        assert weights and {int(k) for k in weights} <= set(ids) - specials  # one weight per token id
        assert min(weights.values()) > 0  # relu'd, zeros left out


def test_bge_m3_compute_score_is_dense_sparse_colbert_and_their_means(references):
    texts = [*QUERIES, *(t for docs in DOCUMENTS for t in docs)]
    encoded = {text: i for i, text in enumerate(texts)}
    output, scores = references["m3-encode"], references["m3-score"]
    assert set(scores) == {"colbert", "sparse", "dense", "sparse+dense", "colbert+sparse+dense"}
    for n, (query, passage) in enumerate(PAIRS):
        q, p = encoded[query], encoded[passage]
        dense = float(output["dense_vecs"][q] @ output["dense_vecs"][p])
        qw, pw = output["lexical_weights"][q], output["lexical_weights"][p]
        sparse = sum(w * pw[t] for t, w in qw.items() if t in pw)
        # colbert: MaxSim averaged over the query's vectors (all tokens after CLS)
        colbert = maxsim(output["colbert_vecs"][q], output["colbert_vecs"][p]) / len(output["colbert_vecs"][q])
        assert scores["dense"][n] == pytest.approx(dense, abs=1e-4)
        assert scores["sparse"][n] == pytest.approx(sparse, abs=1e-4)
        assert scores["colbert"][n] == pytest.approx(colbert, abs=1e-4)
        # weights_for_different_modes defaults to [1, 1, 1] (dense, sparse, colbert): plain means
        assert scores["sparse+dense"][n] == pytest.approx((sparse + dense) / 2, abs=1e-4)
        assert scores["colbert+sparse+dense"][n] == pytest.approx((colbert + sparse + dense) / 3, abs=1e-4)


def test_a_missing_environment_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(reference_env, "ENV", tmp_path / "nowhere")
    monkeypatch.setattr(reference_env, "STAMP", tmp_path / "nowhere" / ".built-stamp")
    with pytest.raises(pytest.fail.Exception) as failed:
        run_reference("versions")
    message = str(failed.value)
    assert "\n" not in message and "make reference-envs" in message and str(tmp_path / "nowhere") in message


def test_a_failed_build_stops_with_one_line_naming_the_step(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"{tmp_path / 'absent-1.0-py3-none-any.whl'}\n")  # fails at once, no network
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "reference" / "build_env.py"),
                           "--env", str(tmp_path / "env"), "--requirements", str(requirements)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"make reference-envs: pip install --no-deps -r {requirements} failed (exit 1; see {tmp_path / 'env' / 'build.log'})"]
    assert not (tmp_path / "env" / ".built-stamp").exists()


def test_bge_m3_reads_the_heads_make_bge_m3_saves(references):
    """FlagEmbedding initialises colbert_linear and sparse_linear at random, with only a log line, when
    either file is missing: its outputs must be the saved heads applied to the backbone's hidden states."""
    import torch
    import transformers

    path, output = references["bge-m3"], references["m3-encode"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModel.from_pretrained(str(path)).eval()
    colbert, sparse = (torch.load(path / name, weights_only=True) for name in ("colbert_linear.pt", "sparse_linear.pt"))
    assert set(colbert) == set(sparse) == {"weight", "bias"}
    text = QUERIES[0]
    ids = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**ids).last_hidden_state[0]
    vectors = torch.nn.functional.normalize(hidden[1:] @ colbert["weight"].T + colbert["bias"], dim=-1)
    np.testing.assert_allclose(output["colbert_vecs"][0], vectors.numpy(), atol=1e-4)
    weights = torch.relu(hidden @ sparse["weight"].T + sparse["bias"])[:, 0]
    best: dict[str, float] = {}
    specials = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    for token, weight in zip(ids["input_ids"][0].tolist(), weights.tolist()):
        if token not in specials and weight > 0:
            best[str(token)] = max(weight, best.get(str(token), 0.0))
    assert output["lexical_weights"][0].keys() == best.keys()
    for token, weight in best.items():
        assert output["lexical_weights"][0][token] == pytest.approx(weight, abs=1e-4)
    np.testing.assert_allclose(output["dense_vecs"][0], torch.nn.functional.normalize(hidden[0], dim=0).numpy(),
                               atol=1e-4)
