"""One request on every core: on an otherwise idle replica the batch queue lends its free runner slots
to the running batch, whose pieces (packed rows, padded sub-batches) then run at once on the real
sessions; the results, their order and the runs counted are those of the pieces one after another;
under load (every slot held by a batch) nothing is lent and the sessions stay as sized."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.config import BundleRef, ServiceSettings
from service.engine.encoder_service import EncoderService
from service.engine.engine import EngineTable, load_engine
from service.engine.runner import SPLIT_MIN_TOKENS, EncodeJob, halves

# 48 texts of 5 to 40 words: several packed rows of 256 tokens, or one padded sub-batch per length band
TEXTS = [" ".join(f"word{(i * 7 + k) % 50}" for k in range(5 + (i * 13) % 36)) for i in range(48)]


@pytest.fixture(scope="module")
def svc(default_bundle) -> EncoderService:
    # fp32 on onnxruntime: a piece's outputs are the same whichever thread runs it (to 1e-6); two slots
    # of one intra-op thread each, the throughput configuration of a 2-CPU replica
    settings = ServiceSettings.model_validate({"bundle": str(default_bundle), "intra_op_threads": 1, "precision": "fp32",
                                               "runtime": "onnxruntime", "batching": {"max_concurrent_batches": 2}})
    return EncoderService(settings, EngineTable([load_engine(BundleRef(path=default_bundle), settings)]))


def job(svc: EncoderService, texts: list[str], normalize: bool = True) -> EncodeJob:
    engine = svc.engines.default
    tokenized = asyncio.run(svc.tokenize(engine, texts, True, "test"))
    return EncodeJob(route="test", ids=[t.ids for t in tokenized], normalize=normalize)


def counted(runner, before: dict) -> dict:
    return {k: runner.counters[k] - before[k] for k in ("batches", "ort_runs", "lent_runs", "wide_batches")}


@pytest.mark.parametrize("normalize", [True, False], ids=["packed rows", "padded sub-batches"])
def test_one_request_on_an_idle_replica_runs_its_pieces_on_two_slots_at_once(svc, normalize):
    """normalize true: the texts run in packed rows; false (re-pooled from the token encodings) in padded
    sub-batches. Through the batch queue they run on both slots at once (the widest moment of the batch
    had two real runs computing), with the embeddings and run counts of the pieces one after another."""
    engine = svc.engines.default
    runner = engine.runner
    request = job(svc, TEXTS, normalize)
    runs_before = dict(runner.runs_by_graph)
    before = dict(runner.counters)
    in_order = runner.compute([request])[0]  # no lender: one piece after another, in this thread
    alone = counted(runner, before)
    runs_alone = {k: v - runs_before.get(k, 0) for k, v in runner.runs_by_graph.items()}
    assert alone["ort_runs"] >= 2 and alone["lent_runs"] == alone["wide_batches"] == 0, alone

    runs_before, before = dict(runner.runs_by_graph), dict(runner.counters)
    lent = asyncio.run(svc.infer(engine, job(svc, TEXTS, normalize), 60))
    spread = counted(runner, before)
    assert spread["batches"] == 1 and spread["wide_batches"] == 1 and spread["lent_runs"] >= 1, spread
    assert spread["ort_runs"] == alone["ort_runs"]
    assert {k: v - runs_before.get(k, 0) for k, v in runner.runs_by_graph.items()} == runs_alone  # the graph label
    np.testing.assert_allclose(lent.embeddings, in_order.embeddings, atol=1e-6)  # each text in its own row
    assert lent.stats == in_order.stats
    assert engine.batcher.held == 0  # every lent slot given back


def test_a_request_of_one_large_piece_is_cut_in_two_for_the_free_slot(svc):
    """One packed row's worth of texts (under 256 tokens in all, above the cut's minimum) is one run
    alone; on an idle replica it is two rows on two slots, with the same embeddings."""
    engine = svc.engines.default
    runner = engine.runner
    lengths = [len(i) for i in job(svc, TEXTS).ids]
    texts = [text for k, text in enumerate(TEXTS) if sum(lengths[:k + 1]) <= 256]
    request = job(svc, texts)
    assert len(texts) >= 2 and SPLIT_MIN_TOKENS <= request.n_tokens <= 256
    before = dict(runner.counters)
    in_order = runner.compute([request])[0]
    assert counted(runner, before)["ort_runs"] == 1
    before = dict(runner.counters)
    cut = asyncio.run(svc.infer(engine, job(svc, texts), 60))
    assert counted(runner, before) == {"batches": 1, "ort_runs": 2, "lent_runs": 1, "wide_batches": 1}
    np.testing.assert_allclose(cut.embeddings, in_order.embeddings, atol=1e-5)


def test_under_load_every_batch_keeps_one_slot_and_the_sessions_stay_as_sized(svc):
    """Two requests too large to share a batch: the first batch forms with the second queued, the second
    takes the other slot, so nothing is lent to either; the sessions are the ones the replica started with."""
    engine = svc.engines.default
    runner, runtime = engine.runner, engine.runtime
    request = job(svc, TEXTS)
    live = svc.settings.batching.model_copy(update={"max_batch_tokens": request.n_tokens + 10})
    svc.reconfigure(live)
    try:
        jobs = [job(svc, TEXTS) for _ in range(2)]
        before = dict(runner.counters)

        async def together():
            return await asyncio.gather(*(svc.infer(engine, j, 60) for j in jobs))

        results = asyncio.run(together())
    finally:
        svc.reconfigure(svc.settings.batching)
    got = counted(runner, before)
    assert got["batches"] == 2 and got["lent_runs"] == 0 and got["wide_batches"] == 0, got
    assert engine.runtime is runtime and runtime.threads == 1 and runtime.fast.threads == 1
    np.testing.assert_allclose(results[0].embeddings, results[1].embeddings, atol=1e-6)


def test_halves_balances_a_packed_row_by_tokens_and_keeps_its_order():
    lengths = [50, 10, 40, 30, 20, 60]
    first, second = halves([0, 1, 2, 3, 4, 5], lengths)
    assert sorted(first + second) == [0, 1, 2, 3, 4, 5]
    assert abs(sum(lengths[i] for i in first) - sum(lengths[i] for i in second)) <= 10
    assert first == sorted(first) and second == sorted(second)
