"""Request ids: the X-Request-Id a client sent, or one made for it, on every answer and log line.

Ray Serve's ingress (its proxy's and each replica's RequestIdMiddleware, and HAProxy's `unique-id`)
already puts an `x-request-id` into the request's headers when the client sent none, and echoes it in
the response's headers; the service reads that id, puts it in its JSON error bodies, its access log
line and its span, and echoes it itself only where no Serve ingress stands in front (plain uvicorn,
tests). So that Serve's echo and ours are the same id, service/http/ingress.py (before Serve's code)
keeps the first id a request came with when it passes the rule below and drops every other, and Serve
then makes one where none is left.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from contextvars import ContextVar

REQUEST_ID_HEADER = "x-request-id"
# what a client's id may be: 1-128 visible ASCII characters (Envoy's and nginx's ids are 32-36);
# anything else is replaced by one made here, never echoed into a header or a log line as it came
MAX_REQUEST_ID_CHARS = 128
_VALID = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID_CHARS)
_REQUEST_ID_NAME = REQUEST_ID_HEADER.encode()

# the id of the request this task serves: what error bodies carry (service/http/errors.py)
current_request_id: ContextVar[str | None] = ContextVar("request_id", default=None)

access_logger = logging.getLogger("service.access")


def is_valid_request_id(value: str | bytes) -> bool:
    """Whether a client's id may be used as the request's (the rule of every protocol): 1-128 visible
    ASCII characters."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return _VALID.fullmatch(value) is not None


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The id the request came with (from the client or Serve's ingress; of several, the first, as
    Serve echoes), else a new one."""
    raw = next((v for k, v in headers if k.lower() == _REQUEST_ID_NAME), None)
    if raw is not None and is_valid_request_id(raw):
        return raw.decode("ascii")
    return uuid.uuid4().hex


def enable_access_log(enabled: bool) -> None:
    """One JSON line per request on stderr (the replica's log), or none. Its own handler: Ray's
    loggers and the root logger's level leave it alone."""
    access_logger.propagate = False
    access_logger.setLevel(logging.INFO if enabled else logging.CRITICAL + 1)
    if enabled and not access_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_logger.addHandler(handler)


def log_access(scope: dict, status: int, started: float, now: float) -> None:
    """The access log line of one request: time (UTC), id, method (`gRPC` for a gRPC call), route
    template (a gRPC call's full method name), model, status (a gRPC call's as HTTP would answer it,
    beside its `grpc_status`), texts and tokens that reached inference, and milliseconds."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    access_logger.info(json.dumps({
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
        "id": scope.get("request_id"),
        "method": scope.get("method"),
        "route": scope.get("route_template", "unmatched"),
        "model": scope.get("model") or None,
        "status": status,
        "texts": scope.get("texts", 0),
        "tokens": scope.get("tokens", 0),
        "ms": round((now - started) * 1000, 1),
        **({"grpc_status": scope["grpc_status"]} if "grpc_status" in scope else {}),
    }, separators=(",", ":")))
