"""The engine on its own, without Ray or HTTP: the real bundle, real tokenizer and onnxruntime, the
EncoderService's steps as the routes call them, concurrent requests through one batch queue; the
batch runner's one rule for `normalize`, and a batch of mixed jobs giving each what it gets alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.config import BundleRef, ServiceSettings
from service.engine.engine import EngineTable, load_engine
from service.engine.errors import BackendError, ClientGone, InvalidRequest, NotFound, Timeout, TooLarge
from service.engine.runner import EncodeJob, Pooled, l2_normalize, pooled_output
from service.engine.encoder_service import EncoderService

TEXTS = [f"sentence number {i} about {'cats' if i % 2 else 'the weather'} and more" for i in range(24)]


@pytest.fixture(scope="module")
def svc(default_bundle) -> EncoderService:
    # fp32: these tests hold where each text's outputs go to 1e-5; auto picks bf16 on a CPU with bf16
    # units, whose packed and padded graphs differ by 1e-3 (its closeness is gated at export)
    settings = ServiceSettings.model_validate({"bundle": str(default_bundle), "intra_op_threads": 1, "precision": "fp32",
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


def test_pooled_output_says_what_normalize_means_for_each_kind_of_model(svc):
    model = svc.engines.default.model  # all-MiniLM-L6-v2: mean pooling, its graph L2-normalises
    raw = model.model_copy(update={"normalize": False})
    classifier = raw.model_copy(update={"task": "classification"})
    assert model.normalize and not raw.normalize
    assert pooled_output(model, True) is Pooled.AS_IS  # the graph already normalises
    assert pooled_output(model, False) is Pooled.REPOOLED  # the raw vector is no output of the graph
    assert pooled_output(raw, True) is Pooled.L2_HERE
    assert pooled_output(raw, False) is Pooled.AS_IS
    assert pooled_output(classifier, False) is pooled_output(classifier, True) is Pooled.AS_IS  # logits untouched

    encodings = np.array([[3.0, 4.0], [1.0, 0.0]], dtype=np.float32)  # two tokens' last_hidden_state
    vector = np.array([3.0, 4.0], dtype=np.float32)
    assert Pooled.AS_IS.make(vector, None, "mean") is vector
    np.testing.assert_allclose(Pooled.L2_HERE.make(vector, None, "mean"), [0.6, 0.8])
    np.testing.assert_allclose(Pooled.REPOOLED.make(vector, encodings, "mean"), [2.0, 2.0])
    np.testing.assert_allclose(Pooled.REPOOLED.make(vector, encodings, "max"), [3.0, 4.0])
    np.testing.assert_allclose(Pooled.REPOOLED.make(vector, encodings, "cls"), [3.0, 4.0])


def test_one_batch_of_mixed_jobs_gives_each_job_what_it_gets_alone_and_counts_every_token(svc):
    """Packed, re-pooled, hidden-state, attention and pair jobs in one compute(): each text's outputs
    land in its own job's result, and the counters add up to the batch's real tokens and runs."""
    engine = svc.engines.default
    runner = engine.runner
    texts = TEXTS[:3] + ["a much longer sentence about the weather in Paris, which was grey and wet all week"]
    pairs = [("What is the capital of France?", "Paris is the capital of France."), ("a", "b c d")]
    single = asyncio.run(svc.tokenize(engine, texts, True, "test"))
    paired = asyncio.run(svc.tokenize_pairs(engine, pairs, True, "test"))
    ids = [t.ids for t in single]

    def jobs() -> list[EncodeJob]:
        return [
            EncodeJob(route="test", ids=ids, normalize=True),  # only the pooled output: packed
            EncodeJob(route="test", ids=ids[:2], normalize=False),  # pooled again from the encodings: padded
            EncodeJob(route="test", ids=ids[1:3], normalize=False, want_hidden=True),
            EncodeJob(route="test", ids=ids[2:], normalize=True, attention=((0, 2), (1,))),
            EncodeJob(route="test", ids=[t.ids for t in paired], normalize=True,
                      type_ids=[t.type_ids for t in paired]),
        ]

    alone = [runner.compute([job])[0] for job in jobs()]
    before, runs_before = dict(runner.counters), dict(runner.runs_by_graph)
    batch = jobs()
    together = runner.compute(batch)
    counted = {k: runner.counters[k] - before[k] for k in before}
    runs = {k: v - runs_before.get(k, 0) for k, v in runner.runs_by_graph.items() if v != runs_before.get(k, 0)}

    for mixed, own in zip(together, alone, strict=True):
        np.testing.assert_allclose(mixed.embeddings, own.embeddings, atol=1e-5)
        for name in ("hidden", "attentions"):
            for a, b in zip(getattr(mixed, name) or [], getattr(own, name) or [], strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5)
    packed, repooled, with_hidden, attention, _ = together
    # normalize=false on a normalising model: the mean of the token encodings, which the graph normalises
    assert not np.allclose(np.linalg.norm(repooled.embeddings, axis=1), 1.0)
    np.testing.assert_allclose(l2_normalize(repooled.embeddings), packed.embeddings[:2], atol=1e-5)
    for t, hidden in enumerate(with_hidden.hidden):
        assert hidden.shape == (len(ids[1 + t]), engine.model.hidden_size)
        np.testing.assert_allclose(with_hidden.embeddings[t], hidden.mean(axis=0), atol=1e-5)
    assert [a.shape for a in attention.attentions] == [(2, 1, len(i), len(i)) for i in ids[2:]]

    assert set(runs) == {"packed-fp32", "encodings-fp32", "full"}, runs
    n_texts = sum(len(job.ids) for job in batch)
    real = sum(len(i) for job in batch for i in job.ids)
    assert {k: counted[k] for k in ("batches", "requests", "texts", "real_tokens")} == {
        "batches": 1, "requests": len(batch), "texts": n_texts, "real_tokens": real}
    assert counted["ort_runs"] == sum(runs.values()) and counted["padded_tokens"] >= real
    ratio = 1 - real / counted["padded_tokens"]
    assert all(r.stats == {"batch_requests": len(batch), "batch_texts": n_texts, "ort_runs": sum(runs.values()),
                           "padding_ratio": ratio} for r in together)


def peak_rss_mb() -> float:
    """This process's resident high-water mark since the last reset_peak_rss()."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as refs:  # 5: reset the peak RSS (Linux's proc(5))
        refs.write("5")


