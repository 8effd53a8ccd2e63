"""The KServe v2 gRPC calls, answered by the replica that runs the model, as HTTP's v2 routes are.

Ray Serve's gRPC ingress calls a replica's method of the call's name with the request message and a
`grpc_context` (metadata in, status code, details and trailing metadata out), so the six calls are
methods of the deployment: `Encoder` inherits them from `KServeGrpc`. A call is read into the v2
request HTTP reads (`V2InferRequest`, with the raw input contents as the binary tail) and runs through
the same code (service/http/routes/v2.py: `v2_run`): the same models, inputs, outputs, limits and
errors. What gRPC adds is here:

- Each error is a status code a client can act on (GRPC_CODES): INVALID_ARGUMENT, NOT_FOUND,
  UNAUTHENTICATED, UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, INTERNAL, with the message in the
  details; RESOURCE_EXHAUSTED is Serve's own refusal when the replicas' slots and queue are full,
  and like a timeout it carries `retry-after` (seconds) in the trailing metadata.
- The client's gRPC deadline is the request's deadline, as X-Request-Timeout-Seconds is on HTTP
  (the service's request_timeout_s when it is shorter); a call cancelled, or past its deadline, is
  cancelled by gRPC and its job leaves the batch queue.
- Authentication: the bearer token in the `authorization` metadata on ModelInfer when auth is on,
  checked from the metadata before the message is read where the replica runs the gRPC server
  (service/grpc/serve_hooks.py), and again here (behind Serve's proxy actor).
- Request ids: Serve takes the client's `request_id` metadata or makes one, and sends it back in
  the trailing metadata; an id that fails HTTP's rule for X-Request-Id (1-128 visible ASCII
  characters) is replaced by a fresh one there, and the access log line and the error details
  carry the same id.
- Metrics: the same families as HTTP, with protocol="grpc" and the call's full name as the route.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from pydantic import ValidationError

from service.engine.engine import shown
from service.engine.errors import InvalidRequest, ServiceError, Unauthorized
from service.engine.runner import EncodeJob, EncodeResult
from service.engine.encoder_service import EncoderService
from service.observability import tracing
from service.grpc.protocol import METHODS, SERVICE, messages, method_path
from service.http.app import SERVER_NAME, SERVER_VERSION, describe
from service.http.context import count
from service.http.errors import status_of
from service.http.middleware import HEADER_DEADLINE_MARGIN_S, BearerAuthMiddleware, InFlightMiddleware, MetricsMiddleware
from service.http.request_ids import current_request_id, is_valid_request_id, log_access
from service.http.routes.v2 import (
    V2_DATATYPES, V2_EXTENSIONS, V2_KINDS, V2Call, declared_count, select_outputs, v2_head, v2_model_metadata, v2_run,
)
from service.http.schemas import V2InferRequest
from service.observability.metrics import service_metrics, status_class

# our error type -> the status code a gRPC client acts on (service/engine/errors.py names the types)
GRPC_CODES = {
    "validation": grpc.StatusCode.INVALID_ARGUMENT,
    "bad_request": grpc.StatusCode.INVALID_ARGUMENT,
    "too_large": grpc.StatusCode.INVALID_ARGUMENT,  # a smaller request fits; the same one never will
    "not_found": grpc.StatusCode.NOT_FOUND,
    "unauthorized": grpc.StatusCode.UNAUTHENTICATED,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "cancelled": grpc.StatusCode.CANCELLED,
    "not_ready": grpc.StatusCode.UNAVAILABLE,
    "backend": grpc.StatusCode.INTERNAL,
}
RETRY_AFTER_KEY = "retry-after"  # trailing metadata: seconds after which the same call may succeed
REQUEST_ID_KEY = "request_id"  # metadata in (the client's) and trailing metadata out (the call's)
CLIENT_GONE = 499  # the access log's and metrics' status of a call the client cancelled (as on HTTP)
# status details travel in the trailers, whose size gRPC caps (8 KiB by default): what a client sent
# is shown in part (service/engine/engine.py, `shown`), and the whole message is cut past this
MAX_DETAILS_CHARS = 2000


class KServeGrpc:
    """The calls of `inference.GRPCInferenceService` (service/grpc/kserve_v2.proto), each a method
    Serve calls by the call's name. `svc` is the replica's EncoderService."""

    svc: EncoderService

    async def ServerLive(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802 - the protocol's names
        return await _answer(self.svc, "ServerLive", grpc_context, lambda call: _live())

    async def ServerReady(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        return await _answer(self.svc, "ServerReady", grpc_context, lambda call: _ready(self.svc))

    async def ModelReady(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        return await _answer(self.svc, "ModelReady", grpc_context, lambda call: _model_ready(self.svc, request, call))

    async def ServerMetadata(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        return await _answer(self.svc, "ServerMetadata", grpc_context, lambda call: _server_metadata())

    async def ModelMetadata(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        return await _answer(self.svc, "ModelMetadata", grpc_context, lambda call: _model_metadata(self.svc, request, call))

    async def ModelInfer(self, request: Any, grpc_context: Any = None) -> Any:  # noqa: N802
        return await _answer(self.svc, "ModelInfer", grpc_context, lambda call: _infer(self.svc, request, call),
                             inference=True)


class GrpcCall:
    """One call in progress: what the access log, the metrics and the deadline need (HTTP keeps the
    same in its ASGI scope, and log_access reads it from this dict)."""

    def __init__(self, method: str, context: Any) -> None:
        self.arrived = time.perf_counter()
        self.context = context
        self.scope: dict[str, Any] = {
            "method": "gRPC", "route_template": method_path(method), "arrived": self.arrived,
            "request_id": _call_id(context),
        }
        remaining = getattr(context, "encoder_time_remaining", None)  # service/grpc/serve_hooks.py keeps it
        self.client_deadline = None if remaining is None else self.arrived + remaining

    def metadata(self, key: str) -> str | None:
        if self.context is None:
            return None
        for k, v in self.context.invocation_metadata():
            if k == key:
                return v
        return None

    def deadline(self, svc: EncoderService) -> float:
        """Seconds this call has left: the client's gRPC deadline, or the service's limit when that is
        shorter, counted from arrival."""
        now = time.perf_counter()
        left = svc.settings.request_timeout_s - (now - self.arrived)
        if self.client_deadline is not None:
            left = min(left, self.client_deadline - now)
        return max(left, 0.001)

    def past_deadline(self, svc: EncoderService) -> bool:
        """Whether the call's deadline has passed (within the margin HTTP allows Serve's clock)."""
        return self.deadline(svc) <= HEADER_DEADLINE_MARGIN_S


async def _answer(svc: EncoderService, method: str, context: Any, work: Callable[[GrpcCall], Awaitable[Any]],
                  inference: bool = False) -> Any:
    """Run one call's work; count it, trace it, log it, and turn an error into its status code."""
    call = GrpcCall(method, context)
    traced = tracing.request_span(call.scope["route_template"], _trace_carrier(call), {
        "rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method,
        "encoder.request_id": call.scope["request_id"]}) if tracing.enabled() else None
    id_token = current_request_id.set(call.scope["request_id"])
    metrics = service_metrics()
    status, code, reply = 500, grpc.StatusCode.INTERNAL, None
    MetricsMiddleware.in_flight += 1
    if inference:
        InFlightMiddleware.pending += 1
        InFlightMiddleware.admitted += 1
    try:
        if inference:
            _authenticate(call)
        reply = await work(call)
        status, code = 200, grpc.StatusCode.OK
        return reply
    except ServiceError as exc:
        status, code = status_of(exc), GRPC_CODES.get(exc.type, grpc.StatusCode.INTERNAL)
        call.scope["failure_reason"] = exc.type
        _refuse(context, code, exc)
        return getattr(messages(), METHODS[method][1])()  # Serve sends the code, not this empty message
    except asyncio.CancelledError:
        # gRPC cancels the call of a client that cancelled it or whose deadline passed
        timed_out = call.past_deadline(svc)
        status, code = (503, grpc.StatusCode.DEADLINE_EXCEEDED) if timed_out else (CLIENT_GONE, grpc.StatusCode.CANCELLED)
        call.scope["failure_reason"] = "timeout" if timed_out else "cancelled"
        raise
    finally:
        current_request_id.reset(id_token)
        MetricsMiddleware.in_flight -= 1
        if inference:
            InFlightMiddleware.pending -= 1
        _record(metrics, call, status, code, reply)
        if traced is not None:
            scope = call.scope
            traced.finish(scope["route_template"], status, {
                "rpc.grpc.status_code": code.value[0], "encoder.model": scope.get("model"),
                "encoder.texts": scope.get("texts", 0), "encoder.tokens": scope.get("tokens", 0)})


