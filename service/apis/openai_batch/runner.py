"""The adapter between a stored batch and the work: it takes unfinished batches from the store (one runner
per replica; a batch's lock says which runs it, and is freed when that process dies, so a restarted or
surviving replica resumes it), runs its lines a chunk at a time, and writes OpenAI's output and error files.

How a line runs. A /v1/embeddings line the embedding job can do (texts, `model`, `dimensions`,
`encoding_format`: no prompt, input_type or chunking) runs in the embedding job (jobs/embed.py), as a
detached Ray actor of its own beside the Serve application (jobs/batch.py), not in a replica (the runner is
handed jobs/batch.py's BatchJobs by the composition, service/deployment.py: service/ never imports jobs/): its
Ray Data actor takes JOB_CPUS with one intra-op thread at OS niceness JOB_NICE, a bounded and lower-priority
share of the node's CPUs. The runner writes the batch's texts as the job's input (`job_rows`: one row per
text, id = custom_id#position), waits for the job's shards to cover a chunk's rows, and builds each line's
body as /v1/embeddings answers it (`dimensions`, `encoding_format`, `model`, `usage` from the route's own
tokenization). Every other line (prompts, chunking, /v1/rerank, /v1/score, a line the route would refuse,
a row the job failed) runs in this process, through the service's own HTTP app (the real routes, engines
and limits, called over ASGI with the replica's token), so its `response.body` is by construction what
its route answers; those lines wait while online requests are inside this replica (at most YIELD_MAX_S
each), so they take the capacity online requests leave.

Whose lines. A batch's lines run as the key that created it (its record's `key`: its name, read again as each
line runs, so a rotated secret changes nothing and a removed key's lines are refused): the models it may call,
its requests and tokens per minute (a line answered 429 waits for the window to refill), its counters; in the
batch queue's `batch` class. The embedding job counts no limit, so it answers lines only for a key without
limits per minute, and only for models that key may call (`job_may_answer`).

Resumption: each chunk's outcomes are one file under the batch's parts/ folder (written whole), so a
restart redoes at most the chunk in flight; finalizing streams the output and error files, part by part, into
temp files renamed into place under ids made from the batch's, so a finalize redone replaces them.

Isolation: a batch whose run raises (whatever its file holds) is tried again after a pause, and `failed` with
the reason after MAX_TRIES; the batches after it run meanwhile. A cancel, the expiry and a deleted input
file are acted on before the file is read. When a batch ends its working data goes (store.remove_working_data);
every SWEEP_S the sweeper (`sweep`, off the loop) deletes files past their `expires_at` and ended batches
past batch_retention_s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np

from service.apis.openai_batch.store import TERMINAL, Store, atomic_write, derived_id, store_at
from service.config import ServiceSettings
from service.front.gate import Gate
from service.front.keys import ON_BEHALF_HEADER

logger = logging.getLogger("ray.serve")

CHUNK_LINES = 32  # lines whose outcomes are written together: what a restart may run again
CONCURRENT_LINES = 4  # lines of a chunk in the engine at once (enough to fill its batches with a few texts each)
POLL_S = 0.5  # how often an idle runner looks for unfinished batches
YIELD_MAX_S = 1.0  # longest a line waits for online requests to leave before it runs anyway
RETRIES = 5  # tries of a line answered 503 (overloaded, not ready) before its answer is kept
LIMIT_WAIT_S = 180.0  # longest a line of a rate-limited key waits (its 429s' Retry-After) before its 429 is kept
JOB_CPUS = 1  # the embedding job's share of the cluster: one Ray Data actor, this many CPUs and intra-op threads
JOB_NICE = 10  # and its OS niceness: on a node shared with replicas, the online requests' threads go first
JOB_RANGE_ROWS = 256  # texts per job shard (one actor call): how often the runner sees the job's progress
JOB_POLL_S = 0.25  # how often the runner looks at the job's progress while it waits for a chunk
JOB_END_WAIT_S = 120.0  # how long a finished batch waits for its job's _SUCCESS before stopping the actor
MAX_TRIES = 3  # runs of a batch that raised before it is failed with the reason (the others run meanwhile)
RETRY_PAUSE_S = 5.0  # times the tries so far: how long a batch that raised waits before its next try
SWEEP_S = 60.0  # how often the runner deletes what has expired (off the loop)
# bytes per number of an output line's embedding: a float32 as JSON (`-0.036528430879116058, `, at most
# about 21 characters) or base64 (4 bytes as 16/3 characters); and what a line adds around its numbers
FLOAT_JSON_BYTES, FLOAT_BASE64_BYTES, LINE_OVERHEAD_BYTES = 21, 16 / 3, 320


@dataclass(frozen=True)
class Line:
    """One request line of a batch file; `problem` says why it cannot run (an error line)."""

    position: int  # among the file's non-blank lines
    custom_id: str | None
    body: dict | None
    problem: str | None = None


def parse_lines(data: bytes, endpoint: str) -> list[Line]:
    """The file's request lines, each checked as OpenAI checks them: a JSON object with a unique
    `custom_id`, `method` POST, `url` the batch's endpoint, a `body` object."""
    lines: list[Line] = []
    seen: set[str] = set()
    for raw in data.splitlines():
        if not raw.strip():
            continue
        position = len(lines)
        try:
            obj = json.loads(raw)
        except RecursionError:  # nested deeper than the parser goes: one bad line, never the batch's end
            lines.append(Line(position, None, None, f"line {position + 1} is nested too deeply to be read"))
            continue
        except Exception as exc:  # noqa: BLE001 - not JSON, not UTF-8, a number past int's digits: that line's error
            lines.append(Line(position, None, None, f"line {position + 1} is not JSON ({str(exc)[:200]})"))
            continue
        if not isinstance(obj, dict):
            lines.append(Line(position, None, None, f"line {position + 1} is not a JSON object"))
            continue
        custom_id = obj.get("custom_id")
        custom_id = custom_id if isinstance(custom_id, str) and custom_id else None
        if custom_id is None:
            problem = "custom_id must be a non-empty string"
        elif custom_id in seen:
            problem = f"custom_id {custom_id!r} is used by an earlier line; each line needs its own"
        elif obj.get("method") != "POST":
            problem = f"method {obj.get('method')!r}: a batch's lines are POST requests"
        elif obj.get("url") != endpoint:
            problem = f"url {obj.get('url')!r} is not the batch's endpoint {endpoint}"
        elif not isinstance(obj.get("body"), dict):
            problem = "body must be a JSON object (the request's body)"
        else:
            problem = None
        if custom_id is not None:
            seen.add(custom_id)
        lines.append(Line(position, custom_id, obj.get("body") if problem is None else None, problem))
    return lines


