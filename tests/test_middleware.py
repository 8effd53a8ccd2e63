"""The call middleware's status for requests that end without a response: a handler cancelled
because its client went away is a 499 (nginx's and Envoy's convention), an exception is a 500. The
service's own end-to-end check of the mid-upload case is in test_metrics.py. Request ids and the
access log line, which the same middleware writes (through service/front/finish.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from service.front import finish as finish_module
from service.front.deps import CALL_KEY
from service.http import middleware


async def _receive() -> dict:
    return {"type": "http.request", "body": b"{}", "more_body": False}


async def _send(message: dict) -> None:
    pass


def run_through(monkeypatch, app, headers=()) -> list[int]:
    """The statuses the middleware counts for one request through `app`."""
    counted: list[int] = []
    real = finish_module.status_class
    monkeypatch.setattr(finish_module, "status_class", lambda status: counted.append(status) or real(status))
    scope = {"type": "http", "method": "POST", "path": "/v1/encode", "headers": list(headers)}
    try:
        asyncio.run(middleware.CallMiddleware(app)(scope, _receive, _send))
    except (asyncio.CancelledError, RuntimeError):
        pass
    return counted


def test_a_cancelled_handler_counts_as_499_not_500(monkeypatch):
    async def cancelled(scope, receive, send):
        raise asyncio.CancelledError  # what Serve does to the handler of a client that left

    assert run_through(monkeypatch, cancelled) == [499]


def test_a_handler_cancelled_at_the_clients_deadline_counts_as_a_503_timeout(monkeypatch):
    """Serve cancels the handler when X-Request-Timeout-Seconds passes on its clock, as it does for a
    client that left; past the deadline it is the service's timeout (5xx), not the client's 499."""
    reasons: list[str] = []

    async def slow_then_cancelled(scope, receive, send):
        await asyncio.sleep(0.2)
        raise asyncio.CancelledError

    real_failures = finish_module.service_metrics().failures.inc
    monkeypatch.setattr(finish_module.service_metrics().failures, "inc",
                        lambda *a, tags, **k: reasons.append(tags["reason"]) or real_failures(*a, tags=tags, **k))
    deadline = [(b"x-request-timeout-seconds", b"0.2")]
    assert run_through(monkeypatch, slow_then_cancelled, deadline) == [503] and reasons == ["timeout"]
    far = [(b"x-request-timeout-seconds", b"30")]  # cancelled well before its deadline: the client left
    assert run_through(monkeypatch, slow_then_cancelled, far) == [499] and reasons[-1] == "cancelled"


def test_an_exception_without_a_response_still_counts_as_500(monkeypatch):
    async def broken(scope, receive, send):
        raise RuntimeError("a bug")

    assert run_through(monkeypatch, broken) == [500]


def test_a_response_sent_before_a_cancellation_keeps_its_status(monkeypatch):
    async def answered_then_cancelled(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise asyncio.CancelledError

    assert run_through(monkeypatch, answered_then_cancelled) == [200]


@pytest.mark.parametrize("status", [200, 422, 503])
def test_answered_requests_count_with_their_own_status(monkeypatch, status):
    async def answers(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    assert run_through(monkeypatch, answers) == [status]


def test_ray_answers_become_our_json_error_and_ours_pass_untouched():
    """service/http/ingress.py: Serve's plain-text answers (its queue-full 503 with Retry-After, its 408)
    become `{"error": {"type", "message"}}` (and the request's id, where Serve gave it one) with status and
    headers kept; JSON answers are not touched."""
    import asyncio

    from service.http.ingress import RayAnswersAsJson

    def app_answering(status: int, body: bytes, content_type: bytes, extra=()):
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", content_type), *extra]})
            await send({"type": "http.response.body", "body": body[:5], "more_body": True})
            await send({"type": "http.response.body", "body": body[5:]})
        return app

    def run(app) -> tuple[dict, bytes]:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        asyncio.run(RayAnswersAsJson(app)({"type": "http", "path": "/v1/embeddings"}, None, send))
        start = sent[0]
        return start, b"".join(m.get("body", b"") for m in sent[1:])

    refused = b"Request dropped due to backpressure (num_queued_requests=1, max_queued_requests=1)."
    start, body = run(app_answering(503, refused, b"text/plain; charset=utf-8", [(b"retry-after", b"2")]))
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"retry-after"] == b"2"
    assert headers[b"content-type"] == b"application/json" and int(headers[b"content-length"]) == len(body)
    assert json.loads(body) == {"error": {"type": "overloaded", "message": refused.decode()}}
    # Serve's 408 is the client's deadline passing on its clock: the service's 503 timeout, Retry-After
    start, body = run(app_answering(408, b"Request abc timed out after Nones.", b"text/plain"))
    assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"1"
    error = json.loads(body)["error"]
    assert error["type"] == "timeout" and error["message"] == "the request did not finish within the request timeout"
    ours = json.dumps({"error": {"type": "validation", "message": "x"}}).encode()
    start, body = run(app_answering(422, ours, b"application/json"))
    assert body == ours and dict(start["headers"])[b"content-type"] == b"application/json"
    start, body = run(app_answering(200, b"success", b"text/plain"))
    assert start["status"] == 200 and body == b"success"  # Serve's /-/healthz: not an error, not touched


def test_each_request_gets_an_id_in_its_error_body_its_header_and_its_access_log_line(monkeypatch):
    """The client's X-Request-Id (or one made for it, where it sent none or one that is not 1-128 visible
    ASCII characters) is on the error body, on the response's header where no Serve ingress echoes it, and
    on the request's one JSON access log line with its route, model, status, texts and tokens."""
    import logging

    from service.http.errors import error_response
    from service.front.finish import access_logger, enable_access_log

    lines: list[dict] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(json.loads(record.getMessage()))

    async def refused(scope, receive, send):
        call = scope[CALL_KEY]
        call.route, call.model, call.texts, call.tokens = "/v1/encode", "m", 2, 9
        await error_response(413, "too_large", "too long", call=call)(scope, receive, send)

    def through(headers):
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/encode", "headers": list(headers)}
        asyncio.run(middleware.CallMiddleware(refused)(scope, _receive, send))
        start = next(m for m in sent if m["type"] == "http.response.start")
        body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
        return [v.decode() for k, v in start["headers"] if k.lower() == b"x-request-id"], body["error"]

    handler = Collect()
    enable_access_log(True)
    access_logger.addHandler(handler)
    monkeypatch.setattr(middleware.CallMiddleware, "behind_serve", False)
    try:
        assert through([(b"x-request-id", b"client-7f3a")]) == (["client-7f3a"], {
            "type": "too_large", "message": "too long", "request_id": "client-7f3a"})
        made, error = through([])
        assert len(made) == 1 and len(made[0]) == 32 and error["request_id"] == made[0]
        replaced, error = through([(b"x-request-id", b"two words")])
        assert replaced != ["two words"] and error["request_id"] == replaced[0]
        monkeypatch.setattr(middleware.CallMiddleware, "behind_serve", True)  # Serve echoes it: not twice
        assert through([(b"x-request-id", b"behind-serve")])[0] == []
    finally:
        access_logger.removeHandler(handler)
    assert [line["id"] for line in lines] == ["client-7f3a", made[0], replaced[0], "behind-serve"]
    first = lines[0]
    assert {k: first[k] for k in ("method", "route", "model", "status", "texts", "tokens")} == {
        "method": "POST", "route": "/v1/encode", "model": "m", "status": 413, "texts": 2, "tokens": 9}
    assert first["ms"] >= 0 and first["time"].endswith("Z")
    assert error_response(400, "bad_request", "outside a request").body == \
        b'{"error":{"type":"bad_request","message":"outside a request"}}'


