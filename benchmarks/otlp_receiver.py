"""An OTLP trace receiver on loopback: the collector's own gRPC service (opentelemetry-proto), keeping
every span it is sent. The tracing tests hold the service's spans against it, and `make bench`'s
tracing rows send every request's spans to it, as they would go to a collector."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent; `endpoint` once started."""

    def __init__(self) -> None:
        self.spans: list = []
        self.lock = threading.Lock()
        self.endpoint = ""
        self._server: grpc.Server | None = None

    def Export(self, request, context):  # noqa: N802 - the protocol's name
        with self.lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> Receiver:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=None)

    def of_trace(self, trace_id: str) -> list:
        with self.lock:
            return [s for s in self.spans if s.trace_id.hex() == trace_id]

    def by_id(self, span_id: bytes):
        with self.lock:
            return next((s for s in self.spans if s.span_id == span_id), None)

    def count(self) -> int:
        with self.lock:
            return len(self.spans)
