"""OpenTelemetry traces, exported with OTLP to a real receiver the test starts (the collector's own
gRPC service, from opentelemetry-proto): the span tree of one request, continued from the client's
W3C traceparent over HTTP and over gRPC, and the batch span that requests sharing a batch link to."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from benchmarks.otlp_receiver import Receiver
from tests.conftest import deploy, wait_until

TRACED, HELD, STOPPED = "traced", "traced-held", "traced-stopped"


@pytest.fixture(scope="module")
def receiver():
    found = Receiver().start()
    yield found, found.endpoint
    found.stop()


@pytest.fixture(scope="module")
def traced(ray_serve, default_bundle, receiver):
    from ray import serve

    deploy({"tracing": {"endpoint": receiver[1], "protocol": "grpc"}, "num_cpus": 0.25}, TRACED, f"/{TRACED}",
           default_bundle)
    yield f"{ray_serve.url}/{TRACED}"
    serve.delete(TRACED)


def traceparent() -> tuple[str, str, str]:
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    return trace_id, parent, f"00-{trace_id}-{parent}-01"


def request_tree(found: Receiver, trace_id: str, parent: str, name: str) -> tuple:
    """The request's server span (child of the client's span) and its children by name, once exported."""
    def complete():
        spans = found.of_trace(trace_id)
        server = next((s for s in spans if s.parent_span_id.hex() == parent), None)
        if server is None:
            return None
        children = {s.name: s for s in spans if s.parent_span_id == server.span_id}
        return (server, children) if {"tokenize", "queue", "serialize"} <= set(children) and server.links else None

    return wait_until(complete, f"the spans of {name} at the receiver", timeout=45, interval=0.5)


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def test_one_request_is_one_trace_continued_from_the_clients_traceparent(traced, receiver):
    found, _ = receiver
    trace_id, parent, header = traceparent()
    r = httpx.post(f"{traced}/v1/embeddings", json={"input": ["a traced text", "and a second one"]},
                   headers={"traceparent": header}, timeout=60)
    assert r.status_code == 200
    server, children = request_tree(found, trace_id, parent, "POST /v1/embeddings")
    assert server.name == "POST /v1/embeddings" and server.kind == server.SPAN_KIND_SERVER
    attrs = attributes(server)
    assert attrs["http.route"] == "/v1/embeddings" and attrs["http.response.status_code"] == 200
    assert attrs["encoder.model"] == "all-MiniLM-L6-v2" and attrs["encoder.texts"] == 2 and attrs["encoder.tokens"] > 4
    assert attrs["encoder.request_id"] == r.headers["x-request-id"]
    for name in ("tokenize", "queue", "serialize"):  # inside the request's time
        child = children[name]
        assert server.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano <= server.end_time_unix_nano, name
    (link,) = server.links
    batch = wait_until(lambda: found.by_id(link.span_id), "the batch span", timeout=30)
    assert batch.name == "batch" and batch.trace_id != server.trace_id  # the batch's own trace
    assert server.span_id in {k.span_id for k in batch.links}
    # the batch ran after the request's queue span ended, and before it was serialised
    assert abs(batch.start_time_unix_nano - children["queue"].end_time_unix_nano) < 1000
    assert batch.end_time_unix_nano <= children["serialize"].start_time_unix_nano
    battrs = attributes(batch)
    assert battrs["encoder.batch.requests"] >= 1 and battrs["encoder.batch.texts"] >= 2
    assert battrs["encoder.graphs"].startswith(("encodings", "packed"))


def test_the_request_id_on_the_span_is_the_one_the_client_got(traced, receiver):
    """An id that fails the service's rule, or the second of two: the span carries the one id the response
    header carries (and the access log line, tests/test_hostile_headers.py), not another."""
    import uuid

    found, _ = receiver
    first = f"first-{uuid.uuid4().hex}"
    for ids, expected in ((["two words"], None), ([first, "second-id"], first)):
        trace_id, parent, header = traceparent()
        r = httpx.post(f"{traced}/v1/embeddings", json={"input": "an id"}, timeout=60,
                       headers=[("traceparent", header), *(("x-request-id", i) for i in ids)])
        assert r.status_code == 200
        (echoed,) = r.headers.get_list("x-request-id")
        assert echoed == expected if expected else echoed not in ids
        server, _ = request_tree(found, trace_id, parent, "POST /v1/embeddings")
        assert attributes(server)["encoder.request_id"] == echoed


def test_a_grpc_call_continues_the_trace_from_its_metadata(ray_serve, traced, receiver):
    import numpy as np
    import tritonclient.grpc as triton_grpc

    found, _ = receiver
    trace_id, parent, header = traceparent()
    client = triton_grpc.InferenceServerClient(ray_serve.grpc_target)
    try:
        text = triton_grpc.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"traced over grpc"], dtype=object))
        client.infer("all-MiniLM-L6-v2", [text], headers={"application": TRACED, "traceparent": header})
    finally:
        client.close()
    server, children = request_tree(found, trace_id, parent, "ModelInfer")
    assert server.name == "/inference.GRPCInferenceService/ModelInfer"
    attrs = attributes(server)
    assert attrs["rpc.system"] == "grpc" and attrs["rpc.grpc.status_code"] == 0 and attrs["encoder.texts"] == 1


def test_requests_that_shared_a_batch_link_to_its_one_span(ray_serve, default_bundle, receiver):
    """The first batch is held; three traced requests queue behind it and run as one batch: one batch
    span links to the three request spans, and each request's span links to it."""
    from ray import serve

    from tests.holding import deploy_holding

    found, endpoint = receiver
    handle = deploy_holding(HELD, f"/{HELD}", default_bundle, replicas=1, num_cpus=0.25, warmup=False,
                            tracing={"endpoint": endpoint}, batching={"max_concurrent_batches": 1})
    url = f"{ray_serve.url}/{HELD}"
    wait_until(lambda: httpx.get(f"{url}/v2/health/live", timeout=10).status_code == 200, "the held app", timeout=60)
    traces = [traceparent() for _ in range(3)]
    answers: list[int] = []

    def send(body: dict, headers: dict) -> None:
        answers.append(httpx.post(f"{url}/v1/embeddings", json=body, headers=headers, timeout=120).status_code)

    try:
        first = threading.Thread(target=send, args=({"input": "held"}, {}))
        first.start()
        wait_until(lambda: handle.held.remote().result(timeout_s=10) == 1, "the first batch to be held", timeout=60)
        queued = [threading.Thread(target=send, args=({"input": f"queued {i}"}, {"traceparent": t[2]}))
                  for i, t in enumerate(traces)]
        for t in queued:
            t.start()
        wait_until(lambda: handle.info.remote().result(timeout_s=10)["load"]["requests_queued"] == 3,
                   "three requests in the batch queue", timeout=30)
        handle.release.remote().result(timeout_s=30)
        for t in [first, *queued]:
            t.join(timeout=120)
        assert answers == [200] * 4, answers
        trees = [request_tree(found, trace_id, parent, f"request {i}") for i, (trace_id, parent, _) in enumerate(traces)]
        batch_ids = {server.links[0].span_id for server, _ in trees}
        assert len(batch_ids) == 1, "the three requests ran in one batch"
        batch = wait_until(lambda: found.by_id(next(iter(batch_ids))), "the shared batch span", timeout=30)
        assert {k.span_id for k in batch.links} == {server.span_id for server, _ in trees}
        assert attributes(batch)["encoder.batch.requests"] == 3
    finally:
        serve.delete(HELD)