def estimated_output_bytes(lines: list[Line], endpoint: str, dims_of) -> int:
    """An upper estimate of the output file's bytes: for /v1/embeddings, texts x dimensions x bytes per
    number (JSON float or base64) per line; `dims_of(model)`: a model's embedding size. For the scoring
    routes, a score per document or pair. Every line adds its envelope."""
    total = 0
    for line in lines:
        total += LINE_OVERHEAD_BYTES
        body = line.body
        if line.problem is not None or body is None:
            continue
        if endpoint == "/v1/embeddings":
            raw = body.get("input")
            n = 1 if isinstance(raw, str) else len(raw) if isinstance(raw, list) else 0
            dims = body.get("dimensions")
            dims = dims if type(dims) is int and dims > 0 else dims_of(body.get("model"))
            per = FLOAT_BASE64_BYTES if body.get("encoding_format") == "base64" else FLOAT_JSON_BYTES
            total += int(n * dims * per) + 64 * n
        else:
            total += sum(64 * len(v) for v in body.values() if isinstance(v, list))
    return total


def job_rows(lines: list[Line]) -> list[dict[str, str]]:
    """The embedding job's input rows for a batch's /v1/embeddings lines: one per text, its id the line's
    custom_id and the text's position in the line's `input` (`custom_id#position`), so the job's output
    maps back to its line and place."""
    rows = []
    for line in lines:
        if line.problem is None and line.body is not None:
            texts = line.body.get("input")
            for position, text in enumerate([texts] if isinstance(texts, str) else texts or []):
                rows.append({"id": f"{line.custom_id}#{position}", "text": text})
    return rows


def request_line(custom_id: str | None, response: dict | None, error: dict | None) -> dict:
    """One line of an output or error file, in OpenAI's format."""
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id, "response": response, "error": error}


@dataclass(frozen=True)
class JobLine:
    """A /v1/embeddings line the embedding job does: its request, engine and texts, and its job rows."""

    request: JobRequest
    engine: Any  # service.engine.engine.Engine
    texts: list[str]
    first_row: int  # its texts are job rows first_row .. first_row + len(texts) - 1


JOB_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}  # what the job's answer covers


@dataclass(frozen=True)
class JobRequest:
    """The fields of a /v1/embeddings body that shape the job's answer."""

    model: str | None
    encoding_format: str
    dimensions: int | None


def job_may_answer(runs_as: str | None) -> Callable[[str], bool] | None:
    """Which models the embedding job may answer a batch's lines for, as the key `runs_as` that owns the batch
    (None: no line: the key has limits per minute, which only the routes count, or has left the keys file)."""
    if runs_as is None or Gate.keyring is None:
        return lambda model: True
    key = Gate.keyring.batch_work_of(runs_as)
    if key is None or key.requests_per_minute is not None or key.tokens_per_minute is not None:
        return None
    return key.may_call


