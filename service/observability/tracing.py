"""OpenTelemetry traces: where a slow request spent its time.

Off by default, and then nothing here runs past one `if` per request. On in a replica when its
settings have `tracing` (service/config.py, TracingSettings), or when the standard variables ask for
it: OTEL_TRACES_EXPORTER=otlp, or an OTLP endpoint in OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
OTEL_EXPORTER_OTLP_ENDPOINT (OTEL_TRACES_EXPORTER=none or OTEL_SDK_DISABLED=true keep it off).
Spans go to the OTLP receiver (a collector) in batches, over gRPC or HTTP/protobuf.

One request is one trace, continued from the client's W3C `traceparent` (HTTP header or gRPC
metadata), else a new one:

    POST /v1/embeddings          SERVER: route, model, status, texts, tokens, request id; a link to its batch
      tokenize                   the tokenizer call
      queue                      from joining the batch queue until its batch started
      serialize                  the response body

A batch is a span of its own (`batch`, the root of its own trace: its run, requests, texts, tokens,
padding, graphs), linked to the request span of every request it served and linked from each, so a
trace viewer goes from a slow request to the batch it waited for and back to the requests that shared
it. (No span per request for the batch's run: the link says it.)

At full sampling every microsecond counts (the target: at most 5 % of single-text throughput, whose
whole replica CPU is about 4 ms a text). So the replica only reads clocks and draws ids: a request's
spans are `time_ns()` readings on a `RequestSpan`, which become plain records (tuples) when the
request ends, queued for a writer thread that hands them, marshalled in batches every 0.1 s, to the
replica's span exporter process (service/observability/span_export.py), which encodes and exports them with the
SDK's OTLP exporter at a lower CPU priority. The SDK's sampler and id
generator, here, decide and name every span, as its tracer would. What the replica no longer does:
the SDK's live-span machinery (locks, attribute checks, context attach and detach per span) and the
OTLP protobuf encoding (about 15 us a span, holding the interpreter lock the event loop needs).
Measured: docs/performance.md. If the exporter process is gone, spans are dropped (and said so once);
requests never wait for it, and at most MAX_QUEUED records wait for it.

The tracer provider is this module's own, not OpenTelemetry's global one: Ray sets up that one for
its own tracing, and the two must not mix.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import marshal
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from service.observability import span_export

if TYPE_CHECKING:
    from service.config import TracingSettings

logger = logging.getLogger("ray.serve")

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
MAX_QUEUED = 65536  # span records waiting for the exporter process; past it, new ones are dropped
WRITE_EVERY_S = 0.1
CHUNK = 4096  # records a frame
# How long closing the exporter may take: its last frames written and the process's last export. Past it
# the process is killed, which also ends a write blocked on its full pipe (a stopped process reads nothing).
CLOSE_TIMEOUT_S = 30.0


class _Exporter:
    """The replica's end of its span exporter process: a queue, and a thread that writes it to the
    process's stdin in marshalled frames."""

    def __init__(self, settings: TracingSettings) -> None:
        package_root = str(Path(__file__).resolve().parents[2])  # the folder holding service/ (where the replica runs)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        self.child = subprocess.Popen([sys.executable, "-m", "service.observability.span_export", settings.model_dump_json()],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.queue: collections.deque[tuple] = collections.deque()
        self.pipe = threading.Lock()  # one writer at a time: the thread, or flush()
        self.dropped = 0
        self.broken = False
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="span-exporter-writer", daemon=True)
        self.thread.start()

    def put(self, record: tuple) -> None:
        if len(self.queue) < MAX_QUEUED and not self.broken:
            self.queue.append(record)
        else:
            self.dropped += 1

    def _run(self) -> None:
        while not self.stopping.wait(WRITE_EVERY_S):
            self.write()

    def write(self) -> None:
        """Everything queued, to the process (dropped, and said once, if it is gone)."""
        with self.pipe:
            while self.queue and not self.broken:
                records = [self.queue.popleft() for _ in range(min(CHUNK, len(self.queue)))]
                try:
                    body = marshal.dumps(records)
                except ValueError:  # an attribute of a type marshal does not take: that record only
                    body = marshal.dumps([r for r in records if _marshallable(r)])
                self._send(span_export.frame(span_export.SPANS, body))

    def _send(self, data: bytes) -> None:
        try:
            self.child.stdin.write(data)
            self.child.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            self.broken = True
            self.queue.clear()
            logger.error("tracing: the span exporter process is gone (exit %s, %s); spans are dropped from now on",
                         self.child.poll(), exc)

    def flush(self, timeout_ms: int) -> None:
        self.write()
        with self.pipe:
            if self.broken:
                return
            self._send(span_export.frame(span_export.FLUSH, str(timeout_ms).encode()))
            ready, _, _ = select.select([self.child.stdout], [], [], timeout_ms / 1000 + 1)
            if ready:
                self.child.stdout.readline()

    def close(self, timeout_s: float | None = None) -> None:
        """Export what is queued, then let the process export what it holds and exit; within `timeout_s`
        (CLOSE_TIMEOUT_S) whatever the process does (stopped, hung): then it is killed. Every wait below
        may block on the process (a write to its full pipe holds `pipe`, its exit), so one timer bounds them all."""
        timeout_s = CLOSE_TIMEOUT_S if timeout_s is None else timeout_s
        self.stopping.set()
        killer = threading.Timer(timeout_s, self._kill, args=(timeout_s,))
        killer.daemon = True
        killer.start()
        try:
            self.thread.join()
            self.write()
            with contextlib.suppress(OSError, ValueError):  # a broken pipe's last flush
                self.child.stdin.close()
            self.child.wait()
        finally:
            killer.cancel()
        if self.dropped:
            logger.warning("tracing: %d span(s) dropped (the exporter process was gone or behind)", self.dropped)

    def _kill(self, timeout_s: float) -> None:
        if self.child.poll() is None:
            logger.warning("tracing: the span exporter process did not finish within %g s; killed, with the spans "
                           "it held", timeout_s)
            self.child.kill()