@pytest.mark.parametrize(("env", "settings", "on"), [
    ({}, None, False),  # off by default
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, None, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, None, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, None, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_TRACES_EXPORTER": "none"}, None, False),
    ({}, {"endpoint": "http://127.0.0.1:4317"}, True),
    ({"OTEL_SDK_DISABLED": "true"}, {"endpoint": "http://127.0.0.1:4317"}, False),
])
def test_tracing_is_off_unless_the_settings_or_the_otel_variables_ask(monkeypatch, env, settings, on):
    from service.observability import tracing
    from service.config import TracingSettings

    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER",
                "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # nothing listens at these endpoints: the exporter's retries give up after a second, not ten
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    parsed = TracingSettings.model_validate(settings) if settings is not None else None
    try:
        assert tracing.configure(parsed) is on and tracing.enabled() is on
        traced = tracing.request_span("POST /x", {}, {})
        assert (traced is None) is not on  # no span at all when off
        if traced is not None:
            traced.finish("POST /x", 200, {})
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


def test_the_sampler_decides_and_a_failed_stage_is_an_error_span(receiver):
    """In this process, against the receiver: at ratio 0 a new trace records nothing, a client's sampled
    traceparent is followed (parent-based) and an unsampled one is not; a stage that raised is an error
    span, a 5xx an error request span, and both reach the collector with their times in order."""
    from service.observability import tracing
    from service.config import TracingSettings

    found, endpoint = receiver
    trace_id, parent, header = traceparent()
    try:
        assert tracing.configure(TracingSettings(endpoint=endpoint, protocol="grpc", sample_ratio=0.0))
        assert tracing.request_span("POST /x", {}, {}) is None
        assert tracing.request_span("POST /x", {"traceparent": header[:-2] + "00"}, {}) is None
        traced = tracing.request_span("POST /x", {"traceparent": header}, {"encoder.request_id": "r-1"})
        assert traced is not None and tracing.current() is traced
        with pytest.raises(ValueError), tracing.span("tokenize", **{"encoder.texts": 1}):
            raise ValueError("not a text")
        traced.finish("POST /x", 500, {"http.response.status_code": 500, "encoder.model": None})
        assert tracing.current() is None
        tracing.flush()
    finally:
        tracing.shutdown()
    spans = wait_until(lambda: len(s := found.of_trace(trace_id)) == 2 and s, "the two spans", timeout=30)
    server = next(s for s in spans if s.parent_span_id.hex() == parent)
    child = next(s for s in spans if s.parent_span_id == server.span_id)
    assert server.name == "POST /x" and server.status.code == server.status.STATUS_CODE_ERROR
    assert attributes(server) == {"encoder.request_id": "r-1", "http.response.status_code": 500}
    assert child.name == "tokenize" and child.status.code == child.status.STATUS_CODE_ERROR
    assert "ValueError: not a text" in child.status.message and attributes(child) == {"encoder.texts": 1}
    assert server.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano <= server.end_time_unix_nano


