"""Bad input and overload get clear JSON errors with the right status, never a 500 or a hang,
and the service keeps answering afterwards."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.conftest import deploy

LONG = "word " * 400  # about 400 tokens: over the model's 256


@pytest.fixture(scope="module")
def client(service_url):
    with httpx.Client(base_url=service_url, timeout=60) as c:
        yield c


BAD_REQUESTS = [
    ("empty list", "POST", "/v1/encode", {"json": {"inputs": []}}, 422, "empty list"),
    ("missing inputs", "POST", "/v1/encode", {"json": {}}, 422, "inputs: Field required"),
    ("wrong type", "POST", "/v1/encode", {"json": {"inputs": 42}}, 422, "inputs"),
    ("number as string", "POST", "/v1/encode", {"json": {"inputs": "x", "truncate": "no"}}, 422, "truncate"),
    ("unknown field", "POST", "/v1/encode", {"json": {"inputs": "x", "pooling": "max"}}, 422, "pooling"),
    ("list of non-strings", "POST", "/v1/encode", {"json": {"inputs": ["a", 3]}}, 422, "inputs.1"),
    ("too many inputs", "POST", "/v1/encode", {"json": {"inputs": ["a"] * 65}}, 413, "at most 64"),
    ("too long, no truncation", "POST", "/v1/encode", {"json": {"inputs": [LONG], "truncate": False}}, 413, "limit is 256"),
    ("unknown layer", "POST", "/v1/encode", {"json": {"inputs": "x", "attention": {"layers": [6]}}}, 422, "layer index 6"),
    ("negative head", "POST", "/v1/encode", {"json": {"inputs": "x", "attention": {"heads": [-1]}}}, 422, "head index -1"),
    ("bad attention format", "POST", "/v1/encode", {"json": {"inputs": "x", "attention": {"format": "png"}}}, 422, "format"),
    ("malformed JSON", "POST", "/v1/encode", {"content": b'{"inputs": [', "headers": {"content-type": "application/json"}}, 422, "not valid JSON"),
    ("form content type", "POST", "/v1/encode", {"content": b"inputs=x", "headers": {"content-type": "application/x-www-form-urlencoded"}}, 422, "Content-Type: application/json"),
    ("body over limit", "POST", "/v1/encode", {"content": b'{"inputs": "' + b"a" * (9 * 1024 * 1024) + b'"}', "headers": {"content-type": "application/json"}}, 413, "larger than the limit"),
    ("text over char limit", "POST", "/v1/encode", {"json": {"inputs": "a" * 100_001}}, 413, "characters"),
    ("response too large", "POST", "/v1/encode", {"json": {"inputs": [LONG] * 6, "attention": {}}}, 413, "response would be"),
    ("attention too large", "POST", "/v1/encode", {"json": {"inputs": [LONG] * 64, "attention": {"heads": [0]}}}, 413, "the attention of this request is"),
    ("attention route too large", "POST", "/v1/attention", {"json": {"inputs": [LONG] * 64, "layers": [0]}}, 413, "the attention of this request is"),
    ("openai unknown model", "POST", "/v1/embeddings", {"json": {"input": "x", "model": "gpt-4"}}, 404, "not served"),
    ("openai token arrays", "POST", "/v1/embeddings", {"json": {"input": [[1, 2, 3]]}}, 422, "list of strings"),
    ("openai dimensions, not matryoshka", "POST", "/v1/embeddings", {"json": {"input": "x", "dimensions": 64}}, 400,
     "does not support dimensions"),
    ("v2 unknown model", "POST", "/v2/models/nope/infer", {"json": {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}}, 404, "'nope' is not served here; served: 'all-MiniLM-L6-v2'"),
    ("v2 wrong datatype", "POST", "/v2/models/all-MiniLM-L6-v2/infer", {"json": {"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]}}, 422, "BYTES"),
    ("v2 shape mismatch", "POST", "/v2/models/all-MiniLM-L6-v2/infer", {"json": {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": ["x"]}]}}, 422, "1 elements"),
    ("v2 unknown output", "POST", "/v2/models/all-MiniLM-L6-v2/infer", {"json": {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}], "outputs": [{"name": "logits"}]}}, 422, "unknown output"),
    ("bad client deadline", "POST", "/v1/encode", {"json": {"inputs": "x"}, "headers": {"X-Request-Timeout-Seconds": "soon"}}, 422, "X-Request-Timeout-Seconds".lower()),
    ("negative client deadline", "POST", "/v1/embeddings", {"json": {"input": "x"}, "headers": {"X-Request-Timeout-Seconds": "-1"}}, 422, "positive number"),
    ("unknown route", "GET", "/v1/nothing", {}, 404, "Not Found"),
    ("wrong method", "GET", "/v1/encode", {}, 405, "Method Not Allowed"),
]


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "message"), [r[1:] for r in BAD_REQUESTS], ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request_gets_a_json_error(client, method, path, kwargs, status, message):
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    if path.startswith("/v2/"):  # KServe's {"error": message}, which tritonclient.http formats; ours beside it
        assert set(body) == {"error", "type", "request_id"} and body["request_id"] == r.headers["x-request-id"]
        assert message in body["error"], body
        return
    error = body["error"]
    assert set(error) == {"type", "message", "request_id"} and error["request_id"] == r.headers["x-request-id"]
    assert message in error["message"], error


def test_service_still_answers_after_bad_requests(client):
    for _ in range(3):
        client.post("/v1/encode", content=b"{", headers={"content-type": "application/json"})
    r = client.post("/v1/encode", json={"inputs": ["still fine"]})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


@pytest.mark.serial
def test_overload_is_refused_at_once_with_retry_after(ray_serve, default_bundle):
    """Tight limits (a replica holds 1 request, Serve queues 1 more): a burst gets 503 + Retry-After
    at once, from Serve, with the JSON error body (service/http/ingress.py); accepted requests finish."""
    deploy(
        {"max_ongoing_requests": 1, "max_queued_requests": 1, "num_cpus": 1, "retry_after_s": 2,
         "batching": {"max_concurrent_batches": 1}},
        "tight", "/tight", default_bundle,
    )
    # seconds of work for the one admitted request, so that "at once" is far apart from "after queueing"
    heavy = {"inputs": [f"sentence {i} " + "with many words " * 90 for i in range(60)]}

    def one(_: int) -> tuple[int, float, httpx.Response]:
        started = time.perf_counter()
        with httpx.Client(base_url=ray_serve.url, timeout=60) as c:
            r = c.post("/tight/v1/encode", json=heavy)
        return r.status_code, time.perf_counter() - started, r

    with ThreadPoolExecutor(max_workers=10) as pool:
        results = list(pool.map(one, range(10)))
    statuses = sorted(s for s, _, _ in results)
    refused = [(t, r) for s, t, r in results if s == 503]
    accepted = [t for s, t, _ in results if s == 200]
    assert set(statuses) <= {200, 503}, statuses
    assert refused and accepted, statuses
    slowest_accepted = max(accepted)
    for elapsed, r in refused:
        assert r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "overloaded"
        assert elapsed < slowest_accepted, "a refusal must come at once, not after queueing"
    with httpx.Client(base_url=ray_serve.url, timeout=60) as c:  # healthy again after the burst
        assert c.post("/tight/v1/encode", json={"inputs": "after the burst"}).status_code == 200
    from ray import serve

    from tests.reliability import record

    serve.delete("tight")  # give its CPUs back to the apps that later tests deploy
    record("overload burst", "10 concurrent 60-text requests against a replica that holds 1",
           {"200": statuses.count(200), "503 + Retry-After": statuses.count(503)}, None,
           note=f"refusals at once (slowest refusal {max(t for t, _ in refused):.2f} s); healthy right after")
    print(f"\noverload burst: {statuses.count(200)} accepted, {statuses.count(503)} refused with 503")


def test_a_request_id_is_echoed_once_and_carried_by_the_error_body(client):
    """Through Serve's ingress: the client's X-Request-Id comes back in one header and in the error body;
    without one, the id Serve made is the one the body carries."""
    r = client.post("/v1/encode", json={"inputs": []}, headers={"X-Request-Id": "client-7f3a"})
    assert r.status_code == 422 and r.headers.get_list("x-request-id") == ["client-7f3a"], r.headers
    assert r.json()["error"]["request_id"] == "client-7f3a"
    r = client.post("/v1/encode", json={"inputs": []})
    made = r.headers.get_list("x-request-id")
    assert len(made) == 1 and r.json()["error"]["request_id"] == made[0], (r.headers, r.text)
    r = client.post("/v1/encode", json={"inputs": "x"}, headers={"X-Request-Id": "ok-1"})
    assert r.status_code == 200 and r.headers.get_list("x-request-id") == ["ok-1"]


def test_the_id_a_client_sends_is_in_the_answer_and_the_access_log_line_with_its_usage(service_url):
    """End to end, against the served app (HAProxy, the replica, its stderr as Ray keeps it): the client's
    X-Request-Id is the response's one header, the error body's `request_id`, Cohere's `id`, and the `id` of
    the request's one access log line, whose `tokens` are the response's usage and `texts` its texts."""
    import uuid

    from tests.access_log import access_line

    def sent(path: str, body: dict) -> tuple[str, httpx.Response, dict]:
        request_id = f"e2e-{uuid.uuid4().hex}"
        r = httpx.post(f"{service_url}{path}", json=body, headers={"X-Request-Id": request_id}, timeout=60)
        assert r.headers.get_list("x-request-id") == [request_id], (r.status_code, r.headers)
        return request_id, r, access_line(service_url, request_id)

    texts = ["the first text", "a second and somewhat longer text"]
    request_id, r, line = sent("/v1/embeddings", {"input": texts})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 2 * 2
    assert {k: line[k] for k in ("method", "route", "model", "status", "texts", "tokens")} == {
        "method": "POST", "route": "/v1/embeddings", "model": "all-MiniLM-L6-v2", "status": 200, "texts": len(texts),
        "tokens": r.json()["usage"]["prompt_tokens"]}
    request_id, r, line = sent("/v2/embed", {"model": "all-MiniLM-L6-v2", "texts": texts,
                                             "input_type": "search_document", "embedding_types": ["float"]})
    assert r.status_code == 200 and r.json()["id"] == request_id, r.text[:300]
    assert (line["route"], line["status"], line["texts"], line["tokens"]) == (
        "/v2/embed", 200, len(texts), r.json()["meta"]["billed_units"]["input_tokens"])
    request_id, r, line = sent("/v1/encode", {"inputs": []})
    assert r.status_code == 422 and r.json()["error"]["request_id"] == request_id
    assert (line["route"], line["status"], line["texts"], line["tokens"]) == ("/v1/encode", 422, 0, 0)
    request_id, r, line = sent("/v2/embed", {"model": "all-MiniLM-L6-v2", "texts": [], "input_type": "search_document",
                                             "embedding_types": ["float"]})
    assert r.status_code >= 400 and r.json()["id"] == request_id and line["status"] == r.status_code, r.text[:300]
