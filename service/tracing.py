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
whole replica CPU is about 4 ms a text). So the request path only reads clocks: a request's spans are
`time_ns()` readings on a `RequestSpan`, which becomes the SDK's finished spans (`ReadableSpan`) in one
go when the request ends, handed to the SDK's batch processor and OTLP exporter. The SDK's sampler and
id generator decide and name them, as its tracer would; what is skipped is its live-span machinery
(locks, attribute validation, context attach/detach per span): measured in-process, 118 -> 36 us of
the request path per request. The exporter's encoding hashes each span's resource (a json.dumps per
span), so the resource here hashes once (`_Resource`): 86 -> 60 us per request (docs/performance.md).

The tracer provider is this module's own, not OpenTelemetry's global one: Ray sets up that one for
its own tracing, and the two must not mix.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.config import TracingSettings

logger = logging.getLogger("ray.serve")

TRACEPARENT, TRACESTATE = "traceparent", "tracestate"
SCOPE_NAME = "mha-encoder-serving"


@dataclass(frozen=True)
class _Tracing:
    """What a replica traces with while tracing is on: the SDK's provider (its sampler, id generator and
    resource) and the batch processor its spans go to."""

    provider: Any
    processor: Any
    scope: Any  # InstrumentationScope
    propagator: Any  # W3C trace context


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
    """Turn tracing on in this process when wanted; returns whether it is on."""
    global _on
    if not wanted(settings):
        _on = None
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from service.config import TracingSettings

    class _Resource(Resource):
        """The resource, hashed once: the OTLP encoder hashes it for every span (a json.dumps each)."""

        def __init__(self, base: Resource) -> None:
            super().__init__(base.attributes, base.schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    settings = settings or TracingSettings()
    name = os.environ.get("OTEL_SERVICE_NAME") or settings.service_name
    sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio)) if settings.sample_ratio is not None else None
    provider = TracerProvider(resource=_Resource(Resource.create({"service.name": name})), sampler=sampler)
    # Every second (the SDK's default is 5 s), in exports of up to 2,048 spans (its default 512: a busy
    # replica makes 2,000 spans a second, and each export costs a gRPC call and a wake-up of its thread)
    processor = BatchSpanProcessor(
        _exporter(settings), schedule_delay_millis=int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "1000")),
        max_export_batch_size=int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2048")),
        max_queue_size=int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "8192")))
    provider.add_span_processor(processor)  # so that the provider's flush and shutdown reach it
    _on = _Tracing(provider, processor, InstrumentationScope(SCOPE_NAME), TraceContextTextMapPropagator())
    logger.info("tracing on: OTLP %s to %s, service.name %s", _protocol(settings),
                settings.endpoint or "the OTEL_EXPORTER_OTLP_* endpoint", name)
    return True