def _trace_carrier(call: GrpcCall) -> dict[str, str]:
    """The client's W3C trace context, from the call's metadata."""
    return {key: value for key in (tracing.TRACEPARENT, tracing.TRACESTATE) if (value := call.metadata(key))}


def _call_id(context: Any) -> str:
    """The call's one request id: the client's `request_id` metadata, or the one Serve made, where it
    passes HTTP's rule for X-Request-Id; else a fresh one. Whichever it is goes back in the trailing
    metadata (in place of the one Serve put there)."""
    if context is None:
        return uuid.uuid4().hex
    given = dict(context.trailing_metadata() or ()).get(REQUEST_ID_KEY)
    if given is None:  # no Serve in front (the interceptor's refusal): the client's metadata
        given = next((v for k, v in context.invocation_metadata() or () if k == REQUEST_ID_KEY), None)
    if isinstance(given, bytes):
        given = given.decode("latin-1")
    request_id = given if given is not None and is_valid_request_id(given) else uuid.uuid4().hex
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


def _refuse(context: Any, code: grpc.StatusCode, exc: ServiceError) -> None:
    if context is None:
        raise exc
    context.set_code(code)
    context.set_details(f"{exc.message[:MAX_DETAILS_CHARS]} (request id {current_request_id.get()})")
    _set_trailing(context, current_request_id.get(),
                  [] if exc.retry_after_s is None else [(RETRY_AFTER_KEY, str(exc.retry_after_s))])


