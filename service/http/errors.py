"""The one mapping from the engine's errors (service/engine/errors.py) to HTTP: a status per error
type, Retry-After where retrying helps, and the JSON error body: ours, `{"error": {"type", "message",
"request_id"}}`, except on the routes of protocols whose clients parse their own (ERROR_STYLES)."""

from __future__ import annotations

from service.engine.errors import ServiceError
from service.http.request_ids import current_request_id
from service.http.responses import JSONResponse

STATUS = {
    "bad_request": 400,
    "empty": 400,
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


# text-embeddings-inference's error types and statuses (its router's server.rs), which its clients read
# (Haystack's TEI ranker raises on `error_type`); kinds TEI does not have keep our status
TEI_ERRORS = {
    "validation": ("Validation", 422),
    "bad_request": ("Validation", 422),
    "empty": ("Empty", 400),
    "too_large": ("Validation", 413),
    "overloaded": ("Overloaded", 429),
    "timeout": ("Overloaded", 429),  # past its deadline in the queue: overloaded, worth a retry later
    "not_ready": ("Unhealthy", 503),
    "backend": ("Backend", 424),
}

# The routes whose clients parse another error body than ours (their app paths; routes/tei.py and
# routes/cohere.py): TEI's `{"error": message, "error_type"}`, Cohere's `{"id", "message"}`
ERROR_STYLES = {path: "tei" for path in ("/", "/embed", "/embed_all", "/rerank", "/predict", "/tokenize", "/decode")}
ERROR_STYLES.update({"/v2/embed": "cohere", "/v2/rerank": "cohere"})


def status_of(exc: ServiceError) -> int:
    return STATUS.get(exc.type, 500)


def app_path(scope: dict) -> str:
    """The request path inside the application (without a route prefix it is mounted under)."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def error_body(status: int, type_: str, message: str, request_id: str | None, path: str) -> tuple[int, dict]:
    """The status and body of an error on `path`: ours, `{"error": {"type", "message", "request_id"}}`, or
    TEI's or Cohere's on their routes (ERROR_STYLES). The id is the request's (X-Request-Id), so a
    client's complaint can be matched to its log line."""
    style = ERROR_STYLES.get(path)
    if style == "tei":
        tei_type, tei_status = TEI_ERRORS.get(type_, (type_.replace("_", " ").title().replace(" ", ""), status))
        return tei_status, {"error": message, "error_type": tei_type}
    if style == "cohere":
        return status, {"id": request_id, "message": message}
    error = {"type": type_, "message": message}
    if request_id is not None:
        error["request_id"] = request_id
    return status, {"error": error}


def error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None,
                   scope: dict | None = None) -> JSONResponse:
    """The JSON error answer (error_body) with its headers; `scope`: the request's, whose path picks the
    body's style."""
    status, body = error_body(status, type_, message, current_request_id.get(), app_path(scope) if scope else "")
    return JSONResponse(body, status_code=status, headers=headers)


def service_error_response(exc: ServiceError, scope: dict | None = None) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return error_response(status_of(exc), exc.type, exc.message, headers, scope)
