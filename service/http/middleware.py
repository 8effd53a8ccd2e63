"""The HTTP transport's two pure-ASGI middlewares, outermost first (overload is refused by Serve
itself: service/http/ingress.py):

- CallMiddleware makes the request's Call (service/front/call.py) from its scope, with the policy its
  route's API declared; passes it through the gate (the bearer token of inference routes before the
  body is read, the in-flight counts); gives it its id, echoed where no Serve ingress echoes it; and
  records it when it ends (service/front/finish.py: metrics, access log line, span).
- BodyLimitMiddleware refuses a body over the limit, whether or not Content-Length is sent (a route that
  reads its body as it streams in and bounds it itself, the Batch API's upload, only by Content-Length).

Their settings are class attributes, set by the deployment when a replica starts (configure in
service/http/server.py): Ray Serve pickles the ingress's FastAPI app by value, module variables its
functions read included, while these classes are imported by reference.
"""

from __future__ import annotations

import asyncio
from typing import Any

from service.apis import path_policies
from service.engine.errors import ServiceError
from service.front.call import Call
from service.front.deps import CALL_KEY
from service.front.errors import CLIENT_GONE
from service.front.finish import finish
from service.front.gate import Gate
from service.front.keys import ON_BEHALF_HEADER
from service.front.quotas import Quotas, headers as limit_headers, limited
from service.front.request_ids import current_request_id
from service.http.errors import error_response, service_error_response
from service.http.headers import (PRIORITY_HEADER, REQUEST_ID_HEADER, TIMEOUT_HEADER,
                                  UNREADABLE_HEADER, app_path, asked_deadline_s, request_id_of, timeout_header)
from service.observability import tracing

_UNREADABLE_NAME = UNREADABLE_HEADER.encode()
_REQUEST_ID_NAME = REQUEST_ID_HEADER.encode()
_AUTHORIZATION = b"authorization"
_PRIORITY_NAME = PRIORITY_HEADER.encode()
_ON_BEHALF_NAME = ON_BEHALF_HEADER.encode()


def call_of_scope(scope: dict) -> Call:
    """The request's Call: its id, method, path, the policy of its route, and its deadline header."""
    headers = scope.get("headers") or []
    method, path = scope.get("method", ""), app_path(scope)
    deadline = timeout_header(headers)
    return Call(request_id_of(headers), "http", method, path=path, policy=path_policies().of(method, path),
                asked_deadline_s=asked_deadline_s(deadline), deadline_name=TIMEOUT_HEADER, deadline_text=deadline,
                asked_batch=any(k == _PRIORITY_NAME and v.strip().lower() == b"batch" for k, v in headers))


