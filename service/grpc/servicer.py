"""The gRPC transport: every API's gRPC methods (service/apis, `Api.grpc`), answered by the replica that
runs the model, through the same front as HTTP's requests.

Ray Serve's gRPC ingress calls a replica's method of the call's name with the request message and a
`grpc_context` (metadata in, status code, details and trailing metadata out), so each method is a
method of the deployment: `Encoder` inherits them from the class `grpc_methods()` builds. What gRPC adds
to the front is here:

- Each error is a status code a client can act on (service/front/errors.py GRPC_CODE): INVALID_ARGUMENT,
  NOT_FOUND, UNAUTHENTICATED, UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, INTERNAL, with the message in
  the details; RESOURCE_EXHAUSTED is Serve's own refusal when the replicas' slots and queue are full,
  and like a timeout it carries `retry-after` (seconds) in the trailing metadata.
- The client's gRPC deadline is the call's deadline, as X-Request-Timeout-Seconds is on HTTP (the
  service's request_timeout_s when it is shorter); a call cancelled, or past its deadline, is
  cancelled by gRPC and its job leaves the batch queue.
- Authentication: the bearer token in the `authorization` metadata on the methods an API declares
  inference, checked from the metadata before the message is read where the replica runs the gRPC
  server (service/grpc/serve_hooks.py), and again here (behind Serve's proxy actor).
- Request ids: Serve takes the client's `request_id` metadata or makes one, and sends it back in
  the trailing metadata; an id that fails the rule of every protocol (1-128 visible ASCII characters)
  is replaced by a fresh one there, and the access log line and the error details carry the same id.
- Metrics: the same families as HTTP, with protocol="grpc" and the call's full name as the route.
"""

from __future__ import annotations

import asyncio
from functools import cache
from typing import Any

import grpc

from service.apis import APIS
from service.engine.encoder_service import EncoderService
from service.engine.errors import ServiceError, Unauthorized
from service.front.call import Call
from service.front.errors import CLIENT_GONE, GRPC_CODE, RETRY_AFTER_KEY, status_of
from service.front.finish import finish
from service.front.gate import Gate
from service.front.policy import GrpcMethod, RoutePolicy
from service.front.quotas import Quotas, headers as limit_headers, limited
from service.front.request_ids import current_request_id, is_valid_request_id, new_request_id
from service.observability import tracing

REQUEST_ID_KEY = "request_id"  # metadata in (the client's) and trailing metadata out (the call's)
# status details travel in the trailers, whose size gRPC caps (8 KiB by default): what a client sent
# is shown in part (service/engine/engine.py, `shown`), and the whole message is cut past this
MAX_DETAILS_CHARS = 2000
NO_TOKEN = "missing or invalid bearer token in the `authorization` metadata"


def code_of(type_: str) -> grpc.StatusCode:
    return grpc.StatusCode[GRPC_CODE.get(type_, "INTERNAL")]


@cache
def grpc_policies() -> dict[str, RoutePolicy]:
    """Every declared gRPC method's policy, by full name (from the declarations alone)."""
    return {full: api.grpc_policy_of(full) for api in APIS for full in api.grpc_inference | api.grpc_open}


@cache
def grpc_services() -> tuple:
    """Every API's gRPC service, each method checked against its API's declaration."""
    services = []
    for api in APIS:
        if api.grpc is None:
            continue
        service = api.grpc_service()
        for name in service.methods:
            api.grpc_policy_of(service.path(name))
        services.append(service)
    return tuple(services)


def grpc_methods() -> type:
    """The class whose methods Serve calls by name: one per method of every API's gRPC service."""
    def method(full: str, handler: GrpcMethod):
        async def call(self, request: Any, grpc_context: Any = None) -> Any:
            return await answer(self.svc, full, handler, request, grpc_context)

        call.__name__ = call.__qualname__ = handler.name
        return call

    methods = {name: method(service.path(name), handler)
               for service in grpc_services() for name, handler in service.methods.items()}
    return type("GrpcMethods", (), {"__doc__": "Every API's gRPC methods (service/grpc/servicer.py).", **methods})


def call_of_context(full_name: str, context: Any) -> Call:
    """The call's record: its id, its route (the method's full name), the policy its API declared, and
    the client's deadline (service/grpc/serve_hooks.py keeps the time it had left when Serve got it)."""
    remaining = getattr(context, "encoder_time_remaining", None)
    return Call(_call_id(context), "grpc", "gRPC", path=full_name, route=full_name,
                policy=grpc_policies().get(full_name), asked_deadline_s=remaining,
                deadline_name="the call's gRPC deadline")


def metadata(context: Any, key: str) -> str | None:
    if context is None:
        return None
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v
    return None


