"""The batch queue on its own (no Ray, no HTTP): a batch forms only when a runner slot is free and
then takes everything queued up to the token budget; abandoned requests leave before it forms; a knob
changed through the replica's reconfigure applies to the next batch at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from service.config import BatchingSettings, BundleRef, ServiceSettings
from service.engine import runner as runner_module
from service.engine.batcher import Batcher
from service.engine.engine import EngineTable, load_engine
from service.engine.runner import EncodeJob
from service.engine.encoder_service import EncoderService


class Runner:
    """A runner whose batches wait until the test lets them finish, recording what each held."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.finish = asyncio.Event()
        self.started = asyncio.Event()
        self.fail: Exception | None = None

    async def run(self, jobs: list[int]) -> list[int]:
        self.batches.append(list(jobs))
        self.started.set()
        await self.finish.wait()
        if self.fail is not None:
            raise self.fail
        return [job * 10 for job in jobs]


def batcher(runner: Runner, **knobs) -> tuple[Batcher, dict]:
    live = {"settings": BatchingSettings(**knobs)}
    return Batcher(runner.run, lambda: live["settings"], cost=lambda job: 10), live


async def busy(runner: Runner, **knobs) -> tuple[Batcher, asyncio.Future]:
    """A batcher whose first request's batch is running (held by the runner) when this returns."""
    b, _ = batcher(runner, **knobs)
    first = asyncio.ensure_future(b.submit(0))
    await runner.started.wait()
    return b, first


def classed(run, cost=lambda job: 10, **knobs) -> Batcher:
    """A batch queue whose jobs are numbers: negative ones a batch-class key's, the others interactive."""
    settings = BatchingSettings(**knobs)
    return Batcher(run, lambda: settings, cost=cost, priority=lambda job: "batch" if job < 0 else "interactive")


async def until(condition, what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


def test_arrivals_while_the_runner_is_busy_form_one_full_batch():
    async def scenario():
        runner = Runner()
        b, first = await busy(runner, max_concurrent_batches=1, max_batch_tokens=1000)
        rest = [asyncio.ensure_future(b.submit(i)) for i in range(1, 33)]
        await until(lambda: b.queued == 32, "32 requests queued behind the busy runner")
        runner.finish.set()
        results = await asyncio.gather(first, *rest)
        return runner.batches, results

    batches, results = asyncio.run(scenario())
    assert batches == [[0], list(range(1, 33))]  # Serve's @serve.batch made many small batches here
    assert results == [i * 10 for i in range(33)]


def test_the_token_budget_bounds_a_batch_and_the_rest_waits_in_order():
    async def scenario():
        runner = Runner()
        runner.finish.set()
        b, _ = batcher(runner, max_concurrent_batches=1, max_batch_tokens=50)  # 5 jobs of 10
        gate = asyncio.Event()
        original = runner.run

        async def held(jobs):
            await gate.wait()
            return await original(jobs)

        b.run = held
        jobs = [asyncio.ensure_future(b.submit(i)) for i in range(12)]
        await until(lambda: b.running == 1, "the first batch running")
        gate.set()
        await asyncio.gather(*jobs)
        return runner.batches

    batches = asyncio.run(scenario())
    assert [len(x) for x in batches] == [5, 5, 2], batches
    assert [j for x in batches for j in x] == list(range(12))  # first come, first served


def test_abandoned_requests_leave_the_queue_before_a_batch_forms():
    async def scenario():
        runner = Runner()
        b, first = await busy(runner, max_concurrent_batches=1, max_batch_tokens=1000)
        waiting = {i: asyncio.ensure_future(b.submit(i)) for i in range(1, 7)}
        await until(lambda: b.queued == 6, "6 queued")
        for i in (2, 4, 6):  # their deadlines passed / their clients left
            waiting[i].cancel()
        await until(lambda: b.queued == 3, "the abandoned ones gone from the queue")
        runner.finish.set()
        await asyncio.gather(first, *(waiting[i] for i in (1, 3, 5)))
        return runner.batches

    assert asyncio.run(scenario()) == [[0], [1, 3, 5]]


def test_a_failed_batch_fails_each_of_its_requests_and_the_next_batch_runs():
    async def scenario():
        runner = Runner()
        b, _ = batcher(runner, max_concurrent_batches=1, max_batch_tokens=1000)
        runner.fail = RuntimeError("session broke")
        runner.finish.set()
        failed = await asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True)
        runner.fail = None
        return failed, await b.submit(3)

    failed, after = asyncio.run(scenario())
    assert all(isinstance(f, RuntimeError) for f in failed) and after == 30