class CallMiddleware:
    """The front door of every HTTP request: its Call, the gate, and its record when it ends."""

    behind_serve = False  # a Serve ingress in front echoes X-Request-Id itself (configure())

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        call = scope[CALL_KEY] = call_of_scope(scope)
        app, inference = self.gated(scope, call)
        if inference and limited(call.key):  # a key's limits, counted for the whole service, before the body
            try:
                await Quotas.admit(call)
            except ServiceError as exc:
                app, inference = refusal_of_limit(exc, call), False
            except asyncio.CancelledError:  # the client left while its key was admitted: recorded, as below
                call.client_gone = True
                call.failed("cancelled")
                finish(call, CLIENT_GONE, 0)
                raise
        id_token = current_request_id.set(call.id)
        echo = not CallMiddleware.behind_serve
        method = scope.get("method", "")
        span = tracing.request_span(f"{method} {call.path}", tracing.carrier_of_headers(dict(scope.get("headers") or [])), {
            "http.request.method": method, "url.path": call.path,
            "encoder.request_id": call.id}) if tracing.enabled() else None
        status = 500  # what an exception that escapes the app without a response amounts to
        responded = False
        sent = 0
        Gate.enter(inference)  # the in-flight gauge samples Gate.in_flight each second (service/deployment.py)

        async def counting_send(message: dict) -> None:
            nonlocal status, sent, responded
            if message["type"] == "http.response.start":
                status, responded = message["status"], True
                if echo:
                    headers = [h for h in message.get("headers", []) if h[0].lower() != _REQUEST_ID_NAME]
                    message = {**message, "headers": [*headers, (_REQUEST_ID_NAME, call.id.encode())]}
                if call.limits:  # OpenAI's x-ratelimit-* on every answer of a limited key
                    message = {**message, "headers": [*message.get("headers", []), *(
                        (k.encode(), v.encode()) for k, v in limit_headers(call))]}
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await app(scope, receive, counting_send)
        except asyncio.CancelledError:
            # Serve cancels the handler of a client that went away, and of one whose
            # X-Request-Timeout-Seconds passed first on Serve's clock (it answers 408 itself, which
            # service/http/ingress.py turns into our 503 timeout)
            if call.past_client_deadline():
                call.timed_out = True
            else:
                call.client_gone = True
            raise
        finally:
            current_request_id.reset(id_token)
            if not responded and call.timed_out:
                status = 503
                call.failed("timeout")
            elif not responded and call.client_gone:
                status = CLIENT_GONE  # left mid-upload or mid-wait: the client's doing, not an error of ours
                call.failed("cancelled")
            Gate.leave(inference)
            Quotas.release_soon(call)  # the key's concurrent lease, if it holds one
            finish(call, status, sent, span, f"{method} {call.route}", {
                "http.route": call.route, "http.response.status_code": status, "encoder.task": call.task or None})

    def gated(self, scope: dict, call: Call) -> tuple[Any, bool]:
        """The app that answers the request, and whether it counts as an inference request in flight:
        the app itself; or, before the body is read, the refusal of a request whose headers Serve could
        not decode, or of one without the token its route needs."""
        headers = scope.get("headers") or []
        unreadable = next((v for k, v in headers if k == _UNREADABLE_NAME), None)
        if unreadable is not None:
            return refusal_of_unreadable(unreadable.decode("latin-1"), call), False
        if Gate.keyring is not None and call.policy.needs_token(call.method):
            call.key, refusal = Gate.identify(next((v for k, v in headers if k == _AUTHORIZATION), None),
                                              next((v for k, v in headers if k == _ON_BEHALF_NAME), None))
            if refusal is not None:
                return refusal_of_token(refusal, call), False
        return self.app, call.policy.inference


def refusal_of_unreadable(names: str, call: Call) -> Any:
    """The ASGI app that answers a request whose headers `names` were not UTF-8 (a 400 in the route's
    error style): what the app would have done with them is unknown, so it does nothing."""
    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        call.failure_reason = "bad_request"
        response = error_response(400, "bad_request", f"header {names}: the value is not UTF-8 text", call=call)
        await response(scope, receive, send)

    return refuse


def refusal_of_limit(refusal: ServiceError, call: Call) -> Any:
    """The ASGI app that answers a request of a key past one of its limits (429 in the route's error style,
    Retry-After, the limits' headers), or whose limits' store is unreachable (503): before its body is read."""
    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        call.failure_reason = refusal.type
        await service_error_response(refusal, call)(scope, receive, send)

    return refuse


def refusal_of_token(refusal: Exception, call: Call) -> Any:
    """The ASGI app that answers a request without the token its route needs: 401 before its body is
    read, so nothing reaches the tokenizer or the model."""
    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        call.failure_reason = "unauthorized"
        response = service_error_response(refusal, call)
        response.headers["WWW-Authenticate"] = 'Bearer realm="encoder"'
        await response(scope, receive, send)

    return refuse


class BodyLimitMiddleware:
    """Refuse request bodies over the limit with 413, whether or not Content-Length is sent.

    The body is counted as it streams in and never buffered past the limit.
    """

    limit = 8 * 1024 * 1024
    path_limits: dict[str, int] = {}  # a route's own limit (the Batch API's upload), by path
    streamed: frozenset[str] = frozenset()  # paths whose route counts its body as it streams in: not buffered

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = app_path(scope)
        limit = BodyLimitMiddleware.path_limits.get(path, BodyLimitMiddleware.limit)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, limit)
        if path in BodyLimitMiddleware.streamed:  # a 100 MB upload is never held here (issue 55)
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                if CALL_KEY in scope:
                    scope[CALL_KEY].client_gone = True  # it left while uploading: nothing to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await self._refuse(scope, receive, send, limit)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope: dict, receive: Any, send: Any, limit: int) -> None:
        response = error_response(413, "too_large", f"request body is larger than the limit of {limit} bytes",
                                  call=scope.get(CALL_KEY))
        await response(scope, receive, send)