def _token_refusal(lookup: Callable[[str], str | None]) -> Unauthorized | None:
    """The refusal of a call whose `authorization` metadata lacks the bearer token (compared in
    constant time), when auth is on; None when the call may go on."""
    token = BearerAuthMiddleware.token
    if token is None:
        return None
    scheme, _, provided = (lookup("authorization") or "").partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(provided.strip().encode(), token)):
        return Unauthorized("missing or invalid bearer token in the `authorization` metadata")
    return None


def _authenticate(call: GrpcCall) -> None:
    refusal = _token_refusal(call.metadata)
    if refusal is not None:
        raise refusal


def needs_refusal(method: str, metadata: Any) -> bool:
    """Whether a call is a ModelInfer that must be refused for its token, from its metadata alone
    (serve_hooks.TokenBeforeMessage asks, before the message is read)."""
    if method != method_path("ModelInfer") or BearerAuthMiddleware.token is None:
        return False
    pairs = [(k, v) for k, v in metadata or ()]
    return _token_refusal(lambda key: next((v for k, v in pairs if k == key), None)) is not None


async def refuse_before_reading(request_iterator: Any, context: Any) -> Any:
    """ModelInfer without the token, refused without reading its message (never iterated): counted,
    logged and answered as `_answer` answers the same refusal after reading it."""
    call = GrpcCall("ModelInfer", context)
    id_token = current_request_id.set(call.scope["request_id"])
    try:
        exc = _token_refusal(call.metadata) or Unauthorized("missing or invalid bearer token")
        call.scope["failure_reason"] = exc.type
        _refuse(context, GRPC_CODES[exc.type], exc)
        _record(service_metrics(), call, status_of(exc), GRPC_CODES[exc.type], None)
    finally:
        current_request_id.reset(id_token)
    return messages().ModelInferResponse()


def _record(metrics: Any, call: GrpcCall, status: int, code: grpc.StatusCode, reply: Any) -> None:
    scope, route = call.scope, call.scope["route_template"]
    model, task = scope.get("model", ""), scope.get("task", "")
    tags = {"route": route, "model": model, "task": task, "protocol": "grpc"}
    metrics.in_flight.set(MetricsMiddleware.in_flight)
    metrics.requests.inc(tags={**tags, "status_class": status_class(status)})
    metrics.duration.observe(time.perf_counter() - call.arrived, tags={**tags, "stage": "total"})
    if code != grpc.StatusCode.OK:
        metrics.failures.inc(tags={**tags, "reason": scope.get("failure_reason", "backend")})
    for kind, n in (scope.get("response_kinds") or {}).items():
        metrics.response_bytes.inc(n, tags={"route": route, "kind": kind, "model": model, "protocol": "grpc"})
    other = (reply.ByteSize() if reply is not None else 0) - sum((scope.get("response_kinds") or {}).values())
    if other > 0:
        metrics.response_bytes.inc(other, tags={"route": route, "kind": "other", "model": model, "protocol": "grpc"})
    scope["grpc_status"] = code.name
    log_access(scope, status, call.arrived, time.perf_counter())


# ---- the calls ----


async def _live() -> Any:
    return messages().ServerLiveResponse(live=True)


async def _ready(svc: EncoderService) -> Any:
    try:
        svc.check_ready()
    except ServiceError:
        return messages().ServerReadyResponse(ready=False)
    return messages().ServerReadyResponse(ready=True)


def _engine(svc: EncoderService, name: str, call: GrpcCall):
    """The model a call names (NOT_FOUND naming the served ones); an empty name is the default model."""
    engine = svc.engines.get(name or None, False)
    call.scope["model"], call.scope["task"] = engine.name, engine.model.task
    return engine


