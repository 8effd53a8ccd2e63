"""OpenAI's Batch API uploads (POST /v1/files, service/apis/openai_batch/uploads.py), as a hostile client
sends them (issue 55): a 100 MiB body stored or refused with the process growing by a few MiB and the event
loop never held; a one-byte boundary and 100 MiB of part headers refused as they stream in; lines counted as
`bytes.splitlines()` splits them; the per-token quotas atomic across processes; `expires_after`; ids matched
whole; and, on a real service, the `openai` SDK's errors in OpenAI's shape, raw paths that try to leave
jobs_dir, the bound on concurrent uploads, the quotas and a 100 MiB upload beside online requests."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import multiprocessing
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.apis.openai_batch.store import Store
from service.apis.openai_batch.uploads import (MAX_PART_HEADER_BYTES, UPLOAD_ALLOWANCE, LineCounter, Limits, UploadSink,
                                               expires_at, read_upload)
from service.engine.errors import BadRequest, NotFound, ServiceError, TooLarge
from tests.conftest import BATCH_LIMITS, deploy
from tests.reliability import record

MiB = 1024 * 1024
CHUNK = 64 * 1024
LINE = b'{"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a short text"}}\n'
KB_LINE = b'{"x": "' + b"y" * 1014 + b'"}\n'  # 1 KiB: a file of these passes a byte limit before a line limit


def multipart_head(boundary: bytes = b"b0undary", filename: bytes = b"requests.jsonl") -> bytes:
    return (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="' + filename
            + b'"\r\nContent-Type: application/jsonl\r\n\r\n')


def multipart_tail(boundary: bytes = b"b0undary") -> bytes:
    return b"\r\n--" + boundary + b"--\r\n"


def file_chunk() -> bytes:
    """64 KiB of whole request lines (the last cut short): one object, sent again and again, so that the
    sender holds nothing while it sends 100 MiB."""
    return (LINE * (CHUNK // len(LINE) + 1))[:CHUNK]


def streamed(head: bytes, repeat: bytes, total: int, tail: bytes) -> Iterator[bytes]:
    """`head`, then `repeat` until `total` bytes of it were sent, then `tail`."""
    yield head
    sent = 0
    while sent < total:
        piece = repeat if total - sent >= len(repeat) else repeat[:total - sent]
        sent += len(piece)
        yield piece
    yield tail


class Measured:
    """What one upload cost at function level: tracemalloc's peak over the upload (every Python allocation:
    chunks, parser state, counters), the process's RSS growth (sampled), the event loop's worst lateness
    (a ticker that asks to wake every 5 ms), the body bytes consumed and the seconds taken."""

    def __init__(self) -> None:
        self.peak = self.rss_growth = 0
        self.stall_s = self.seconds = 0.0
        self.consumed = 0
        self.baseline_stall_s = 0.0
        self.outcome: object = None


async def measured_upload(chunks: Iterator[bytes], sink: UploadSink, body_limit: int, *, trace: bool) -> Measured:
    """read_upload (what POST /v1/files runs) over `chunks`, measured; its outcome (Received or the error)."""
    m = Measured()
    process = psutil.Process()
    start_rss = process.memory_info().rss
    done = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            m.consumed += len(chunk)
            yield chunk
            await asyncio.sleep(0)  # as a socket's chunks arrive: the loop runs between them

    async def ticker() -> None:
        while not done.is_set():
            asked = time.perf_counter()
            await asyncio.sleep(0.005)
            m.stall_s = max(m.stall_s, time.perf_counter() - asked - 0.005)
            m.rss_growth = max(m.rss_growth, process.memory_info().rss - start_rss)

    if not trace:  # the same ticker with no upload, as long as an upload takes: what the machine's load alone costs
        end = time.perf_counter() + 2.5
        while time.perf_counter() < end:
            asked = time.perf_counter()
            await asyncio.sleep(0.005)
            m.baseline_stall_s = max(m.baseline_stall_s, time.perf_counter() - asked - 0.005)

    if trace:
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
    tick = asyncio.create_task(ticker())
    began = time.perf_counter()
    try:
        m.outcome = await read_upload(body(), sink, body_limit)
    except ServiceError as exc:
        m.outcome = exc
    finally:
        m.seconds = time.perf_counter() - began
        done.set()
        await tick
        if trace:
            m.peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
    return m


def limits(file_bytes: int = 200 * MiB, lines: int = 5_000_000, line_bytes: int = MiB) -> Limits:
    return Limits(file_bytes, lines, line_bytes)


def run_upload(chunks: Iterator[bytes], tmp_path: Path, lim: Limits, boundary: bytes = b"b0undary",
               trace: bool = False) -> tuple[Measured, UploadSink]:
    sink = UploadSink(boundary, lim, tmp_path)
    return asyncio.run(measured_upload(chunks, sink, lim.file_bytes + UPLOAD_ALLOWANCE, trace=trace)), sink


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---- function level: memory, loop stall, hostile bodies ----


@pytest.mark.parametrize("trace", [False, True], ids=["loop stall and RSS", "tracemalloc peak"])
def test_a_100_mib_upload_is_stored_with_a_few_mib_of_memory_and_no_loop_stall(tmp_path, trace):
    """Before issue 55's fix: +1.9 GiB and a 16.8 s loop stall at this level. Run twice, since tracemalloc
    slows every allocation: once for the stall and RSS, once for the Python allocations' peak."""
    size = 100 * MiB
    chunk = file_chunk()
    m, sink = run_upload(streamed(multipart_head(), chunk, size, multipart_tail()), tmp_path, limits(), trace=trace)
    assert not isinstance(m.outcome, Exception), m.outcome
    received = m.outcome
    assert received.size == size and received.fields == {"purpose": "batch"} and received.filename == "requests.jsonl"
    digest, stored_lines = hashlib.sha256(), 0
    with open(received.path, "rb") as f:
        while block := f.read(MiB):
            digest.update(block)
            stored_lines += block.count(b"\n")
    expected = hashlib.sha256()
    for piece in streamed(b"", chunk, size, b""):
        expected.update(piece)
    assert digest.hexdigest() == expected.hexdigest()
    assert received.lines == stored_lines + 1  # the last line is cut short, and counts
    sink.discard()
    assert leftovers(tmp_path) == []
    if trace:
        assert m.peak < 4 * MiB, f"tracemalloc peak {m.peak / MiB:.1f} MiB"
    else:
        assert m.rss_growth < 16 * MiB, f"RSS grew by {m.rss_growth / MiB:.1f} MiB"
        # the loop's worst lateness beyond what the machine's load gives an idle loop (the shared 2-core machine
        # runs other suites: 179 ms was seen there); before the fix: 16.8 s
        assert m.stall_s < 0.1 + m.baseline_stall_s, \
            f"the event loop was held {m.stall_s * 1000:.0f} ms (idle: {m.baseline_stall_s * 1000:.0f} ms)"
    record("a 100 MiB upload stored (function level)", "100 MiB of 97-byte lines, 64 KiB chunks",
           {"seconds": round(m.seconds, 1), "tracemalloc_peak_mib" if trace else "rss_growth_mib":
            round((m.peak if trace else m.rss_growth) / MiB, 2), **({} if trace else {
                "loop_stall_ms": round(m.stall_s * 1000), "idle_loop_stall_ms": round(m.baseline_stall_s * 1000)})},
           note="stored whole, the loop never held past 100 ms")


