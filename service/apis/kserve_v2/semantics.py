"""The Open Inference Protocol v2's semantics, once for both transports: which outputs a task has and a
request selects, each input's texts read within its declared count, the model's metadata, and one
inference request through the model's task (`v2_run`). service/apis/kserve_v2/http.py reads requests
from HTTP bodies (JSON, binary tensors), service/apis/kserve_v2/grpc.py from gRPC messages.

An inference request is read in three steps, the same for every task: the outputs to return are chosen
with their binary flags (`select_outputs`), each input's texts are read from JSON data or from its own
slice of the binary tail (`v2_texts`), then `_v2_embed` or `_v2_classify` runs the model.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np

from bundle.manifest import ModelInfo
from service.apis.kserve_v2.schemas import V2InferRequest, V2Tensor
from service.engine.encoder_service import EncoderService
from service.engine.engine import Engine, shown
from service.engine.errors import InvalidRequest, TooLarge
from service.engine.runner import EncodeJob, EncodeResult
from service.engine.scoring import classification_job, read_logits
from service.front.responses import JSON_FLOAT_BYTES

V2_ROUTE = "/v2/models/{name}/infer"
V2_INPUT = "text"
V2_OUTPUTS = ("sentence_embedding", "last_hidden_state", "attention_mask", "attentions")
V2_DEFAULT_OUTPUTS = ("sentence_embedding", "last_hidden_state", "attention_mask")
# a classification model: texts, or text pairs (query, document) with `text_pair`; logits and scores
V2_PAIR_INPUT = "text_pair"
V2_CLASSIFIER_OUTPUTS = ("logits", "scores")
# a model's sparse vectors (SPLADE, BGE-M3), flat: text i's terms are [offsets[i], offsets[i + 1]) of indices and
# values; its token vectors (ColBERT, BGE-M3), flat: text i's are its lengths[i] rows after the previous texts'
V2_SPARSE_OUTPUTS = ("sparse_indices", "sparse_values", "sparse_offsets")
V2_MULTIVECTOR_OUTPUTS = ("multivector", "multivector_lengths")


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


def task_outputs(model: ModelInfo) -> TaskOutputs:
    """What a model can return on v2: its task's outputs, and an embedding model's representations beyond
    the dense one (its sparse and multi-vector tensors); a model without a dense embedding has no
    sentence_embedding, and returns its own representations when a request lists no output."""
    if model.task != "embedding" or not (model.sparse or model.multivector):
        return OUTPUTS_BY_TASK[model.task]
    own = (V2_SPARSE_OUTPUTS if model.sparse else ()) + (V2_MULTIVECTOR_OUTPUTS if model.multivector else ())
    dense = "dense" in model.representations
    names = tuple(n for n in V2_OUTPUTS if dense or n != "sentence_embedding") + own
    return TaskOutputs(names, V2_DEFAULT_OUTPUTS if dense else own, "available: " + ", ".join(names))


def select_outputs(req: V2InferRequest, model: ModelInfo) -> dict[str, bool]:
    """The outputs to return, in the order asked, each with whether it goes as binary data: the
    output's own `binary_data` when it says, else the request's `binary_data_output`."""
    outputs, everything_binary = task_outputs(model), req.parameters.binary_data_output
    if not req.outputs:
        return dict.fromkeys(outputs.default, everything_binary)
    selected = {}
    for asked in req.outputs:
        if asked.name not in outputs.names:
            raise InvalidRequest(f"unknown output {shown(asked.name)}; {outputs.listing}")
        own = asked.parameters.binary_data
        selected[asked.name] = everything_binary if own is None else own
    return selected


def v2_texts(req: V2InferRequest, binary: bytes, max_inputs: int, names: tuple[str, ...] = (V2_INPUT,),
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


def v2_tensors(result: EncodeResult, attended: list[int], requested: list[str], T: int) -> dict[str, np.ndarray]:
    """The v2 response's tensors: token-level outputs zero-padded to the longest input (`attended`: each
    input's attended tokens, the mask's ones), sparse and multi-vector outputs flat (no padding) with their
    offsets and lengths."""
    n = len(attended)
    out: dict[str, np.ndarray] = {}
    for name in requested:
        if name == "sentence_embedding":
            out[name] = np.ascontiguousarray(result.embeddings, dtype=np.float32)
        elif name == "attention_mask":
            mask = np.zeros((n, T), dtype=np.int64)
            for i, k in enumerate(attended):
                mask[i, :k] = 1
            out[name] = mask
        elif name == "sparse_indices":
            out[name] = np.concatenate([indices for indices, _ in result.sparse]).astype(np.int64)
        elif name == "sparse_values":
            out[name] = np.concatenate([values for _, values in result.sparse]).astype(np.float32)
        elif name == "sparse_offsets":
            out[name] = np.array([0, *accumulate(len(indices) for indices, _ in result.sparse)], dtype=np.int64)
        elif name == "multivector":
            out[name] = np.ascontiguousarray(np.concatenate(result.multivectors), dtype=np.float32)
        elif name == "multivector_lengths":
            out[name] = np.array([len(m) for m in result.multivectors], dtype=np.int64)
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


V2_KINDS = {"sentence_embedding": "embedding", "last_hidden_state": "token_embeddings", "attentions": "attention",
            **dict.fromkeys(V2_SPARSE_OUTPUTS, "sparse"), **dict.fromkeys(V2_MULTIVECTOR_OUTPUTS, "multivector")}


V2_EXTENSIONS = ["binary_tensor_data"]


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
    model = engine.model
    d, L, H = model.hidden_size, model.num_layers, model.num_heads
    described = {
        "sentence_embedding": ("FP32", [-1, model.sentence_dim]),
        "last_hidden_state": ("FP32", [-1, -1, d]),
        "attention_mask": ("INT64", [-1, -1]),
        "attentions": ("FP32", [L, -1, H, -1, -1]),
        "sparse_indices": ("INT64", [-1]),
        "sparse_values": ("FP32", [-1]),
        "sparse_offsets": ("INT64", [-1]),
        "multivector": ("FP32", [-1, model.multivector.dim if model.multivector else -1]),
        "multivector_lengths": ("INT64", [-1]),
    }
    return {
        "name": engine.name,
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": V2_INPUT, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": name, "datatype": described[name][0], "shape": described[name][1]}
                    for name in task_outputs(model).names],
    }


@dataclass(frozen=True)
class V2Call:
    """What a v2 inference takes from the transport it came in on (http.py, grpc.py): its route and
    protocol (the metrics' labels), and how a job runs (the call's deadline, a client that leaves)."""

    route: str
    protocol: str
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
    """An embedding model on v2: `text` in; the sentence embedding, token states, mask and attentions, and
    the model's sparse and multi-vector tensors, out, as `outputs` selects them, after the response's size
    is checked (a SPLADE vector's terms, bounded by the vocabulary only, once they are known)."""
    model = engine.model
    sparse, multivector = bool(set(V2_SPARSE_OUTPUTS) & set(outputs)), bool(set(V2_MULTIVECTOR_OUTPUTS) & set(outputs))
    pooled_only = not ({"last_hidden_state", "attentions"} & set(outputs) or multivector
                       or (sparse and model.needs_heads))
    texts, skip = svc.prompted(engine, svc.texts(v2_texts(req, binary, svc.settings.max_inputs)[V2_INPUT]),
                               req.parameters.prompt_name, req.parameters.input_type, pooled_only)
    is_query = req.parameters.input_type == "query"  # a ColBERT's query marker and expansion
    tokenized, ids, attended = await svc.tokenize_for_model(engine, texts, req.parameters.truncate, call.route,
                                                            is_query, protocol=call.protocol)
    lengths = [len(i) for i in ids]
    n, T = len(tokenized), max(lengths)
    d, L, H = model.hidden_size, model.num_layers, model.num_heads
    if "attentions" in outputs:
        svc.check_attention_size(engine, tokenized)
    splade = sparse and model.sparse.kind == "splade"
    terms = 0 if splade else sum(lengths)  # BGE-M3: at most a term per token
    sizes = {"sentence_embedding": n * model.sentence_dim, "last_hidden_state": n * T * d, "attention_mask": n * T,
             "attentions": L * n * H * T * T, "sparse_indices": 2 * terms, "sparse_values": terms,
             "sparse_offsets": n + 1, "multivector": sum(lengths) * (model.multivector.dim if multivector else 0),
             "multivector_lengths": n}
    estimate = sum(sizes[name] * (4 if as_binary else JSON_FLOAT_BYTES) for name, as_binary in outputs.items())
    svc.check_response_size(estimate)
    job = EncodeJob(
        route=call.route,
        protocol=call.protocol,
        ids=ids,
        normalize=model.normalize,
        want_embedding="sentence_embedding" in outputs,
        want_hidden="last_hidden_state" in outputs,
        attention=(tuple(range(L)), tuple(range(H))) if "attentions" in outputs else None,
        pool_skip=skip,
        sparse=sparse,
        multivector=multivector,
        is_query=is_query,
        attended=attended,
    )
    result = await call.infer(job)
    if splade:
        found = sum(len(indices) for indices, _ in result.sparse)
        estimate += sum(found * (8 if outputs[name] else JSON_FLOAT_BYTES) for name in V2_SPARSE_OUTPUTS[:2]
                        if name in outputs)
        svc.check_response_size(estimate)
    mask = attended if attended is not None else lengths
    return V2Ran(lambda: v2_tensors(result, mask, list(outputs), T), estimate)


async def _v2_classify(svc: EncoderService, engine: Engine, req: V2InferRequest, binary: bytes,
                       outputs: dict[str, bool], call: V2Call) -> V2Ran:
    """A classification model on v2: `text` (and `text_pair` for query-document pairs, one each) in;
    `logits` and `scores` out, scores read as /v1/classify reads them (the checkpoint's problem_type)."""
    inputs = v2_texts(req, binary, svc.settings.max_inputs, (V2_INPUT, V2_PAIR_INPUT), optional=(V2_PAIR_INPUT,))
    texts, truncate = svc.texts(inputs[V2_INPUT]), req.parameters.truncate
    if V2_PAIR_INPUT in inputs:
        pairs = svc.texts(inputs[V2_PAIR_INPUT])
        if len(pairs) != len(texts):
            raise InvalidRequest(f"{V2_PAIR_INPUT!r} has {len(pairs)} elements, {V2_INPUT!r} {len(texts)}: one pair each")
        tokenized = await svc.tokenize_pairs(engine, list(zip(texts, pairs, strict=True)), truncate, call.route,
                                             protocol=call.protocol)
    else:
        tokenized = await svc.tokenize(engine, texts, truncate, call.route, protocol=call.protocol)
    result = await call.infer(classification_job(call.route, tokenized, V2_PAIR_INPUT in inputs, call.protocol))
    logits = np.ascontiguousarray(result.embeddings, dtype=np.float32)
    computed = {"logits": logits,
                "scores": np.ascontiguousarray(read_logits(logits, engine.model.problem_type), dtype=np.float32)}
    return V2Ran(lambda: {name: computed[name] for name in outputs}, logits.size * 2 * JSON_FLOAT_BYTES)
