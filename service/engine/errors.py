"""Why a request cannot be served, as the engine says it: a type (which doubles as the failure
reason operators see in metrics) and a message. No protocol here: service/front/errors.py maps each
type to its status and renders `{"error": {"type", "message"}}`.
"""

from __future__ import annotations


class ServiceError(Exception):
    type: str = "backend"

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s  # worth retrying after this long (overload, deadline, not ready)


class InvalidRequest(ServiceError):
    type = "validation"


class BadRequest(ServiceError):
    """A request the model cannot serve as asked (a prompt it has not, a size it was not trained for):
    400, as OpenAI answers an unsupported `dimensions`."""

    type = "bad_request"


class EmptyInput(ServiceError):
    """Nothing to compute (an empty list of texts or documents) on the routes of protocols that answer
    it with its own status: TEI's 400 `Empty`. Our own routes refuse it in their schemas (422)."""

    type = "empty"


class TooLarge(ServiceError):
    type = "too_large"


class NotFound(ServiceError):
    type = "not_found"


class Unauthorized(ServiceError):
    type = "unauthorized"


class Forbidden(ServiceError):
    """A key that may not call this model (the keys file's `models`)."""

    type = "forbidden"


class Timeout(ServiceError):
    """Past the request's deadline; its work leaves the queue (never computed for nobody)."""

    type = "timeout"


class ClientGone(ServiceError):
    """The caller went away before the answer was ready."""

    type = "cancelled"


class NotReady(ServiceError):
    type = "not_ready"


class BackendError(ServiceError):
    type = "backend"
