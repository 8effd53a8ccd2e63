"""The Open Inference Protocol v2 (KServe / Triton): server and model metadata, health, and
inference with JSON or binary tensors (the binary tensor data extension `tritonclient` uses).

No `from __future__ import annotations` (see http/routes/native.py).
"""

import asyncio
import struct
from typing import Any

import numpy as np
import orjson
from fastapi import Depends, Request
from fastapi.responses import Response
from pydantic import ValidationError

from service.engine.errors import InvalidRequest
from service.engine.runner import EncodeJob, EncodeResult
from service.engine.service import EncoderService
from service.engine.tokenization import TokenizedText
from service.http.app import ERROR_RESPONSES, SERVER_NAME, SERVER_VERSION, app, describe
from service.http.context import infer, model_for, service
from service.http.responses import JSON_FLOAT_BYTES, OFF_LOOP_BYTES, JSONResponse, KindCounter
from service.http.schemas import V2InferRequest, V2ModelMetadata

V2_INPUT = "text"
V2_OUTPUTS = ("sentence_embedding", "last_hidden_state", "attention_mask", "attentions")
V2_DEFAULT_OUTPUTS = ("sentence_embedding", "last_hidden_state", "attention_mask")
# a classification model: texts, or text pairs (query, document) with `text_pair`; logits and scores
V2_PAIR_INPUT = "text_pair"
V2_CLASSIFIER_OUTPUTS = ("logits", "scores")


def _parse_v2_body(raw: bytes, header_len: str | None) -> tuple[V2InferRequest, bytes]:
    """Split a v2 body into its JSON header and binary tail (binary tensor data extension)."""
    if header_len is not None:
        if not header_len.isdigit() or int(header_len) > len(raw):
            raise InvalidRequest(f"Inference-Header-Content-Length {header_len!r} does not fit a {len(raw)}-byte body")
        json_part, binary = raw[: int(header_len)], raw[int(header_len) :]
    else:
        json_part, binary = raw, b""
    try:
        return V2InferRequest.model_validate_json(json_part), binary
    except ValidationError as exc:
        raise InvalidRequest(describe(list(exc.errors()))) from None


def _v2_texts(req: V2InferRequest, binary: bytes, names: tuple[str, ...] = (V2_INPUT,),
              optional: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """The texts of each BYTES input, by name, from JSON data or binary length-prefixed strings (the
    binary tail holds each binary input's bytes in the order the inputs are listed)."""
    given = [t.name for t in req.inputs]
    required = [n for n in names if n not in optional]
    if not set(required) <= set(given) or not set(given) <= set(names) or len(set(given)) != len(given):
        wanted = " and ".join(repr(n) for n in required) + "".join(f", optionally {n!r}" for n in optional)
        raise InvalidRequest(f"expected inputs {wanted} (BYTES, shape [n]); got {given}")
    out, offset = {}, 0
    for tensor in req.inputs:
        name = tensor.name
        if tensor.datatype != "BYTES":
            raise InvalidRequest(f"input {name!r} must have datatype BYTES, got {tensor.datatype}")
        count = int(np.prod(tensor.shape)) if tensor.shape else 0
        if len(tensor.shape) not in (1, 2) or (len(tensor.shape) == 2 and tensor.shape[1] != 1) or count < 1:
            raise InvalidRequest(f"input {name!r} must have shape [n] or [n, 1] with n >= 1, got {tensor.shape}")
        binary_size = (tensor.parameters or {}).get("binary_data_size")
        if binary_size is not None:
            if not isinstance(binary_size, int) or binary_size < 0 or offset + binary_size > len(binary):
                raise InvalidRequest(f"binary_data_size {binary_size} does not fit the {len(binary)} bytes sent")
            items, end = [], offset + binary_size
            while offset < end:
                if offset + 4 > end:
                    raise InvalidRequest("truncated BYTES element in binary data")
                (length,) = struct.unpack_from("<I", binary, offset)
                offset += 4
                if offset + length > end:
                    raise InvalidRequest("truncated BYTES element in binary data")
                items.append(binary[offset : offset + length])
                offset += length
        else:
            flat = []
            for item in tensor.data or []:  # JSON data may be nested per shape
                flat.extend(item if isinstance(item, list) else [item])
            items = flat
        if len(items) != count:
            raise InvalidRequest(f"input {name!r} has shape {tensor.shape} but {len(items)} elements")
        texts = []
        for i, item in enumerate(items):
            if isinstance(item, bytes):
                try:
                    item = item.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidRequest(f"element {i} of {name!r} is not valid UTF-8") from None
            if not isinstance(item, str):
                raise InvalidRequest(f"element {i} of {name!r} must be a string")
            texts.append(item)
        out[name] = texts
    if offset != len(binary):
        raise InvalidRequest(f"binary_data_size {offset} does not match the {len(binary)} bytes sent")
    return out


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


_V2_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}


_V2_KINDS = {"sentence_embedding": "embedding", "last_hidden_state": "token_embeddings", "attentions": "attention"}


def _v2_response(head: dict, tensors: dict[str, np.ndarray], binary_out: dict[str, bool], request: Request) -> Response:
    outputs, tail = [], []
    kinds = KindCounter()
    for name, array in tensors.items():
        entry: dict[str, Any] = {"name": name, "datatype": _V2_DATATYPES[array.dtype], "shape": list(array.shape)}
        kind = _V2_KINDS.get(name, "other")
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


