"""An OTLP trace receiver on loopback: the collector's own gRPC service (opentelemetry-proto), keeping
every span it is sent. The tracing tests hold the service's spans against it, and `make bench`'s
tracing rows send every request's spans to it, as they would go to a collector: in a process of its
own there (`ReceiverProcess`, `python -m benchmarks.otlp_receiver`), counting them, so that its work
shares no interpreter lock with the bench's load generator (a collector never runs in the client).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it is sent; `endpoint` once started."""

    def __init__(self, keep: bool = True) -> None:
        self.spans: list = []
        self.keep = keep  # False: count them only
        self.received = 0
        self.lock = threading.Lock()
        self.endpoint = ""
        self._server: grpc.Server | None = None

    def Export(self, request, context):  # noqa: N802 - the protocol's name
        with self.lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.received += len(scope_spans.spans)
                    if self.keep:
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
            return self.received


class ReceiverProcess:
    """A counting receiver in a child process: `endpoint` once started, `count()` of the spans it got."""

    def __init__(self) -> None:
        self.endpoint = ""
        self._child: subprocess.Popen | None = None

    def start(self) -> ReceiverProcess:
        self._child = subprocess.Popen([sys.executable, "-m", "benchmarks.otlp_receiver"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        self.endpoint = self._child.stdout.readline().strip()
        if not self.endpoint.startswith("http://"):
            self.stop()
            raise RuntimeError(f"the OTLP receiver did not start (it said {self.endpoint!r})")
        return self

    def count(self) -> int:
        self._child.stdin.write("count\n")
        self._child.stdin.flush()
        return int(self._child.stdout.readline())

    def stop(self) -> None:
        if self._child is not None:
            self._child.stdin.close()  # its loop ends at end of input
            try:
                self._child.wait(10)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()
            self._child = None


def main() -> None:
    """The child: prints its endpoint, then the span count for each line read, until end of input."""
    receiver = Receiver(keep=False).start()
    print(receiver.endpoint, flush=True)
    try:
        for _ in sys.stdin:
            print(receiver.count(), flush=True)
    finally:
        receiver.stop()


if __name__ == "__main__":
    main()
