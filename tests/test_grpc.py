"""KServe v2 over gRPC, served by the real replicas through Ray Serve's gRPC ingress behind HAProxy:
tritonclient.grpc used unchanged gets what v2 over HTTP returns for the same texts, and a client can
act on every error's status code. Several applications share the session's Serve, so each call names
its application in the `application` metadata, as Serve asks of a client when several are deployed."""

from __future__ import annotations

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from tritonclient.utils import InferenceServerException

from service.apis.kserve_v2.messages import messages, method_path
from tests.metrics_scrape import poll, total

MODEL = "all-MiniLM-L6-v2"
APP = {"application": "encoder"}
TEXTS = ["the first text", "a second, longer text than the first one", "héllo wörld ✓"]


@pytest.fixture(scope="module")
def client(ray_serve, service_url):
    c = triton_grpc.InferenceServerClient(ray_serve.grpc_target)
    yield c
    c.close()


@pytest.fixture(scope="module")
def channel(ray_serve, service_url):
    with grpc.insecure_channel(ray_serve.grpc_target) as ch:
        yield ch


def text_input(texts: list[str], name: str = "text") -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    return tensor


def http_v2(url: str, texts: list[str], outputs: list[str]) -> dict[str, np.ndarray]:
    body = {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
            "outputs": [{"name": n} for n in outputs]}
    answer = httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=60).raise_for_status().json()
    return {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in answer["outputs"]}


def call(channel, method: str, request, metadata=(("application", "encoder"),), timeout: float = 60):
    """A raw call with this module's messages: the reply and the call (its code, details, trailing metadata)."""
    reply_class = type(request).__name__.replace("Request", "Response")
    stub = channel.unary_unary(method_path(method), request_serializer=type(request).SerializeToString,
                               response_deserializer=getattr(messages(), reply_class).FromString)
    return stub.with_call(request, metadata=metadata, timeout=timeout)


def test_health_and_metadata_calls_answer_as_tritonclient_reads_them(client):
    assert client.is_server_live(headers=APP)
    assert client.is_server_ready(headers=APP)
    assert client.is_model_ready(MODEL, headers=APP)
    server = client.get_server_metadata(headers=APP)
    assert server.name == "mha-encoder-serving" and "binary_tensor_data" in server.extensions
    model = client.get_model_metadata(MODEL, headers=APP)
    assert model.name == MODEL and [t.name for t in model.inputs] == ["text"]
    assert {t.name: list(t.shape) for t in model.outputs}["sentence_embedding"] == [-1, 384]


def test_infer_returns_what_v2_over_http_returns_for_the_same_texts(client, service_url):
    names = ["sentence_embedding", "last_hidden_state", "attention_mask"]
    result = client.infer(MODEL, [text_input(TEXTS)], outputs=[triton_grpc.InferRequestedOutput(n) for n in names],
                          request_id="grpc-req-1", headers=APP)
    over_http = http_v2(service_url, TEXTS, names)
    for name in names:
        got = result.as_numpy(name)
        assert got.shape == over_http[name].shape, name
        np.testing.assert_allclose(got, over_http[name], atol=1e-5, rtol=0, err_msg=name)
    assert result.get_response().id == "grpc-req-1"  # v2's id, echoed
    assert result.as_numpy("attention_mask").dtype == np.int64
    norms = np.linalg.norm(result.as_numpy("sentence_embedding"), axis=1)
    np.testing.assert_allclose(norms, 1.0, atol=1e-5)  # the model's Normalize, as on every route


def test_attention_weights_over_grpc(client):
    result = client.infer(MODEL, [text_input(TEXTS[:2])], outputs=[triton_grpc.InferRequestedOutput("attentions")],
                          headers=APP)
    attn = result.as_numpy("attentions")  # layers, texts, heads, T, T
    assert attn.shape[:3] == (6, 2, 12)
    short = attn[:, 0]
    mask_len = int((short.sum(axis=-1)[0, 0] > 0).sum())  # rows past the first text's tokens are padding
    np.testing.assert_allclose(short[:, :, :mask_len].sum(axis=-1), 1.0, atol=1e-5)