def _marshallable(record: tuple) -> bool:
    try:
        marshal.dumps(record)
        return True
    except ValueError:
        logger.warning("tracing: span %r dropped: an attribute marshal does not take", record[0])
        return False


class _Tracing:
    """What a replica traces with while tracing is on: the SDK's sampler and id generator (from a
    provider of its own, which reads OTEL_TRACES_SAMPLER as the SDK does), the W3C propagator, and
    the exporter process."""

    def __init__(self, settings: TracingSettings) -> None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ratio = settings.sample_ratio
        provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)) if ratio is not None else None)
        self.sampler = provider.sampler
        self.ids = provider.id_generator
        self.propagator = TraceContextTextMapPropagator()
        self.exporter = _Exporter(settings)


_on: _Tracing | None = None  # set while tracing is on in this process
_current: contextvars.ContextVar[RequestSpan | None] = contextvars.ContextVar("encoder_request_span", default=None)


def wanted(settings: TracingSettings | None) -> bool:
    """Whether this process should trace: the settings ask, or the OTEL_* variables do."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if settings is not None:
        return True
    return exporter == "otlp" or any(os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                                                                    "OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(settings: TracingSettings | None) -> bool:
    """Turn tracing on in this process when wanted (its exporter process started); returns whether it is on."""
    global _on
    shutdown()
    if not wanted(settings):
        return False
    from service.config import TracingSettings

    settings = settings or TracingSettings()
    _on = _Tracing(settings)
    logger.info("tracing on: OTLP %s to %s, service.name %s, spans exported by process %d",
                span_export.protocol(settings.model_dump()),
                settings.endpoint or "the OTEL_EXPORTER_OTLP_* endpoint",
                os.environ.get("OTEL_SERVICE_NAME") or settings.service_name, _on.exporter.child.pid)
    return True


def enabled() -> bool:
    return _on is not None


def shutdown(timeout_s: float | None = None) -> None:
    """Tracing off in this process (what was recorded is exported first, within `timeout_s`: CLOSE_TIMEOUT_S)."""
    global _on
    on, _on = _on, None
    if on is not None:
        on.exporter.close(timeout_s)


def flush(timeout_ms: int = 5000) -> None:
    """Export what is recorded now (a test that waits for its spans)."""
    if _on is not None:
        _on.exporter.flush(timeout_ms)


# ---- the request's own span ----


class RequestSpan:
    """The SERVER span of one request (HTTP or gRPC), current while the request is handled, and its
    children (tokenize, queue, serialize) and links, recorded as clock readings until it finishes."""

    __slots__ = ("on", "trace_id", "span_id", "parent_span_id", "trace_state", "start_ns", "attributes", "children",
                 "links", "ended", "_token")

    def __init__(self, on: _Tracing, trace_id: int, parent_span_id: int, trace_state: str,
                 attributes: dict[str, Any]) -> None:
        self.on, self.trace_id, self.trace_state, self.attributes = on, trace_id, trace_state, attributes
        self.span_id = on.ids.generate_span_id()
        self.parent_span_id = parent_span_id  # 0: none; else the client's span (remote)
        self.start_ns = time.time_ns()
        self.children: list[tuple[str, int, int, dict[str, Any] | None, str | None]] = []
        self.links: list[tuple[int, int]] = []
        self.ended = False
        self._token = _current.set(self)

    def finish(self, name: str, status: int, attributes: dict[str, Any]) -> None:
        """End the request: its span's and its children's records, queued for the exporter process.
        Never raises: a request is answered whatever becomes of its spans."""
        end_ns = time.time_ns()
        self.ended = True
        _current.reset(self._token)
        try:
            self._record(name, status, attributes, end_ns)
        except Exception:  # noqa: BLE001 - logged; the request's answer stands
            logger.exception("tracing: the spans of a request (%s) were not recorded", name)

    def _record(self, name: str, status: int, attributes: dict[str, Any], end_ns: int) -> None:
        on, trace_id, state = self.on, self.trace_id, self.trace_state
        for child, start_ns, child_end_ns, child_attributes, error in self.children:
            on.exporter.put((child, trace_id, on.ids.generate_span_id(), self.span_id, False, False, start_ns,
                             child_end_ns, child_attributes, (), error, state))
        self.attributes.update((k, v) for k, v in attributes.items() if v is not None)
        if "url.path" in self.attributes and self.attributes["url.path"] == self.attributes.get("http.route"):
            del self.attributes["url.path"]  # said once: every attribute is encoded and sent for every request
        on.exporter.put((name, trace_id, self.span_id, self.parent_span_id, bool(self.parent_span_id), True,
                         self.start_ns, end_ns, self.attributes, tuple(self.links),
                         f"status {status}" if status >= 500 else None, state))


def request_span(name: str, carrier: dict[str, str], attributes: dict[str, Any]) -> RequestSpan | None:
    """The request's span, continued from the client's traceparent in `carrier`; None when tracing is off
    or the sampler leaves this request out (then nothing of it is recorded)."""
    on = _on
    if on is None:
        return None
    from opentelemetry import trace

    parent_context = on.propagator.extract(carrier) if carrier else None
    parent = trace.get_current_span(parent_context).get_span_context() if parent_context is not None else None
    if parent is not None and not parent.is_valid:
        parent = None
    trace_id = parent.trace_id if parent is not None else on.ids.generate_trace_id()
    decision = on.sampler.should_sample(parent_context, trace_id, name, trace.SpanKind.SERVER, attributes)
    if not decision.decision.is_sampled():
        return None
    if decision.attributes:
        attributes = {**attributes, **decision.attributes}
    state = decision.trace_state.to_header() if decision.trace_state else ""
    return RequestSpan(on, trace_id, parent.span_id if parent is not None else 0, state, attributes)


def carrier_of_headers(headers: dict[bytes, bytes]) -> dict[str, str]:
    return {key: headers[key.encode()].decode("latin-1") for key in (TRACEPARENT, TRACESTATE) if key.encode() in headers}


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """A child of the current request's span (tokenize, serialize); nothing when tracing is off or the
    request is not sampled."""
    request = _current.get() if _on is not None else None
    if request is None:
        yield
        return
    start_ns = time.time_ns()
    try:
        yield
    except BaseException as exc:
        request.children.append((name, start_ns, time.time_ns(), attributes or None, f"{type(exc).__name__}: {exc}"))
        raise
    request.children.append((name, start_ns, time.time_ns(), attributes or None, None))


def current() -> RequestSpan | None:
    """The current request's span (on its task), for a job to carry to its batch; None when not traced."""
    return _current.get() if _on is not None else None


