"""The one mapping from the engine's errors (service/engine/errors.py) to HTTP: a status per error
type, Retry-After where retrying helps, and the one JSON error body."""

from __future__ import annotations

from service.engine.errors import ServiceError
from service.http.request_ids import current_request_id
from service.http.responses import JSONResponse

STATUS = {
    "bad_request": 400,
    "validation": 422,
    "too_large": 413,
    "not_found": 404,
    "unauthorized": 401,
    # past the deadline: 503 with Retry-After, as Triton answers a request whose queue timeout
    # expired (UNAVAILABLE); 408 would say the client was too slow to send its request
    "timeout": 503,
    "cancelled": 499,  # the client closed the connection; nobody reads this answer (nginx's 499)
    "not_ready": 503,
    "overloaded": 503,
    "backend": 500,
}


def status_of(exc: ServiceError) -> int:
    return STATUS.get(exc.type, 500)


def error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one JSON error body, `{"error": {"type", "message", "request_id"}}`, with its status and headers;
    the id is the request's (X-Request-Id), so a client's complaint can be matched to its log line."""
    error = {"type": type_, "message": message}
    if (request_id := current_request_id.get()) is not None:
        error["request_id"] = request_id
    return JSONResponse({"error": error}, status_code=status, headers=headers)


def service_error_response(exc: ServiceError) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return error_response(status_of(exc), exc.type, exc.message, headers)
