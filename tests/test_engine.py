"""The engine on its own, without Ray or HTTP: the real bundle, real tokenizer and onnxruntime, the
EncoderService's steps as the routes call them, concurrent requests through one batch queue."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.config import BundleRef, ServiceSettings
from service.engine.engine import EngineTable, load_engine
from service.engine.errors import ClientGone, InvalidRequest, NotFound, Timeout, TooLarge
from service.engine.runner import EncodeJob
from service.engine.service import EncoderService

TEXTS = [f"sentence number {i} about {'cats' if i % 2 else 'the weather'} and more" for i in range(24)]


@pytest.fixture(scope="module")
def svc(default_bundle) -> EncoderService:
    settings = ServiceSettings.model_validate({"bundle": str(default_bundle), "intra_op_threads": 1,
                                               "batching": {"max_concurrent_batches": 1}})
    engines = EngineTable([load_engine(BundleRef(path=default_bundle), settings)])
    return EncoderService(settings, engines)


async def embed(svc: EncoderService, texts: list[str], timeout: float = 30.0, gone=None) -> np.ndarray:
    engine = svc.engines.get(None)
    tokenized = await svc.tokenize(engine, svc.texts(texts), True, "/v1/embeddings")
    job = EncodeJob(route="/v1/embeddings", ids=[t.ids for t in tokenized], normalize=engine.model.normalize)
    return (await svc.infer(engine, job, timeout, gone)).embeddings


def test_concurrent_single_texts_fill_batches_and_each_gets_its_own_embedding(svc):
    async def scenario():
        alone = await embed(svc, TEXTS)  # one request of all the texts: the reference
        before = dict(svc.engines.default.runner.counters)
        singles = await asyncio.gather(*(embed(svc, [t]) for t in TEXTS))
        after = svc.engines.default.runner.counters
        return alone, np.concatenate(singles), after["batches"] - before["batches"]

    alone, singles, batches = asyncio.run(scenario())
    np.testing.assert_allclose(singles, alone, atol=1e-5)
    assert batches <= 2, f"{batches} batches for {len(TEXTS)} requests queued together"  # one, or one + the rest


def test_requests_past_their_deadline_or_whose_caller_left_are_not_computed(svc):
    engine = svc.engines.default
    release = asyncio.Event()

    async def scenario():
        original = engine.batcher.run

        async def slow(jobs):  # the first batch holds the runner until the test lets it go
            await release.wait()
            return await original(jobs)

        engine.batcher.run = slow
        try:
            first = asyncio.ensure_future(embed(svc, ["the one being computed"]))
            while engine.batcher.running == 0:
                await asyncio.sleep(0.001)
            texts_before = engine.runner.counters["texts"]
            left = asyncio.get_running_loop().create_future()
            gone_soon = asyncio.ensure_future(embed(svc, ["the caller leaves"], gone=left))
            late = asyncio.ensure_future(embed(svc, ["past its deadline"], timeout=0.05))
            with pytest.raises(Timeout):
                await late
            left.set_result(None)
            with pytest.raises(ClientGone):
                await gone_soon
            release.set()
            await first
            return engine.runner.counters["texts"] - texts_before
        finally:
            engine.batcher.run = original

    assert asyncio.run(scenario()) == 1  # only the first request's text was computed


def test_limits_are_checked_before_any_inference(svc):
    engine = svc.engines.default
    with pytest.raises(TooLarge, match="at most 64"):
        svc.texts(["x"] * 65)
    with pytest.raises(InvalidRequest, match="layer index 9"):
        svc.indexes([9], engine.model.num_layers, "layer")
    with pytest.raises(NotFound, match="'nope' is not served"):
        svc.engines.get("nope")
    long = [" ".join(["word"] * 250)] * 40  # about 10,000 tokens: within the request budget
    tokenized = asyncio.run(svc.tokenize(engine, long, True, "/v1/attention"))
    with pytest.raises(TooLarge, match="attention of this request"):
        svc.check_attention_size(engine, tokenized)
