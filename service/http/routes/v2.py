"""The Open Inference Protocol v2 (KServe / Triton): server and model metadata, health, and
inference with JSON or binary tensors (the binary tensor data extension `tritonclient` uses).

An inference request is read in three steps, the same for every task: the body is split into its
JSON header and binary tail (`_parse_v2_body`), the outputs to return are chosen with their binary
flags (`select_outputs`), and each input's texts are read from JSON data or from its own slice of
the tail (`_v2_texts`). Then `_v2_embed` or `_v2_classify` runs the model, and `_v2_response` writes
JSON or binary outputs.

No `from __future__ import annotations` (see http/routes/native.py).
"""

import asyncio
import math
import struct
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from itertools import accumulate
from typing import Any

import numpy as np
import orjson
from fastapi import Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from service.observability import tracing
from service.engine.engine import Engine, shown
from service.engine.errors import InvalidRequest, TooLarge
from service.engine.runner import EncodeJob, EncodeResult
from service.engine.encoder_service import EncoderService
from service.engine.tokenization import TokenizedText
from service.http.app import ERROR_RESPONSES, SERVER_NAME, SERVER_VERSION, app, describe
from service.http.context import infer, model_for, prompted, service
from service.http.responses import JSON_FLOAT_BYTES, OFF_LOOP_BYTES, JSONResponse, KindCounter
from service.http.schemas import V2InferRequest, V2ModelMetadata, V2Tensor

V2_ROUTE = "/v2/models/{name}/infer"
V2_INPUT = "text"
V2_OUTPUTS = ("sentence_embedding", "last_hidden_state", "attention_mask", "attentions")
V2_DEFAULT_OUTPUTS = ("sentence_embedding", "last_hidden_state", "attention_mask")
# a classification model: texts, or text pairs (query, document) with `text_pair`; logits and scores
V2_PAIR_INPUT = "text_pair"
V2_CLASSIFIER_OUTPUTS = ("logits", "scores")


@dataclass(frozen=True)
class TaskOutputs:
    """What a task can return on v2: every output, those returned when a request lists none, and
    how an unknown output's error names the ones there are."""

    names: tuple[str, ...]
    default: tuple[str, ...]
    listing: str


OUTPUTS_BY_TASK = {
    "embedding": TaskOutputs(V2_OUTPUTS, V2_DEFAULT_OUTPUTS, "available: " + ", ".join(V2_OUTPUTS)),
    "classification": TaskOutputs(V2_CLASSIFIER_OUTPUTS, V2_CLASSIFIER_OUTPUTS,
                                  "a classification model has " + ", ".join(V2_CLASSIFIER_OUTPUTS)),
}


def _parse_v2_body(raw: bytes, header_len: str | None) -> tuple[V2InferRequest, bytes]:
    """Split a v2 body into its JSON header and binary tail (binary tensor data extension)."""
    if header_len is not None:
        if not header_len.isdigit() or int(header_len) > len(raw):
            raise InvalidRequest(f"Inference-Header-Content-Length {shown(header_len)} does not fit a {len(raw)}-byte body")
        json_part, binary = raw[: int(header_len)], raw[int(header_len) :]
    else:
        json_part, binary = raw, b""
    try:
        return V2InferRequest.model_validate_json(json_part), binary
    except ValidationError as exc:
        raise InvalidRequest(describe(list(exc.errors()))) from None


def select_outputs(req: V2InferRequest, task: str) -> dict[str, bool]:
    """The outputs to return, in the order asked, each with whether it goes as binary data: the
    output's own `binary_data` when it says, else the request's `binary_data_output`."""
    outputs, everything_binary = OUTPUTS_BY_TASK[task], req.parameters.binary_data_output
    if not req.outputs:
        return dict.fromkeys(outputs.default, everything_binary)
    selected = {}
    for asked in req.outputs:
        if asked.name not in outputs.names:
            raise InvalidRequest(f"unknown output {shown(asked.name)}; {outputs.listing}")
        own = asked.parameters.binary_data
        selected[asked.name] = everything_binary if own is None else own
    return selected


