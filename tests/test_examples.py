"""The client scripts in examples/, each run as a user runs it (a subprocess of this Python) against
the suite's running service, so that they cannot rot: the checks are on what they print.

The open examples run against the default app (service_url). Rerank, auth and the load script run
against one more app: the default model plus a cross-encoder built locally (tests/families.py),
a bearer token required, and limits tight enough (2 requests per replica, 1 queued) that the load
script's concurrent requests are shed with 503 + Retry-After and its retries are exercised. The Qdrant
hybrid-search example runs against the representation models' app (representations_url: a tiny BGE-M3).
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import deploy

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "examples-token"
PREFIX = "/examples"


def run_example(script: str, *args: str, token: str | None = None, timeout: float = 180) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ENCODER_API_TOKEN"}
    if token:
        env["ENCODER_API_TOKEN"] = token
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def secured_with_ranker(ray_serve, default_bundle, exported_classifier, tmp_path_factory):
    """The default model and a BERT ranker (the session's export, tests/conftest.py) behind a token."""
    checkpoint, ranker = exported_classifier("ranker")
    token_file = tmp_path_factory.mktemp("examples") / "token"
    token_file.write_text(TOKEN + "\n")
    deploy({"bundles": [{"path": str(default_bundle)}, {"path": str(ranker), "name": "ranker"}],
            "auth_token_file": str(token_file), "num_cpus": 0.5, "max_ongoing_requests": 2,
            "max_queued_requests": 1, "retry_after_s": 1}, "examples", PREFIX, default_bundle)
    try:
        yield ray_serve.url + PREFIX, checkpoint
    finally:
        from ray import serve

        serve.delete("examples")


def test_openai_example_prints_models_dimension_and_cosine(service_url):
    out = run_example("openai_client.py", "--url", service_url)
    assert "models all-MiniLM-L6-v2" in out
    assert out.count("dimension 384") == 2, out
    cosine = float(re.search(r"cosine (\S+)", out).group(1))
    assert 0.5 < cosine < 1.0, out  # two sentences about eating: similar, not identical


@pytest.mark.parametrize("tensors", ["binary", "json"])
def test_tritonclient_example_gets_normalised_embeddings(service_url, tensors):
    out = run_example("triton_http.py", "--url", service_url, *(["--json"] if tensors == "json" else []))
    assert "server ready True model ready True" in out
    assert "inputs [('text', 'BYTES')]" in out
    assert "sentence_embedding shape [2, 384] norms [1.0, 1.0]" in out, out
    tokens = [int(n) for n in re.search(r"tokens per text \[(.*)\]", out).group(1).split(",")]
    assert tokens[0] == 9, out  # [CLS] the cat sat on the mat . [SEP]


def test_tritonclient_grpc_example_gets_the_same_embeddings_over_grpc(ray_serve, service_url):
    out = run_example("triton_grpc.py", "--target", ray_serve.grpc_target, "--application", "encoder")
    assert "server ready True model ready True" in out, out
    assert "('sentence_embedding', 'FP32', [-1, 384])" in out, out
    assert "sentence_embedding shape [2, 384] norms [1.0, 1.0]" in out, out
    assert "tokens per text [9, " in out and "id example-1" in out, out
    assert "unknown model -> StatusCode.NOT_FOUND" in out, out


def test_attention_example_prints_words_and_contributions_that_sum_to_the_score(service_url):
    out = run_example("attention_similarity.py", "--url", service_url)
    assert "units ['[CLS]', 'Photosynthesis', 'is', 'unbelievable', '.', '[SEP]']" in out, out
    score = float(re.search(r"similarity (\S+)", out).group(1))
    sums = [float(s) for s in re.findall(r"sum of contributions (\S+);", out)]
    assert len(sums) == 2 and all(abs(s - score) < 1e-3 for s in sums), out


def test_rerank_example_ranks_as_cross_encoder_does(secured_with_ranker):
    from sentence_transformers import CrossEncoder

    from examples.rerank import DOCUMENTS, QUERY

    url, checkpoint = secured_with_ranker
    out = run_example("rerank.py", "--url", url, "--model", "ranker", token=TOKEN)
    order = [int(i) for i in re.search(r"order \[(.*)\]", out).group(1).split(",")]
    expected = CrossEncoder(str(checkpoint), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])
    assert order == list(np.argsort(-expected)), (out, expected)
    printed = [float(s) for s in re.findall(r"score (\S+)", out)]
    np.testing.assert_allclose(printed, np.sort(expected)[::-1], atol=1e-4)


def test_auth_example_is_refused_without_the_token_and_served_with_it(secured_with_ranker):
    url, _ = secured_with_ranker
    out = run_example("auth.py", "--url", url, token=TOKEN)
    assert "without a token 401 unauthorized Bearer" in out, out
    assert "with a wrong token 401 unauthorized" in out
    assert "with the token 200 dimension 384" in out
    assert "readiness without a token 200" in out