def test_spans_that_cannot_be_recorded_never_fail_the_request(receiver, caplog):
    """finish() runs in every traced request's last step: an error there is logged, never raised."""
    from service.observability import tracing
    from service.config import TracingSettings

    _, endpoint = receiver
    try:
        tracing.configure(TracingSettings(endpoint=endpoint, protocol="grpc"))

        def broken(record):
            raise RuntimeError("exporter queue gone")

        tracing._on.exporter.put = broken
        traced = tracing.request_span("POST /x", {}, {})
        traced.finish("POST /x", 200, {})  # does not raise
        assert tracing.current() is None
        assert "the spans of a request (POST /x) were not recorded" in caplog.text
    finally:
        tracing.shutdown()


def test_the_exporter_process_ends_with_tracing_with_its_replica_and_never_holds_requests(receiver, caplog):
    """Spans leave the replica for an exporter process of its own (service/observability/span_export.py): it exits
    when tracing is turned off, and when its replica dies without a word (SIGKILL, os._exit: its input
    ends); if it is gone, requests still finish and their spans are dropped, said once."""
    import subprocess
    import sys

    from service.observability import tracing
    from service.config import TracingSettings

    _, endpoint = receiver
    settings = TracingSettings(endpoint=endpoint, protocol="grpc")
    tracing.configure(settings)
    child = tracing._on.exporter.child
    tracing.shutdown()
    assert child.poll() == 0  # exited, having exported what it held

    script = ("import os, sys; from service.observability import tracing; from service.config import TracingSettings; "
              f"tracing.configure(TracingSettings.model_validate_json({settings.model_dump_json()!r})); "
              "print(tracing._on.exporter.child.pid, flush=True); os._exit(0)")
    orphan = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60).stdout)

    def gone() -> bool:
        try:
            os.kill(orphan, 0)
        except ProcessLookupError:
            return True
        return open(f"/proc/{orphan}/stat").read().split()[2] == "Z"  # exited, not yet reaped by init

    wait_until(gone, "the exporter process of a replica that died to exit", timeout=30, interval=0.2)

    try:
        tracing.configure(settings)
        tracing._on.exporter.child.kill()
        tracing._on.exporter.child.wait()
        for _ in range(3):
            traced = tracing.request_span("POST /x", {}, {})
            with tracing.span("tokenize"):
                pass
            traced.finish("POST /x", 200, {})
            tracing.flush(1000)  # writes to the dead process: said, never raised
        assert caplog.text.count("the span exporter process is gone") == 1
    finally:
        tracing.shutdown()
    assert "span(s) dropped" in caplog.text