def _v2_texts(req: V2InferRequest, binary: bytes, max_inputs: int, names: tuple[str, ...] = (V2_INPUT,),
              optional: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The texts of each BYTES input, by name, from its JSON data or its slice of the binary tail. Each
    input's shape is checked against the limit first, and no more elements are read than it declares
    (one past, to say the data disagrees)."""
    given = [t.name for t in req.inputs]
    required = [n for n in names if n not in optional]
    if not set(required) <= set(given) or not set(given) <= set(names) or len(set(given)) != len(given):
        wanted = " and ".join(repr(n) for n in required) + "".join(f", optionally {n!r}" for n in optional)
        raise InvalidRequest(f"expected inputs {wanted} (BYTES, shape [n]); got {shown(given)}")
    counts = [declared_count(t.name, t.datatype, t.shape, max_inputs) for t in req.inputs]
    slices = _binary_slices(req.inputs, binary)
    return {tensor.name: _input_texts(tensor, count, part) for tensor, count, part in zip(req.inputs, counts, slices, strict=True)}


def declared_count(name: str, datatype: str, shape: list[int], max_inputs: int) -> int:
    """How many texts an input declares: a BYTES tensor of shape [n] or [n, 1], 1 <= n <= max_inputs.
    Read from the shape alone, before any element (HTTP and gRPC)."""
    if datatype != "BYTES":
        raise InvalidRequest(f"input {shown(name)} must have datatype BYTES, got {shown(datatype)}")
    shape = list(shape)
    count = math.prod(shape) if len(shape) in (1, 2) else 0
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1) or count < 1:
        raise InvalidRequest(f"input {shown(name)} must have shape [n] or [n, 1] with n >= 1, got {shown(shape)}")
    if count > max_inputs:
        raise TooLarge(f"input {shown(name)} has shape {shown(shape)}: {count} inputs; at most {max_inputs} per request")
    return count


def _binary_slices(inputs: list[V2Tensor], binary: bytes) -> list[memoryview | None]:
    """Each input's bytes in the binary tail, None for an input sent as JSON. The tail holds the binary
    inputs one after another in the order they are listed, each `binary_data_size` bytes long, and
    nothing else."""
    sizes = [tensor.parameters.binary_data_size for tensor in inputs]
    ends = list(accumulate(size or 0 for size in sizes))
    for size, end in zip(sizes, ends, strict=True):
        if size is not None and end > len(binary):
            raise InvalidRequest(f"binary_data_size {size} does not fit the {len(binary)} bytes sent")
    if ends[-1] != len(binary):
        raise InvalidRequest(f"binary_data_size {ends[-1]} does not match the {len(binary)} bytes sent")
    tail = memoryview(binary)
    return [None if size is None else tail[end - size : end] for size, end in zip(sizes, ends, strict=True)]


def _length_prefixed(part: memoryview, most: int) -> list[bytes]:
    """The elements of one binary BYTES input, each a 4-byte little-endian length, then its bytes: at
    most `most` of them (the reading stops there, whatever follows)."""
    items, at = [], 0
    while at < len(part) and len(items) < most:
        if at + 4 > len(part):
            raise InvalidRequest("truncated BYTES element in binary data")
        (length,) = struct.unpack_from("<I", part, at)
        start, at = at + 4, at + 4 + length
        if at > len(part):
            raise InvalidRequest("truncated BYTES element in binary data")
        items.append(bytes(part[start:at]))
    return items


def _json_elements(tensor: V2Tensor, most: int) -> list[Any]:
    """The elements of a JSON input, its data flattened one level (JSON data may be nested per shape):
    at most `most` of them."""
    flat: list[Any] = []
    for item in tensor.data or []:
        if len(flat) >= most:
            break
        flat.extend(item[: most - len(flat)] if isinstance(item, list) else [item])
    return flat


def _input_texts(tensor: V2Tensor, count: int, part: memoryview | None) -> list[str]:
    """One input's texts: exactly `count` of them, each a string or UTF-8 bytes; one element past
    `count` is as far as it reads to say the data does not match the shape."""
    items = _json_elements(tensor, count + 1) if part is None else _length_prefixed(part, count + 1)
    if len(items) != count:
        got = f"more than {count}" if len(items) > count else str(len(items))
        raise InvalidRequest(f"input {shown(tensor.name)} has shape {shown(tensor.shape)} but {got} elements")
    texts = []
    for i, item in enumerate(items):
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidRequest(f"element {i} of {shown(tensor.name)} is not valid UTF-8") from None
        if not isinstance(item, str):
            raise InvalidRequest(f"element {i} of {shown(tensor.name)} must be a string")
        texts.append(item)
    return texts


def _v2_tensors(result: EncodeResult, tokenized: list[TokenizedText], requested: list[str], T: int) -> dict[str, np.ndarray]:
    """Rectangular tensors for the v2 response: token-level outputs zero-padded to the longest input."""
    n = len(tokenized)
    out: dict[str, np.ndarray] = {}
    for name in requested:
        if name == "sentence_embedding":
            out[name] = np.ascontiguousarray(result.embeddings, dtype=np.float32)
        elif name == "attention_mask":
            mask = np.zeros((n, T), dtype=np.int64)
            for i, t in enumerate(tokenized):
                mask[i, : t.n_tokens] = 1
            out[name] = mask
        elif name == "last_hidden_state":
            hidden = np.zeros((n, T, result.hidden[0].shape[-1]), dtype=np.float32)
            for i, h in enumerate(result.hidden):
                hidden[i, : h.shape[0]] = h
            out[name] = hidden
        elif name == "attentions":
            L, H = result.attentions[0].shape[:2]
            attn = np.zeros((L, n, H, T, T), dtype=np.float32)
            for i, a in enumerate(result.attentions):
                k = a.shape[-1]
                attn[:, i, :, :k, :k] = a
            out[name] = attn
    return out


V2_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


V2_KINDS = {"sentence_embedding": "embedding", "last_hidden_state": "token_embeddings", "attentions": "attention"}


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
    kinds.report(request)
    header = orjson.dumps({**head, "outputs": outputs}, option=orjson.OPT_SERIALIZE_NUMPY)
    if not tail:
        return Response(header, media_type="application/json")
    return Response(
        header + b"".join(tail),
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(header))},
    )


V2_EXTENSIONS = ["binary_tensor_data"]


@app.get("/v2")
async def v2_server() -> JSONResponse:
    return JSONResponse({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": V2_EXTENSIONS})


@app.get("/v2/health/live")
async def v2_live() -> JSONResponse:
    """Liveness: a replica answers. (While none is up, Serve's own /-/healthz tells whether the
    ingress is alive; see docs/serving.md, "Liveness and readiness".)"""
    return JSONResponse({"live": True})


@app.get("/v2/health/ready", responses=ERROR_RESPONSES)
async def v2_ready(svc: EncoderService = Depends(service)) -> JSONResponse:
    """Ready: a replica whose sessions passed their last health check answers."""
    svc.check_ready()
    return JSONResponse({"ready": True})


@app.get("/v2/models/{name}", response_model=V2ModelMetadata, responses=ERROR_RESPONSES)
@app.get("/v2/models/{name}/versions/{version}", include_in_schema=False)
async def v2_metadata(name: str, request: Request, version: str = "1", svc: EncoderService = Depends(service)) -> JSONResponse:
    return JSONResponse(v2_model_metadata(model_for(svc, name, request, task=None)))


def v2_model_metadata(engine: Engine) -> dict[str, Any]:
    """A model's inputs and outputs as v2 describes them (HTTP and gRPC)."""
    if engine.model.task == "classification":
        labels = len(engine.model.labels or [])
        return {
            "name": engine.name, "versions": ["1"], "platform": "onnxruntime_onnx",
            "inputs": [{"name": V2_INPUT, "datatype": "BYTES", "shape": [-1]},
                       {"name": V2_PAIR_INPUT, "datatype": "BYTES", "shape": [-1], "optional": True}],
            "outputs": [{"name": name, "datatype": "FP32", "shape": [-1, labels]} for name in V2_CLASSIFIER_OUTPUTS],
            "parameters": {"labels": engine.model.labels, "problem_type": engine.model.problem_type},
        }
    d, L, H = engine.model.hidden_size, engine.model.num_layers, engine.model.num_heads
    e = engine.model.sentence_dim
    return {
        "name": engine.name,
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": V2_INPUT, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [
            {"name": "sentence_embedding", "datatype": "FP32", "shape": [-1, e]},
            {"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, -1, d]},
            {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "attentions", "datatype": "FP32", "shape": [L, -1, H, -1, -1]},
        ],
    }


@app.get("/v2/models/{name}/ready", responses=ERROR_RESPONSES)
@app.get("/v2/models/{name}/versions/{version}/ready", include_in_schema=False)
async def v2_model_ready(name: str, request: Request, version: str = "1", svc: EncoderService = Depends(service)) -> JSONResponse:
    engine = model_for(svc, name, request, task=None)
    svc.check_ready()
    return JSONResponse({"name": engine.name, "ready": True})


@app.post("/v2/repository/index")
async def v2_repository_index(svc: EncoderService = Depends(service)) -> JSONResponse:
    """The model repository extension's index: every served model, all loaded and ready."""
    return JSONResponse([{"name": m.name, "version": "1", "state": "READY", "reason": ""} for m in svc.engines])


@app.post("/v2/models/{name}/infer", responses=ERROR_RESPONSES)
@app.post("/v2/models/{name}/versions/{version}/infer", include_in_schema=False)
async def v2_infer(name: str, request: Request, version: str = "1", svc: EncoderService = Depends(service)) -> Response:
    """KServe/Triton inference: a BYTES tensor of texts in, the requested tensors out.

    Supports the binary tensor data extension that tritonclient uses by default.
    """
    engine = model_for(svc, name, request, task=None)
    raw, header_len = await request.body(), request.headers.get("inference-header-content-length")
    # a large body's JSON is parsed in a worker thread: its data may hold millions of elements, and
    # their count is known only once it is parsed
    req, binary = (_parse_v2_body(raw, header_len) if len(raw) <= OFF_LOOP_BYTES
                   else await asyncio.to_thread(_parse_v2_body, raw, header_len))
    outputs = select_outputs(req, engine.model.task)
    ran = await v2_run(svc, engine, req, binary, outputs, V2Call(V2_ROUTE, lambda job: infer(svc, engine, job, request)))

    def build() -> Response:
        with tracing.span("serialize"):
            return _v2_response(v2_head(engine, req), ran.tensors(), outputs, request)

    # a large response is built in a worker thread, not on the event loop other requests wait on
    return build() if ran.estimate <= OFF_LOOP_BYTES else await asyncio.to_thread(build)


@dataclass(frozen=True)
class V2Call:
    """What a v2 inference takes from the protocol it came in on (HTTP here, gRPC in
    service/grpc/inference.py): its route label, and how a job runs (deadline, client gone)."""

    route: str
    infer: Callable[[EncodeJob], Awaitable[EncodeResult]]


@dataclass(frozen=True)
class V2Ran:
    """A v2 inference's outputs, built when asked (`tensors`), and their size estimate in bytes."""

    tensors: Callable[[], dict[str, np.ndarray]]
    estimate: int


async def v2_run(svc: EncoderService, engine: Engine, req: V2InferRequest, binary: bytes, outputs: dict[str, bool],
                 call: V2Call) -> V2Ran:
    """One v2 inference request, whichever protocol it came in on: its texts through the model's task."""
    if engine.model.task == "classification":
        return await _v2_classify(svc, engine, req, binary, outputs, call)
    return await _v2_embed(svc, engine, req, binary, outputs, call)


def v2_head(engine: Engine, req: V2InferRequest) -> dict[str, str]:
    return {"model_name": engine.name, "model_version": "1", "id": req.id or ""}


async def _v2_embed(svc: EncoderService, engine: Engine, req: V2InferRequest, binary: bytes,
                    outputs: dict[str, bool], call: V2Call) -> V2Ran:
    """An embedding model on v2: `text` in; the sentence embedding, token states, mask and attentions
    out, as `outputs` selects them, after the response's size is checked."""
    pooled_only = not ({"last_hidden_state", "attentions"} & set(outputs))
    texts, skip = prompted(svc, engine, svc.texts(_v2_texts(req, binary, svc.settings.max_inputs)[V2_INPUT]), req.parameters.prompt_name,
                           req.parameters.input_type, pooled_only)
    tokenized = await svc.tokenize(engine, texts, req.parameters.truncate, call.route)
    n, T = len(tokenized), max(t.n_tokens for t in tokenized)
    d, L, H = engine.model.hidden_size, engine.model.num_layers, engine.model.num_heads
    if "attentions" in outputs:
        svc.check_attention_size(engine, tokenized)
    sizes = {"sentence_embedding": n * engine.model.sentence_dim, "last_hidden_state": n * T * d, "attention_mask": n * T, "attentions": L * n * H * T * T}
    estimate = sum(sizes[name] * (4 if as_binary else JSON_FLOAT_BYTES) for name, as_binary in outputs.items())
    svc.check_response_size(estimate)
    job = EncodeJob(
        route=call.route,
        ids=[t.ids for t in tokenized],
        normalize=engine.model.normalize,
        want_hidden="last_hidden_state" in outputs,
        attention=(tuple(range(L)), tuple(range(H))) if "attentions" in outputs else None,
        pool_skip=skip,
    )
    result = await call.infer(job)
    return V2Ran(lambda: _v2_tensors(result, tokenized, list(outputs), T), estimate)


async def _v2_classify(svc: EncoderService, engine: Engine, req: V2InferRequest, binary: bytes,
                       outputs: dict[str, bool], call: V2Call) -> V2Ran:
    """A classification model on v2: `text` (and `text_pair` for query-document pairs, one each) in;
    `logits` and `scores` out, scores read as /v1/classify reads them (the checkpoint's problem_type)."""
    from service.http.routes.heads import read_logits

    inputs = _v2_texts(req, binary, svc.settings.max_inputs, (V2_INPUT, V2_PAIR_INPUT), optional=(V2_PAIR_INPUT,))
    texts, truncate = svc.texts(inputs[V2_INPUT]), req.parameters.truncate
    if V2_PAIR_INPUT in inputs:
        pairs = svc.texts(inputs[V2_PAIR_INPUT])
        if len(pairs) != len(texts):
            raise InvalidRequest(f"{V2_PAIR_INPUT!r} has {len(pairs)} elements, {V2_INPUT!r} {len(texts)}: one pair each")
        tokenized = await svc.tokenize_pairs(engine, list(zip(texts, pairs, strict=True)), truncate, call.route)
        types = [t.type_ids for t in tokenized]
    else:
        tokenized, types = await svc.tokenize(engine, texts, truncate, call.route), None
    job = EncodeJob(route=call.route, ids=[t.ids for t in tokenized], normalize=False, type_ids=types)
    result = await call.infer(job)
    logits = np.ascontiguousarray(result.embeddings, dtype=np.float32)
    computed = {"logits": logits,
                "scores": np.ascontiguousarray(read_logits(logits, engine.model.problem_type), dtype=np.float32)}
    return V2Ran(lambda: {name: computed[name] for name in outputs}, logits.size * 2 * JSON_FLOAT_BYTES)