def test_bytes_contents_are_read_as_raw_input_contents_are(channel, client):
    m = messages()
    request = m.ModelInferRequest(model_name=MODEL, id="plain-contents")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[2])
    tensor.contents.bytes_contents.extend([t.encode() for t in TEXTS[:2]])
    request.outputs.add(name="sentence_embedding")
    reply, rpc = call(channel, "ModelInfer", request)
    got = np.frombuffer(reply.raw_output_contents[0], dtype="<f4").reshape(list(reply.outputs[0].shape))
    raw = client.infer(MODEL, [text_input(TEXTS[:2])], outputs=[triton_grpc.InferRequestedOutput("sentence_embedding")],
                       headers=APP).as_numpy("sentence_embedding")
    np.testing.assert_allclose(got, raw, atol=1e-6)
    assert reply.id == "plain-contents"
    trailing = dict(rpc.trailing_metadata())
    assert trailing.get("request_id"), trailing  # Serve's id for the call, sent back


@pytest.mark.parametrize(("mutate", "code", "words"), [
    (lambda r: setattr(r, "model_name", "no-such-model"), grpc.StatusCode.NOT_FOUND, "no-such-model"),
    (lambda r: setattr(r.inputs[0], "datatype", "FP32"), grpc.StatusCode.INVALID_ARGUMENT, "BYTES"),
    (lambda r: r.outputs.add(name="logits"), grpc.StatusCode.INVALID_ARGUMENT, "unknown output"),
    (lambda r: r.parameters["truncate"].CopyFrom(messages().InferParameter(string_param="no")),
     grpc.StatusCode.INVALID_ARGUMENT, "truncate"),
    (lambda r: r.raw_input_contents.append(b"\x05\x00\x00\x00ab"), grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents"),
])
def test_errors_are_status_codes_a_client_can_act_on(channel, mutate, code, words):
    m = messages()
    request = m.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hello")
    mutate(request)
    with pytest.raises(grpc.RpcError) as raised:
        call(channel, "ModelInfer", request)
    assert raised.value.code() == code, raised.value.details()
    sent_back = dict(raised.value.trailing_metadata())["request_id"]  # the call's id, as the details name it
    assert words in raised.value.details() and f"(request id {sent_back})" in raised.value.details()


def test_a_text_past_the_limit_without_truncation_is_invalid_argument_through_tritonclient(client):
    with pytest.raises(InferenceServerException) as raised:
        client.infer(MODEL, [text_input(["word " * 2000])], parameters={"truncate": False}, headers=APP)
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT", raised.value


def test_grpc_calls_are_counted_with_their_protocol(client, metrics_url):
    client.infer(MODEL, [text_input(["counted"])], headers=APP)
    route = method_path("ModelInfer")
    families = poll(metrics_url, lambda f: total(f, "ray_encoder_requests_total", route=route, protocol="grpc") > 0,
                    "a gRPC ModelInfer counted with protocol=grpc")
    assert total(families, "ray_encoder_requests_total", route="/v1/embeddings", protocol="grpc") == 0
    assert total(families, "ray_encoder_request_duration_seconds_count", route=route, stage="queue", protocol="grpc") > 0


HELD = "grpc-held"


@pytest.fixture(scope="module")
def held(ray_serve, default_bundle):
    """One replica whose first batch waits for release(), holding two requests; Serve queues one more."""
    from ray import serve

    from tests.conftest import wait_until
    from tests.holding import deploy_holding

    handle = deploy_holding(HELD, f"/{HELD}", default_bundle, replicas=1, num_cpus=0.25, max_ongoing_requests=2,
                            max_queued_requests=1, retry_after_s=2, warmup=False, batching={"max_concurrent_batches": 1})
    wait_until(lambda: httpx.get(f"{ray_serve.url}/{HELD}/v2/health/live", timeout=10).status_code == 200,
               f"the ingress to route /{HELD}", timeout=60)
    yield handle
    serve.delete(HELD)


def batch_queue(metrics_url: str) -> float:
    """Requests in the held replica's batch queue, read from its metrics: a handle call would take one of
    the replica's two slots."""
    from tests.metrics_scrape import scrape

    return total(scrape(metrics_url), "ray_encoder_batch_queue_requests", application=HELD)


def test_deadline_cancel_and_overload_over_grpc(ray_serve, held, channel, metrics_url):
    """A call past its gRPC deadline and a cancelled call leave the batch queue without running; a
    call that finds the replica full is RESOURCE_EXHAUSTED with the retry hint in its trailing metadata."""
    import threading
    import time

    from tests.conftest import wait_until

    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{ray_serve.url}/{HELD}/v1/embeddings", json={"input": "held"}, timeout=120)))
    first.start()
    try:
        wait_until(lambda: held.held.remote().result(timeout_s=10) == 1, "the first batch to be held", timeout=60)
        m = messages()
        request = m.ModelInferRequest(model_name=MODEL)
        request.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"queued")
        stub = channel.unary_unary(method_path("ModelInfer"), request_serializer=m.ModelInferRequest.SerializeToString,
                                   response_deserializer=m.ModelInferResponse.FromString)
        metadata = (("application", HELD),)

        # past its deadline while queued behind the held batch
        started = time.perf_counter()
        with pytest.raises(grpc.RpcError) as late:
            stub(request, metadata=metadata, timeout=2)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.perf_counter() - started < 10

        # cancelled by the client while in the batch queue
        pending = stub.future(request, metadata=metadata, timeout=60)
        wait_until(lambda: batch_queue(metrics_url) == 1, "the call to wait in the batch queue", timeout=30)
        # both slots taken (the held request and that call): Serve queues one more, then refuses
        waiting = stub.future(request, metadata=metadata, timeout=60)
        time.sleep(1)
        with pytest.raises(grpc.RpcError) as full:
            stub.with_call(request, metadata=metadata, timeout=30)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full.value.details()
        assert dict(full.value.trailing_metadata() or ()).get("retry-after") == "2"
        waiting.cancel()
        pending.cancel()
        wait_until(lambda: batch_queue(metrics_url) == 0, "the cancelled call to leave the batch queue", timeout=30)
    finally:
        held.release.remote().result(timeout_s=60)
        first.join(timeout=120)
    assert answers and answers[0].status_code == 200
    counters = held.info.remote().result(timeout_s=30)["counters"]
    assert counters["requests"] == 1, counters  # no gRPC call ran
    route = method_path("ModelInfer")
    poll(metrics_url, lambda f: total(f, "ray_encoder_request_failures_total", route=route, reason="timeout",
                                      protocol="grpc", application=HELD) >= 1
         and total(f, "ray_encoder_request_failures_total", route=route, reason="cancelled", protocol="grpc",
                   application=HELD) >= 1
         and total(f, "ray_encoder_request_failures_total", route="serve_queue", reason="overloaded", protocol="grpc",
                   application=HELD) >= 1,
         "the deadline, the cancel and the refusal counted with protocol=grpc")


