"""The headers the HTTP transport reads, and how: the request id (X-Request-Id), the client's own
deadline (X-Request-Timeout-Seconds), and the mark service/http/ingress.py leaves on headers Serve
could not have decoded.

Ray Serve's ingress (its proxy's and each replica's RequestIdMiddleware, and HAProxy's `unique-id`)
already puts an `x-request-id` into the request's headers when the client sent none, and echoes it in
the response's headers; the service reads that id, puts it in its JSON error bodies, its access log
line and its span, and echoes it itself only where no Serve ingress stands in front (plain uvicorn,
tests). So that Serve's echo and ours are the same id, service/http/ingress.py (before Serve's code)
keeps the first id a request came with when it passes the rule (service/front/request_ids.py) and
drops every other, and Serve then makes one where none is left.
"""

from __future__ import annotations

from service.front.request_ids import is_valid_request_id, new_request_id

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_NAME = REQUEST_ID_HEADER.encode()
# A client's own deadline, in seconds (the header Ray Serve also reads, and answers 408 on).
TIMEOUT_HEADER = "x-request-timeout-seconds"
_TIMEOUT_NAME = TIMEOUT_HEADER.encode()
# Headers Serve could not have decoded (not UTF-8), named by service/http/ingress.py, which took them out
# before Serve's code ran: the request is refused by the middleware, with an id, a log line and metrics.
UNREADABLE_HEADER = "x-encoder-unreadable-headers"
# A caller that asks for less: `batch` puts its work behind interactive work in the batch queue (the Batch API's
# runner sends it). It never raises a call above its key's priority.
PRIORITY_HEADER = "x-encoder-priority"


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The id the request came with (from the client or Serve's ingress; of several, the first, as
    Serve echoes), else a new one."""
    raw = next((v for k, v in headers if k.lower() == _REQUEST_ID_NAME), None)
    if raw is not None and is_valid_request_id(raw):
        return raw.decode("ascii")
    return new_request_id()


def timeout_header(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The client's X-Request-Timeout-Seconds as it was sent, None without it."""
    raw = next((v for k, v in headers if k == _TIMEOUT_NAME), None)
    return None if raw is None else raw.decode("latin-1")


def asked_deadline_s(text: str | None) -> float | None:
    """A deadline header as a number of seconds (NaN when it is not one), None without it."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        return float("nan")


def app_path(scope: dict) -> str:
    """The request path inside the application (without a route prefix it is mounted under)."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path