async def _model_ready(svc: EncoderService, request: Any, call: GrpcCall) -> Any:
    _engine(svc, request.name, call)
    return await _ready(svc)


async def _server_metadata() -> Any:
    return messages().ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=V2_EXTENSIONS)


async def _model_metadata(svc: EncoderService, request: Any, call: GrpcCall) -> Any:
    described = v2_model_metadata(_engine(svc, request.name, call))
    m = messages()
    tensors = m.ModelMetadataResponse.TensorMetadata
    return m.ModelMetadataResponse(
        name=described["name"], versions=described["versions"], platform=described["platform"],
        inputs=[tensors(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in described["inputs"]],
        outputs=[tensors(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in described["outputs"]],
    )


async def _infer(svc: EncoderService, request: Any, call: GrpcCall) -> Any:
    engine = _engine(svc, request.model_name, call)
    req, binary = v2_request(request, svc.settings.max_inputs)
    outputs = select_outputs(req, engine.model.task)
    route = call.scope["route_template"]

    async def run(job: EncodeJob) -> EncodeResult:
        count(call.scope, [job])
        return await svc.infer(engine, job, call.deadline(svc))

    ran = await v2_run(svc, engine, req, binary, outputs, V2Call(route, run))

    def build() -> Any:
        with tracing.span("serialize"):
            return _response(v2_head(engine, req), ran.tensors(), call)

    return build() if ran.estimate <= _OFF_LOOP_BYTES else await asyncio.to_thread(build)


_OFF_LOOP_BYTES = 1 << 20
MAX_V2_INPUTS, MAX_V2_OUTPUTS = 8, 16  # as V2InferRequest allows: checked before the tensors are read


def v2_request(request: Any, max_inputs: int) -> tuple[V2InferRequest, bytes]:
    """A ModelInferRequest as the v2 request HTTP reads: raw input contents become the binary tail
    (each input `binary_data_size` bytes of it), `bytes_contents` the input's data. Counts come
    first: each input's shape against the limit and its `bytes_contents` against its shape (a
    length, read without touching an element) before any element is copied."""
    if len(request.inputs) > MAX_V2_INPUTS or len(request.outputs) > MAX_V2_OUTPUTS:
        raise InvalidRequest(f"{len(request.inputs)} inputs and {len(request.outputs)} outputs; at most "
                             f"{MAX_V2_INPUTS} and {MAX_V2_OUTPUTS}")
    raw = request.raw_input_contents
    if len(raw) and len(raw) != len(request.inputs):
        raise InvalidRequest(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs: one each, in order")
    inputs = []
    for i, tensor in enumerate(request.inputs):
        count = declared_count(tensor.name, tensor.datatype, tensor.shape, max_inputs)
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                                 "parameters": parameters(tensor.parameters)}
        if len(raw):
            if tensor.HasField("contents"):
                raise InvalidRequest(f"input {shown(tensor.name)} has contents while raw_input_contents is given: "
                                     "one or the other")
            entry["parameters"]["binary_data_size"] = len(raw[i])
        else:
            given = len(tensor.contents.bytes_contents)
            if given != count:
                raise InvalidRequest(f"input {shown(tensor.name)} has shape {shown(list(tensor.shape))} but {given} elements")
            entry["data"] = list(tensor.contents.bytes_contents)
        inputs.append(entry)
    body = {"id": request.id or None, "parameters": parameters(request.parameters), "inputs": inputs,
            "outputs": [{"name": o.name, "parameters": parameters(o.parameters)} for o in request.outputs] or None}
    try:
        return V2InferRequest.model_validate(body), b"".join(raw)
    except ValidationError as exc:
        raise InvalidRequest(describe(list(exc.errors()))) from None


def parameters(given: Any) -> dict[str, Any]:
    """A protobuf map of InferParameter as plain values (bool, int, str)."""
    return {key: getattr(value, value.WhichOneof("parameter_choice")) for key, value in given.items()
            if value.WhichOneof("parameter_choice") is not None}


def _response(head: dict[str, str], tensors: dict[str, np.ndarray], call: GrpcCall) -> Any:
    """Every output as raw little-endian bytes (raw_output_contents, as Triton answers)."""
    m = messages()
    reply = m.ModelInferResponse(**head)
    kinds: dict[str, int] = {}
    for name, array in tensors.items():
        reply.outputs.add(name=name, datatype=V2_DATATYPES[array.dtype], shape=list(array.shape))
        data = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False)).tobytes()
        reply.raw_output_contents.append(data)
        kind = V2_KINDS.get(name, "other")
        kinds[kind] = kinds.get(kind, 0) + len(data)
    call.scope["response_kinds"] = kinds
    return reply