def _protocol(settings: TracingSettings) -> str:
    return (settings.protocol or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")


def _exporter(settings: TracingSettings):
    if _protocol(settings) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = settings.endpoint
        insecure = endpoint.startswith("http://") if endpoint else None
        return OTLPSpanExporter(endpoint=endpoint, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=settings.endpoint)


def enabled() -> bool:
    return _on is not None


def shutdown() -> None:
    """Tracing off in this process (what was buffered is exported first)."""
    global _on
    on, _on = _on, None
    if on is not None:
        on.provider.shutdown()


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered now (a replica that stops, a test that waits for its spans)."""
    if _on is not None:
        _on.provider.force_flush(timeout_ms)


# ---- the request's own span ----


def _sampled_context(on: _Tracing, trace_id: int, trace_state: Any = None) -> Any:
    from opentelemetry.trace import SpanContext, TraceFlags

    return SpanContext(trace_id, on.provider.id_generator.generate_span_id(), is_remote=False,
                       trace_flags=TraceFlags(TraceFlags.SAMPLED), trace_state=trace_state)


def _finished(on: _Tracing, name: str, context: Any, parent: Any, start_ns: int, end_ns: int,
              attributes: dict[str, Any] | None, kind: Any = None, links: tuple = (), status: Any = None) -> Any:
    """One finished span, as the SDK's tracer would have made it."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanKind, Status

    return ReadableSpan(name, context=context, parent=parent, resource=on.provider.resource,
                        attributes=attributes or {}, links=links, kind=kind or SpanKind.INTERNAL,
                        status=status or Status(), start_time=start_ns, end_time=end_ns,
                        instrumentation_scope=on.scope)


class RequestSpan:
    """The SERVER span of one request (HTTP or gRPC), current while the request is handled, and its
    children (tokenize, queue, serialize) and links, recorded as clock readings until it finishes."""

    __slots__ = ("on", "context", "parent", "start_ns", "attributes", "children", "links", "ended", "_token")

    def __init__(self, on: _Tracing, context: Any, parent: Any, attributes: dict[str, Any]) -> None:
        self.on, self.context, self.parent, self.attributes = on, context, parent, attributes
        self.start_ns = time.time_ns()
        self.children: list[tuple[str, int, int, dict[str, Any] | None, Any]] = []
        self.links: list[Any] = []
        self.ended = False
        self._token = _current.set(self)

    def finish(self, name: str, status: int, attributes: dict[str, Any]) -> None:
        """End the request: its span and its children's, to the batch processor (and so to the exporter).
        Never raises: a request is answered whatever becomes of its spans."""
        end_ns = time.time_ns()
        self.ended = True
        _current.reset(self._token)
        try:
            self._export(name, status, attributes, end_ns)
        except Exception:  # noqa: BLE001 - logged; the request's answer stands
            logger.exception("tracing: the spans of a request (%s) were not recorded", name)

    def _export(self, name: str, status: int, attributes: dict[str, Any], end_ns: int) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        on, context = self.on, self.context
        for child, start_ns, child_end_ns, child_attributes, child_status in self.children:
            on.processor.on_end(_finished(on, child, _sampled_context(on, context.trace_id, context.trace_state),
                                          context, start_ns, child_end_ns, child_attributes, status=child_status))
        self.attributes.update((k, v) for k, v in attributes.items() if v is not None)
        if "url.path" in self.attributes and self.attributes["url.path"] == self.attributes.get("http.route"):
            del self.attributes["url.path"]  # said once: every attribute is encoded and sent for every request
        on.processor.on_end(_finished(
            on, name, context, self.parent, self.start_ns, end_ns, self.attributes, kind=SpanKind.SERVER,
            links=tuple(self.links), status=Status(StatusCode.ERROR, f"status {status}") if status >= 500 else None))


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
    trace_id = parent.trace_id if parent is not None else on.provider.id_generator.generate_trace_id()
    decision = on.provider.sampler.should_sample(parent_context, trace_id, name, trace.SpanKind.SERVER, attributes)
    if not decision.decision.is_sampled():
        return None
    if decision.attributes:
        attributes = {**attributes, **decision.attributes}
    return RequestSpan(on, _sampled_context(on, trace_id, decision.trace_state), parent, attributes)


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
        from opentelemetry.trace import Status, StatusCode

        request.children.append((name, start_ns, time.time_ns(), attributes,
                                 Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}")))
        raise
    request.children.append((name, start_ns, time.time_ns(), attributes, None))


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
    from opentelemetry.trace import Link

    traced: list[tuple[Any, RequestSpan]] = [
        (job, r) for job in jobs if isinstance(r := getattr(job, "trace", None), RequestSpan)]
    if not traced:
        return
    now_perf, now_ns = time.perf_counter(), time.time_ns()
    start_ns, end_ns = _epoch_ns(started, now_perf, now_ns), _epoch_ns(ended, now_perf, now_ns)
    batch = _sampled_context(on, on.provider.id_generator.generate_trace_id())
    on.processor.on_end(_finished(on, "batch", batch, None, start_ns, end_ns, attributes,
                                  links=tuple(Link(r.context) for _, r in traced)))
    for job, request in traced:
        if request.ended:  # a request whose client left may have ended (499) before its batch did
            continue
        request.links.append(Link(batch))  # what the request brought to it: its own encoder.texts and .tokens
        request.children.append(("queue", _epoch_ns(job.enqueued, now_perf, now_ns), start_ns, None, None))