def test_a_raised_concurrency_starts_the_queued_batch_through_reconfigure_alone(default_bundle, monkeypatch):
    """Serve's reconfigure hook (the deployment's own method, on a replica's real engine) raising
    max_concurrent_batches starts the batch queued behind a busy runner at once: no arrival, no finished
    batch, nothing woken by hand. It runs on sessions resized for two batches at once (half the threads)."""
    from service.deployment import Encoder

    monkeypatch.setattr(runner_module, "available_cpus", lambda: 4)  # the replica's CPUs, as the process sees them
    # onnxruntime fp32, whose sessions' threads this test reads (auto picks OpenVINO bf16 on CPUs with bf16 units)
    settings = ServiceSettings.model_validate({"bundle": str(default_bundle), "num_cpus": 4, "runtime": "onnxruntime",
                                               "precision": "fp32", "batching": {"max_concurrent_batches": 1}})
    engines = EngineTable([load_engine(BundleRef(path=default_bundle), settings)])
    replica = SimpleNamespace(svc=EncoderService(settings, engines), engines=engines)  # what reconfigure uses
    engine = engines.default
    old = engine.runtime
    assert old.threads == 4

    def job() -> EncodeJob:
        return EncodeJob(route="/v1/embeddings", ids=[np.array([101, 7592, 2088, 102])], normalize=True)

    async def scenario():
        gate, ran_on = asyncio.Event(), []
        compute = engine.batcher.run

        async def first_held(jobs):  # the first batch holds its slot until the test lets it go
            ran_on.append(engine.runtime)
            if len(ran_on) == 1:
                await gate.wait()
            return await compute(jobs)

        engine.batcher.run = first_held
        first = asyncio.ensure_future(engine.batcher.submit(job()))
        await until(lambda: engine.batcher.running == 1, "the first batch holding the only slot")
        second = asyncio.ensure_future(engine.batcher.submit(job()))
        await until(lambda: engine.batcher.queued == 1, "the second request queued behind it")
        await asyncio.sleep(0.05)
        assert engine.batcher.queued == 1 and not second.done()  # one slot: it waits
        await Encoder.func_or_class.reconfigure(replica, {"max_concurrent_batches": 2})
        done, _ = await asyncio.wait({second}, timeout=20)  # the first batch still holds its slot
        assert second in done, "the queued request did not start after max_concurrent_batches was raised"
        assert not first.done()
        gate.set()
        return (await first).embeddings, second.result().embeddings, ran_on

    first, second, ran_on = asyncio.run(scenario())
    assert ran_on[0] is old and ran_on[1] is engine.runtime is engine.runner.runtime and engine.runtime is not old
    assert engine.runtime.threads == 2 and {g.threads for g in (engine.runtime.full, engine.runtime.fast)} == {2}
    assert old.threads == 4  # the sessions a running batch holds are left as they were
    assert replica.svc.batching.max_concurrent_batches == 2 and engine.runner.batching.max_concurrent_batches == 2
    np.testing.assert_allclose(second, first, atol=1e-5)


def test_the_first_request_waits_for_company_only_when_asked():
    async def scenario(wait: float):
        runner = Runner()
        runner.finish.set()
        b, _ = batcher(runner, max_concurrent_batches=1, max_batch_tokens=1000, batch_wait_timeout_s=wait)
        first = asyncio.ensure_future(b.submit(1))
        if wait == 0:
            await runner.started.wait()  # its batch formed at once, alone
        else:
            await asyncio.sleep(0)  # the batch former is waiting for company now
        second = asyncio.ensure_future(b.submit(2))
        await asyncio.gather(first, second)
        return runner.batches

    assert asyncio.run(scenario(0.0)) == [[1], [2]]
    assert asyncio.run(scenario(0.5)) == [[1, 2]]


