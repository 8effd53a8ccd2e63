"""A tracing replica's span exporter: a process of its own that turns span records into OTLP.

    python -m service.observability.span_export '{"endpoint": ..., "protocol": ..., "service_name": ...}'

service/observability/tracing.py starts one per replica that traces and writes it frames on its stdin: b"S" and a
marshalled list of span records (their layout below), or b"F" (flush: it exports what it holds and answers
b"ok" on stdout). Here a thread exports them in batches (`Batches`) with the SDK's OTLP exporter (gRPC or
HTTP/protobuf, the standard OTEL_* variables read as the SDK reads them). Over gRPC, the default, the
records become OTLP's protobuf message directly (`Encoder`); over HTTP, the SDK's finished spans first.
Why a process: encoding OTLP costs about 15-28 us of Python a span, and in the replica that work held
the interpreter lock its event loop needs, which cost single-text throughput far more than its CPU
(docs/performance.md). It runs at a lower priority than its replica (NICE): where cores are short,
serving goes first. End of input (the replica gone, or tracing turned off) or SIGTERM: what is held is
exported, then it exits.
"""

from __future__ import annotations

import contextlib
import json
import marshal
import os
import signal
import struct
import sys
import threading
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


class Encoder:
    """Span records straight to OTLP's protobuf request, without making the SDK's spans first: the same
    message the SDK's encoder makes of them (tests/test_tracing.py holds the two equal), at a third of
    its cost (about 8 against 28 us a span, protobuf's upb backend). The protobuf classes are looked up
    once here, not per span or value (this module is imported by every replica, tracing or not)."""

    def __init__(self, resource, scope_name: str) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, InstrumentationScope, KeyValue
        from opentelemetry.proto.resource.v1.resource_pb2 import Resource
        from opentelemetry.proto.trace.v1 import trace_pb2

        self.pb, self.request = trace_pb2, ExportTraceServiceRequest
        self.key_value, self.any_value, self.array_value = KeyValue, AnyValue, ArrayValue
        self.resource = Resource(attributes=self.attributes(resource.attributes))
        self.schema_url = resource.schema_url
        self.scope = InstrumentationScope(name=scope_name)

    def __call__(self, records: list[tuple]):
        pb, attributes_of = self.pb, self.attributes
        span, link, status = pb.Span, pb.Span.Link, pb.Status
        server, internal = span.SpanKind.SPAN_KIND_SERVER, span.SpanKind.SPAN_KIND_INTERNAL
        has_is_remote, is_remote = pb.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK, pb.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
        unset = status()
        spans = []
        for (name, trace_id, span_id, parent_span_id, parent_is_remote, is_server, start_ns, end_ns, attributes,
             links, error, trace_state) in records:
            spans.append(span(
                trace_id=trace_id.to_bytes(16, "big"), span_id=span_id.to_bytes(8, "big"),
                trace_state=trace_state or None, name=name,
                parent_span_id=parent_span_id.to_bytes(8, "big") if parent_span_id else None,
                kind=server if is_server else internal, start_time_unix_nano=start_ns, end_time_unix_nano=end_ns,
                attributes=attributes_of(attributes) if attributes else None,
                links=[link(trace_id=t.to_bytes(16, "big"), span_id=s.to_bytes(8, "big"), flags=has_is_remote)
                       for t, s in links] if links else None,
                status=status(code=status.STATUS_CODE_ERROR, message=error) if error is not None else unset,
                flags=has_is_remote | is_remote if parent_is_remote else has_is_remote))
        return self.request(resource_spans=[pb.ResourceSpans(
            resource=self.resource, schema_url=self.schema_url,
            scope_spans=[pb.ScopeSpans(scope=self.scope, spans=spans)])])

    def attributes(self, attributes: dict[str, Any]) -> list:
        """OTLP's key-values, as the SDK encodes attributes (None values left out, as the SDK drops them)."""
        key_value, value_of = self.key_value, self.value
        return [key_value(key=key, value=value_of(value)) for key, value in attributes.items() if value is not None]

    def value(self, value: Any):
        any_value = self.any_value
        if isinstance(value, bool):
            return any_value(bool_value=value)
        if isinstance(value, str):
            return any_value(string_value=value)
        if isinstance(value, int):
            return any_value(int_value=value)
        if isinstance(value, float):
            return any_value(double_value=value)
        if isinstance(value, bytes):
            return any_value(bytes_value=value)
        if isinstance(value, (list, tuple)):
            return any_value(array_value=self.array_value(values=[self.value(v) for v in value]))
        return any_value(string_value=str(value))


def resource_of(settings: dict[str, Any]):
    """The SDK's resource (its telemetry.sdk.* attributes, OTEL_RESOURCE_ATTRIBUTES) and our service.name."""
    from opentelemetry.sdk.resources import Resource

    name = os.environ.get("OTEL_SERVICE_NAME") or settings.get("service_name") or "mha-encoder"
    return Resource.create({"service.name": name})