def job_request(svc: Any, body: dict, bad_text: Callable[[Any], str | None]) -> tuple[JobRequest, Any, list[str]] | None:
    """(request, engine, texts) when the embedding job answers this body exactly as /v1/embeddings would;
    None for anything else (a prompt, input_type, chunking, any other field, a body the route refuses or
    would read otherwise: those run in process, where the route answers or refuses them itself). Checked
    here by hand, strictly: an API does not import another's schemas (tests/test_layout.py). `bad_text`: the
    job's rule for a row it would not embed (BatchJobs.bad_text)."""
    from service.engine.prompts import check_dimensions
    from service.front.schemas import strings_only

    dimensions, fmt, model, user = (body.get(k) for k in ("dimensions", "encoding_format", "model", "user"))
    if (not set(body) <= JOB_FIELDS or fmt not in (None, "float", "base64") or not isinstance(model, str | None)
            or not isinstance(user, str | None)
            or not (dimensions is None or (type(dimensions) is int and dimensions >= 1))):
        return None
    raw = body.get("input")
    if not isinstance(raw, str | list):
        return None
    try:
        strings_only(raw)
        engine = svc.model_for(model, "/v1/embeddings", True, "embedding")
        svc.check_representations(engine, ["dense"])
        check_dimensions(engine.model, engine.name, dimensions)
        texts = svc.texts(raw)
        svc.prompted(engine, texts, None, None)
    except Exception:  # noqa: BLE001 - the route's own refusal, in process
        return None
    if not texts or any(bad_text(t) is not None for t in texts):  # the job's bad rows, which the route embeds
        return None
    return JobRequest(model, fmt or "float", dimensions), engine, texts