@pytest.fixture
def no_run_cap(monkeypatch):
    """Batch-class jobs held to the token budget alone: these tests' runner waits on the test, so the time per
    token the batch queue measures from it means nothing (the cap has a test of its own)."""
    from service.engine import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "BATCH_RUN_S", 1e9)


def test_interactive_jobs_go_first_and_batch_jobs_keep_their_share_and_are_never_starved(no_run_cap):
    """Jobs are numbers: negative ones are a batch-class key's. While the runner is busy, 40 batch jobs and 8
    interactive ones queue (each of cost 10, a budget of 80): the next batch holds the 7 interactive jobs that
    fit its budget less the batch share (1/8: 10 tokens) and one batch job; the batch jobs then fill the
    batches once no interactive job waits. A batch job larger than the share goes alone with what fits, once
    it has waited BATCH_WAIT_S."""
    from service.engine import batcher as batcher_module

    async def scenario():
        runner = Runner()
        costs = {-99: 75}
        b = classed(runner.run, lambda job: costs.get(job, 10), max_concurrent_batches=1, max_batch_tokens=80)
        first = asyncio.ensure_future(b.submit(0))
        await runner.started.wait()
        flood = [asyncio.ensure_future(b.submit(-i)) for i in range(1, 41)]
        interactive = [asyncio.ensure_future(b.submit(i)) for i in range(1, 9)]
        await until(lambda: b.queued == 48, "48 jobs queued behind the busy runner")
        runner.finish.set()
        await asyncio.gather(first, *flood, *interactive)
        batches = list(runner.batches)
        # a big batch job behind a stream of interactive ones: it waits at most about BATCH_WAIT_S
        runner.batches.clear()
        runner.finish.clear()
        hold = asyncio.ensure_future(b.submit(100))
        await until(lambda: len(runner.batches) == 1, "a batch running")
        big = asyncio.ensure_future(b.submit(-99))
        small = [asyncio.ensure_future(b.submit(200 + i)) for i in range(7)]
        await asyncio.sleep(batcher_module.BATCH_WAIT_S + 0.05)
        runner.finish.set()
        await asyncio.gather(hold, big, *small)
        return batches, list(runner.batches)

    batches, later = asyncio.run(scenario())
    assert batches[0] == [0]
    assert batches[1] == [1, 2, 3, 4, 5, 6, 7, -1], batches[1]  # 7 interactive (70 of 80 less 10 kept) + 1 batch
    assert batches[2][0] == 8 and all(j < 0 for j in batches[2][1:]) and len(batches[2]) == 8, batches[2]
    served = [j for x in batches for j in x if j < 0]
    assert served == [-i for i in range(1, 41)]  # every batch job served, in order
    assert later[1][0] == -99 and all(j >= 200 for j in later[1][1:]), later  # the big one went first, past its wait


def test_a_backlog_of_large_batch_jobs_takes_one_batch_in_each_wait_not_every_batch(no_run_cap):
    """Five large batch-class jobs (each alone fills a batch) waiting long already, and 20 interactive ones, all
    queued behind a busy runner: one large job goes, then the interactive ones fill the next batches before the
    second large one (its wait counts from the last batch job taken, not from its arrival: else every batch
    would start with one, and the interactive jobs would wait behind the whole backlog)."""
    async def scenario():
        runner = Runner()
        b = classed(runner.run, lambda job: 75 if job < 0 else 10, max_concurrent_batches=1, max_batch_tokens=80)
        first = asyncio.ensure_future(b.submit(0))
        await runner.started.wait()
        backlog = [asyncio.ensure_future(b.submit(-i)) for i in range(1, 6)]
        interactive = [asyncio.ensure_future(b.submit(i)) for i in range(1, 21)]
        await until(lambda: b.queued == 25, "25 jobs queued behind the busy runner")
        await asyncio.sleep(0.6)  # the backlog has waited past BATCH_WAIT_S
        runner.finish.set()
        await asyncio.gather(first, *interactive, *backlog)
        return list(runner.batches)

    batches = asyncio.run(scenario())
    where = {job: n for n, x in enumerate(batches) for job in x}
    assert where[-1] == 1 and batches[1] == [-1], batches  # the one past its wait
    assert max(where[i] for i in range(1, 21)) < where[-2], batches  # every interactive job before the next one
    assert [where[-i] for i in range(1, 6)] == sorted(where[-i] for i in range(1, 6))  # and the backlog in order


