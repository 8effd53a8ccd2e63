"""The FastAPI app every route module adds to, its middlewares, and the one mapping from failures
to JSON error bodies.

Routes raise `service.engine.errors` exceptions; the handlers here turn every failure (ours, FastAPI's
validation, unknown routes, anything unexpected) into `{"error": {"type", "message"}}`.
"""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service import __doc__ as service_doc
from service.engine.errors import ServiceError
from service.http.errors import error_response, service_error_response
from service.http.middleware import InFlightMiddleware, BearerAuthMiddleware, BodyLimitMiddleware, MetricsMiddleware
from service.http.responses import JSONResponse
from service.http.schemas import ErrorResponse

logger = logging.getLogger("ray.serve")

SERVER_NAME = "mha-encoder-serving"
SERVER_VERSION = "0.1.0"
ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (401, 404, 413, 422, 429, 503)}


def _set_route_template(scope: dict) -> None:
    """Tell the metrics middleware which route template served the request (the scope dict is
    shared with it): templates, not paths, so label values stay few."""
    route = scope.get("route")
    if route is not None:
        scope["route_template"] = getattr(route, "path", "unmatched")


async def record_route(request: Request) -> None:
    """An app-wide dependency that sets the route template. Async: FastAPI runs a plain `def`
    dependency in a thread pool, a thread hop per request."""
    _set_route_template(request.scope)


app = FastAPI(
    title="MHA encoder service",
    version=SERVER_VERSION,
    description=service_doc,
    default_response_class=JSONResponse,
    dependencies=[Depends(record_route)],
)

app.add_middleware(BodyLimitMiddleware)
app.add_middleware(InFlightMiddleware)
app.add_middleware(BearerAuthMiddleware)
app.add_middleware(MetricsMiddleware)  # added last: outermost, so it sees every refusal too


def _failed(request: Request, reason: str) -> None:
    """Tell the metrics middleware why this request failed, and on which route."""
    _set_route_template(request.scope)
    request.scope["failure_reason"] = reason


@app.exception_handler(ServiceError)
async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    _failed(request, exc.type)
    return service_error_response(exc, request.scope)


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


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    _failed(request, "validation")
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(422, "validation", f"request body is not valid JSON ({errors[0].get('ctx', {}).get('error', 'decode error')})",
                              scope=request.scope)
    content_type = request.headers.get("content-type", "")
    if "json" not in content_type and any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return error_response(
            422, "validation", f"request body must be a JSON object sent with Content-Type: application/json (got {content_type or 'none'!r})",
            scope=request.scope)
    return error_response(422, "validation", describe(errors), scope=request.scope)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
    _failed(request, "not_found" if exc.status_code == 404 else "validation")
    return error_response(exc.status_code, type_, str(exc.detail), getattr(exc, "headers", None), request.scope)


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, RecursionError):  # absurdly nested JSON
        _failed(request, "validation")
        return error_response(422, "validation", "request body is nested too deeply", scope=request.scope)
    _failed(request, "backend")
    logger.exception("unexpected error")
    return error_response(500, "backend", f"internal error ({type(exc).__name__})", scope=request.scope)
