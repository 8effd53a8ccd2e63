"""Ray Serve's own answers in our JSON error shape.

Some answers never reach our FastAPI app: Serve's 503 when a replica's slots and its queue are
full (backpressure), its 408 when X-Request-Timeout-Seconds passes, its 404 for a path no
application serves, its 500 when a replica dies. Serve writes them as plain text. Serve calls
the function named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (service/config.py, INGRESS_ENV)
in its HTTP proxy and in each replica's own HTTP server (the one HAProxy sends to), and wraps
their ASGI apps in the middlewares it returns (service/ingress_callback.py): this one rewrites those answers into
`{"error": {"type", "message", "request_id"}}`, keeps their status and headers (Retry-After), and counts
Serve's refusals in ray_encoder_request_failures_total{reason="overloaded"}, where the
overload alert looks. Our own answers are JSON already and pass through untouched.

Serve's 408 is the client's deadline passing on Serve's clock, a moment before ours: it becomes the
503 `timeout` with Retry-After that the service answers for the same deadline, so which clock fired
first never shows. The replica's CallMiddleware counts it (Serve cancels the handler there).

Before any of Serve's code, `ServeHeaderGuard` makes the headers safe for it: Serve decodes some
header values as UTF-8 (the request id, X-Request-Timeout-Seconds, the multiplexed model id, the
session id, traceparent) in its proxy and in each replica's HTTP server, and bytes that are not UTF-8
made it answer a plain-text 500 with no log line. Such a header is taken out and named in
UNREADABLE_HEADER, and the app refuses the request with a JSON 400 that has an id, an access log line,
metrics and a span (CallMiddleware). It also keeps one X-Request-Id (service/http/headers.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from service.apis import path_policies
from service.front.finish import count_serve_refusal
from service.front.request_ids import is_valid_request_id
from service.http.headers import REQUEST_ID_HEADER, TIMEOUT_HEADER, UNREADABLE_HEADER, app_path, asked_deadline_s, timeout_header

logger = logging.getLogger("ray.serve")

# Serve's status -> our error type (service/engine/errors.py names the same ones)
RAY_ANSWER_TYPES = {404: "not_found", 408: "timeout", 413: "too_large", 500: "backend", 503: "unavailable"}
SERVE_TIMEOUT = 408  # Serve's answer when X-Request-Timeout-Seconds passes; ours is 503 `timeout`
BACKPRESSURE = "backpressure"  # in Serve's text for a refusal by max_queued_requests (both ingresses)


def error_type(status: int, text: str) -> str:
    if status == 503 and BACKPRESSURE in text.lower():
        return "overloaded"
    return RAY_ANSWER_TYPES.get(status, "backend" if status >= 500 else "bad_request")


class RayAnswersAsJson:
    """ASGI middleware: an error answer that is not JSON becomes our JSON error body."""

    retry_after_s = 1  # on a deadline that passed; a replica sets its retry_after_s (http/server.py configure)

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start: dict | None = None
        body: list[bytes] = []

        async def rewriting_send(message: dict) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                content_type = headers.get(b"content-type", b"")
                if message["status"] >= 400 and not content_type.startswith(b"application/json"):
                    start = message  # hold it until the body is complete
                    return
                return await send(message)
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await send_json(start, b"".join(body).decode("utf-8", "replace"))

        async def send_json(held: dict, text: str) -> None:
            status = held["status"]
            type_ = error_type(status, text)
            message = text.strip() or f"HTTP {status}"
            kept = [(k, v) for k, v in held.get("headers") or [] if k.lower() not in (b"content-type", b"content-length")]
            if status == SERVE_TIMEOUT:
                status, message = 503, deadline_message(scope)
                kept = [(k, v) for k, v in kept if k.lower() != b"retry-after"]
                kept.append((b"retry-after", str(RayAnswersAsJson.retry_after_s).encode()))
            request_id = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.encode())
            # Serve's RequestIdMiddleware, outside this one, has put the client's id or its own; TEI's and
            # Cohere's routes get their clients' body (in an application mounted at the root)
            style = path_policies().of(scope.get("method", ""), app_path(scope)).error_style
            status, error = style(status, type_, message, request_id.decode("ascii", "replace") if request_id else None)
            payload = json.dumps(error).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": kept + [(b"content-type", b"application/json"),
                                           (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            if type_ == "overloaded":
                count_serve_refusal()

        await self.app(scope, receive, rewriting_send)


def serve_decoded_headers() -> frozenset[bytes]:
    """The names (lowercase, `-` as `_`, as Serve compares some of them) of the headers whose values Ray
    Serve decodes as UTF-8 before the app runs (ray/serve/_private/proxy.py, replica.py, http_util.py:
    its constants where it has them; a Ray without one is said once in the log)."""
    names = {"traceparent", "tracestate", REQUEST_ID_HEADER, TIMEOUT_HEADER}
    try:
        from ray.serve._private import constants
    except ImportError:
        constants = None
    for constant in ("SERVE_HTTP_REQUEST_ID_HEADER", "SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER", "SERVE_MULTIPLEXED_MODEL_ID",
                     "SERVE_SESSION_ID", "SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER"):
        value = getattr(constants, constant, None)
        if isinstance(value, str):
            names.add(value)
        else:
            logger.warning("Ray Serve has no %s: that header is not checked for bytes Serve cannot decode", constant)
    return frozenset(n.lower().replace("-", "_").encode() for n in names)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class ServeHeaderGuard:
    """ASGI middleware, outermost in Serve's proxy and replicas' servers: takes out the header values
    Serve would fail to decode, naming them in UNREADABLE_HEADER for the app to refuse (the client
    cannot set that header: any it sent is dropped), and keeps the request's one X-Request-Id: the
    first, when it passes the service's rule, else none, so that Serve makes one (and Serve's echo,
    the error body, the access log line and the span carry the same id)."""

    decoded: frozenset[bytes] = frozenset()  # serve_decoded_headers(), when the first instance is made

    def __init__(self, app: Any) -> None:
        self.app = app
        if not ServeHeaderGuard.decoded:
            ServeHeaderGuard.decoded = serve_decoded_headers()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope["headers"] = self.guarded(scope.get("headers") or [])
        await self.app(scope, receive, send)

    def guarded(self, headers: list) -> list:
        """The headers as Serve and the app may read them (the same list when nothing is to change)."""
        decoded, id_name, mark = self.decoded, REQUEST_ID_HEADER.encode(), UNREADABLE_HEADER.encode()
        ids = 0
        for name, value in headers:
            key = name.lower()
            if key == id_name:
                ids += 1
                if ids > 1 or not is_valid_request_id(value):
                    break
            elif key == mark or (key.replace(b"-", b"_") in decoded and not _is_utf8(value)):
                break
        else:
            return headers  # the common case: nothing to change, nothing copied
        kept, request_id, names = [], None, []
        for name, value in headers:
            key = name.lower()
            if key == id_name:
                if request_id is None:
                    request_id = value
                continue
            if key == mark:
                continue
            if key.replace(b"-", b"_") in decoded and not _is_utf8(value):
                names.append(key.decode("latin-1"))
                continue
            kept.append((name, value))
        if request_id is not None:
            if not _is_utf8(request_id):
                names.append(REQUEST_ID_HEADER)
            elif is_valid_request_id(request_id):
                kept.append((id_name, request_id))
        if names:
            kept.append((mark, ",".join(dict.fromkeys(names)).encode()))
        return kept


def deadline_message(scope: dict) -> str:
    """What Serve's 408 means, in the words of the service's own timeout (Serve's text names
    its request_timeout_s, not the client's header)."""
    asked = asked_deadline_s(timeout_header(scope.get("headers") or []))
    within = f"the client's deadline ({TIMEOUT_HEADER}: {asked:g}s)" if asked is not None else "the request timeout"
    return f"the request did not finish within {within}"