def test_serve_never_sees_a_header_it_cannot_decode_and_the_app_refuses_it_with_an_id():
    """service/http/ingress.py's guard, before Serve's code: a header value Serve decodes as UTF-8 that is
    not UTF-8 is taken out and named for the app, which answers a JSON 400 with the request's one id and
    an access log line; one X-Request-Id is kept (the first, when valid); a client's own naming is dropped.
    (End to end through both ingresses: tests/test_hostile_headers.py.)"""
    import logging

    from service.http.ingress import ServeHeaderGuard
    from service.http.headers import UNREADABLE_HEADER
    from service.front.finish import access_logger, enable_access_log

    seen: list[list] = []

    async def serve_then_app(scope, receive, send):  # what Serve's code does first: decode them all
        seen.append(list(scope["headers"]))
        for name, value in scope["headers"]:
            name.decode("utf-8"), value.decode("utf-8")
        await middleware.CallMiddleware(answers_200)(scope, receive, send)

    async def answers_200(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def through(headers):
        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": list(headers)}
        asyncio.run(ServeHeaderGuard(serve_then_app)(scope, _receive, send))
        start = next(m for m in sent if m["type"] == "http.response.start")
        return start, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    lines: list[dict] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(json.loads(record.getMessage()))

    handler = Collect()
    enable_access_log(True)
    access_logger.addHandler(handler)
    try:
        plain = [(b"host", b"x"), (b"x-request-id", b"client-1"), (b"serve_multiplexed_model_id", b"m\xc3\xa9")]
        start, _ = through(plain)
        assert start["status"] == 200 and seen[-1] == plain  # nothing to change: passed as it came
        for name, value in [(b"x-request-timeout-seconds", b"\xff"), (b"serve-multiplexed-model-id", b"\xff"),
                            (b"x-request-id", b"caf\xe9")]:
            start, body = through([(b"host", b"x"), (name, value)])
            error = json.loads(body)["error"]
            assert start["status"] == 400 and error["type"] == "bad_request", (name, body)
            assert name.decode().lower() in error["message"] and value not in [v for _, v in seen[-1]]
            ids = [v.decode() for k, v in start["headers"] if k == b"x-request-id"]
            assert ids == [error["request_id"]] and lines[-1]["id"] == ids[0] and lines[-1]["status"] == 400
        start, _ = through([(UNREADABLE_HEADER.encode(), b"x-request-id")])  # a client cannot name any itself
        assert start["status"] == 200 and seen[-1] == []
        through([(b"x-request-id", b"first"), (b"x-request-id", b"second")])
        assert seen[-1] == [(b"x-request-id", b"first")] and lines[-1]["id"] == "first"
        through([(b"x-request-id", b"not valid"), (b"x-request-id", b"second")])
        assert seen[-1] == []  # none left: Serve makes one (here, the middleware does)
        through([(b"x-request-id", b"b" * 129)])
        assert seen[-1] == []
    finally:
        access_logger.removeHandler(handler)


@pytest.mark.parametrize("path, body, chunks, expected", [
    ("/v1/embeddings", b'{"model": "minilm", "input": "x"}', 1, "minilm"),
    ("/repository/v1/embeddings", b'{"input": "x", "model": "e5-small"}', 3, "e5-small"),  # in three messages
    ("/v2/models/bert-0/infer", b'{"inputs": []}', 1, "bert-0"),
    ("/repo/v2/repository/models/xlm-roberta-2/load", b"", 1, "xlm-roberta-2"),
    ("/v1/embeddings", b'{"model": "../etc/passwd", "input": "x"}', 1, None),  # not a model name: left to the app
    ("/v1/embeddings", b'{"model": ["a"], "input": "x"}', 1, None),
    ("/v1/embeddings", b"[" * 10000 + b"]" * 10000, 1, None),  # nested past Python's stack
    ("/v1/embeddings", b"not json", 1, None),
    ("/v1/embeddings", b'{"model": "big", "input": "' + b"x" * 20000 + b'"}', 4, None),  # past the 16 KB read
])
def test_serves_proxy_routes_by_the_model_a_request_names_and_the_app_gets_the_body_untouched(path, body, chunks,
                                                                                             expected):
    """service/hosting/model_routing.py in Serve's proxy: the model named by v2's path or the JSON body becomes
    Serve's multiplexed model id (a client's own such header replaced); what is not a model name, not JSON or
    larger than the router reads sets nothing; the app downstream reads the same body, whole."""
    from service.hosting.model_routing import MODEL_ID_HEADER, ModelIdFromRequest

    seen: dict = {}

    async def app(scope, receive, send) -> None:
        got = b""
        while True:
            message = await receive()
            got += message.get("body", b"")
            if not message.get("more_body", False):
                break
        seen["ids"] = [v.decode() for k, v in scope["headers"] if k == MODEL_ID_HEADER]
        seen["body"] = got

    size = max(1, -(-len(body) // chunks))
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": part, "more_body": i < len(parts) - 1} for i, part in enumerate(parts)]

    async def receive() -> dict:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-length", str(len(body)).encode()), (b"serve-multiplexed-model-id", b"client-said")]}
    asyncio.run(ModelIdFromRequest(app)(scope, receive, _send))
    assert seen["body"] == body
    assert seen["ids"] == ([expected] if expected else []), seen["ids"]