def test_a_chunked_request_past_the_budget_is_refused_before_any_window_exists(svc):
    """16 texts of 100k characters in windows of 8 tokens, 5 of them repeated: a quarter of a million
    windows. Windowed before the budget was checked, this request took 13 s and 3 GB of a worker;
    counted first, it is refused at its first text, and no memory to speak of."""
    engine = svc.engines.default
    words = "the committee will vote on the proposal next thursday after a public consultation".split()
    texts = [((" ".join(words) + " ") * 1300)[:100_000]] * 16
    reset_peak_rss()
    before = peak_rss_mb()
    with pytest.raises(TooLarge, match=r"in \d+ chunks of its first 1 of 16 texts; at most 16384 per request"):
        asyncio.run(svc.tokenize_chunks(engine, texts, 8, 5, "/v1/embeddings"))
    assert peak_rss_mb() - before < 200, f"peak RSS grew {peak_rss_mb() - before:.0f} MB"


def test_jobs_of_one_request_are_all_cancelled_when_one_fails(svc):
    """infer_all (explain's jobs): every cost is checked before any job queues, and the first failure
    cancels the jobs still waiting or running, so a failed request does not go on computing."""
    engine = svc.engines.default
    tokenized = asyncio.run(svc.tokenize(engine, TEXTS[:4], True, "/v1/embeddings"))
    doomed = EncodeJob(route="/v1/embeddings", ids=[t.ids for t in tokenized[:2]], normalize=True)
    sibling = EncodeJob(route="/v1/embeddings", ids=[t.ids for t in tokenized[2:]], normalize=True)
    batching = svc.batching
    release = asyncio.Event()

    async def scenario():
        original = engine.batcher.run
        ran: list[EncodeJob] = []

        async def run(jobs):  # a session that breaks on the doomed job; the sibling's batch is held
            if any(job is doomed for job in jobs):
                raise RuntimeError("the session broke")
            ran.extend(jobs)
            await release.wait()
            return await original(jobs)

        engine.batcher.run = run
        try:
            counted = engine.runner.counters["requests"]
            too_big = EncodeJob(route="/v1/embeddings", ids=[np.zeros(batching.max_batch_tokens + 1, np.int64)],
                                normalize=True)
            with pytest.raises(TooLarge):  # refused before the sibling before it was queued
                await svc.infer_all(engine, [sibling, too_big], 30.0)
            assert ran == [] and engine.batcher.queued == 0
            with pytest.raises(BackendError, match="can be retried"):
                await asyncio.wait_for(svc.infer_all(engine, [doomed, sibling], 30.0), 10)
            await asyncio.sleep(0)
            assert engine.batcher.queued == 0 and engine.runner.counters["requests"] == counted
        finally:
            release.set()
            engine.batcher.run = original

    # one batch each: the budget holds either job, not both
    svc.reconfigure(batching.model_copy(update={"max_batch_tokens": max(doomed.n_tokens, sibling.n_tokens)}))
    try:
        asyncio.run(scenario())
    finally:
        svc.reconfigure(batching)