@app.get("/v2")
async def v2_server() -> JSONResponse:
    return JSONResponse({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": ["binary_tensor_data"]})


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
    engine = model_for(svc, name, request, task=None)
    if engine.model.task == "classification":
        labels = len(engine.model.labels or [])
        return JSONResponse({
            "name": engine.name, "versions": ["1"], "platform": "onnxruntime_onnx",
            "inputs": [{"name": V2_INPUT, "datatype": "BYTES", "shape": [-1]},
                       {"name": V2_PAIR_INPUT, "datatype": "BYTES", "shape": [-1], "optional": True}],
            "outputs": [{"name": name, "datatype": "FP32", "shape": [-1, labels]} for name in V2_CLASSIFIER_OUTPUTS],
            "parameters": {"labels": engine.model.labels, "problem_type": engine.model.problem_type},
        })
    d, L, H = engine.model.hidden_size, engine.model.num_layers, engine.model.num_heads
    e = engine.model.sentence_dim
    return JSONResponse(
        {
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
    )


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
    raw = await request.body()
    header_len = request.headers.get("inference-header-content-length")
    req, binary = _parse_v2_body(raw, header_len)
    params = req.parameters or {}
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise InvalidRequest("parameters.truncate must be a boolean")
    if engine.model.task == "classification":
        return await _v2_classify(svc, engine, req, binary, truncate, request)
    texts = svc.texts(_v2_texts(req, binary)[V2_INPUT])
    requested = [o.name for o in req.outputs] if req.outputs else list(V2_DEFAULT_OUTPUTS)
    unknown = [n for n in requested if n not in V2_OUTPUTS]
    if unknown:
        raise InvalidRequest(f"unknown output {unknown[0]!r}; available: {', '.join(V2_OUTPUTS)}")
    binary_out = {
        o.name: bool((o.parameters or {}).get("binary_data", params.get("binary_data_output", False)))
        for o in (req.outputs or [])
    }
    for n in requested:
        binary_out.setdefault(n, bool(params.get("binary_data_output", False)))
    tokenized = await svc.tokenize(engine, texts, truncate, "/v2/models/{name}/infer")
    n, T = len(tokenized), max(t.n_tokens for t in tokenized)
    d, L, H = engine.model.hidden_size, engine.model.num_layers, engine.model.num_heads
    if "attentions" in requested:
        svc.check_attention_size(engine, tokenized)
    sizes = {"sentence_embedding": n * engine.model.sentence_dim, "last_hidden_state": n * T * d, "attention_mask": n * T, "attentions": L * n * H * T * T}
    estimate = sum(sizes[k] * (4 if binary_out[k] else JSON_FLOAT_BYTES) for k in requested)
    svc.check_response_size(estimate)
    job = EncodeJob(
        route="/v2/models/{name}/infer",
        ids=[t.ids for t in tokenized],
        normalize=engine.model.normalize,
        want_hidden="last_hidden_state" in requested,
        attention=(tuple(range(L)), tuple(range(H))) if "attentions" in requested else None,
    )
    result = await infer(svc, engine, job, request)
    head = {"model_name": engine.name, "model_version": "1", "id": req.id or ""}

    def build() -> Response:
        return _v2_response(head, _v2_tensors(result, tokenized, requested, T), binary_out, request)

    # a large response is built in a worker thread, not on the event loop other requests wait on
    return build() if estimate <= OFF_LOOP_BYTES else await asyncio.to_thread(build)


async def _v2_classify(svc: EncoderService, engine, req: V2InferRequest, binary: bytes, truncate: bool,
                       request: Request) -> Response:
    """A classification model on v2: `text` (and `text_pair` for query-document pairs, one each) in;
    `logits` and `scores` out, scores read as /v1/classify reads them (the checkpoint's problem_type)."""
    from service.http.routes.heads import read_logits

    inputs = _v2_texts(req, binary, (V2_INPUT, V2_PAIR_INPUT), optional=(V2_PAIR_INPUT,))
    texts = svc.texts(inputs[V2_INPUT])
    route = "/v2/models/{name}/infer"
    if V2_PAIR_INPUT in inputs:
        pairs = svc.texts(inputs[V2_PAIR_INPUT])
        if len(pairs) != len(texts):
            raise InvalidRequest(f"{V2_PAIR_INPUT!r} has {len(pairs)} elements, {V2_INPUT!r} {len(texts)}: one pair each")
        tokenized = await svc.tokenize_pairs(engine, list(zip(texts, pairs, strict=True)), truncate, route)
        types = [t.type_ids for t in tokenized]
    else:
        tokenized, types = await svc.tokenize(engine, texts, truncate, route), None
    requested = [o.name for o in req.outputs] if req.outputs else list(V2_CLASSIFIER_OUTPUTS)
    unknown = [n for n in requested if n not in V2_CLASSIFIER_OUTPUTS]
    if unknown:
        raise InvalidRequest(f"unknown output {unknown[0]!r}; a classification model has {', '.join(V2_CLASSIFIER_OUTPUTS)}")
    params = req.parameters or {}
    binary_out = {o.name: bool((o.parameters or {}).get("binary_data", params.get("binary_data_output", False)))
                  for o in (req.outputs or [])}
    for n in requested:
        binary_out.setdefault(n, bool(params.get("binary_data_output", False)))
    job = EncodeJob(route=route, ids=[t.ids for t in tokenized], normalize=False, type_ids=types)
    result = await infer(svc, engine, job, request)
    logits = np.ascontiguousarray(result.embeddings, dtype=np.float32)
    computed = {"logits": logits,
                "scores": np.ascontiguousarray(read_logits(logits, engine.model.problem_type), dtype=np.float32)}
    head = {"model_name": engine.name, "model_version": "1", "id": req.id or ""}
    return _v2_response(head, {n: computed[n] for n in requested}, binary_out, request)
