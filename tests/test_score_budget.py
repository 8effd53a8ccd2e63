"""vLLM's /v1/score N:N on a late-interaction model holds the token budget like every other scoring route
(issue 55, defect 7): 64 pairs of about 50 tokens against a budget of 300 tokens were answered 200, each
query's group checked alone. Here the whole request's tokens are counted before anything runs: a 413 in
vLLM's JSON body, as 1:N, /v1/rerank and cosine N:N answer; what fits the budget still scores each pair
as 1:1 does. Against an app of the session's ColBERT and BGE-M3 with a budget of 300 tokens (deploy())."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

from tests.conftest import deploy

BUDGET = 300
WORDS = ("cat", "mat", "market", "paris", "capital", "river", "stock", "zebra", "garden", "window")


def sentence(i: int, words: int) -> str:
    return f"{i} " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


QUERIES = [sentence(i, 8) for i in range(64)]  # 64 distinct queries: 64 groups of one pair, each within the budget
DOCUMENTS = [sentence(i + 3, 60) for i in range(64)]  # cut at the ColBERT's document length (truncate -1)


@pytest.fixture(scope="module")
def tight_url(ray_serve, representation_bundles):
    deploy({"bundles": [f"{name}={representation_bundles[name]}" for name in ("colbert", "bge-m3")],
            "num_cpus": 0.5, "precision": "fp32", "batching": {"max_batch_tokens": BUDGET}},
           "score-budget", "/score-budget", representation_bundles["colbert"])
    yield f"{ray_serve.url}/score-budget"
    from ray import serve

    serve.delete("score-budget")  # its replica gone: the session's later tests have the CPUs


def scores(url: str, model: str, text_1, text_2) -> httpx.Response:
    return httpx.post(f"{url}/v1/score", json={"model": model, "text_1": text_1, "text_2": text_2,
                                               "truncate_prompt_tokens": -1}, timeout=60)


@pytest.mark.parametrize("model", ["colbert", "bge-m3"])
def test_vllm_score_n_to_n_past_the_token_budget_is_a_413_like_one_to_n_and_rerank(tight_url, model):
    started = time.perf_counter()
    r = scores(tight_url, model, QUERIES, DOCUMENTS)
    took = time.perf_counter() - started
    assert r.status_code == 413, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 413, r.text
    assert "in 64 pairs" in error["message"] and f"at most {BUDGET} per request" in error["message"], error
    assert took < 10, f"{took:.1f}s to refuse"
    # the routes that already held the budget, for the same texts: 1:N and /v1/rerank
    assert scores(tight_url, model, QUERIES[0], DOCUMENTS).status_code == 413
    rerank = httpx.post(f"{tight_url}/v1/rerank", json={"model": model, "query": QUERIES[0], "documents": DOCUMENTS,
                                                        "truncate": True}, timeout=60)
    assert rerank.status_code == 413, rerank.text[:300]


@pytest.mark.parametrize("model", ["colbert", "bge-m3"])
def test_vllm_score_n_to_n_within_the_budget_scores_each_pair_as_one_to_one(tight_url, model):
    r = scores(tight_url, model, QUERIES[:2], DOCUMENTS[:2])  # 2 x (10 + 40) tokens, BGE-M3 2 x (10 + 98)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    alone = [scores(tight_url, model, QUERIES[i], [DOCUMENTS[i]]).json()["data"][0]["score"] for i in range(2)]
    np.testing.assert_allclose([d["score"] for d in data], alone, rtol=1e-6)
    assert r.json()["usage"]["prompt_tokens"] <= BUDGET


def test_the_engine_counts_every_pair_before_any_inference(representation_bundles):
    """At the engine's level: the pairs' tokenization is the only work done for a request past the
    budget; its run (inference) is never called."""
    from service.config import BundleRef, ServiceSettings
    from service.engine.encoder_service import EncoderService
    from service.engine.engine import EngineTable, load_engine
    from service.engine.errors import TooLarge
    from service.engine.late_interaction import late_interaction_pair_scores

    bundle = representation_bundles["colbert"]
    settings = ServiceSettings.model_validate({"bundle": str(bundle), "intra_op_threads": 1, "precision": "fp32",
                                               "batching": {"max_batch_tokens": BUDGET}})
    svc = EncoderService(settings, EngineTable([load_engine(BundleRef(path=bundle), settings)]))
    engine = svc.engines.default
    ran: list = []

    async def run(jobs):
        ran.append(jobs)
        raise AssertionError("inference ran for a request past its budget")

    with pytest.raises(TooLarge, match=r"request has \d+ tokens in 64 pairs; at most 300 per request"):
        asyncio.run(late_interaction_pair_scores(svc, engine, QUERIES, DOCUMENTS, True, "/v1/score", run))
    assert ran == []
