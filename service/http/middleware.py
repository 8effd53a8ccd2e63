"""Pure-ASGI middlewares around every route, outermost first: metrics, bearer auth, in-flight
count, body limit (overload is refused by Serve itself: service/http/ingress.py).

Their settings are class attributes, set by the deployment when a replica starts: Ray Serve
pickles the ingress's FastAPI app by value, module variables its functions read included, while
these classes are imported by reference, so every reader in the replica sees the same values.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import time
from typing import Any

from service.observability import tracing
from service.config import ServiceSettings
from service.http.errors import ERROR_STYLES, app_path, error_response
from service.http.request_ids import REQUEST_ID_HEADER, current_request_id, enable_access_log, log_access, request_id_of
from service.observability.metrics import service_metrics, status_class

_REASON_BY_STATUS = {401: "unauthorized", 404: "not_found", 413: "too_large", 422: "validation",
                     429: "overloaded", 499: "cancelled", 503: "overloaded"}
# A request whose client left before it was answered: nginx's and Envoy's 499, never a 500.
CLIENT_GONE = 499
# A client's own deadline, in seconds (the header Ray Serve also reads, and answers 408 on).
TIMEOUT_HEADER = "x-request-timeout-seconds"
# How much earlier than the client's deadline ours ends: Serve's clock starts a little before ours,
# so ours ends first and the answer is ours.
HEADER_DEADLINE_MARGIN_S = 0.05
# Headers Serve could not have decoded (not UTF-8), named by service/http/ingress.py, which took them out
# before Serve's code ran: the request is refused here, with an id, a log line and metrics.
UNREADABLE_HEADER = "x-encoder-unreadable-headers"
_UNREADABLE_NAME = UNREADABLE_HEADER.encode()


def asked_deadline_s(scope: dict) -> float | None:
    """The client's X-Request-Timeout-Seconds as a number (NaN when it is not one), None without it."""
    raw = dict(scope.get("headers") or []).get(TIMEOUT_HEADER.encode())
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        return float("nan")


def past_client_deadline(scope: dict, now: float) -> bool:
    """Whether the client's own deadline had passed by `now` (perf_counter), counted from arrival:
    Serve cancels a handler at that deadline exactly as it does for a client that left."""
    asked, arrived = asked_deadline_s(scope), scope.get("arrived")
    return asked is not None and arrived is not None and now - arrived >= asked - HEADER_DEADLINE_MARGIN_S


def serve_config_now():
    """This replica's deployment config as Serve last applied it (replicas, autoscaling and request
    limits change on a running replica there), or None outside a replica (unit tests)."""
    try:
        from ray import serve

        return serve.get_replica_context()._deployment_config
    except Exception:  # noqa: BLE001 - not in a replica, or a Ray without it
        return None


def is_inference(method: str, path: str) -> bool:
    """The routes that run the model (and so need a token, and count as in flight)."""
    return method == "POST" and (path.startswith("/v1/") or (path.startswith("/v2/models/") and path.endswith("/infer"))
                                 or path in ERROR_STYLES)  # TEI's and Cohere's routes: each runs or tokenizes


