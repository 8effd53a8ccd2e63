"""The error taxonomy: each of the engine's error types (service/engine/errors.py) as the HTTP status
and the gRPC status code a client acts on, the reason a failed call is counted under, and our JSON
error body. An API whose clients parse another body declares its own style (service/front/policy.py):
TEI's in service/apis/tei, Cohere's in service/apis/cohere.
"""

from __future__ import annotations

from collections.abc import Callable

from service.engine.errors import ServiceError

HTTP_STATUS = {
    "bad_request": 400,
    "empty": 400,
    "validation": 422,
    "too_large": 413,
    "not_found": 404,
    "unauthorized": 401,
    "forbidden": 403,
    # past the deadline: 503 with Retry-After, as Triton answers a request whose queue timeout
    # expired (UNAVAILABLE); 408 would say the client was too slow to send its request
    "timeout": 503,
    "cancelled": 499,  # the client closed the connection; nobody reads this answer (nginx's 499)
    "not_ready": 503,
    "overloaded": 503,
    "backend": 500,
    # a key past one of its limits (service/front/quotas.py): the type names the limit, as OpenAI's does
    "requests": 429,
    "tokens": 429,
    "concurrent": 429,
}
RATE_LIMIT_TYPES = frozenset({"requests", "tokens", "concurrent"})

# the gRPC status code of each error type (grpc.StatusCode's names; the gRPC transport looks them up)
GRPC_CODE = {
    "validation": "INVALID_ARGUMENT",
    "bad_request": "INVALID_ARGUMENT",
    "too_large": "INVALID_ARGUMENT",  # a smaller request fits; the same one never will
    "not_found": "NOT_FOUND",
    "unauthorized": "UNAUTHENTICATED",
    "forbidden": "PERMISSION_DENIED",
    "overloaded": "RESOURCE_EXHAUSTED",
    "timeout": "DEADLINE_EXCEEDED",
    "cancelled": "CANCELLED",
    "not_ready": "UNAVAILABLE",
    "backend": "INTERNAL",
    "requests": "RESOURCE_EXHAUSTED",
    "tokens": "RESOURCE_EXHAUSTED",
    "concurrent": "RESOURCE_EXHAUSTED",
}

# A call whose client left before it was answered: nginx's and Envoy's 499, never a 500 (metrics and
# the access log; nobody reads the answer).
CLIENT_GONE = 499
# Where a retry hint travels: HTTP's Retry-After header, gRPC's trailing metadata key (seconds)
RETRY_AFTER_KEY = "retry-after"

# The reason a failed call is counted under when nothing more precise was noted
REASON_BY_STATUS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 413: "too_large", 422: "validation",
                    429: "overloaded", 499: "cancelled", 503: "overloaded"}


def status_of(exc: ServiceError) -> int:
    return HTTP_STATUS.get(exc.type, 500)


# An API's error body: (status, error type, message, request id) -> (status, body). The status may
# change (TEI answers some types with its own).
ErrorStyle = Callable[[int, str, str, "str | None"], "tuple[int, dict]"]


def our_error_body(status: int, type_: str, message: str, request_id: str | None) -> tuple[int, dict]:
    """`{"error": {"type", "message", "request_id"}}`: the id is the call's, so a client's complaint can
    be matched to its log line."""
    error = {"type": type_, "message": message}
    if type_ in RATE_LIMIT_TYPES:
        error["code"] = "rate_limit_exceeded"  # OpenAI's: its SDK and clients read type and code
    if request_id is not None:
        error["request_id"] = request_id
    return status, {"error": error}


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}


def describe(errors: list[dict]) -> str:
    """Pydantic errors as one line: `field.path: problem`, the most specific first.

    Union branches (`inputs.str`, `inputs.list[str].1`) are folded into the field path the
    client wrote, and an error on a field is dropped when a deeper one explains it.
    """
    located = []
    for err in errors[:50]:  # a 100k-element body can carry 100k errors; describing 50 is plenty
        parts = [
            str(p) for p in err.get("loc", ())
            if p != "body" and not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p or p.startswith("function-")))
        ]
        located.append((parts, err.get("msg", "invalid")))
    located.sort(key=lambda item: -len(item[0]))
    kept: list[tuple[list[str], str]] = []
    for parts, msg in located:
        if any(k[: len(parts)] == parts for k, _ in kept) and parts != [] and any(len(k) > len(parts) for k, _ in kept):
            continue
        if (parts, msg) not in kept:
            kept.append((parts, msg))
    lines = [f"{'.'.join(parts) or 'body'}: {msg}" for parts, msg in kept[:3]]
    hidden = max(len(kept) - 3, 0) + max(len(errors) - 50, 0)
    more = f" (and {hidden} more)" if hidden else ""
    return "; ".join(lines) + more
