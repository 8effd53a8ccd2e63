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
it. (No span per request for the batch's run: the link says it, and at full sampling every span
counts, about 40 us of the replica's CPU each.)

The tracer provider is this module's own, not OpenTelemetry's global one: Ray sets up that one for
its own tracing, and the two must not mix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.config import TracingSettings

logger = logging.getLogger("ray.serve")

_tracer: Any = None  # the replica's tracer while tracing is on, else None
_provider: Any = None
TRACEPARENT, TRACESTATE = "traceparent", "tracestate"


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
    global _tracer, _provider
    if not wanted(settings):
        _tracer = _provider = None
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from service.config import TracingSettings

    settings = settings or TracingSettings()
    name = os.environ.get("OTEL_SERVICE_NAME") or settings.service_name
    sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio)) if settings.sample_ratio is not None else None
    provider = TracerProvider(resource=Resource.create({"service.name": name}), sampler=sampler)
    delay_ms = int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "1000"))  # the SDK's default is 5 s
    provider.add_span_processor(BatchSpanProcessor(_exporter(settings), schedule_delay_millis=delay_ms))
    _provider, _tracer = provider, provider.get_tracer("mha-encoder-serving")
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
    return _tracer is not None


def shutdown() -> None:
    """Tracing off in this process (what was buffered is exported first)."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is not None:
        provider.shutdown()


def flush(timeout_ms: int = 5000) -> None:
    """Export what is buffered now (a replica that stops, a test that waits for its spans)."""
    if _provider is not None:
        _provider.force_flush(timeout_ms)


# ---- the request's own span ----


class RequestSpan:
    """The SERVER span of one request (HTTP or gRPC), current while the request is handled."""

    def __init__(self, name: str, carrier: dict[str, str], attributes: dict[str, Any]) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        self.span = _tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
        self._token = otel_context.attach(trace.set_span_in_context(self.span, parent))

    def finish(self, name: str, status: int, attributes: dict[str, Any]) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry.trace import Status, StatusCode

        self.span.update_name(name)
        self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR, f"status {status}"))
        self.span.end()
        otel_context.detach(self._token)


class _Propagator:
    """W3C trace context, made once on first use."""

    def extract(self, carrier: dict[str, str]):
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        global _PROPAGATOR
        _PROPAGATOR = TraceContextTextMapPropagator()
        return _PROPAGATOR.extract(carrier)


_PROPAGATOR: Any = _Propagator()


def request_span(name: str, carrier: dict[str, str], attributes: dict[str, Any]) -> RequestSpan | None:
    """The request's span, continued from the client's traceparent in `carrier`; None when tracing is off."""
    return RequestSpan(name, carrier, attributes) if _tracer is not None else None


def carrier_of_headers(headers: dict[bytes, bytes]) -> dict[str, str]:
    return {key: headers[key.encode()].decode("latin-1") for key in (TRACEPARENT, TRACESTATE) if key.encode() in headers}


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[None]:
    """A child of the current request's span (tokenize, serialize); nothing when tracing is off."""
    if _tracer is None:
        yield
        return
    with _tracer.start_as_current_span(name, attributes=attributes):
        yield


def current() -> Any:
    """The current OpenTelemetry context (the request's, on its task), for a job to carry to its batch."""
    if _tracer is None:
        return None
    from opentelemetry import context as otel_context

    return otel_context.get_current()


# ---- a batch, recorded when it has run ----


def _epoch_ns(perf: float, now_perf: float, now_ns: int) -> int:
    """A perf_counter() reading as the epoch nanoseconds spans are stamped with."""
    return now_ns - int((now_perf - perf) * 1e9)


def record_batch(jobs: list[Any], started: float, ended: float, attributes: dict[str, Any]) -> None:
    """The batch's span, linked to the request span of each traced job (its `trace` context, set when it
    was submitted), which links back to it; and each job's `queue` span under its request. Called from
    the batch's worker thread after the run, with perf_counter() times, while the requests still wait."""
    if _tracer is None:
        return
    from opentelemetry import trace

    traced = [job for job in jobs if getattr(job, "trace", None) is not None]
    if not traced:
        return
    now_perf, now_ns = time.perf_counter(), time.time_ns()
    start_ns, end_ns = _epoch_ns(started, now_perf, now_ns), _epoch_ns(ended, now_perf, now_ns)
    requests = [trace.get_current_span(job.trace) for job in traced]
    links = [trace.Link(r.get_span_context()) for r in requests if r.get_span_context().is_valid]
    batch = _tracer.start_span("batch", context=trace.set_span_in_context(trace.INVALID_SPAN), links=links,
                               start_time=start_ns, attributes=attributes)
    batch.end(end_time=end_ns)
    batch_context = batch.get_span_context()
    for job, request in zip(traced, requests, strict=True):
        if request.is_recording():  # a request whose client left may have ended (499) before its batch did
            request.add_link(batch_context, {"encoder.texts": len(job.ids), "encoder.tokens": job.n_tokens})
        queued = _tracer.start_span("queue", context=job.trace, start_time=_epoch_ns(job.enqueued, now_perf, now_ns))
        queued.end(end_time=start_ns)
