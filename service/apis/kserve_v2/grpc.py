"""KServe v2 over gRPC: the six calls of `inference.GRPCInferenceService` and the repository extension's three
(kserve_v2.proto), each `answer(svc, request, call)`, answered with the same semantics as HTTP's (semantics.py: the same models,
inputs, outputs, limits and errors). The gRPC transport (service/grpc) hands each call its record,
checks the token of ModelInfer, RepositoryModelLoad and RepositoryModelUnload, maps errors to status codes and records the call.

A ModelInferRequest is read into the v2 request HTTP reads (`V2InferRequest`, with the raw input
contents as the binary tail), its counts checked before any element is copied.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from pydantic import ValidationError

from service.apis.kserve_v2 import repository
from service.apis.kserve_v2.messages import METHODS, SERVICE as SERVICE_NAME, messages
from service.apis.kserve_v2.schemas import V2InferRequest
from service.apis.kserve_v2.semantics import (V2_DATATYPES, V2_EXTENSIONS, V2_KINDS, V2Call, declared_count,
                                              select_outputs, v2_head, v2_model_metadata, v2_run)
from service.engine.encoder_service import EncoderService
from service.engine.engine import shown
from service.engine.errors import InvalidRequest, ServiceError
from service.engine.runner import EncodeJob, EncodeResult
from service.front.call import Call
from service.front.quotas import Quotas
from service.front.errors import describe
from service.front.identity import SERVER_NAME, SERVER_VERSION
from service.front.policy import GrpcMethod, GrpcService
from service.observability import tracing


def _ready(svc: EncoderService) -> bool:
    try:
        svc.check_ready()
    except ServiceError:
        return False
    return True


async def _engine(svc: EncoderService, name: str, call: Call):
    """The model a call names (a repository's loaded here first; NOT_FOUND naming the served ones); an empty
    name is the default model."""
    call.may_call(name)
    await svc.load_if_needed(name or None, call.deadline(svc.settings.request_timeout_s))
    return call.serves(svc.engines.get(name or None, False))


async def server_live(svc: EncoderService, request: Any, call: Call) -> Any:
    return messages().ServerLiveResponse(live=True)


async def server_ready(svc: EncoderService, request: Any, call: Call) -> Any:
    return messages().ServerReadyResponse(ready=_ready(svc))


async def model_ready(svc: EncoderService, request: Any, call: Call) -> Any:
    await _engine(svc, request.name, call)
    return messages().ModelReadyResponse(ready=_ready(svc))


async def server_metadata(svc: EncoderService, request: Any, call: Call) -> Any:
    return messages().ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=V2_EXTENSIONS)


async def model_metadata(svc: EncoderService, request: Any, call: Call) -> Any:
    described = v2_model_metadata(await _engine(svc, request.name, call))
    m = messages()
    tensors = m.ModelMetadataResponse.TensorMetadata
    return m.ModelMetadataResponse(
        name=described["name"], versions=described["versions"], platform=described["platform"],
        inputs=[tensors(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in described["inputs"]],
        outputs=[tensors(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in described["outputs"]],
    )


async def model_infer(svc: EncoderService, request: Any, call: Call) -> Any:
    engine = await _engine(svc, request.model_name, call)
    req, binary = v2_request(request, svc.settings.max_inputs)
    outputs = select_outputs(req, engine.model)

    async def run(job: EncodeJob) -> EncodeResult:
        await Quotas.charge_tokens(call, call.tokens_of([job]))  # a key's tokens per minute, before they are batched
        call.count([job])
        return await svc.infer(engine, job, call.deadline(svc.settings.request_timeout_s))

    ran = await v2_run(svc, engine, req, binary, outputs, V2Call(call.route, call.protocol, run))

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


def _response(head: dict[str, str], tensors: dict[str, np.ndarray], call: Call) -> Any:
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
    call.response_kinds = kinds
    return reply



async def repository_index(svc: EncoderService, request: Any, call: Call) -> Any:
    m = messages()
    return m.RepositoryIndexResponse(models=[
        m.RepositoryIndexResponse.ModelIndex(name=r["name"], version=r["version"], state=r["state"], reason=r["reason"])
        for r in repository.index(svc, request.ready)])


async def repository_load(svc: EncoderService, request: Any, call: Call) -> Any:
    await repository.load(svc, request.model_name, call)
    return messages().RepositoryModelLoadResponse()


async def repository_unload(svc: EncoderService, request: Any, call: Call) -> Any:
    repository.unload(svc, request.model_name)
    return messages().RepositoryModelUnloadResponse()


_ANSWERS = {"ServerLive": server_live, "ServerReady": server_ready, "ModelReady": model_ready,
            "ServerMetadata": server_metadata, "ModelMetadata": model_metadata, "ModelInfer": model_infer,
            "RepositoryIndex": repository_index, "RepositoryModelLoad": repository_load,
            "RepositoryModelUnload": repository_unload}


def _service() -> GrpcService:
    m = messages()
    return GrpcService(SERVICE_NAME, {
        name: GrpcMethod(name, getattr(m, request), getattr(m, response), _ANSWERS[name])
        for name, (request, response) in METHODS.items()})


SERVICE = _service()
