"""A tracing replica's span exporter: a process of its own that turns span records into OTLP.

    python -m service.span_export '{"endpoint": ..., "protocol": ..., "service_name": ...}'

service/tracing.py starts one per replica that traces and writes it frames on its stdin: b"S" and a
marshalled list of span records (their layout below), or b"F" (flush: it exports what it holds and answers
b"ok" on stdout). Here each record becomes the SDK's finished span (`ReadableSpan`), given to the
SDK's batch processor and OTLP exporter (gRPC or HTTP/protobuf, the standard OTEL_* variables read as
the SDK reads them). Why a process: encoding OTLP protobuf costs about 15 us of Python a span, and in
the replica that work held the interpreter lock its event loop needs, which cost single-text
throughput far more than its CPU (docs/performance.md). End of input (the replica gone, or tracing
turned off) or SIGTERM: what is held is exported, then it exits.
"""

from __future__ import annotations

import json
import marshal
import os
import signal
import struct
import sys
from typing import Any, BinaryIO

SCOPE_NAME = "mha-encoder-serving"
HEADER = struct.Struct("<cI")  # frame kind, body length
SPANS, FLUSH = b"S", b"F"
# One span: (name, trace_id, span_id, parent_span_id (0: none), parent_is_remote, server (bool),
# start_ns, end_ns, attributes (dict or None), links ((trace_id, span_id), ...), error (str or None),
# trace_state (W3C tracestate header or ""))


def frame(kind: bytes, body: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(body)) + body


def protocol(settings: dict[str, Any]) -> str:
    return (settings.get("protocol") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")


def exporter(settings: dict[str, Any]):
    endpoint = settings.get("endpoint")
    if protocol(settings) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://") if endpoint else None)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint)


class Spans:
    """Records in, the SDK's finished spans out to its batch processor."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        class _Resource(Resource):
            """The resource, hashed once: the OTLP encoder hashes it for every span (a json.dumps each)."""

            def __init__(self, base: Resource) -> None:
                super().__init__(base.attributes, base.schema_url)
                self._hash = super().__hash__()

            def __hash__(self) -> int:
                return self._hash

        name = os.environ.get("OTEL_SERVICE_NAME") or settings.get("service_name") or "mha-encoder"
        self.resource = _Resource(Resource.create({"service.name": name}))
        self.provider = TracerProvider(resource=self.resource)
        # Every second (the SDK's default is 5 s), in exports of up to 2,048 spans (its default 512: a
        # busy replica makes 2,000 spans a second, and each export is a call to the collector)
        self.processor = BatchSpanProcessor(
            exporter(settings), schedule_delay_millis=int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "1000")),
            max_export_batch_size=int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2048")),
            max_queue_size=int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "8192")))
        self.provider.add_span_processor(self.processor)  # so that its flush and shutdown reach it
        self.scope = InstrumentationScope(SCOPE_NAME)

    def add(self, records: list[tuple]) -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

        sampled = TraceFlags(TraceFlags.SAMPLED)
        unset = Status()
        for (name, trace_id, span_id, parent_span_id, parent_is_remote, server, start_ns, end_ns, attributes,
             links, error, trace_state) in records:
            state = TraceState.from_header([trace_state]) if trace_state else None
            context = SpanContext(trace_id, span_id, is_remote=False, trace_flags=sampled, trace_state=state)
            parent = (SpanContext(trace_id, parent_span_id, is_remote=parent_is_remote, trace_flags=sampled)
                      if parent_span_id else None)
            self.processor.on_end(ReadableSpan(
                name, context=context, parent=parent, resource=self.resource, attributes=attributes or {},
                links=tuple(Link(SpanContext(t, s, is_remote=False, trace_flags=sampled)) for t, s in links),
                kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
                status=Status(StatusCode.ERROR, error) if error is not None else unset,
                start_time=start_ns, end_time=end_ns, instrumentation_scope=self.scope))


def read_exact(stream: BinaryIO, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve(spans: Spans, stdin: BinaryIO, stdout: BinaryIO) -> None:
    while (head := read_exact(stdin, HEADER.size)) is not None:
        kind, length = HEADER.unpack(head)
        body = read_exact(stdin, length)
        if body is None:
            return
        if kind == SPANS:
            spans.add(marshal.loads(body))
        elif kind == FLUSH:
            spans.provider.force_flush(int(body or b"5000"))
            stdout.write(b"ok\n")
            stdout.flush()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of `make run` reaches the whole group: the
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # replica's end closes our input instead
    spans = Spans(json.loads(argv[0]) if argv else {})
    try:
        serve(spans, sys.stdin.buffer, sys.stdout.buffer)
    finally:
        spans.provider.shutdown()  # exports what is held
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