async def answer(svc: EncoderService, full_name: str, method: GrpcMethod, request: Any, context: Any) -> Any:
    """Run one call: gate it, answer it, turn an error into its status code, and record it."""
    call = call_of_context(full_name, context)
    inference = call.policy is not None and call.policy.inference
    span = tracing.request_span(full_name, _trace_carrier(context), {
        "rpc.system": "grpc", "rpc.service": full_name.split("/")[1], "rpc.method": method.name,
        "encoder.request_id": call.id}) if tracing.enabled() else None
    id_token = current_request_id.set(call.id)
    status, code, reply = 500, grpc.StatusCode.INTERNAL, None
    Gate.enter(inference)
    try:
        if inference:
            call.key, refusal = Gate.identify(metadata(context, "authorization"))
            if refusal is not None:
                raise Unauthorized(NO_TOKEN)
            if limited(call.key):  # a key's limits, counted for the whole service
                await Quotas.admit(call)
        reply = await method.answer(svc, request, call)
        status, code = 200, grpc.StatusCode.OK
        return reply
    except ServiceError as exc:
        status, code = status_of(exc), code_of(exc.type)
        call.failure_reason = exc.type
        _refuse(context, code, exc, call)
        return method.response()  # Serve sends the code, not this empty message
    except asyncio.CancelledError:
        # gRPC cancels the call of a client that cancelled it or whose deadline passed
        timed_out = call.seconds_left(svc.settings.request_timeout_s) <= 0 or call.past_client_deadline()
        status, code = (503, grpc.StatusCode.DEADLINE_EXCEEDED) if timed_out else (CLIENT_GONE, grpc.StatusCode.CANCELLED)
        call.failure_reason = "timeout" if timed_out else "cancelled"
        raise
    finally:
        current_request_id.reset(id_token)
        Gate.leave(inference)
        Quotas.release_soon(call)  # the key's concurrent lease, if it holds one
        if call.limits and context is not None and code == grpc.StatusCode.OK:
            _set_trailing(context, call.id, limit_headers(call))
        _finish(call, status, code, reply, span)


def _finish(call: Call, status: int, code: grpc.StatusCode, reply: Any, span: Any = None) -> None:
    if code != grpc.StatusCode.OK:
        call.failed("backend")
    sent = reply.ByteSize() if reply is not None else 0
    finish(call, status, sent, span, call.route, {"rpc.grpc.status_code": code.value[0]}, grpc_status=code.name)


def _trace_carrier(context: Any) -> dict[str, str]:
    """The client's W3C trace context, from the call's metadata."""
    return {key: value for key in (tracing.TRACEPARENT, tracing.TRACESTATE) if (value := metadata(context, key))}


def _call_id(context: Any) -> str:
    """The call's one request id: the client's `request_id` metadata, or the one Serve made, where it
    passes the rule of every protocol; else a fresh one. Whichever it is goes back in the trailing
    metadata (in place of the one Serve put there)."""
    if context is None:
        return new_request_id()
    given = dict(context.trailing_metadata() or ()).get(REQUEST_ID_KEY)
    if given is None:  # no Serve in front (the interceptor's refusal): the client's metadata
        given = next((v for k, v in context.invocation_metadata() or () if k == REQUEST_ID_KEY), None)
    if isinstance(given, bytes):
        given = given.decode("latin-1")
    request_id = given if given is not None and is_valid_request_id(given) else new_request_id()
    if request_id != given:
        _set_trailing(context, request_id, [])
    return request_id


def _set_trailing(context: Any, request_id: str | None, pairs: list[tuple[str, str]]) -> None:
    """The trailing metadata: the call's request id, once, then `pairs`. Serve's context keeps the id
    it holds in front of whatever is set (RayServegRPCContext.set_trailing_metadata), so its list is
    written here instead, when it has one."""
    full = ([(REQUEST_ID_KEY, request_id)] if request_id else []) + pairs
    if isinstance(getattr(context, "_trailing_metadata", None), list):
        context._trailing_metadata = full
    else:
        context.set_trailing_metadata(full)


def _refuse(context: Any, code: grpc.StatusCode, exc: ServiceError, call: Call) -> None:
    if context is None:
        raise exc
    context.set_code(code)
    context.set_details(f"{exc.message[:MAX_DETAILS_CHARS]} (request id {current_request_id.get()})")
    _set_trailing(context, current_request_id.get(),
                  ([] if exc.retry_after_s is None else [(RETRY_AFTER_KEY, str(exc.retry_after_s))]) + limit_headers(call))


def needs_refusal(full_name: str, given: Any) -> bool:
    """Whether a call must be refused for its token from its metadata alone (serve_hooks'
    TokenBeforeMessage asks, before the message is read): an inference method's, without the token."""
    policy = grpc_policies().get(full_name)
    if policy is None or not policy.inference or Gate.keyring is None:
        return False
    pairs = [(k, v) for k, v in given or ()]
    return Gate.refusal(next((v for k, v in pairs if k == "authorization"), None)) is not None


def refusal_before_reading(full_name: str):
    """The handler of a call without the token, refused without reading its message (never iterated):
    counted, logged and answered as `answer` answers the same refusal after reading it."""
    async def refuse(request_iterator: Any, context: Any) -> Any:
        call = call_of_context(full_name, context)
        id_token = current_request_id.set(call.id)
        try:
            exc = Unauthorized(NO_TOKEN)
            call.failure_reason = exc.type
            _refuse(context, code_of(exc.type), exc, call)
            _finish(call, status_of(exc), code_of(exc.type), None)
        finally:
            current_request_id.reset(id_token)
        service = next(s for s in grpc_services() if full_name.startswith(f"/{s.name}/"))
        return service.methods[full_name.rsplit("/", 1)[1]].response()

    return refuse