def test_the_exporters_encoder_makes_the_sdks_message():
    """Over gRPC the exporter process encodes span records itself (a third of the SDK's cost); the
    message must be the one the SDK's own encoder makes of the same spans, field for field."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from service.observability import span_export

    resource = span_export.resource_of({"service_name": "parity"})
    records = [
        ("POST /v1/embeddings", 2**127 + 5, 2**63 + 7, 11, True, True, 1_000, 9_000,
         {"http.route": "/v1/embeddings", "http.response.status_code": 200, "encoder.texts": 3,
          "encoder.ok": True, "encoder.padding": 0.25, "encoder.graphs": ["encodings", "full"], "gone": None},
         ((3, 4), (2**128 - 1, 2**64 - 1)), None, "vendor=a,other=b"),
        ("tokenize", 12, 13, 2**63 + 7, False, False, 2_000, 3_000, {"encoder.texts": 1}, (), "ValueError: no", ""),
        ("batch", 14, 15, 0, False, False, 4_000, 5_000, None, ((2**127 + 5, 2**63 + 7),), None, ""),
    ]
    ours = span_export.Encoder(resource, span_export.SCOPE_NAME)(records)
    sdks = encode_spans(span_export.readable_spans(records, resource, InstrumentationScope(span_export.SCOPE_NAME)))
    assert ours == sdks
    assert ours.SerializeToString(deterministic=True) == sdks.SerializeToString(deterministic=True)
    assert len(ours.resource_spans[0].scope_spans[0].spans) == 3


def test_spans_go_over_otlp_http_too():
    """protocol http/protobuf: the SDK's HTTP exporter posts them to a receiver's /v1/traces."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    from service.observability import tracing
    from service.config import TracingSettings

    got: list = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, self.headers["Content-Type"], ExportTraceServiceRequest.FromString(body)))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    trace_id, parent, header = traceparent()
    try:
        tracing.configure(TracingSettings(endpoint=f"http://127.0.0.1:{server.server_port}/v1/traces",
                                          protocol="http/protobuf", service_name="over-http"))
        traced = tracing.request_span("POST /x", {"traceparent": header}, {"encoder.request_id": "r-2"})
        with tracing.span("tokenize"):
            pass
        traced.finish("POST /x", 200, {"http.response.status_code": 200})
        tracing.flush()
    finally:
        tracing.shutdown()
        server.shutdown()
    assert got, "nothing was posted to the receiver"
    path, content_type, request = got[0]
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    resource = request.resource_spans[0].resource
    assert {"service.name": "over-http"}.items() <= attributes(resource).items()
    spans = {s.name: s for s in request.resource_spans[0].scope_spans[0].spans}
    assert set(spans) == {"POST /x", "tokenize"}
    assert spans["POST /x"].trace_id.hex() == trace_id and spans["POST /x"].parent_span_id.hex() == parent
    assert spans["tokenize"].parent_span_id == spans["POST /x"].span_id
    assert attributes(spans["POST /x"]) == {"encoder.request_id": "r-2", "http.response.status_code": 200}


def test_a_stalled_collector_never_stalls_the_exporters_input(capfd):
    """While an export hangs (a collector slow or away), the exporter process keeps reading the replica's
    frames: spans wait up to OTEL_BSP_MAX_QUEUE_SIZE, past it they are dropped and said once, and what
    waited is exported once the collector answers again."""
    from service.observability import span_export

    release, exported = threading.Event(), []

    def export(records):
        release.wait(30)
        exported.extend(records)

    class Small(span_export.Batches):
        BATCH, DELAY_S, MAX_WAITING = 4, 0.05, 10

    batches = Small(export)
    batches.add([("first", 1)] * 4)  # a full batch: the thread takes it and hangs in export
    wait_until(lambda: not batches.waiting, "the first batch to be taken", timeout=10, interval=0.01)
    reader = threading.Thread(target=lambda: [batches.add([(f"r{i}", i)] * 3) for i in range(5)])
    reader.start()
    reader.join(10)
    assert not reader.is_alive() and not release.is_set(), "adding spans waited for the hung export"
    assert len(batches.waiting) == 10 and batches.dropped == 5  # 15 records, room for 10
    release.set()
    batches.flush(10)
    batches.shutdown()
    assert len(exported) == 4 + 10
    err = capfd.readouterr().err
    assert err.count("spans waiting for the collector; dropping") == 1 and "5 spans dropped" in err