def readable_spans(records: list[tuple], resource, scope) -> list:
    """Records as the SDK's finished spans: what its OTLP/HTTP exporter takes (it encodes them itself)."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

    sampled = TraceFlags(TraceFlags.SAMPLED)
    unset = Status()
    spans = []
    for (name, trace_id, span_id, parent_span_id, parent_is_remote, server, start_ns, end_ns, attributes,
         links, error, trace_state) in records:
        state = TraceState.from_header([trace_state]) if trace_state else None
        context = SpanContext(trace_id, span_id, is_remote=False, trace_flags=sampled, trace_state=state)
        parent = (SpanContext(trace_id, parent_span_id, is_remote=parent_is_remote, trace_flags=sampled)
                  if parent_span_id else None)
        spans.append(ReadableSpan(
            name, context=context, parent=parent, resource=resource,
            attributes={k: v for k, v in attributes.items() if v is not None} if attributes else {},
            links=tuple(Link(SpanContext(t, s, is_remote=False, trace_flags=sampled)) for t, s in links),
            kind=SpanKind.SERVER if server else SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, error) if error is not None else unset,
            start_time=start_ns, end_time=end_ns, instrumentation_scope=scope))
    return spans


def exporter(settings: dict[str, Any]):
    """The SDK's OTLP exporter for the protocol (its OTEL_EXPORTER_OTLP_* variables: headers, TLS,
    compression, timeout, retries), taking lists of records. Over gRPC, our encoder is its translation
    step (`_translate_data`, the hook each of its exporters fills); over HTTP, its `export` encodes the
    SDK's spans itself, so they are made first."""
    endpoint = settings.get("endpoint")
    resource = resource_of(settings)
    if protocol(settings) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        class RecordsOverGrpc(OTLPSpanExporter):
            encode = Encoder(resource, SCOPE_NAME)

            def _translate_data(self, data):  # noqa: ANN001 - the SDK's hook
                return self.encode(data)

        return RecordsOverGrpc(endpoint=endpoint, insecure=endpoint.startswith("http://") if endpoint else None)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    class RecordsOverHttp(HttpExporter):
        scope = InstrumentationScope(SCOPE_NAME)

        def export(self, records):  # noqa: ANN001, ANN201
            return super().export(readable_spans(records, resource, self.scope))

    return RecordsOverHttp(endpoint=endpoint)


class Batches:
    """Records in; exported by a thread of its own in batches of up to BATCH, every DELAY_S or as soon as
    a batch is full, so that reading the replica's frames never waits for the collector. Past
    MAX_WAITING records waiting, new ones are dropped (said once, counted at the end)."""

    # The SDK's batch processor's variables, with other defaults: a busy replica makes 2,000 spans a
    # second, so exports of up to 2,048 (the SDK's 512) every second (its 5 s)
    BATCH = int(os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2048"))
    DELAY_S = int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "1000")) / 1000
    MAX_WAITING = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "8192"))

    def __init__(self, export) -> None:  # noqa: ANN001 - a list of records -> the SDK's export result
        self.export = export
        self.waiting: list[tuple] = []
        self.flushes: list[threading.Event] = []
        self.stopping = False
        self.dropped = 0
        self.lock = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="span-export", daemon=True)
        self.thread.start()

    def add(self, records: list[tuple]) -> None:
        with self.lock:
            room = self.MAX_WAITING - len(self.waiting)
            if room < len(records):
                if not self.dropped:
                    print(f"span export: more than {self.MAX_WAITING} spans waiting for the collector; dropping",
                          file=sys.stderr, flush=True)
                self.dropped += len(records) - max(room, 0)
                records = records[:max(room, 0)]
            self.waiting.extend(records)
            if len(self.waiting) >= self.BATCH:
                self.lock.notify()

    def flush(self, timeout_s: float) -> None:
        done = threading.Event()
        with self.lock:
            self.flushes.append(done)
            self.lock.notify()
        done.wait(timeout_s)

    def _run(self) -> None:
        while True:
            with self.lock:
                self.lock.wait_for(lambda: len(self.waiting) >= self.BATCH or self.flushes or self.stopping,
                                   self.DELAY_S)
                taken, self.waiting = self.waiting, []
                flushes, self.flushes = self.flushes, []
                stopping = self.stopping
            for at in range(0, len(taken), self.BATCH):
                try:
                    self.export(taken[at:at + self.BATCH])  # the SDK's exporter logs its own failures
                except Exception as exc:  # noqa: BLE001 - one batch lost, never the process
                    print(f"span export: {len(taken[at:at + self.BATCH])} spans not exported: {exc!r}",
                          file=sys.stderr, flush=True)
            for done in flushes:
                done.set()
            if stopping:
                return

    def shutdown(self) -> None:
        """Exports what is waiting, then returns."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join()
        if self.dropped:
            print(f"span export: {self.dropped} spans dropped (the collector was behind)", file=sys.stderr, flush=True)


def read_exact(stream: BinaryIO, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def serve(batches: Batches, stdin: BinaryIO, stdout: BinaryIO) -> None:
    while (head := read_exact(stdin, HEADER.size)) is not None:
        kind, length = HEADER.unpack(head)
        body = read_exact(stdin, length)
        if body is None:
            return
        if kind == SPANS:
            batches.add(marshal.loads(body))
        elif kind == FLUSH:
            batches.flush(int(body or b"5000") / 1000)
            stdout.write(b"ok\n")
            stdout.flush()


NICE = 10  # below the replica: where cores are short, serving goes first and spans use the idle time


def main(argv: list[str]) -> int:
    with contextlib.suppress(OSError):
        os.nice(NICE)  # its weight is still a tenth of the replica's (CFS), far above the ~3 % it needs
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C of `make run` reaches the whole group: the
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # replica's end closes our input instead
    otlp = exporter(json.loads(argv[0]) if argv else {})
    batches = Batches(otlp.export)
    try:
        serve(batches, sys.stdin.buffer, sys.stdout.buffer)
    finally:
        batches.shutdown()  # exports what is waiting
        otlp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
