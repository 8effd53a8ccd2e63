"""OpenAI's Batch API: POST/GET/DELETE /v1/files, POST/GET /v1/batches, POST /v1/batches/{id}/cancel
(routes.py), so that the `openai` SDK's `client.files` and `client.batches` work unchanged. Files and
batches live in settings.jobs_dir (store.py); a batch's lines are run by runner.py beside the online
requests, and answered as the routes they name answer. Every route needs the key (a key sees only its own
files and batches), so all are declared keyed routes: the gate refuses a request without it before its body is
read (an upload included), and none counts against the key's limits per minute or concurrent requests (the
Batch API's own quotas bound them: files, bytes, unfinished batches, uploads at once); a batch's lines do, each
as a request of the key (runner.py). Errors are OpenAI's (below), as the SDK and code written against OpenAI
read them.
"""

from service.front.errors import RATE_LIMIT_TYPES
from service.front.policy import Api


def openai_error_body(status: int, type_: str, message: str, request_id: str | None) -> tuple[int, dict]:
    """OpenAI's `{"error": {"message", "type", "param", "code"}}`: `type` its category (invalid_request_error for
    a client's mistake, authentication_error, rate_limit_error, server_error), `code` ours (service/front/errors.py:
    not_found, too_large, bad_request, validation, ...); our statuses. The request id is in X-Request-Id."""
    if status == 401:
        category = "authentication_error"
    elif status == 429:
        category = "rate_limit_error"
    elif status >= 500:
        category = "server_error"
    else:
        category = "invalid_request_error"
    if type_ in RATE_LIMIT_TYPES:  # OpenAI's own rate-limit body: type the limit, code rate_limit_exceeded
        return status, {"error": {"message": message, "type": type_, "param": None, "code": "rate_limit_exceeded"}}
    return status, {"error": {"message": message, "type": category, "param": None, "code": type_}}


API = Api(
    name="openai_batch",
    routes=("service.apis.openai_batch.routes",),
    keyed=frozenset({
        "POST /v1/files", "GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content", "DELETE /v1/files/{file_id}",
        "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{batch_id}", "POST /v1/batches/{batch_id}/cancel",
    }),
    error_style=openai_error_body,
)

UPLOAD_PATH = "/v1/files"


def body_limits(max_body_bytes: int, batch_max_file_bytes: int) -> dict[str, int]:
    """The body limit of the upload route (the file's limit plus what multipart adds), where it exceeds the
    service's body limit; the route itself reads the body as it streams in and counts it exactly
    (STREAMED_PATHS: the body-limit middleware does not buffer it)."""
    from service.apis.openai_batch.uploads import UPLOAD_ALLOWANCE

    return {UPLOAD_PATH: max(max_body_bytes, batch_max_file_bytes + UPLOAD_ALLOWANCE)}


# The routes that read and bound their body themselves as it streams in: the body-limit middleware refuses a
# declared Content-Length over their limit, and passes the rest through unbuffered
STREAMED_PATHS = frozenset({UPLOAD_PATH})
