"""Errors as HTTP answers: the status of each error type (service/front/errors.py), Retry-After where
retrying helps, and the JSON body in the style the route's API declared (ours, TEI's, Cohere's)."""

from __future__ import annotations

from service.engine.errors import ServiceError
from service.front.call import Call
from service.front.errors import our_error_body, status_of
from service.front.request_ids import current_request_id
from service.front.responses import JSONResponse


def error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None,
                   call: Call | None = None) -> JSONResponse:
    """The JSON error answer with its headers, in the style of the call's route (ours without one). The
    id is the call's (X-Request-Id), so a client's complaint can be matched to its log line."""
    style = call.policy.error_style if call is not None and call.policy is not None else our_error_body
    status, body = style(status, type_, message, current_request_id.get())
    return JSONResponse(body, status_code=status, headers=headers)


def service_error_response(exc: ServiceError, call: Call | None = None) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None
    return error_response(status_of(exc), exc.type, exc.message, headers, call)
