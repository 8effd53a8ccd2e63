"""The batch queue in front of a model's runner: a batch forms only when a runner slot is free,
and then takes everything queued, up to the token budget.

Ray Serve's `@serve.batch` (2.60) takes a batch from its queue and starts its task *before* a
`max_concurrent_batches` slot is free; the task then waits for the slot. So while the slots are
busy, arrivals are frozen into many small batches queued behind them: at 32 single-text clients
a batch held 2.5 texts. text-embeddings-inference's batching task does it the other way round,
and so does this one: wait for a free slot, then for work, then take what queued meanwhile.
Requests whose caller gave up (cancelled: a deadline passed, the client left) leave the queue
before a batch forms, so nothing is computed for nobody. The knobs are read on every batch, so
a new budget, wait or concurrency (Serve's user_config) applies to the next batch; `knobs_changed()`
wakes the former, since a raised concurrency frees a slot that no arrival or finished batch announces.

Two classes of callers share the queue (issue 58): `interactive` jobs go first, and `batch` ones (a batch-class
API key's, the Batch API's lines) fill what is left of each batch, with BATCH_SHARE of its budget kept for them
whenever both wait, so a flood of batch work adds at most that share to an interactive batch and is never
starved: it gets at least that share of every batch (and the whole of it when no interactive job waits); a
batch job larger than the share goes once no batch job went for BATCH_WAIT_S, with whatever interactive jobs fit
(so a standing backlog of large batch jobs takes one batch in each BATCH_WAIT_S, not every batch). A batch's
batch-class jobs are also held to what the runner computes in BATCH_ALONE_RUN_S (its measured time per token), and
in BATCH_RUN_S while interactive jobs came within INTERACTIVE_RECENT_S: an interactive job then waits for a short
run, not a full budget of batch work, before its own (at least one batch-class job still goes in each batch
without interactive ones), and the last free runner slot of a replica that runs several batches is left to them: batch-class work
keeps the others (it is served at that rate meanwhile). On a GPU a budget's run takes a few milliseconds; on a
CPU the free slot is a free core for the next interactive job.

A slot no batch holds is lent to the running batch: when nothing is queued and no other model of the
replica has a batch in flight, the runner runs a batch's independent pieces (sub-batches, packed rows)
on the free slots at once (`lend`), so one large request uses every core of an idle replica. A lent
slot goes back after the piece it runs as soon as work is queued (`slot_wanted`), so a batch forms
within one piece's time and, under load, every batch has one slot, as before. The batch's task holds
its batch queue in `HOLDER` (a context variable: `run(jobs)` keeps its one argument, and a request run
alone, batching off, holds no slot and is lent none).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Generic, TypeVar

from service.config import BatchingSettings

Job = TypeVar("Job")
Result = TypeVar("Result")

# the batch queue whose runner slot the current batch's task holds (set in that task only), its lender
HOLDER: ContextVar[Batcher | None] = ContextVar("batch_slot_holder", default=None)
BATCH_SHARE = 0.125  # of a batch's token budget, kept for batch-class jobs while interactive ones wait too
BATCH_WAIT_S = 0.5  # a batch-class job larger than that share goes once no batch job went for this long
BATCH_RUN_S = 0.004  # while interactive jobs come, a batch holds at most this long a run of batch-class jobs ...
INTERACTIVE_RECENT_S = 1.0  # ... "come": the last one arrived within this long
BATCH_ALONE_RUN_S = 0.05  # ... and otherwise this long: the wait of the first interactive job to come
INTERACTIVE, BATCH = "interactive", "batch"


class Batcher(Generic[Job, Result]):
    """submit(job) -> its result, computed in a batch by `run(jobs) -> results` (list in, list out)."""

    def __init__(self, run: Callable[[list[Job]], Awaitable[list[Result]]], knobs: Callable[[], BatchingSettings],
                 cost: Callable[[Job], int], priority: Callable[[Job], str] = lambda job: INTERACTIVE) -> None:
        self.run = run
        self.knobs = knobs  # the live batching settings
        self.cost = cost  # a job's share of max_batch_tokens
        self.priority = priority  # a job's class: INTERACTIVE first, BATCH in what is left (and its share)
        self.running = 0  # batches being computed now
        self.lent = 0  # slots lent to a running batch's pieces (borrowed and given back in its worker threads)
        self.neighbours: list[Batcher] = []  # the batch queues of the replica's other models
        self._slots = threading.Lock()  # running + lent, read and changed from the loop and the runner's threads
        self._queue: deque[tuple[Job, asyncio.Future]] = deque()  # interactive jobs, oldest first
        self._batch_queue: deque[tuple[Job, asyncio.Future, float]] = deque()  # batch-class jobs, with their arrival
        self._batch_taken_at = float("-inf")  # when a batch-class job last went into a batch (loop time)
        self._interactive_at = float("-inf")  # when an interactive job last arrived (loop time)
        self._token_s = 0.0  # a run's seconds per token of budget, as measured (0: not yet)
        self._changed = asyncio.Event()  # a job arrived or a batch finished
        self._former: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        return sum(1 for _, future in self._queue if not future.done()) + \
            sum(1 for _, future, _ in self._batch_queue if not future.done())

    async def submit(self, job: Job) -> Result:
        """Queue the job and wait for its result. Cancelling the caller cancels its place in the queue."""
        loop = asyncio.get_running_loop()
        if self._former is None or self._former.done() or self._former.get_loop() is not loop:
            self._changed = asyncio.Event()  # of this loop (a replica has one; tests run several)
            self._former = loop.create_task(self._form_batches())
        future = loop.create_future()
        if self.priority(job) == BATCH:
            self._batch_queue.append((job, future, loop.time()))
        else:
            self._queue.append((job, future))
            self._interactive_at = loop.time()
        self._changed.set()
        return await future

    def close(self) -> None:
        """Stop forming batches (its model is being unloaded: the former task would hold the model, and its
        sessions' memory, for as long as the process lives). Call when nothing is queued or running."""
        if self._former is not None and not self._former.done():
            self._former.cancel()
        self._former = None
        # what it was given holds its engine (run is the engine's compute: a reference cycle), so that the model's
        # memory is freed as the engine's last reference goes, without a full garbage collection (measured for
        # all-MiniLM-L6-v2: 343 MiB freed at once; a collection took 92-135 ms on the replica's event loop)
        self.run = self.knobs = self.cost = self.priority = None  # type: ignore[assignment]
        self.neighbours = []

    def knobs_changed(self) -> None:
        """New knobs (reconfigure): the former looks at the queue again now. Raising
        max_concurrent_batches frees a slot that no arrival or finished batch would announce, so jobs
        queued behind a busy runner would otherwise wait for the next event. Safe from any thread."""
        former = self._former
        if former is None or former.done():
            return  # no former yet: the next submit starts one, which reads the knobs first
        loop = former.get_loop()
        if loop.is_closed():
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self._changed.set()
        else:  # asyncio.Event is not thread-safe: set it on its own loop
            loop.call_soon_threadsafe(self._changed.set)

    @property
    def held(self) -> int:
        """Runner slots in use: one per running batch, and those lent to their pieces."""
        return self.running + self.lent

    def slot_wanted(self) -> bool:
        """Whether a lent slot must go back: work is queued here, or another model of the replica is computing.
        Read from the runner's threads: len() of the deque and the neighbours' counts are single reads."""
        return bool(len(self._queue)) or bool(len(self._batch_queue)) or any(n.held for n in self.neighbours)

    def lend(self) -> bool:
        """One free slot for a running batch's pieces, if the replica is otherwise idle: nothing queued, no
        other model computing, a slot no batch holds. True: the caller must give_back() it. Any thread."""
        if self.slot_wanted():
            return False
        with self._slots:
            if self.held >= self.knobs().max_concurrent_batches:
                return False
            self.lent += 1
            return True

    def give_back(self) -> None:
        """A lent slot returned; the former is woken (a batch may form on it). Any thread."""
        with self._slots:
            self.lent -= 1
        self.knobs_changed()

    async def _form_batches(self) -> None:
        while True:
            knobs = self.knobs()
            self._drop_abandoned()
            if not (self._queue or self._batch_queue) or self.held >= knobs.max_concurrent_batches:
                self._changed.clear()
                await self._changed.wait()
                continue
            if (keep := self._slot_kept_s(knobs)) > 0:  # the last free slot waits for interactive jobs
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), keep)
                except asyncio.TimeoutError:
                    pass
                continue
            if knobs.batch_wait_timeout_s > 0 and self._cost_queued() < knobs.max_batch_tokens:
                await asyncio.sleep(knobs.batch_wait_timeout_s)  # company for the first request
                self._drop_abandoned()
                if not (self._queue or self._batch_queue):
                    continue
            batch = self._take(knobs.max_batch_tokens)
            with self._slots:
                self.running += 1
            asyncio.ensure_future(self._compute(batch))

    def _drop_abandoned(self) -> None:
        if any(future.done() for _, future in self._queue):
            self._queue = deque(item for item in self._queue if not item[1].done())
        if any(future.done() for _, future, _ in self._batch_queue):
            self._batch_queue = deque(item for item in self._batch_queue if not item[1].done())

    def _cost_queued(self) -> int:
        return sum(self.cost(job) for job, _ in self._queue) + sum(self.cost(job) for job, _, _ in self._batch_queue)

    def _take(self, budget: int) -> list[tuple[Job, asyncio.Future]]:
        """The oldest interactive jobs that fit the budget, less BATCH_SHARE of it while batch-class jobs wait,
        then the oldest batch-class jobs in what is left (at least one job in all: a job is checked against
        the budget before it is queued). Jobs that do not fit wait, in order, for the next batch."""
        batch: list[tuple[Job, asyncio.Future]] = []
        used = 0
        now = asyncio.get_running_loop().time()
        batch_budget = self._batch_budget(budget, now)
        reserved = min(int(budget * BATCH_SHARE), batch_budget) if self._batch_queue and self._queue else 0
        if self._batch_queue and self._queue:  # a batch-class job past its wait goes now, whatever its size: its
            job, future, since = self._batch_queue[0]  # wait counted from its arrival or the last batch job taken
            if now - max(since, self._batch_taken_at) >= BATCH_WAIT_S:
                self._batch_queue.popleft()
                batch.append((job, future))
                used = self.cost(job)
                reserved = 0
                self._batch_taken_at = now
        while self._queue:
            job, future = self._queue[0]
            cost = self.cost(job)
            if batch and used + cost > budget - reserved:
                break
            self._queue.popleft()
            if not future.done():
                batch.append((job, future))
                used += cost
        batch_used = 0
        while self._batch_queue:
            job, future, _ = self._batch_queue[0]
            cost = self.cost(job)
            if batch and (used + cost > budget or batch_used + cost > batch_budget):
                break
            self._batch_queue.popleft()
            if not future.done():
                batch.append((job, future))
                used += cost
                batch_used += cost
                self._batch_taken_at = now
        return batch

    def _slot_kept_s(self, knobs: BatchingSettings) -> float:
        """How long the last free runner slot stays free for interactive jobs: while only batch-class jobs are
        queued, interactive ones came within INTERACTIVE_RECENT_S and the replica runs 2 batches or more (so batch
        work keeps the others); 0: it may be taken now."""
        if self._queue or knobs.max_concurrent_batches < 2 or self.held < knobs.max_concurrent_batches - 1:
            return 0.0
        return max(0.0, self._interactive_at + INTERACTIVE_RECENT_S - asyncio.get_running_loop().time())

    def _batch_budget(self, budget: int, now: float) -> int:
        """The batch-class tokens one batch may hold: what the runner computes in BATCH_RUN_S while interactive jobs
        come, else in BATCH_ALONE_RUN_S (an interactive job that comes after a quiet while waits for no longer run);
        at most the budget, and the budget until the first batch is measured."""
        if self._token_s <= 0:
            return budget
        run_s = BATCH_RUN_S if now - self._interactive_at <= INTERACTIVE_RECENT_S else BATCH_ALONE_RUN_S
        return max(1, min(budget, int(run_s / self._token_s)))

    async def _compute(self, batch: list[tuple[Job, asyncio.Future]]) -> None:
        try:
            live = [(job, future) for job, future in batch if not future.done()]
            if not live:
                return
            try:
                HOLDER.set(self)  # this task's context only: what run() lends the batch's pieces from
                loop = asyncio.get_running_loop()
                started, tokens = loop.time(), sum(self.cost(job) for job, _ in live)
                results = await self.run([job for job, _ in live])
                if tokens > 0:  # seconds per token, smoothed over the last few batches
                    took = (loop.time() - started) / tokens
                    self._token_s = took if self._token_s <= 0 else 0.8 * self._token_s + 0.2 * took
            except Exception as exc:  # noqa: BLE001 - every caller of the batch gets its failure
                for _, future in live:
                    if not future.done():
                        future.set_exception(exc)
                return
            for (_, future), result in zip(live, results, strict=True):
                if not future.done():
                    future.set_result(result)
        finally:
            with self._slots:
                self.running -= 1
            self._changed.set()