class EmbeddingJob:
    """A batch's /v1/embeddings lines as the embedding job (jobs/batch.py's actor), and their answers."""

    def __init__(self, jobs: Any, batch_id: str, directory: Path, lines: dict[int, JobLine]) -> None:
        self.jobs = jobs  # jobs/batch.py's BatchJobs, handed down by the composition: service/ imports no jobs/
        self.batch_id, self.directory, self.lines = batch_id, directory, lines
        self.output = directory / "out"
        self.failed: str | None = None  # why the job stopped short: its lines then run in process
        self.shards: dict[str, tuple[int, dict[str, np.ndarray]]] = {}  # read shards: (last row, id -> embedding)
        self.actor: Any = None

    @classmethod
    async def start(cls, jobs: Any, svc: Any, batch_id: str, directory: Path, lines: list[Line],
                    may_call: Callable[[str], bool] = lambda model: True) -> EmbeddingJob | None:
        """The job of a batch's lines that it can do (None when there are none) and whose model the batch's key
        may call: its input written once (a restarted runner finds it), its actor found running or started."""
        # each line's checks and the rows (3.3 s at 50,000 lines) off the loop: online requests go on meanwhile
        chosen, engine = await asyncio.to_thread(cls.choose, svc, lines, jobs.bad_text, may_call)
        if not chosen:
            return None
        job = cls(jobs, batch_id, directory, chosen)
        source = directory / "input.jsonl"
        await asyncio.to_thread(cls.write_input, source, [line for line in lines if line.position in chosen])
        begun = await asyncio.to_thread(jobs.begun_with, job.output)
        spec = {"bundle": str(Path(engine.path).resolve()), "inputs": [str(source)], "output": str(job.output),
                "id_column": "id", "format": "jsonl", "batch_size": JOB_RANGE_ROWS,
                # the precision this replica serves, not the setting: under `auto` the job's own start-up probe
                # could choose the other runtime, and its vectors would differ from /v1/embeddings' answers. A
                # batch resumed after a restart keeps the precision its job began with (a replica restarted
                # under load can choose another): one batch, one precision, and the job refuses to mix them
                "precision": begun.get("precision") or engine.runtime.precision,
                "concurrency": 1, "num_cpus": JOB_CPUS, "nice": JOB_NICE}
        job.actor = jobs.start(batch_id, spec)
        return job

    @staticmethod
    def choose(svc: Any, lines: list[Line], bad_text: Callable[[Any], str | None],
               may_call: Callable[[str], bool] = lambda model: True) -> tuple[dict[int, JobLine], Any]:
        """The lines the job does (by position, with their rows) and their engine: one bundle per job; a model
        the key may not call is left to the route, which refuses it (403)."""
        chosen: dict[int, JobLine] = {}
        engine, row = None, 0
        for line in lines:
            found = job_request(svc, line.body, bad_text) if line.problem is None else None
            if found is None or (engine is not None and found[1] is not engine) or not may_call(found[1].name):
                continue
            request, engine, texts = found
            chosen[line.position] = JobLine(request, engine, texts, row)
            row += len(texts)
        return chosen, engine

    @staticmethod
    def write_input(source: Path, lines: list[Line]) -> None:
        """The job's input, written once (a restarted runner finds it): a temp file renamed into place."""
        if source.exists():
            return
        atomic_write(source, b"".join(json.dumps(r).encode() + b"\n" for r in job_rows(lines)))

    def summary(self) -> dict:
        """What the job did, kept in the batch's record (its folder goes when the batch ends): the job's
        _SUCCESS (None when it did not finish) and the processes that wrote its shards."""
        try:
            done = json.loads((self.output / "_SUCCESS").read_text())
        except (OSError, ValueError):
            done = None
        try:
            workers = sorted({r.worker for r in self.covered()})
        except (OSError, ValueError):
            workers = []
        return {"success": done, "workers": workers}

    def covered(self) -> list:
        return self.jobs.records(self.output)

    async def state(self) -> dict:
        try:
            return await self.actor.state.remote()
        except Exception as exc:  # noqa: BLE001 - the actor died (its node lost, killed): said as the job's end
            return {"done": True, "summary": None, "error": f"the job's actor is gone ({type(exc).__name__}: {exc})"}

    async def wait_for(self, first: int, last: int, stop) -> bool:
        """Wait until the job's records cover rows first..last (True), the job ends short of them (False,
        self.failed says why) or `stop()` (None: the batch is being cancelled or expired)."""
        while True:
            records = await asyncio.to_thread(self.covered)
            if covers(records, first, last):
                return True
            state = await self.state()
            if state["done"]:  # re-read: the last records may have landed since
                if covers(await asyncio.to_thread(self.covered), first, last):
                    return True
                self.failed = state["error"] or "the job ended without those rows"
                logger.error("openai batch %s: the embedding job failed (%s); its lines run in the replica",
                             self.batch_id, self.failed)
                return False
            if stop():
                return None
            await asyncio.sleep(JOB_POLL_S)

    def vectors(self, first: int, last: int) -> dict[str, np.ndarray]:
        """The embeddings of rows first..last, by job row id, from the shards that hold them."""
        import pyarrow.parquet as pq

        found: dict[str, np.ndarray] = {}
        for record in self.covered():
            if record.last < first or record.first > last:
                continue
            if record.name not in self.shards:
                table = pq.read_table(self.jobs.shard_path(self.output, record.first, record.last), columns=["id", "embedding"])
                ids = table.column("id").to_pylist()
                vectors = [np.asarray(v, dtype=np.float32) for v in table.column("embedding").to_pylist()]
                self.shards[record.name] = (record.last, dict(zip(ids, vectors, strict=True)))
            found.update(self.shards[record.name][1])
        # chunks come in row order: a shard wholly before this one's rows is done with
        self.shards = {name: held for name, held in self.shards.items() if held[0] >= first}
        return found

    async def outcomes(self, chunk: list[Line], stop) -> dict[int, tuple[bool, dict]] | None:
        """The outcomes of the chunk's lines the job did, by position (the rest run in process); None when
        `stop()` came first."""
        mine = [line for line in chunk if line.position in self.lines]
        if not mine or self.failed is not None:
            return {}
        first = self.lines[mine[0].position].first_row
        last_line = self.lines[mine[-1].position]
        last = last_line.first_row + len(last_line.texts) - 1
        ready = await self.wait_for(first, last, stop)
        if ready is None:
            return None
        if not ready:
            return {}
        vectors = await asyncio.to_thread(self.vectors, first, last)
        out = {}
        for line in mine:
            answer = await self.answer(line, vectors)
            if answer is not None:
                out[line.position] = answer
        return out

    async def answer(self, line: Line, vectors: dict[str, np.ndarray]) -> tuple[bool, dict] | None:
        """The line's output as /v1/embeddings answers its body, from the job's vectors; None when the job
        has not every one of its texts (a failed row) or the route would refuse it (too many tokens)."""
        from service.engine.prompts import shortened
        from service.front.deps import service
        from service.front.responses import encode_array

        job_line = self.lines[line.position]
        request, engine = job_line.request, job_line.engine
        keys = [f"{line.custom_id}#{i}" for i in range(len(job_line.texts))]
        if any(k not in vectors for k in keys):
            return None
        svc = await service()
        try:  # usage as the route counts it (and its token limit), from the replica's tokenizer
            tokenized = await svc.tokenize(engine, job_line.texts, True, "/v1/embeddings")
        except Exception:  # noqa: BLE001 - the route's refusal: in process
            return None
        stacked = np.stack([vectors[k] for k in keys])
        if request.dimensions is not None:
            stacked = shortened(stacked, request.dimensions)
        data = []
        for i, vector in enumerate(stacked):
            encoded = encode_array(vector, request.encoding_format, "float32")
            data.append({"object": "embedding", "index": i,
                         "embedding": encoded if isinstance(encoded, str) else encoded.tolist()})
        tokens = sum(t.n_tokens for t in tokenized)
        body = {"object": "list", "data": data, "model": engine.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        response = {"status_code": 200, "request_id": f"batch_req-{secrets.token_hex(12)}", "body": body}
        return True, request_line(line.custom_id, response, None)

    async def end(self, completed: bool) -> None:
        """A completed batch lets its job write _SUCCESS first; then the actor is stopped (it is detached:
        nothing else ends it) and the shards, whose vectors are in the output file now, are removed."""
        deadline = time.monotonic() + JOB_END_WAIT_S
        while completed and self.failed is None and time.monotonic() < deadline and not (await self.state())["done"]:
            await asyncio.sleep(JOB_POLL_S)
        await asyncio.to_thread(self.jobs.stop, self.batch_id)


def covers(records: list, first: int, last: int) -> bool:
    """Whether the records (disjoint ranges) cover every row first..last."""
    at = first
    for record in sorted(records, key=lambda r: r.first):
        if record.first <= at <= record.last:
            at = record.last + 1
        if at > last:
            return True
    return at > last


class BatchRunner:
    """This replica's runner of batches: started with the replica, on its event loop."""

    def __init__(self, settings: ServiceSettings, app: Any, jobs: Any = None) -> None:
        self.settings = settings
        # the embedding job's entry points (jobs/batch.py BatchJobs), given by the composition (deployment.py);
        # None: every line runs in this process
        self.jobs = jobs
        self.root = settings.jobs_dir
        self.app = app
        self.retry_after_s = max(settings.retry_after_s, 1)
        self.in_flight = 0  # this runner's lines inside the replica now (they pass the gate too)
        self.client: httpx.AsyncClient | None = None
        self.task: asyncio.Task | None = None
        self.retry_at: dict[str, float] = {}  # a batch that raised: when it is tried again (monotonic)

    def start(self) -> None:
        """Run from now on, on the running event loop (the replica's, when Serve builds the deployment)."""
        self.task = asyncio.get_running_loop().create_task(self.run_forever(), name="openai-batch-runner")

    async def stop(self) -> None:
        """Stop taking lines and chunks (the replica is stopping): what is recorded stays, and a runner started
        later (this service restarted, another replica) resumes the batch from its records."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def run_forever(self) -> None:
        transport = httpx.ASGITransport(app=self.app)
        swept = 0.0
        async with httpx.AsyncClient(transport=transport, base_url="http://batch.local", timeout=None) as client:
            self.client = client
            while True:
                try:
                    if time.monotonic() - swept > SWEEP_S:
                        swept = time.monotonic()
                        store = await asyncio.to_thread(store_at, self.root)
                        await asyncio.to_thread(sweep, store, self.settings.batch_retention_s)
                    await self.run_unfinished()
                except Exception:  # a batch's trouble must not stop the runner of the others
                    logger.exception("openai batch runner: a pass over the unfinished batches failed")
                await asyncio.sleep(POLL_S)

    async def run_unfinished(self) -> None:
        """Every unfinished batch no other runner holds, oldest first; one that raises is tried again later
        (failed after MAX_TRIES), never in the way of those after it."""
        if not (self.root.expanduser() / "batches").is_dir():  # no batch was ever created here
            return
        store = await asyncio.to_thread(store_at, self.root)
        for batch_id in await asyncio.to_thread(store.unfinished_ids):  # the marks: no record read on the loop
            if self.retry_at.get(batch_id, 0.0) > time.monotonic():
                continue
            lock = await asyncio.to_thread(store.claim, batch_id)
            if lock is None:
                continue
            try:
                await self.run_batch(store, batch_id)
                self.retry_at.pop(batch_id, None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - this batch's trouble, whatever its file holds
                logger.exception("openai batch %s: its run failed", batch_id)
                await asyncio.to_thread(self.tried, store, batch_id, exc)
            finally:
                lock.close()

    def tried(self, store: Store, batch_id: str, exc: BaseException) -> None:
        """Count a run of the batch that raised (in its record, so a restart counts on); past MAX_TRIES the
        batch is failed with the reason, else tried again after a pause."""
        record = store.record(batch_id)
        if record is None or record["status"] in TERMINAL:
            return
        record["tries"] = record.get("tries", 0) + 1
        if record["tries"] >= MAX_TRIES:
            self.retry_at.pop(batch_id, None)
            self.fail(store, record, "batch_failed",
                      f"the batch could not be run ({type(exc).__name__}: {str(exc)[:300]}); tried {MAX_TRIES} times")
            return
        store.save_batch(record)
        self.retry_at[batch_id] = time.monotonic() + RETRY_PAUSE_S * record["tries"]

    async def run_batch(self, store: Store, batch_id: str) -> None:
        record = await asyncio.to_thread(store.record, batch_id)
        if record is None or record["status"] in TERMINAL:  # another runner finished it meanwhile
            if record is not None:
                await asyncio.to_thread(store.remove_working_data, batch_id)
            return
        parts = store.parts_dir(batch_id)
        # acted on before the file is read (it may be what stopped every try): a cancel, the expiry, a deletion
        ending = await asyncio.to_thread(self.stopped, store, record)
        if ending is not None:
            return await self.end(store, record, parts, record["request_counts"]["total"], ending)
        try:  # file work off the replica's event loop, where the online requests are answered
            data = await asyncio.to_thread((store.files / f"{record['input_file_id']}.jsonl").read_bytes)
        except FileNotFoundError:
            return await self.end(store, record, parts, 0, "deleted")
        lines = await asyncio.to_thread(parse_lines, data, record["endpoint"])
        del data
        if record["status"] == "validating":
            problem = await self.validated(record, lines)
            if problem is not None:
                return await asyncio.to_thread(self.fail, store, record, *problem)
            record.update(status="in_progress", in_progress_at=int(time.time()),
                          request_counts={"total": len(lines), "completed": 0, "failed": 0})
            await asyncio.to_thread(store.save_batch, record)
        await asyncio.to_thread(parts.mkdir, exist_ok=True)
        done = {int(p.name.split("-")[0]) for p in await asyncio.to_thread(lambda: list(parts.glob("*.jsonl")))}
        # the counts of the chunks done before a restart, added to as chunks end
        counts = await asyncio.to_thread(self.counts, parts, len(lines))
        job = None
        may_call = job_may_answer(record.get("key"))
        if (self.jobs is not None and may_call is not None and record["endpoint"] == "/v1/embeddings"
                and len(done) * CHUNK_LINES < len(lines)):
            from service.front.deps import service

            job = await EmbeddingJob.start(self.jobs, await service(), batch_id,
                                           (self.root.expanduser() / "batches" / f"{batch_id}.job").resolve(), lines,
                                           may_call)

        def stopping() -> bool:
            return self.stopped(store, record) is not None

        ending = "completed"
        for start in range(0, len(lines), CHUNK_LINES):
            if start in done:
                continue
            ending = await asyncio.to_thread(self.stopped, store, record) or "completed"
            if ending != "completed":
                break
            chunk = lines[start:start + CHUNK_LINES]
            by_job = {} if job is None else await job.outcomes(chunk, stopping)
            if by_job is None:  # cancelled, expired or deleted while the job ran
                ending = await asyncio.to_thread(self.stopped, store, record) or "cancelled"
                break
            outcomes = await self.answer_chunk(record["endpoint"], chunk, by_job, record.get("key"), stopping)
            # serialized off the loop too: a chunk of 32 lines of 64 vectors is megabytes of JSON
            await asyncio.to_thread(lambda: atomic_write(
                parts / f"{start:08d}-{start + len(chunk):08d}.jsonl",
                b"".join(json.dumps({"ok": ok, "line": line}).encode() + b"\n" for ok, line in outcomes)))
            counts["completed"] += sum(ok for ok, _ in outcomes)
            counts["failed"] += sum(not ok for ok, _ in outcomes)
            record["request_counts"] = dict(counts)
            await asyncio.to_thread(store.save_batch, record)
        if job is not None:
            await job.end(ending == "completed")
            record["job"] = await asyncio.to_thread(job.summary)
        await self.end(store, record, parts, len(lines), ending)

    async def validated(self, record: dict, lines: list[Line]) -> tuple[str, str] | None:
        """Why a batch cannot start (its error's code and message), checked before any line runs: no lines,
        or an output estimated past batch_max_output_bytes."""
        if not lines:
            return "empty_file", "the input file has no request lines"
        from service.front.deps import service

        svc = await service()
        sizes: dict[str | None, int] = {}

        def dims_of(model: Any) -> int:
            key = model if isinstance(model, str) else None
            if key not in sizes:
                try:
                    sizes[key] = svc.model_for(key, record["endpoint"], True, None).model.sentence_dim
                except Exception:  # noqa: BLE001 - a model the route will refuse: its line is an error, sized as the default's
                    sizes[key] = svc.model_for(None, record["endpoint"], True, None).model.sentence_dim
            return sizes[key]

        estimate = await asyncio.to_thread(estimated_output_bytes, lines, record["endpoint"], dims_of)
        limit = self.settings.batch_max_output_bytes
        if estimate > limit:
            return ("output_too_large",
                    f"the batch's output is estimated at {estimate} bytes ({len(lines)} lines; texts x dimensions x "
                    f"bytes per number); the limit is {limit} (batch_max_output_bytes): split it into smaller batches "
                    "or ask for base64 or fewer dimensions")
        return None

    @staticmethod
    def stopped(store: Store, record: dict) -> str | None:
        """How the batch ends now, if it must: `cancelled` (asked), `expired` (past its window), `deleted`
        (its input file is gone); None to go on."""
        if store.cancel_asked_at(record["id"]) is not None:
            return "cancelled"
        if time.time() > record["expires_at"]:
            return "expired"
        if not store.file_exists(record["input_file_id"]):
            return "deleted"
        return None

    async def end(self, store: Store, record: dict, parts: Path, total: int, ending: str) -> None:
        """The batch's last state and files, then its working data removed (off the loop)."""
        if ending == "deleted":  # its owner deleted the input: nothing more is written from it
            await asyncio.to_thread(self.fail, store, record, "input_file_deleted",
                                    f"input file {record['input_file_id']} was deleted before the batch ended")
            return
        await asyncio.to_thread(self.stop_job_if_any, record["id"])  # a job a runner before this one started
        await asyncio.to_thread(self.finalize, store, record, parts, total, ending)
        await asyncio.to_thread(store.remove_working_data, record["id"])

    async def answer_chunk(self, endpoint: str, chunk: list[Line], by_job: dict[int, tuple[bool, dict]] | None = None,
                           runs_as: str | None = None, stopping: Callable[[], bool] | None = None,
                           ) -> list[tuple[bool, dict]]:
        """Each line's outcome (whether it goes to the output file, and its line there), in order: those the
        embedding job answered (`by_job`, by position), the others run in process as the key `runs_as`."""
        by_job = by_job or {}
        rest = [line for line in chunk if line.position not in by_job]
        answered: dict[int, tuple[bool, dict]] = dict(by_job)
        for group in range(0, len(rest), CONCURRENT_LINES):
            some = rest[group:group + CONCURRENT_LINES]
            outcomes = await asyncio.gather(*(self.answer(endpoint, line, runs_as, stopping) for line in some))
            for line, outcome in zip(some, outcomes, strict=True):
                answered[line.position] = outcome
        return [answered[line.position] for line in chunk]

    async def answer(self, endpoint: str, line: Line, runs_as: str | None = None,
                     stopping: Callable[[], bool] | None = None) -> tuple[bool, dict]:
        """A line run through its route, in this process, after online requests, as the key that owns its batch
        (`runs_as`: its models and limits per minute hold; a 429 waits for the limit to refill, at most
        LIMIT_WAIT_S in all, while the batch is not stopped)."""
        if line.problem is not None:
            return False, request_line(line.custom_id, None, {"code": "invalid_request", "message": line.problem})
        assert self.client is not None
        request_id = f"batch_req-{secrets.token_hex(12)}"
        headers = {"content-type": "application/json", "x-request-id": request_id,
                   "x-encoder-priority": "batch"}  # behind interactive work in the batch queue (engine/batcher.py)
        if Gate.keyring is not None:  # the keyring's own key, which only this process knows (service/front/keys.py)
            headers["authorization"] = f"Bearer {Gate.keyring.internal.decode()}"
            if runs_as is not None:
                headers[ON_BEHALF_HEADER] = runs_as
        tries, waited = 0, 0.0
        while True:
            await self.after_online_requests()
            self.in_flight += 1
            try:
                r = await self.client.post(endpoint, content=json.dumps(line.body).encode(), headers=headers)
            finally:
                self.in_flight -= 1
            # the key's window (its answers carry OpenAI's x-ratelimit-* headers), not another refusal
            rate_limited = r.status_code == 429 and any(
                name in r.headers for name in ("x-ratelimit-limit-requests", "x-ratelimit-limit-tokens"))
            if rate_limited and waited < LIMIT_WAIT_S and not (
                    stopping is not None and await asyncio.to_thread(stopping)):
                pause = min(max(float(r.headers.get("retry-after", "1") or 1), 1.0), LIMIT_WAIT_S - waited)
                waited += pause
                await asyncio.sleep(pause)
                continue
            tries += 1
            if r.status_code != 503 or tries == RETRIES:
                break
            await asyncio.sleep(self.retry_after_s)
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"type": "backend", "message": r.text[:1000]}}
        response = {"status_code": r.status_code, "request_id": request_id, "body": body}
        return 200 <= r.status_code < 300, request_line(line.custom_id, response, None)

    async def after_online_requests(self) -> None:
        """Wait (at most YIELD_MAX_S) while online inference requests are inside this replica."""
        deadline = time.monotonic() + YIELD_MAX_S
        while Gate.pending > self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    @staticmethod
    def counts(parts: Path, total: int) -> dict[str, int]:
        completed = failed = 0
        for part in parts.glob("*.jsonl"):
            for raw in part.read_bytes().splitlines():
                if json.loads(raw)["ok"]:
                    completed += 1
                else:
                    failed += 1
        return {"total": total, "completed": completed, "failed": failed}

    def stop_job_if_any(self, batch_id: str) -> None:
        if self.jobs is not None:
            self.jobs.stop_if_any(batch_id)

    def fail(self, store: Store, record: dict, code: str, message: str) -> None:
        """The batch `failed` with one error saying why; its job stopped, then its working data removed (after
        the record, so a runner stopped in between leaves only what the sweeper removes)."""
        self.stop_job_if_any(record["id"])
        record.update(status="failed", failed_at=int(time.time()),
                      errors={"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]})
        store.save_batch(record)
        store.remove_working_data(record["id"])

    def finalize(self, store: Store, record: dict, parts: Path, total: int, ending: str) -> None:
        """The output and error files from the chunks done, in line order, streamed a line at a time into
        temp files renamed into place (a batch's output may be gigabytes); then the batch's last state."""
        now = int(time.time())
        if ending == "completed" and now > record["expires_at"]:  # finalized past its window (a late restart)
            ending = "expired"
        if ending == "completed":
            record.update(status="finalizing", finalizing_at=now)
            store.save_batch(record)
        batch_id, owner = record["id"], record["owner"]
        counts = {"total": total, "completed": 0, "failed": 0}
        written: dict[bool, Path] = {}
        try:
            with (tempfile.NamedTemporaryFile(dir=store.files, prefix=f".{batch_id}.output.", delete=False) as out,
                  tempfile.NamedTemporaryFile(dir=store.files, prefix=f".{batch_id}.error.", delete=False) as err):
                written = {True: Path(out.name), False: Path(err.name)}
                for part in sorted(parts.glob("*.jsonl")):
                    with part.open("rb") as f:
                        for raw in f:
                            outcome = json.loads(raw)
                            ok = bool(outcome["ok"])
                            (out if ok else err).write(json.dumps(outcome["line"]).encode() + b"\n")
                            counts["completed" if ok else "failed"] += 1
                for f in (out, err):
                    f.flush()
                    os.fsync(f.fileno())
            expires_after_s = int(record.get("output_expires_s") or self.settings.batch_output_expires_s)
            for ok, what, key in ((True, "output", "output_file_id"), (False, "error", "error_file_id")):
                if counts["completed" if ok else "failed"]:
                    record[key] = store.adopt_file(owner, f"{batch_id}_{what}.jsonl", "batch_output", written[ok],
                                                   derived_id("file-", batch_id, what), expires_after_s)["id"]
        finally:
            for path in written.values():
                path.unlink(missing_ok=True)
        record["request_counts"] = counts
        record["status"] = ending
        record[f"{ending}_at"] = now
        if ending == "cancelled":
            record["cancelling_at"] = store.cancel_asked_at(batch_id) or now
        store.save_batch(record)


def sweep(store: Store, retention_s: int, now: float | None = None) -> dict[str, int]:
    """Delete what has expired (run off the loop, every SWEEP_S): each file whose `expires_at` has passed, its
    record and bytes; each ended batch created more than `retention_s` ago, its record and marks; and the
    working data an ended batch left (a runner stopped between its end and the removal). Says how many."""
    now = time.time() if now is None else now
    removed = {"files": 0, "batches": 0, "working": 0}
    for path in store.files.glob("file-*.json"):
        try:
            expires_at = json.loads(path.read_bytes()).get("expires_at")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(expires_at, int | float) and expires_at <= now:
            path.with_suffix(".jsonl").unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            removed["files"] += 1
    unfinished = set(store.unfinished_ids())
    for created_ns, _, batch_id in store.indexed():
        if batch_id in unfinished or created_ns / 1e9 + retention_s > now:
            continue
        record = store.record(batch_id)
        if record is not None and record["status"] in TERMINAL:
            store.forget_batch(record)
            removed["batches"] += 1
    for left in [*store.batches.glob("batch_*.parts"), *store.batches.glob("batch_*.job")]:
        batch_id = left.name.split(".")[0]
        record = store.record(batch_id)
        if batch_id not in unfinished and (record is None or record["status"] in TERMINAL):
            store.remove_working_data(batch_id)
            removed["working"] += 1
    return removed
