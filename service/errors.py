"""One error taxonomy and one mapping to HTTP: routes raise these, one handler renders them.

Every error body is {"error": {"type": ..., "message": ...}}; the type doubles as the
failure reason operators see in metrics.
"""

from __future__ import annotations

from service.responses import JSONResponse


class ServiceError(Exception):
    status: int = 500
    type: str = "backend"

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"type": self.type, "message": self.message}}


class InvalidRequest(ServiceError):
    status, type = 422, "validation"


class TooLarge(ServiceError):
    status, type = 413, "too_large"


class NotFound(ServiceError):
    status, type = 404, "not_found"


class Unauthorized(ServiceError):
    status, type = 401, "unauthorized"


class Timeout(ServiceError):
    """Past the request's deadline: 503 with Retry-After, as Triton answers a request whose queue
    timeout expired (UNAVAILABLE); 408 would say the client was too slow to send its request."""

    status, type = 503, "timeout"


class ClientGone(ServiceError):
    """The client closed the connection; nobody reads this answer (nginx's 499)."""

    status, type = 499, "cancelled"


class NotReady(ServiceError):
    status, type = 503, "not_ready"


class BackendError(ServiceError):
    status, type = 500, "backend"


def error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one JSON error body, `{"error": {"type", "message"}}`, with its status and headers."""
    return JSONResponse({"error": {"type": type_, "message": message}}, status_code=status, headers=headers)