def test_while_interactive_jobs_come_a_batch_holds_a_short_run_of_batch_jobs(monkeypatch):
    """A runner that takes 2 ms a token (20 ms a job of 10): 16 batch-class jobs, while no interactive job came, fill
    the first batch to the budget (8 jobs: nothing measured yet), then batches of what runs in BATCH_ALONE_RUN_S
    (here 100 ms: 5 jobs, fewer where the runner's sleeps overrun, never 1); after an interactive job came, each
    batch holds what runs in BATCH_RUN_S (4 ms: less than one job, so one), the interactive one first; once none
    came for INTERACTIVE_RECENT_S, 2 to 5 again."""
    from service.engine import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "INTERACTIVE_RECENT_S", 60.0)
    monkeypatch.setattr(batcher_module, "BATCH_ALONE_RUN_S", 0.1)  # 5 jobs at 2 ms a token; fewer on a slow machine

    class TimedRunner:
        def __init__(self) -> None:
            self.batches: list[list[int]] = []

        async def run(self, jobs: list[int]) -> list[int]:
            self.batches.append(list(jobs))
            await asyncio.sleep(0.02 * len(jobs))
            return [job * 10 for job in jobs]

    async def scenario():
        runner = TimedRunner()
        b = classed(runner.run, max_concurrent_batches=1, max_batch_tokens=80)
        phases = []
        for phase in ("alone", "beside interactive", "interactive gone"):
            runner.batches.clear()
            if phase == "beside interactive":
                jobs = [asyncio.ensure_future(b.submit(100))]
            else:
                jobs = []
                if phase == "interactive gone":
                    monkeypatch.setattr(batcher_module, "INTERACTIVE_RECENT_S", 0.0)
            jobs += [asyncio.ensure_future(b.submit(-i)) for i in range(1, 17)]
            await asyncio.gather(*jobs)
            phases.append(list(runner.batches))
        return phases

    alone, beside, gone = asyncio.run(scenario())
    # (each but the last of a phase, which holds what is left)
    assert alone[0] == [-i for i in range(1, 9)] and all(2 <= len(b) <= 5 for b in alone[1:-1]), alone
    assert len(alone) >= 3 and len(gone) >= 4 and all(2 <= len(b) <= 5 for b in gone[:-1]), gone
    assert beside == [[100], *([-i] for i in range(1, 17))], beside
    assert [j for b in alone + gone for j in b] == [-i for i in range(1, 17)] * 2  # in order, every one


def test_while_interactive_jobs_come_batch_work_leaves_the_last_free_slot_to_them(monkeypatch):
    """Two runner slots, one batch-class job a batch: with no interactive job, two batches of batch work run at
    once; after an interactive one came, one at a time (the other slot waits for interactive jobs), and every
    batch job is still served."""
    from service.engine import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "INTERACTIVE_RECENT_S", 60.0)

    class Runner2:
        def __init__(self) -> None:
            self.running = self.peak = 0

        async def run(self, jobs: list[int]) -> list[int]:
            self.running += 1
            self.peak = max(self.peak, self.running)
            await asyncio.sleep(0.01)
            self.running -= 1
            return [job * 10 for job in jobs]

    async def scenario():
        runner = Runner2()
        b = classed(runner.run, max_concurrent_batches=2, max_batch_tokens=10)
        peaks = []
        for beside in (False, True):
            runner.peak = 0
            if beside:
                await b.submit(100)
            results = await asyncio.gather(*(b.submit(-i) for i in range(1, 9)))
            assert results == [-10 * i for i in range(1, 9)]
            peaks.append(runner.peak)
        return peaks

    assert asyncio.run(scenario()) == [2, 1]
