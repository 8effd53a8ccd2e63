"""The HTTP transport's app: FastAPI with every API's routes mounted (service/apis), its two
middlewares (service/http/middleware.py), and every failure (ours, FastAPI's validation, unknown
routes, anything unexpected) answered as a JSON error body in the style of the route's API.

The app is built when this module is imported, and checks then that every route it mounts is declared
by its API (inference or open, service/front/policy.py) and that every declared route is mounted: a
route without a policy stops the replica from starting.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from service import __doc__ as service_doc
from service.apis import APIS, openai_batch
from service.config import ServiceSettings
from service.engine.errors import ServiceError
from service.front.deps import call_of, note_route
from service.front.errors import describe
from service.front.finish import enable_access_log
from service.front.identity import SERVER_VERSION
from service.front.policy import Api, UndeclaredRoute
from service.front.replica import serve_config_now
from service.front.responses import JSONResponse
from service.http.errors import error_response, service_error_response
from service.http.ingress import RayAnswersAsJson
from service.http.middleware import BodyLimitMiddleware, CallMiddleware

logger = logging.getLogger("ray.serve")

# FastAPI's own pages: the OpenAPI document and the docs that read it, open to anyone
DOCS = Api(name="docs", routes=(), open=frozenset({"GET /openapi.json", "GET /docs", "GET /docs/oauth2-redirect",
                                                    "GET /redoc"}))


def _failed(request: Request, reason: str) -> None:
    """Note why this request failed, and on which route."""
    note_route(request)
    call_of(request).failure_reason = reason


def build_app(apis: tuple[Api, ...] = APIS) -> FastAPI:
    """The FastAPI app with every API's routes, checked against their declarations. The routes join the
    app's own list, in the order of the APIs (the hot ones first: Starlette tries them in order), not as
    included routers, which FastAPI matches lazily at about 30 us more per request."""
    app = FastAPI(title="MHA encoder service", version=SERVER_VERSION, description=service_doc,
                  default_response_class=JSONResponse)
    for api in apis:
        for router in api.routers():
            app.router.routes.extend(router.routes)
    check_declared(app, (*apis, DOCS))
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(CallMiddleware)  # added last: outermost, so it sees every refusal too
    _handle_errors(app)
    return app


def check_declared(app: FastAPI, apis: tuple[Api, ...]) -> None:
    """Every mounted route has exactly one declaration (inference or open), and every declaration is a
    mounted route; else the app does not start (UndeclaredRoute names the route)."""
    declared = {key: api for api in apis for key in api.declared}
    mounted = {f"{method} {route.path}" for route in app.routes if isinstance(route, Route)
               for method in (route.methods or ()) if method != "HEAD"}
    for key in sorted(mounted - declared.keys()):
        raise UndeclaredRoute(f"route {key} is mounted but no API declares it inference or open")
    for key in sorted(declared.keys() - mounted):
        raise UndeclaredRoute(f"API {declared[key].name!r} declares {key}, which no route serves")
    for key, api in declared.items():
        method, _, path = key.partition(" ")
        api.policy_of(method, path)  # declared once: not both inference and open


def _handle_errors(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        _failed(request, exc.type)
        return service_error_response(exc, call_of(request))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        _failed(request, "validation")
        call = call_of(request)
        errors = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(422, "validation", "request body is not valid JSON "
                                  f"({errors[0].get('ctx', {}).get('error', 'decode error')})", call=call)
        content_type = request.headers.get("content-type", "")
        if "json" not in content_type and any(tuple(e.get("loc", ())) == ("body",) for e in errors):
            return error_response(
                422, "validation", "request body must be a JSON object sent with Content-Type: application/json "
                f"(got {content_type or 'none'!r})", call=call)
        return error_response(422, "validation", describe(errors), call=call)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
        _failed(request, "not_found" if exc.status_code == 404 else "validation")
        return error_response(exc.status_code, type_, str(exc.detail), getattr(exc, "headers", None), call_of(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, RecursionError):  # absurdly nested JSON
            _failed(request, "validation")
            return error_response(422, "validation", "request body is nested too deeply", call=call_of(request))
        _failed(request, "backend")
        logger.exception("unexpected error")
        return error_response(500, "backend", f"internal error ({type(exc).__name__})", call=call_of(request))


def configure(settings: ServiceSettings) -> None:
    """Apply the settings to the HTTP transport of this replica."""
    BodyLimitMiddleware.limit = settings.max_body_bytes
    BodyLimitMiddleware.path_limits = openai_batch.body_limits(settings.max_body_bytes, settings.batch_max_file_bytes)
    BodyLimitMiddleware.streamed = openai_batch.STREAMED_PATHS
    CallMiddleware.behind_serve = serve_config_now() is not None
    enable_access_log(settings.access_log)
    RayAnswersAsJson.retry_after_s = settings.retry_after_s


app = build_app()