class MetricsMiddleware:
    """Counts every request by route template and status, its total time, in-flight requests,
    failures by reason, and response bytes (the routes report bytes per output kind); gives it its
    id (service/http/request_ids.py) and writes its access log line."""

    in_flight = 0  # requests inside this replica's app now
    behind_serve = False  # a Serve ingress in front echoes X-Request-Id itself (configure())

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics = service_metrics()
        started = time.perf_counter()
        scope["arrived"] = started  # a request's deadline counts from here (context.deadline)
        raw_headers = scope.get("headers") or []
        request_id = request_id_of(raw_headers)
        app = self.app
        unreadable = next((v for k, v in raw_headers if k == _UNREADABLE_NAME), None)
        if unreadable is not None:
            app = refusal_of_unreadable(unreadable.decode("latin-1"))
        scope["request_id"] = request_id
        id_token = current_request_id.set(request_id)
        echo = not MetricsMiddleware.behind_serve
        traced = tracing.request_span(f"{scope.get('method', '')} {app_path(scope)}",
                                      tracing.carrier_of_headers(dict(scope.get("headers") or [])), {
            "http.request.method": scope.get("method", ""), "url.path": app_path(scope),
            "encoder.request_id": request_id}) if tracing.enabled() else None
        status = 500  # what an exception that escapes the app without a response amounts to
        responded = False
        sent = 0
        MetricsMiddleware.in_flight += 1
        metrics.in_flight.set(MetricsMiddleware.in_flight)

        async def counting_send(message: dict) -> None:
            nonlocal status, sent, responded
            if message["type"] == "http.response.start":
                status, responded = message["status"], True
                if echo:
                    headers = [h for h in message.get("headers", []) if h[0].lower() != REQUEST_ID_HEADER.encode()]
                    message = {**message, "headers": [*headers, (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await app(scope, receive, counting_send)
        except asyncio.CancelledError:
            # Serve cancels the handler of a client that went away, and of one whose
            # X-Request-Timeout-Seconds passed first on Serve's clock (it answers 408 itself, which
            # service/http/ingress.py turns into our 503 timeout)
            scope["timed_out" if past_client_deadline(scope, time.perf_counter()) else "client_gone"] = True
            raise
        finally:
            current_request_id.reset(id_token)
            if not responded and scope.get("timed_out"):
                status = 503
                scope.setdefault("failure_reason", "timeout")
            elif not responded and scope.get("client_gone"):
                status = CLIENT_GONE  # left mid-upload or mid-wait: the client's doing, not an error of ours
                scope.setdefault("failure_reason", "cancelled")
            MetricsMiddleware.in_flight -= 1
            metrics.in_flight.set(MetricsMiddleware.in_flight)
            # set by the app's route dependency (or an error handler): the template, so label values stay few
            route = scope.get("route_template", "unmatched")
            model = scope.get("model", "")  # set by the route once it knows which model the request is for
            task = scope.get("task", "")  # and that model's task: embedding, classification
            metrics.requests.inc(tags={"route": route, "status_class": status_class(status), "model": model, "task": task})
            metrics.duration.observe(time.perf_counter() - started,
                                     tags={"route": route, "stage": "total", "model": model, "task": task})
            if status >= 400:
                reason = scope.get("failure_reason") or _REASON_BY_STATUS.get(status, "backend")
                metrics.failures.inc(tags={"route": route, "reason": reason, "model": model, "task": task})
            kinds: dict[str, int] = scope.get("response_kinds") or {}
            for kind, n in kinds.items():
                if n > 0:
                    metrics.response_bytes.inc(n, tags={"route": route, "kind": kind, "model": model})
            other = sent - sum(kinds.values())
            if other > 0:
                metrics.response_bytes.inc(other, tags={"route": route, "kind": "other", "model": model})
            log_access(scope, status, started, time.perf_counter())
            if traced is not None:
                traced.finish(f"{scope.get('method', '')} {route}", status, {
                    "http.route": route, "http.response.status_code": status, "encoder.model": model or None,
                    "encoder.task": task or None, "encoder.texts": scope.get("texts", 0),
                    "encoder.tokens": scope.get("tokens", 0)})


def refusal_of_unreadable(names: str) -> Any:
    """The ASGI app that answers a request whose headers `names` were not UTF-8 (a 400 in the route's
    error style): what the app would have done with them is unknown, so it does nothing."""
    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        scope["failure_reason"] = "bad_request"
        response = error_response(400, "bad_request", f"header {names}: the value is not UTF-8 text", scope=scope)
        await response(scope, receive, send)

    return refuse


class BearerAuthMiddleware:
    """Optional bearer-token authentication of the inference routes.

    Health, readiness, model metadata, /info and the docs stay open (probes and scrapers carry
    no token). A missing or wrong token is a 401 before the body is read: nothing reaches the
    tokenizer or the model. Tokens are compared in constant time.
    """

    token: bytes | None = None  # None: authentication off

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        token = BearerAuthMiddleware.token
        if scope["type"] != "http" or token is None or not is_inference(scope.get("method", ""), app_path(scope)):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, provided = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(provided.strip(), token):
            return await self.app(scope, receive, send)
        scope["failure_reason"] = "unauthorized"
        response = error_response(
            401, "unauthorized", "missing or invalid bearer token", {"WWW-Authenticate": 'Bearer realm="encoder"'}, scope
        )
        await response(scope, receive, send)


class InFlightMiddleware:
    """Counts the inference requests inside this replica (waiting for a batch or in one) for /info
    and the tests. Serve itself holds a replica to max_ongoing_requests (routing elsewhere, queueing,
    then refusing with 503: service/http/ingress.py), so nothing past the limit reaches this far."""

    pending = 0  # inference requests admitted and not yet answered
    admitted = 0  # inference requests admitted since the replica started

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_inference(scope.get("method", ""), app_path(scope)):
            return await self.app(scope, receive, send)
        InFlightMiddleware.pending += 1
        InFlightMiddleware.admitted += 1
        try:
            await self.app(scope, receive, send)
        finally:
            InFlightMiddleware.pending -= 1


class BodyLimitMiddleware:
    """Refuse request bodies over the limit with 413, whether or not Content-Length is sent.

    The body is counted as it streams in and never buffered past the limit.
    """

    limit = 8 * 1024 * 1024

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = BodyLimitMiddleware.limit
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, limit)
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope["client_gone"] = True  # it left while uploading: nothing to answer
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
                                  scope=scope)
        await response(scope, receive, send)


def load_token(settings: ServiceSettings) -> bytes | None:
    """The API token: from the file named in the settings (a mounted secret), else from the
    environment variable named in the settings; None when neither is set (authentication off)."""
    if settings.auth_token_file is not None:
        token = settings.auth_token_file.read_text().strip()
        if not token:
            raise ValueError(f"{settings.auth_token_file}: the token file is empty")
        return token.encode()
    value = os.environ.get(settings.auth_token_env, "").strip()
    return value.encode() if value else None


def configure(settings: ServiceSettings) -> None:
    """Apply the settings to the middlewares of this replica."""
    from service.http.ingress import RayAnswersAsJson

    BodyLimitMiddleware.limit = settings.max_body_bytes
    MetricsMiddleware.behind_serve = serve_config_now() is not None
    enable_access_log(settings.access_log)
    RayAnswersAsJson.retry_after_s = settings.retry_after_s
    BearerAuthMiddleware.token = load_token(settings)