@pytest.mark.serial
def test_async_load_example_retries_what_is_shed_and_gets_every_answer(secured_with_ranker):
    url, _ = secured_with_ranker
    out = run_example("async_load.py", "--url", url, "--requests", "40", "--concurrency", "12",
                      "--texts", "8", "--words", "60", token=TOKEN, timeout=300)
    found = re.search(r"ok (\d+) of 40; retried after 503 (\d+) \(overloaded (\d+), timeout (\d+)\)", out)
    assert found, out
    ok, retried, overloaded, _ = map(int, found.groups())
    assert ok == 40, out
    assert retried > 0 and overloaded > 0, f"12 clients on room for 3 were never shed: {out}"


def test_tei_and_cohere_client_examples_embed_and_rerank_with_the_token(secured_with_ranker):
    """The drop-in clients' scripts (huggingface_hub, cohere, LlamaIndex, Haystack), each against the
    app that requires a token, with the default model and a cross-encoder."""
    from sentence_transformers import CrossEncoder

    url, checkpoint = secured_with_ranker
    texts = ["A man is eating food.", "A man is eating a piece of bread."]
    expected = CrossEncoder(str(checkpoint), device="cpu").predict([("what is the man eating?", t) for t in texts])
    hub = run_example("tei_huggingface_hub.py", "--url", url, "--reranker", "ranker", token=TOKEN)
    assert "feature_extraction shape [2, 384] norms [1.0, 1.0]" in hub and "normalize=False norms [1.0" not in hub, hub
    assert 0.5 < float(re.search(r"cosine (\S+)", hub).group(1)) < 1.0, hub
    scores = {int(i): float(s) for i, s in re.findall(r"rerank index (\d) score (\S+)", hub)}
    np.testing.assert_allclose([scores[0], scores[1]], expected, atol=1e-3)
    co = run_example("cohere_client.py", "--url", url, "--reranker", "ranker", token=TOKEN)
    assert "float dimension 384 ubinary bytes 48" in co and re.search(r"rerank index \d relevance_score", co), co
    llama = run_example("llama_index_tei.py", "--url", url, "--reranker", token=TOKEN)
    assert "embeddings 2 dimension 384" in llama and llama.count("rerank score") == 3, llama
    haystack = run_example("haystack_tei.py", "--url", url, token=TOKEN)
    assert re.search(r"retrieved \S+ 'A man is eating a piece of bread.'", haystack.splitlines()[0]), haystack


def test_hybrid_qdrant_example_reranks_the_prefetched_candidates_by_the_services_maxsim(representations_url):
    """The Qdrant example against a tiny BGE-M3: Qdrant's order of the dense and sparse candidates is the
    order the service's own /v1/rerank gives them by MaxSim, with the same score (Qdrant sums over the query's
    tokens what /v1/rerank averages), and a document's own text finds that document first."""
    from examples.hybrid_qdrant import generated_texts

    texts = generated_texts(300)
    exact = 123
    out = run_example("hybrid_qdrant.py", "--url", representations_url, "--model", "bge-m3", "--texts", "300",
                      "--batch", "16", "--query", texts[exact], "--query", "fresh bread at the market")
    assert "indexed 300 texts: dense 32, sparse, colbert 32 per token" in out, out
    blocks = out.split("query ")[1:]
    assert len(blocks) == 2, out

    def ids(name: str, block: str) -> list[int]:
        return [int(i) for i in re.search(rf"  {name} \[(.*)\]", block).group(1).split(",")]

    for query, block in zip((texts[exact], "fresh bread at the market"), blocks, strict=True):
        dense, sparse, hybrid = ids("dense", block), ids("sparse", block), ids("hybrid", block)
        assert len(dense) == 20 and 0 < len(sparse) and len(hybrid) == 10, block
        candidates = sorted(set(dense) | set(sparse))
        assert set(hybrid) <= set(candidates), block
        r = httpx.post(f"{representations_url}/v1/rerank", json={
            "model": "bge-m3", "query": query, "documents": [texts[i] for i in candidates], "explain": True},
            timeout=60)
        assert r.status_code == 200, r.text
        maxsim = {candidates[x["index"]]: x["explanation"]["scores"]["multivector"] for x in r.json()["results"]}
        n_query_tokens = len(r.json()["results"][0]["explanation"]["maxsim"])
        # Qdrant's order is the service's MaxSim order: best first, and no candidate left out beats the last
        # one kept (1e-5: float32 sums in two libraries; near-ties may swap within it)
        assert all(maxsim[a] >= maxsim[b] - 1e-5 for a, b in itertools.pairwise(hybrid)), (block, maxsim)
        assert min(maxsim[i] for i in hybrid) >= max(maxsim[i] for i in candidates if i not in hybrid) - 1e-5, maxsim
        printed = {int(i): float(s) for i, s in re.findall(r"id (\d+) maxsim (\S+)", block)}
        np.testing.assert_allclose([printed[i] for i in hybrid], [maxsim[i] * n_query_tokens for i in hybrid],
                                   atol=1e-3)
    assert ids("hybrid", blocks[0])[0] == exact, blocks[0]
    assert ids("dense", blocks[0])[0] == exact, blocks[0]  # cosine 1 with itself
