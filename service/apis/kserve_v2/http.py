"""The Open Inference Protocol v2 over HTTP (KServe / Triton): server and model metadata, health, and
inference with JSON or binary tensors (the binary tensor data extension `tritonclient` uses). The body
is split into its JSON header and binary tail here, then read and run by semantics.py, as gRPC's are.

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

import asyncio
from typing import Any

import numpy as np
import orjson
from fastapi import Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from service.apis.kserve_v2 import repository
from service.apis.kserve_v2.schemas import V2InferRequest, V2ModelMetadata
from service.apis.kserve_v2.semantics import (V2_DATATYPES, V2_EXTENSIONS, V2_KINDS, V2_ROUTE, V2Call, select_outputs,
                                              v2_head, v2_model_metadata, v2_run)
from service.engine.encoder_service import EncoderService
from service.engine.engine import shown
from service.engine.errors import InvalidRequest, TooLarge
from service.front.deps import api_router, call_of, infer, model_for, service
from service.front.errors import describe
from service.front.identity import SERVER_NAME, SERVER_VERSION
from service.front.json_values import separators
from service.front.responses import OFF_LOOP_BYTES, JSONResponse, KindCounter
from service.front.schemas import ERROR_RESPONSES
from service.observability import tracing

router = api_router()


def json_values_limit(max_inputs: int) -> int:
    """The most separators a v2 JSON body may hold: two inputs of max_inputs texts, with room to spare for
    the members of the inputs, outputs and parameters."""
    return 4 * max_inputs + 1024


def _parse_v2_body(raw: bytes, header_len: str | None, max_inputs: int) -> tuple[V2InferRequest, bytes]:
    """Split a v2 body into its JSON header and binary tail (binary tensor data extension), and parse the
    header once its values are counted (a large one only: a small one parses in well under a ms)."""
    if header_len is not None:
        if not header_len.isdigit() or int(header_len) > len(raw):
            raise InvalidRequest(f"Inference-Header-Content-Length {shown(header_len)} does not fit a {len(raw)}-byte body")
        json_part, binary = raw[: int(header_len)], raw[int(header_len) :]
    else:
        json_part, binary = raw, b""
    most = json_values_limit(max_inputs)
    if len(json_part) > OFF_LOOP_BYTES and separators(json_part) > most:
        raise TooLarge(f"the request's JSON holds more than {most} values; an input holds at most {max_inputs} texts")
    try:
        return V2InferRequest.model_validate_json(json_part), binary
    except ValidationError as exc:
        raise InvalidRequest(describe(list(exc.errors()))) from None


def _v2_response(head: dict, tensors: dict[str, np.ndarray], binary_out: dict[str, bool], request: Request) -> Response:
    outputs, tail = [], []
    kinds = KindCounter()
    for name, array in tensors.items():
        entry: dict[str, Any] = {"name": name, "datatype": V2_DATATYPES[array.dtype], "shape": list(array.shape)}
        kind = V2_KINDS.get(name, "other")
        if binary_out.get(name):
            data = np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<"), copy=False)).tobytes()
            entry["parameters"] = {"binary_data_size": len(data)}
            kinds.bytes[kind] = kinds.bytes.get(kind, 0) + len(data)
            tail.append(data)
        else:
            entry["data"] = kinds.array(kind, array.reshape(-1), "float", "float32") if array.dtype == np.float32 \
                else kinds.fragment(kind, array.reshape(-1))
        outputs.append(entry)
    kinds.report(call_of(request))
    header = orjson.dumps({**head, "outputs": outputs}, option=orjson.OPT_SERIALIZE_NUMPY)
    if not tail:
        return Response(header, media_type="application/json")
    return Response(
        header + b"".join(tail),
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(header))},
    )


@router.get("/v2")
async def v2_server() -> JSONResponse:
    return JSONResponse({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": V2_EXTENSIONS})


@router.get("/v2/health/live")
async def v2_live() -> JSONResponse:
    """Liveness: a replica answers. (While none is up, Serve's own /-/healthz tells whether the
    ingress is alive; see docs/serving.md, "Liveness and readiness".)"""
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", responses=ERROR_RESPONSES)
async def v2_ready(svc: EncoderService = Depends(service)) -> JSONResponse:
    """Ready: a replica whose sessions passed their last health check answers."""
    svc.check_ready()
    return JSONResponse({"ready": True})


@router.get("/v2/models/{name}", response_model=V2ModelMetadata, responses=ERROR_RESPONSES)
@router.get("/v2/models/{name}/versions/{version}", include_in_schema=False)
async def v2_metadata(name: str, request: Request, version: str = "1", svc: EncoderService = Depends(service)) -> JSONResponse:
    return JSONResponse(v2_model_metadata(await model_for(svc, name, request, task=None)))


@router.get("/v2/models/{name}/ready", responses=ERROR_RESPONSES)
@router.get("/v2/models/{name}/versions/{version}/ready", include_in_schema=False)
async def v2_model_ready(name: str, request: Request, version: str = "1", svc: EncoderService = Depends(service)) -> JSONResponse:
    engine = await model_for(svc, name, request, task=None)
    svc.check_ready()
    return JSONResponse({"name": engine.name, "ready": True})


@router.post("/v2/repository/index")
async def v2_repository_index(request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """The model repository extension's index: every model with its state on this replica (READY, LOADING,
    UNAVAILABLE and why); `{"ready": true}` lists the ready ones only. tritonclient's
    get_model_repository_index."""
    body = await _small_json(request)
    return JSONResponse(repository.index(svc, bool(body.get("ready", False))))


@router.post("/v2/repository/models/{name}/load", responses=ERROR_RESPONSES)
async def v2_repository_load(name: str, request: Request, svc: EncoderService = Depends(service)) -> Response:
    """Load the model on this replica (tritonclient's load_model): 200 once it is ready, 404 when no such model,
    503 with Retry-After when the replica's model budget or load slots leave no room now."""
    await _small_json(request)
    await repository.load(svc, name, call_of(request))
    return Response(status_code=200)


@router.post("/v2/repository/models/{name}/unload", responses=ERROR_RESPONSES)
async def v2_repository_unload(name: str, request: Request, svc: EncoderService = Depends(service)) -> Response:
    """Unload the model on this replica (tritonclient's unload_model), now or once its requests are done."""
    await _small_json(request)
    repository.unload(svc, name)
    return Response(status_code=200)


async def _small_json(request: Request) -> dict:
    """A repository call's optional JSON body (`ready`, `parameters`): empty, or an object of at most 64 KiB."""
    raw = await request.body()
    if not raw.strip():
        return {}
    if len(raw) > 65536:
        raise TooLarge(f"a repository request's body is {len(raw)} bytes; at most 65536")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body is a JSON object (`ready`, `parameters`), or empty")
    return body


@router.post("/v2/models/{name}/infer", responses=ERROR_RESPONSES)
@router.post("/v2/models/{name}/versions/{version}/infer", include_in_schema=False)
async def v2_infer(name: str, request: Request, version: str = "1", svc: EncoderService = Depends(service)) -> Response:
    """KServe/Triton inference: a BYTES tensor of texts in, the requested tensors out.

    Supports the binary tensor data extension that tritonclient uses by default.
    """
    engine = await model_for(svc, name, request, task=None)
    raw, header_len = await request.body(), request.headers.get("inference-header-content-length")
    # a large body's JSON is counted, then parsed, in a worker thread: its data may hold millions of
    # elements, refused before any of them is parsed
    req, binary = (_parse_v2_body(raw, header_len, svc.settings.max_inputs) if len(raw) <= OFF_LOOP_BYTES
                   else await asyncio.to_thread(_parse_v2_body, raw, header_len, svc.settings.max_inputs))
    outputs = select_outputs(req, engine.model)
    ran = await v2_run(svc, engine, req, binary, outputs, V2Call(V2_ROUTE, "http", lambda job: infer(svc, engine, job, request)))

    def build() -> Response:
        with tracing.span("serialize"):
            return _v2_response(v2_head(engine, req), ran.tensors(), outputs, request)

    # a large response is built in a worker thread, not on the event loop other requests wait on
    return build() if ran.estimate <= OFF_LOOP_BYTES else await asyncio.to_thread(build)