def test_closing_the_exporter_is_bounded_when_its_process_is_stopped(receiver, monkeypatch, caplog):
    """A SIGSTOPped exporter process reads nothing: the writer thread blocks on its full pipe, holding the
    pipe's lock. Closing (a replica's stop, tracing reconfigured) still returns within its bound, having
    killed the process; before, it waited for that lock forever."""
    import signal
    import time

    from service.observability import tracing
    from service.config import TracingSettings

    _, endpoint = receiver
    monkeypatch.setattr(tracing, "CLOSE_TIMEOUT_S", 2.0, raising=False)
    tracing.configure(TracingSettings(endpoint=endpoint, protocol="grpc"))
    exporter = tracing._on.exporter
    child = exporter.child
    os.kill(child.pid, signal.SIGSTOP)
    closing = None
    try:
        filler = "x" * 200
        for i in range(20_000):  # ~5 MB of records: far past the pipe's 64 KiB
            exporter.put(("POST /x", i + 1, i + 1, 0, False, True, 1, 2, {"filler": filler}, (), None, ""))

        def writer_blocked() -> bool:  # holding the lock across several looks: blocked in a write
            return all(exporter.pipe.locked() and not time.sleep(0.1) for _ in range(5))

        wait_until(writer_blocked, "the writer thread to block on the stopped process's pipe", timeout=30)
        started = time.monotonic()
        closing = threading.Thread(target=tracing.shutdown, daemon=True)
        closing.start()
        closing.join(20)
        took = time.monotonic() - started
        assert not closing.is_alive(), "close() did not return while its exporter process was stopped"
        assert took < 2.0 + 3, took
        assert child.poll() == -signal.SIGKILL
        assert "did not finish within 2 s; killed" in caplog.text
        print(f"\nclose with a stopped exporter process: {took:.2f} s (bound 2 s)")
    finally:
        if child.poll() is None:  # the unfixed close: free its thread
            child.kill()
        if closing is not None:
            closing.join(10)
        tracing.shutdown()


def test_a_graceful_stop_of_a_replica_exports_its_last_spans(ray_serve, default_bundle, receiver):
    """Serve's graceful stop of a traced replica (serve.delete, scale-down, a new version): the spans of its
    last requests still held by its exporter process reach the collector before the process goes."""
    from ray import serve

    from service.app import compose
    from service.config import ServiceSettings
    from service.deployment import Encoder

    class ExportsOnlyWhenClosed(Encoder.func_or_class):  # type: ignore[misc] - pickled by value (a local class)
        """The replica, its exporter process holding every span until flushed or closed (a batch delay of 10
        minutes), so that the spans a graceful stop must export are certain to be still held there."""

        async def __init__(self, settings) -> None:  # the ingress wrapper's __init__ is async
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "600000"  # read by the exporter process it starts
            await super().__init__(settings)

    found, endpoint = receiver
    settings = ServiceSettings.model_validate({"bundle": str(default_bundle), "num_cpus": 0.25, "warmup": False,
                                               "tracing": {"endpoint": endpoint, "protocol": "grpc"}})
    serve.run(compose(settings, serve.deployment(ExportsOnlyWhenClosed, name="Encoder")), name=STOPPED,
              route_prefix=f"/{STOPPED}", logging_config={"enable_access_log": False})
    trace_id, parent, header = traceparent()
    try:
        url = f"{ray_serve.url}/{STOPPED}"
        wait_until(lambda: httpx.get(f"{url}/v2/health/live", timeout=10).status_code == 200, "the app", timeout=60)
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "the last words"}, headers={"traceparent": header},
                       timeout=60)
        assert r.status_code == 200
        time.sleep(1.5)  # the writer thread has handed them over (every 0.1 s); the process holds them
        assert not found.of_trace(trace_id), "exported before the stop: the test would prove nothing"
    finally:
        serve.delete(STOPPED)  # a graceful stop: drain, then Serve's destructor hook, then the process ends
    spans = wait_until(lambda: found.of_trace(trace_id), "the last request's spans after the stop", timeout=30)
    server = next(s for s in spans if s.parent_span_id.hex() == parent)
    assert server.name == "POST /v1/embeddings" and attributes(server)["encoder.request_id"] == r.headers["x-request-id"]