def test_a_100_mib_upload_over_the_limit_is_refused_at_the_limit_and_leaves_nothing(tmp_path):
    m, sink = run_upload(streamed(multipart_head(), file_chunk(), 100 * MiB, multipart_tail()), tmp_path,
                         limits(file_bytes=8 * MiB), trace=True)
    assert isinstance(m.outcome, TooLarge) and "batch_max_file_bytes" in m.outcome.message, m.outcome
    assert m.consumed < 8 * MiB + 2 * CHUNK  # refused the moment the limit passed, not at the end
    sink.discard()
    assert leftovers(tmp_path) == [] and m.peak < 4 * MiB


def test_a_one_byte_boundary_and_100_mib_of_lookalike_delimiters_stay_small_and_fast(tmp_path):
    """The old parser split the body on the delimiter: +1.3 GiB with a one-byte boundary. Here a file of
    100 MiB whose every line starts as the delimiter would (\\r\\n--, then not the boundary)."""
    lookalike = (b"\r\n--y" * (CHUNK // 5))[:CHUNK]
    m, sink = run_upload(streamed(multipart_head(b"x"), lookalike, 100 * MiB, multipart_tail(b"x")), tmp_path,
                         limits(lines=50_000_000), boundary=b"x", trace=False)
    assert not isinstance(m.outcome, Exception), m.outcome
    assert m.outcome.size == 100 * MiB
    sink.discard()
    assert m.rss_growth < 16 * MiB and m.stall_s < 0.1 + m.baseline_stall_s, (m.rss_growth / MiB, m.stall_s)
    # and a body of nothing but one-byte-boundary delimiters: refused at the part count, not read to its end
    parts = b"--x\r\n\r\n\r\n" * (CHUNK // 9)
    m, sink = run_upload(streamed(b"", parts, 100 * MiB, b"--x--\r\n"), tmp_path, limits(), boundary=b"x", trace=True)
    assert isinstance(m.outcome, BadRequest) and "parts" in m.outcome.message, m.outcome
    assert m.consumed <= 2 * CHUNK and m.peak < 4 * MiB
    sink.discard()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("shape", ["one endless header", "a million short headers"])
def test_100_mib_of_part_headers_is_refused_after_16_kib(tmp_path, shape):
    """Before: +3.3 GiB. Part headers are counted as they are parsed (MAX_PART_HEADER_BYTES), 413."""
    repeat = b"a" * CHUNK if shape == "one endless header" else (b"X-Pad: 1\r\n" * (CHUNK // 10))
    head = b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"\r\n" + (
        b"X-Pad: " if shape == "one endless header" else b"")
    m, sink = run_upload(streamed(head, repeat, 100 * MiB, b"\r\n\r\n"), tmp_path, limits(), trace=True)
    assert isinstance(m.outcome, TooLarge) and f"{MAX_PART_HEADER_BYTES} bytes" in m.outcome.message, m.outcome
    assert m.consumed <= MAX_PART_HEADER_BYTES + 2 * CHUNK and m.peak < 4 * MiB and m.seconds < 5
    sink.discard()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(("case", "expected"), [
    ("a line one byte over", (TooLarge, "batch_max_line_bytes")),
    ("one line too many", (TooLarge, "batch_max_lines")),
    ("cut before the closing boundary", (BadRequest, "closing boundary")),
    ("no file part", (BadRequest, "`file`")),
    ("purpose after the file", (BadRequest, "purpose")),
    ("two file parts", (BadRequest, "more than one")),
    ("a field of 2 KB", (BadRequest, "longer than")),
    ("garbage", (BadRequest, "malformed")),
])
def test_malformed_or_oversized_bodies_are_refused_and_leave_no_temporary_file(tmp_path, case, expected):
    line_limit, line_count = 1000, 20
    file_part = (b"--b0undary\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.jsonl\"\r\n\r\n")
    purpose = b'--b0undary\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    body = {
        "a line one byte over": multipart_head() + b"{}\n" + b"x" * (line_limit + 1) + b"\n" + multipart_tail(),
        "one line too many": multipart_head() + b"{}\r\n" * (line_count + 1) + multipart_tail(),
        "cut before the closing boundary": multipart_head() + b"{}\n",
        "no file part": purpose + b"--b0undary--\r\n",
        "purpose after the file": file_part + b"{}\n\r\n" + purpose.replace(b"batch", b"fine-tune") + b"--b0undary--\r\n",
        "two file parts": file_part + b"{}\r\n" + file_part + b"{}" + multipart_tail(),
        "a field of 2 KB": purpose.replace(b"batch", b"b" * 2048) + b"--b0undary--\r\n",
        "garbage": bytes(range(256)) * 100,
    }[case]
    m, sink = run_upload(iter([body[i:i + 7] for i in range(0, len(body), 7)]), tmp_path,
                         limits(lines=line_count, line_bytes=line_limit))
    kind, words = expected
    assert isinstance(m.outcome, kind) and words in m.outcome.message, m.outcome
    sink.discard()
    assert leftovers(tmp_path) == []


def test_a_line_at_the_limit_and_the_last_line_allowed_are_stored(tmp_path):
    """The one-byte boundary of the line and line-count limits: exactly at each is fine."""
    body = multipart_head() + b"x" * 1000 + b"\r\n" + b"{}\n" * 18 + b"{}" + multipart_tail()
    m, sink = run_upload(iter([body[i:i + 5] for i in range(0, len(body), 5)]), tmp_path, limits(lines=20, line_bytes=1000))
    assert not isinstance(m.outcome, Exception), m.outcome
    assert m.outcome.lines == 20
    sink.discard()


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=80).map(lambda b: bytes(b"ab\r\n"[x % 4] for x in b)),
       cuts=st.lists(st.integers(0, 80), max_size=6), line_limit=st.integers(1, 8))
def test_lines_are_counted_as_splitlines_splits_them_however_the_chunks_fall(data, cuts, line_limit):
    """The runner reads a file with bytes.splitlines() (\\n, \\r, \\r\\n): the upload's counts agree, wherever the
    chunks cut the stream, a \\r\\n between two chunks included."""
    counter = LineCounter(Limits(10**9, 10**9, line_limit))
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    longest = max((len(line) for line in data.splitlines()), default=0)
    try:
        for a, b in zip(bounds, bounds[1:]):
            counter.feed(data[a:b])
    except TooLarge:
        assert longest > line_limit
    else:
        assert longest <= line_limit and counter.total() == len(data.splitlines())


def test_expires_after_is_openais_and_the_default_applies_without_it():
    assert expires_at({}, 1000, 0) is None
    assert expires_at({}, 1000, 86400) == 1000 + 86400
    assert expires_at({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}, 1000, 0) == 4600
    assert expires_at({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592000"}, 1000, 60) == 2593000
    for fields, words in [({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "between"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "between"),
                          ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "anchor"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1e9"}, "whole number"),
                          ({"expires_after[seconds]": "3600"}, "both")]:
        with pytest.raises(BadRequest, match=words):
            expires_at(fields, 1000, 0)


# ---- the store: quotas under a lock across processes, ids matched whole ----


def _racer(root: str, owner: str, index: int, size: int, max_files: int, max_bytes: int, go, results) -> None:
    store = Store(Path(root))
    tmp = store.files / f".upload-racer-{index}.tmp"
    tmp.write_bytes(b"x" * size)
    go.wait()
    try:
        store.add_upload(owner, f"{index}.jsonl", size, tmp, None, int(time.time()), max_files, max_bytes)
        results.put("stored")
    except ServiceError as exc:
        tmp.unlink(missing_ok=True)
        results.put(exc.type)


@pytest.mark.parametrize("quota", ["files", "bytes"])
def test_the_per_token_quotas_hold_when_processes_race_for_the_last_places(tmp_path, quota):
    """Eight processes (replicas sharing jobs_dir) store an upload each at the same moment: exactly as many as
    the quota allows are stored, whichever quota binds (fcntl lock per owner under jobs_dir)."""
    owner = hashlib.sha256(b"token").hexdigest()
    max_files, max_bytes = (3, 10**9) if quota == "files" else (100, 3 * 1000 + 500)
    ctx = multiprocessing.get_context("fork")  # a process per replica, started fast
    go, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(str(tmp_path), owner, i, 1000, max_files, max_bytes, go, results))
             for i in range(8)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    go.set()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    refused = "bad_request" if quota == "files" else "too_large"
    assert outcomes == sorted(["stored"] * 3 + [refused] * 5), outcomes
    store = Store(tmp_path)
    assert store.usage(owner) == (3, 3000)
    assert len(list(store.files.glob("file-*.jsonl"))) == 3 and not list(store.files.glob(".upload-*"))
    other = hashlib.sha256(b"another").hexdigest()
    assert store.usage(other) == (0, 0)  # another token's quota is its own
    # a deleted file gives its place back, and a record removed behind the store's back is not counted
    first, second = sorted(p.stem for p in store.files.glob("file-*.jsonl"))[:2]
    store.delete_file(owner, first)
    (store.files / f"{second}.json").unlink()
    assert store.usage(owner) == (1, 1000)


def test_an_id_with_a_trailing_newline_is_not_found(tmp_path):
    """`re.match("...$")` accepted "file-<24 hex>\\n": a record planted under that name was served."""
    store = Store(tmp_path)
    good = "file-" + "a" * 24
    for name in (good, good + "\n"):
        record = {"id": name, "object": "file", "bytes": 2, "created_at": 0, "filename": "x", "purpose": "batch",
                  "status": "processed", "expires_at": None, "status_details": None, "owner": ""}
        (store.files / f"{name}.json").write_text(json.dumps(record))
        (store.files / f"{name}.jsonl").write_bytes(b"{}")
    assert store.file("", good)["id"] == good
    for bad in (good + "\n", good + "\r", "\n" + good, good.upper()):
        with pytest.raises(NotFound):
            store.file("", bad)
    assert store.record("batch_" + "b" * 24 + "\n") is None


# ---- on the shared service (authentication off): OpenAI's errors, raw paths, expires_after, the upload slots ----

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def assert_openais(r: httpx.Response, status: int, code: str) -> dict:
    """An answer in OpenAI's error shape, exactly: `{"error": {"message", "type", "param", "code"}}`."""
    assert r.status_code == status and r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR_KEYS, body
    error = body["error"]
    assert error["code"] == code and isinstance(error["message"], str) and error["param"] is None, body
    category = "authentication_error" if status == 401 else "server_error" if status >= 500 else "invalid_request_error"
    assert error["type"] == category, body
    return error


@pytest.fixture(scope="module")
def sdk(service_url):
    with openai.OpenAI(base_url=f"{service_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_the_sdks_errors_carry_openais_code_type_and_body(sdk):
    """Code written against OpenAI reads `e.code`, `e.type`, `e.body`: each is OpenAI's, with our code."""
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.files.retrieve("file-" + "0" * 24)
    assert caught.value.code == "not_found" and caught.value.type == "invalid_request_error"
    assert set(caught.value.body) == OPENAI_ERROR_KEYS and "file-000" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.batches.create(input_file_id="file-" + "0" * 24, endpoint="/v1/embeddings", completion_window="24h")
    assert caught.value.code == "not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert caught.value.code == "bad_request" and caught.value.type == "invalid_request_error"
    with pytest.raises(openai.APIStatusError) as caught:
        sdk.files.create(file=("a.jsonl", io.BytesIO(KB_LINE * (BATCH_LIMITS["batch_max_file_bytes"] // 1024 + 1))),
                         purpose="batch")
    assert caught.value.status_code == 413 and caught.value.code == "too_large"
    assert "batch_max_file_bytes" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                         expires_after={"anchor": "created_at", "seconds": 60})
    assert caught.value.code == "bad_request" and "between 3600 and 2592000" in caught.value.body["message"]


def test_raw_refusals_on_every_files_and_batches_route_are_openais(service_url):
    with httpx.Client(base_url=service_url, timeout=60) as c:
        assert_openais(c.get("/v1/files/file-" + "0" * 24), 404, "not_found")
        assert_openais(c.get("/v1/files/file-" + "0" * 24 + "/content"), 404, "not_found")
        assert_openais(c.delete("/v1/files/nonsense"), 404, "not_found")
        assert_openais(c.get("/v1/batches/batch_" + "0" * 24), 404, "not_found")
        assert_openais(c.post("/v1/batches/batch_" + "0" * 24 + "/cancel"), 404, "not_found")
        assert_openais(c.post("/v1/files", content=b"{}", headers={"content-type": "application/json"}), 400, "bad_request")
        assert_openais(c.post("/v1/batches", json={"input_file_id": "x"}), 422, "validation")
        assert_openais(c.get("/v1/batches", params={"limit": 0}), 422, "validation")
        assert_openais(c.put("/v1/files"), 405, "method_not_allowed")
        # a chunked body (no Content-Length) past the upload's limit: counted as it streams in
        big = streamed(multipart_head(), KB_LINE * 64, 4 * MiB, multipart_tail())
        error = assert_openais(c.post("/v1/files", content=big,
                                      headers={"content-type": "multipart/form-data; boundary=b0undary"}), 413, "too_large")
        assert "batch_max_file_bytes" in error["message"]
        # and a declared Content-Length past the route's body limit (the larger of max_body_bytes, 8 MiB by
        # default, and the file's limit with what multipart adds), before a byte is read
        r = c.post("/v1/files", content=b"x" * (9 * MiB), headers={"content-type": "multipart/form-data; boundary=b0"})
        assert_openais(r, 413, "too_large")


def raw_request(url: str, target: str, method: str = "GET") -> tuple[int, bytes]:
    """`method target` sent as written (no client normalises `..`, `%2F` or `//`): the status and body."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        decoded = b""
        while body:
            size, _, rest = body.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            decoded, body = decoded + rest[:n], rest[n + 2:]
        body = decoded
    return int(head.split()[1]), body


def test_raw_paths_that_try_to_leave_jobs_dir_get_404_json_and_read_nothing(service_url, batch_jobs_dir):
    """httpx and the SDK normalise `../` before sending: these are sent raw. A record planted outside files/
    (as `../secret` would find it) and one under an id with a trailing newline (which `re.match(...$)`
    accepted) are never served."""
    secret = "TOPSECRET-" + os.urandom(4).hex()
    planted = {"id": "x", "object": "file", "bytes": 1, "created_at": 0, "filename": secret, "purpose": "batch",
               "status": "processed", "expires_at": None, "status_details": None, "owner": ""}
    (batch_jobs_dir / "secret.json").write_text(json.dumps(planted))
    (batch_jobs_dir / "secret.jsonl").write_text(secret)
    newline_id = "file-" + os.urandom(12).hex()
    (batch_jobs_dir / "files" / f"{newline_id}\n.json").write_text(json.dumps({**planted, "id": newline_id}))
    (batch_jobs_dir / "files" / f"{newline_id}\n.jsonl").write_text(secret)
    targets = ["/v1/files/..%2Fsecret", "/v1/files/..%2Fsecret/content", "/v1/files/%2E%2E%2Fsecret/content",
               "/v1/files/..%252Fsecret/content", "/v1/files/../secret/content", "/v1/files/../../etc/passwd",
               "/v1/files//..//secret/content", "//v1/files/..%2F..%2Fsecret.json", "/v1/files/%2e%2e/content",
               "/v1/files/..", "/v1/batches/..%2F..%2Fsecret", f"/v1/files/{newline_id}%0A",
               f"/v1/files/{newline_id}%0A/content", f"/v1/files/{newline_id}%0a", "/v1/files/file-%00/content"]
    for target in targets:
        for method in ("GET", "DELETE") if "/content" not in target else ("GET",):
            status, body = raw_request(service_url, target, method)
            assert status in (404, 405), (target, method, status, body[:200])
            assert secret.encode() not in body, (target, body[:200])
            error = json.loads(body)["error"]
            assert isinstance(error["message"], str), (target, body)
    assert (batch_jobs_dir / "secret.json").exists()  # and nothing deleted
    assert (batch_jobs_dir / "files" / f"{newline_id}\n.json").exists()


def test_expires_after_from_the_sdk_and_the_default_are_stored(sdk):
    uploaded = sdk.files.create(file=("e.jsonl", io.BytesIO(b"{}\n")), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 7200})
    assert uploaded.expires_at == uploaded.created_at + 7200
    assert sdk.files.retrieve(uploaded.id).expires_at == uploaded.expires_at
    plain = sdk.files.create(file=("d.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    assert plain.expires_at == plain.created_at + 30 * 24 * 3600  # batch_file_expires_after_s's default
    for f in (uploaded, plain):
        sdk.files.delete(f.id)


@pytest.mark.serial
def test_uploads_past_the_replicas_concurrent_bound_get_503_with_retry_after(service_url, batch_jobs_dir):
    """batch_max_concurrent_uploads (4 by default) uploads held open mid-body: the next is refused at once
    (503, Retry-After, OpenAI's body); once they end, uploads are taken again, and the held ones stored."""
    async def scenario() -> tuple[list[httpx.Response], httpx.Response]:
        release = asyncio.Event()

        async def held_body() -> AsyncIterator[bytes]:
            # 64 KiB before it holds: HAProxy (the suite's ingress) buffers a request's first 16 KiB
            # (tune.bufsize, option http-buffer-request) before it passes it to a replica
            yield multipart_head() + KB_LINE * 64
            await release.wait()
            yield b"{}\n" + multipart_tail()

        async with httpx.AsyncClient(base_url=service_url, timeout=90) as c:
            holders = [asyncio.create_task(c.post("/v1/files", content=held_body(),
                                                  headers={"content-type": "multipart/form-data; boundary=b0undary"}))
                       for _ in range(4)]
            # Every held upload has taken its slot once it writes its temporary file. Only then the fifth: sent
            # earlier, it could take a slot before a held one reached the route, and that one be refused instead
            deadline = time.monotonic() + 60
            while len(list((batch_jobs_dir / "files").glob(".upload-*"))) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            refused = await c.post("/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "batch"})
            release.set()
            return [await h for h in holders], refused

    held, refused = asyncio.run(scenario())
    assert_openais(refused, 503, "overloaded")
    assert int(refused.headers["retry-after"]) >= 1 and "batch_max_concurrent_uploads" in refused.json()["error"]["message"]
    assert [r.status_code for r in held] == [200] * 4, [r.text for r in held]
    for r in held:
        assert (batch_jobs_dir / "files" / f"{r.json()['id']}.jsonl").read_bytes() == KB_LINE * 64 + b"{}\n"
        httpx.delete(f"{service_url}/v1/files/{r.json()['id']}", timeout=30)
    after = httpx.post(f"{service_url}/v1/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "batch"},
                       timeout=60)
    assert after.status_code == 200, after.text
    httpx.delete(f"{service_url}/v1/files/{after.json()['id']}", timeout=30)
    assert not list((batch_jobs_dir / "files").glob(".upload-*"))
    record("uploads past the replica's bound", "4 uploads held open mid-body, a fifth sent",
           {"503": 1, "200": 4}, note="refused at once with Retry-After; the held ones stored when they ended")


# ---- an app of its own: a token, quotas, and a 100 MiB upload beside online requests ----

TOKEN = "upload-quota-token"
QUOTA = {"batch_max_file_bytes": 120 * MiB, "batch_max_lines": 2_000_000, "batch_max_files_per_token": 3,
         "batch_max_bytes_per_token": 150 * MiB}


@pytest.fixture(scope="module")
def quota_app(ray_serve, default_bundle, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("upload-token") / "token"
    token_file.write_text(TOKEN)
    jobs_dir = tmp_path_factory.mktemp("upload-jobs")
    deploy({"auth_token_file": str(token_file), "num_cpus": 0.5, "jobs_dir": str(jobs_dir), **QUOTA},
           "uploads", "/uploads", default_bundle)
    yield f"{ray_serve.url}/uploads", jobs_dir
    from ray import serve

    serve.delete("uploads")


def test_without_the_token_files_and_batches_answer_401_in_openais_shape(quota_app):
    url, _ = quota_app
    for method, path in [("GET", "/v1/files/file-" + "0" * 24), ("POST", "/v1/files"), ("GET", "/v1/batches"),
                         ("POST", "/v1/batches")]:
        r = httpx.request(method, f"{url}{path}", timeout=30, headers={"authorization": "Bearer wrong"})
        assert_openais(r, 401, "unauthorized")
    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=60) as c:
        with pytest.raises(openai.AuthenticationError) as caught:
            c.batches.list()
    assert caught.value.type == "authentication_error" and caught.value.code == "unauthorized"


def test_a_100_mib_upload_beside_online_requests_then_the_quotas(quota_app):
    """A 100 MiB upload streamed to the service (chunked, no Content-Length) while a client sends single-text
    /v1/embeddings requests one after another: the replica's RSS (sampled) and the requests' latency against
    the same requests alone. Then the quotas: 3 files and 150 MiB per token, refused before storing."""
    url, jobs_dir = quota_app
    auth = {"authorization": f"Bearer {TOKEN}"}
    replica = psutil.Process(httpx.get(f"{url}/info", timeout=30, headers=auth).json()["replica"]["pid"])

    def latencies(seconds: float, stop: threading.Event | None = None) -> list[float]:
        out = []
        with httpx.Client(base_url=url, headers=auth, timeout=60) as c:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end and not (stop is not None and stop.is_set()):
                began = time.perf_counter()
                assert c.post("/v1/embeddings", json={"input": "a single online text"}).status_code == 200
                out.append(time.perf_counter() - began)
        return out

    def upload_100_mib(with_online: bool) -> tuple[httpx.Response, float, float, list[float]]:
        """The upload, the seconds it took, the replica's RSS growth (MiB, sampled every 50 ms) and the
        latencies of the online requests sent meanwhile."""
        start_rss, peak_rss, stop = replica.memory_info().rss, [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak_rss[0] = max(peak_rss[0], replica.memory_info().rss)
                time.sleep(0.05)

        beside: list[float] = []
        threads = [threading.Thread(target=sample)]
        if with_online:
            threads.append(threading.Thread(target=lambda: beside.extend(latencies(600, stop))))
        for t in threads:
            t.start()
        try:
            began = time.perf_counter()
            r = httpx.post(f"{url}/v1/files", headers={**auth, "content-type": "multipart/form-data; boundary=b0undary"},
                           content=streamed(multipart_head(), file_chunk(), 100 * MiB, multipart_tail()), timeout=600)
            seconds = time.perf_counter() - began
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert r.status_code == 200, r.text
        assert (jobs_dir / "files" / f"{r.json()['id']}.jsonl").stat().st_size == r.json()["bytes"] == 100 * MiB
        return r, seconds, (peak_rss[0] - start_rss) / MiB, sorted(beside)

    alone = sorted(latencies(5))
    first, alone_s, alone_growth, _ = upload_100_mib(with_online=False)
    httpx.delete(f"{url}/v1/files/{first.json()['id']}", headers=auth, timeout=60)
    r, upload_s, growth, beside = upload_100_mib(with_online=True)
    stored = r.json()
    p50_alone, p50_beside = alone[len(alone) // 2], beside[len(beside) // 2]
    figures = {"upload_alone_s": round(alone_s, 1), "replica_rss_growth_alone_mib": round(alone_growth, 1),
               "upload_s": round(upload_s, 1), "replica_rss_growth_mib": round(growth, 1),
               "online_p50_alone_ms": round(p50_alone * 1000, 1), "online_p50_beside_ms": round(p50_beside * 1000, 1),
               "online_max_alone_ms": round(alone[-1] * 1000, 1), "online_max_beside_ms": round(beside[-1] * 1000, 1),
               "online_requests_beside": len(beside)}
    print(figures)
    # before issue 55's fix: +2,275 MiB and a single-text request at 6,037 ms. Measured on the shared 2-core
    # machine: +70 MiB alone, +66 MiB beside the online requests, online max 61-94 ms against 46 ms alone. The
    # growth is Ray Serve's, not the route's: its receive proxy in the replica queues the body as fast as the
    # client sends it (docs/jobs.md, Uploads); the bounds leave room for that, far under the defect
    assert alone_growth < 128 and growth < 128, figures
    assert beside and beside[-1] < 1.0, figures
    record("a 100 MiB upload beside online requests (Ray Serve)", "100 MiB chunked upload, single-text /v1/embeddings "
           "requests one after another", figures, note="stored; replica RSS sampled every 50 ms")

    with openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=300) as c:
        # 100 MiB stored of 150: 60 MiB more passes batch_max_bytes_per_token, refused while it streams in
        with pytest.raises(openai.APIStatusError) as caught:
            c.files.create(file=("big.jsonl", io.BytesIO(KB_LINE * (60 * 1024))), purpose="batch")
        assert caught.value.status_code == 413 and "batch_max_bytes_per_token" in caught.value.body["message"]
        small = [c.files.create(file=(f"{i}.jsonl", io.BytesIO(b"{}\n")), purpose="batch") for i in range(2)]
        with pytest.raises(openai.BadRequestError) as caught:
            c.files.create(file=("4.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert caught.value.code == "bad_request" and "batch_max_files_per_token" in caught.value.body["message"]
        c.files.delete(small[0].id)
        c.files.delete(stored["id"])
        again = c.files.create(file=("5.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert again.bytes == 3
    assert not list((jobs_dir / "files").glob(".upload-*"))
