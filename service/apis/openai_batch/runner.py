"""The adapter between a stored batch and the work: it takes unfinished batches from the store (one runner
per replica; a batch's lock says which runs it, and is freed when that process dies, so a restarted or
surviving replica resumes it), runs its lines a chunk at a time, and writes OpenAI's output and error files.

How a line runs: in this process, through the service's own HTTP app (the real routes, engines and
limits, called over ASGI with the replica's token), so a line's `response.body` is by construction what
its route (/v1/embeddings, /v1/rerank, /v1/score) answers for that body. Lines wait while online requests
are inside this replica (at most YIELD_MAX_S each), so a batch takes the capacity they leave.

When the embedding job lands (`python -m jobs embed`, issue 50), a batch's /v1/embeddings lines go to it
as a Ray job beside the Serve application instead: `job_rows` below is its input (one row per text,
id = custom_id#position); what switches is `BatchRunner.answer_chunk` (docs/batch-api.md, "When the
embedding job lands").

Resumption: each chunk's outcomes are one file under the batch's parts/ folder (written whole), so a
restart redoes at most the chunk in flight; finalizing writes the output and error files under ids made
from the batch's, so a finalize redone replaces them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from service.apis.openai_batch.store import TERMINAL, Store, atomic_write, creation_order, derived_id, store_at
from service.config import ServiceSettings
from service.front.gate import Gate

logger = logging.getLogger("ray.serve")

CHUNK_LINES = 32  # lines whose outcomes are written together: what a restart may run again
CONCURRENT_LINES = 4  # lines of a chunk in the engine at once (enough to fill its batches with a few texts each)
POLL_S = 0.5  # how often an idle runner looks for unfinished batches
YIELD_MAX_S = 1.0  # longest a line waits for online requests to leave before it runs anyway
RETRIES = 5  # tries of a line answered 503 (overloaded, not ready) before its answer is kept


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
        except ValueError as exc:
            lines.append(Line(position, None, None, f"line {position + 1} is not JSON ({exc})"))
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


class BatchRunner:
    """This replica's runner of batches: started with the replica, on its event loop."""

    def __init__(self, settings: ServiceSettings, app: Any) -> None:
        self.root = settings.jobs_dir
        self.app = app
        self.retry_after_s = max(settings.retry_after_s, 1)
        self.in_flight = 0  # this runner's lines inside the replica now (they pass the gate too)
        self.client: httpx.AsyncClient | None = None
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        """Run from now on, on the running event loop (the replica's, when Serve builds the deployment)."""
        self.task = asyncio.get_running_loop().create_task(self.run_forever(), name="openai-batch-runner")

    async def run_forever(self) -> None:
        transport = httpx.ASGITransport(app=self.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://batch.local", timeout=None) as client:
            self.client = client
            while True:
                try:
                    await self.run_unfinished()
                except Exception:  # a batch's trouble must not stop the runner of the others
                    logger.exception("openai batch runner: a pass over the unfinished batches failed")
                await asyncio.sleep(POLL_S)

    async def run_unfinished(self) -> None:
        """Every unfinished batch no other runner holds, oldest first."""
        if not (self.root.expanduser() / "batches").is_dir():  # no batch was ever created here
            return
        store = store_at(self.root)
        for record in sorted(store.all_batches(), key=creation_order):
            if record["status"] in TERMINAL:
                continue
            lock = store.claim(record["id"])
            if lock is None:
                continue
            try:
                await self.run_batch(store, record["id"])
            finally:
                lock.close()

    async def run_batch(self, store: Store, batch_id: str) -> None:
        record = store.record(batch_id)
        if record is None or record["status"] in TERMINAL:  # another runner finished it meanwhile
            return
        try:  # file work off the replica's event loop, where the online requests are answered
            data = await asyncio.to_thread((store.files / f"{record['input_file_id']}.jsonl").read_bytes)
        except FileNotFoundError:
            return self.fail(store, record, "file_not_found", f"input file {record['input_file_id']} was deleted")
        lines = await asyncio.to_thread(parse_lines, data, record["endpoint"])
        if record["status"] == "validating":
            if not lines:
                return self.fail(store, record, "empty_file", "the input file has no request lines")
            record.update(status="in_progress", in_progress_at=int(time.time()),
                          request_counts={"total": len(lines), "completed": 0, "failed": 0})
            store.save_batch(record)
        parts = store.parts_dir(batch_id)
        parts.mkdir(exist_ok=True)
        done = {int(p.name.split("-")[0]) for p in parts.glob("*.jsonl")}
        # the counts of the chunks done before a restart, added to as chunks end
        counts = await asyncio.to_thread(self.counts, parts, len(lines))
        ending = "completed"
        for start in range(0, len(lines), CHUNK_LINES):
            if start in done:
                continue
            if store.cancel_asked_at(batch_id) is not None:
                ending = "cancelled"
                break
            if time.time() > record["expires_at"]:
                ending = "expired"
                break
            chunk = lines[start:start + CHUNK_LINES]
            outcomes = await self.answer_chunk(record["endpoint"], chunk)
            await asyncio.to_thread(atomic_write, parts / f"{start:08d}-{start + len(chunk):08d}.jsonl",
                                    b"".join(json.dumps({"ok": ok, "line": line}).encode() + b"\n" for ok, line in outcomes))
            counts["completed"] += sum(ok for ok, _ in outcomes)
            counts["failed"] += sum(not ok for ok, _ in outcomes)
            record["request_counts"] = dict(counts)
            await asyncio.to_thread(store.save_batch, record)
        await asyncio.to_thread(self.finalize, store, record, parts, len(lines), ending)

    async def answer_chunk(self, endpoint: str, chunk: list[Line]) -> list[tuple[bool, dict]]:
        """Each line's outcome (whether it goes to the output file, and its line there), in order. The switch
        point of issue 50's embedding job: /v1/embeddings chunks go to it then (job_rows)."""
        outcomes: list[tuple[bool, dict]] = []
        for group in range(0, len(chunk), CONCURRENT_LINES):
            outcomes += await asyncio.gather(*(self.answer(endpoint, line)
                                               for line in chunk[group:group + CONCURRENT_LINES]))
        return outcomes

    async def answer(self, endpoint: str, line: Line) -> tuple[bool, dict]:
        """A line run through its route, in this process, after online requests."""
        if line.problem is not None:
            return False, request_line(line.custom_id, None, {"code": "invalid_request", "message": line.problem})
        assert self.client is not None
        request_id = f"batch_req-{secrets.token_hex(12)}"
        headers = {"content-type": "application/json", "x-request-id": request_id}
        if Gate.token is not None:
            headers["authorization"] = f"Bearer {Gate.token.decode()}"
        for attempt in range(RETRIES):
            await self.after_online_requests()
            self.in_flight += 1
            try:
                r = await self.client.post(endpoint, content=json.dumps(line.body).encode(), headers=headers)
            finally:
                self.in_flight -= 1
            if r.status_code != 503 or attempt == RETRIES - 1:
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

    @staticmethod
    def fail(store: Store, record: dict, code: str, message: str) -> None:
        record.update(status="failed", failed_at=int(time.time()),
                      errors={"object": "list", "data": [{"code": code, "message": message, "param": None, "line": None}]})
        store.save_batch(record)

    def finalize(self, store: Store, record: dict, parts: Path, total: int, ending: str) -> None:
        """The output and error files from the chunks done, in line order, then the batch's last state."""
        now = int(time.time())
        if ending == "completed":
            record.update(status="finalizing", finalizing_at=now)
            store.save_batch(record)
        outputs: list[bytes] = []
        errors: list[bytes] = []
        for part in sorted(parts.glob("*.jsonl")):
            for raw in part.read_bytes().splitlines():
                outcome = json.loads(raw)
                (outputs if outcome["ok"] else errors).append(json.dumps(outcome["line"]).encode() + b"\n")
        batch_id, owner = record["id"], record["owner"]
        if outputs:
            record["output_file_id"] = store.add_file(owner, f"{batch_id}_output.jsonl", "batch_output", b"".join(outputs),
                                                      derived_id("file-", batch_id, "output"))["id"]
        if errors:
            record["error_file_id"] = store.add_file(owner, f"{batch_id}_error.jsonl", "batch_output", b"".join(errors),
                                                     derived_id("file-", batch_id, "error"))["id"]
        record["request_counts"] = self.counts(parts, total)
        record["status"] = ending
        record[f"{ending}_at"] = now
        if ending == "cancelled":
            record["cancelling_at"] = store.cancel_asked_at(batch_id) or now
        store.save_batch(record)
        shutil.rmtree(parts, ignore_errors=True)