def test_ray_serves_proxy_actor_answers_the_same_calls(client):
    """The fallback path: HAProxy sends a call to Ray Serve's proxy actor while it has not yet seen a
    new replica healthy, and `--ingress proxy` runs it alone. The proxy hands the request to the
    replica pickled, so the messages must pickle (service/apis/kserve_v2/messages.py)."""
    import os

    proxy = triton_grpc.InferenceServerClient(f"127.0.0.1:{os.environ['RAY_SERVE_FALLBACK_PROXY_GRPC_PORT']}")
    try:
        names = [triton_grpc.InferRequestedOutput("sentence_embedding")]
        through_proxy = proxy.infer(MODEL, [text_input(TEXTS)], outputs=names, headers=APP).as_numpy("sentence_embedding")
        direct = client.infer(MODEL, [text_input(TEXTS)], outputs=names, headers=APP).as_numpy("sentence_embedding")
        np.testing.assert_allclose(through_proxy, direct, atol=1e-6)
        assert proxy.get_model_metadata(MODEL, headers=APP).name == MODEL
        with pytest.raises(InferenceServerException) as raised:
            proxy.infer("no-such-model", [text_input(["x"])], headers=APP)
        assert raised.value.status() == "StatusCode.NOT_FOUND", raised.value
    finally:
        proxy.close()