def test_one_disconnect_from_rays_receive_proxy_cancels_every_job_of_a_request(svc):
    """Ray Serve hands a replica's handler `receive()` through a queue (ASGIDIReceiveProxy behind HAProxy,
    ASGIReceiveProxy behind its proxy actor) that delivers `http.disconnect` once: of two callers waiting
    on it, one wakes and the other waits on. So explain's jobs share one watcher (context.infer_all):
    the client leaving cancels all of them before they run."""
    from ray.serve._private.direct_ingress_http_util import ASGIDIReceiveProxy
    from starlette.requests import Request

    from service.front.deps import _disconnected, infer_all

    engine = svc.engines.default
    tokenized = asyncio.run(svc.tokenize(engine, TEXTS[:4], True, "/v1/embeddings"))
    jobs = [EncodeJob(route="/v1/embeddings", ids=[t.ids], normalize=True) for t in tokenized]
    release = asyncio.Event()

    async def scenario():
        def request() -> tuple[Request, ASGIDIReceiveProxy]:
            scope = {"type": "http", "method": "POST", "path": "/v1/rerank", "headers": [], "query_string": b""}
            proxy = ASGIDIReceiveProxy(scope, None, asyncio.get_running_loop())
            return Request(scope, proxy), proxy

        # Ray's semantics, as found: two watchers, one disconnect, one of them still waiting
        req, proxy = request()
        watchers = [asyncio.ensure_future(_disconnected(req)) for _ in range(2)]
        await asyncio.sleep(0.01)
        proxy.put_message({"type": "http.disconnect"})
        done, pending = await asyncio.wait(watchers, timeout=1)
        assert (len(done), len(pending)) == (1, 1)
        for w in pending:
            w.cancel()

        original = engine.batcher.run

        async def held(batch):  # the runner is busy with someone else's batch until released
            await release.wait()
            return await original(batch)

        engine.batcher.run = held
        try:
            busy = asyncio.ensure_future(svc.infer(engine, EncodeJob(route="/v1/embeddings", ids=[tokenized[0].ids],
                                                                     normalize=True), 30.0))
            while engine.batcher.running == 0:
                await asyncio.sleep(0.001)
            computed = engine.runner.counters["requests"]
            req, proxy = request()
            leaving = asyncio.ensure_future(infer_all(svc, engine, jobs, req))
            while engine.batcher.queued < len(jobs):
                await asyncio.sleep(0.001)
            proxy.put_message({"type": "http.disconnect"})
            with pytest.raises(ClientGone):
                await asyncio.wait_for(leaving, 10)
            assert engine.batcher.queued == 0
            release.set()
            await busy
            assert engine.runner.counters["requests"] == computed + 1  # the busy one only
        finally:
            release.set()
            engine.batcher.run = original

    asyncio.run(scenario())