# ---- a batch, recorded when it has run ----


def _epoch_ns(perf: float, now_perf: float, now_ns: int) -> int:
    """A perf_counter() reading as the epoch nanoseconds spans are stamped with."""
    return now_ns - int((now_perf - perf) * 1e9)


def record_batch(jobs: list[Any], started: float, ended: float, attributes: dict[str, Any]) -> None:
    """The batch's span, the root of a trace of its own, linked to the request span of each traced job
    (its `trace`, set when it was submitted), which links back to it; and each job's `queue` span under
    its request. Called from the batch's worker thread after the run, with perf_counter() times, while
    the requests still wait."""
    on = _on
    if on is None:
        return
    traced: list[tuple[Any, RequestSpan]] = [
        (job, r) for job in jobs if isinstance(r := getattr(job, "trace", None), RequestSpan)]
    if not traced:
        return
    now_perf, now_ns = time.perf_counter(), time.time_ns()
    start_ns, end_ns = _epoch_ns(started, now_perf, now_ns), _epoch_ns(ended, now_perf, now_ns)
    attributes = {k: v.item() if hasattr(v, "item") else v for k, v in attributes.items()}  # numpy scalars
    batch_trace, batch_span = on.ids.generate_trace_id(), on.ids.generate_span_id()
    on.exporter.put(("batch", batch_trace, batch_span, 0, False, False, start_ns, end_ns, attributes,
                     tuple((r.trace_id, r.span_id) for _, r in traced), None, ""))
    for job, request in traced:
        if request.ended:  # a request whose client left may have ended (499) before its batch did
            continue
        request.links.append((batch_trace, batch_span))  # what the request brought: its own encoder.texts, .tokens
        request.children.append(("queue", _epoch_ns(job.enqueued, now_perf, now_ns), start_ns, None, None))
