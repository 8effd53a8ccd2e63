"""The ingress deployment: HTTP routes, validation, tokenization, and the call to the encoder.

Routes raise `service.errors` exceptions; one set of handlers turns every failure (ours,
FastAPI's validation, unknown routes, anything unexpected) into a JSON error body.

No `from __future__ import annotations` here: FastAPI must see real annotation objects on the
route methods that Ray Serve's ingress rebinds.
"""

import asyncio
import base64
import hmac
import logging
import os
import struct
import time
from typing import Any

import numpy as np
import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from bundle.manifest import load_bundle
from service import __doc__ as service_doc
from service.batching import EncodeJob, EncodeResult, l2_normalize
from service.config import ServiceSettings
from service.errors import (
    BackendError,
    InvalidRequest,
    NotFound,
    NotReady,
    Overloaded,
    ServiceError,
    Timeout,
    TooLarge,
)
from service.metrics import refresh_periodically, service_metrics, status_class
from service.schemas import (
    EncodeRequest,
    EncodeResponse,
    ErrorResponse,
    OpenAIEmbeddingRequest,
    OpenAIEmbeddingResponse,
    TokenizeRequest,
    TokenizeResponse,
    V2InferRequest,
    V2ModelMetadata,
    as_list,
)
from service.tokenization import TextTokenizer, TokenizedText, token_list

logger = logging.getLogger("ray.serve")

SERVER_NAME = "mha-encoder-serving"
SERVER_VERSION = "0.1.0"
V2_INPUT = "text"
V2_OUTPUTS = ("sentence_embedding", "last_hidden_state", "attention_mask", "attentions")
V2_DEFAULT_OUTPUTS = ("sentence_embedding", "last_hidden_state", "attention_mask")
JSON_FLOAT_BYTES = 16  # a float32 in JSON, with its separator, at most


class JSONResponse(Response):
    """orjson with numpy support: float32 arrays are written as float32, not widened to float64."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (401, 404, 408, 413, 422, 429, 503)}


async def _record_route(request: Request) -> None:
    """An app-wide dependency: tell the metrics middleware which route template served the
    request (the scope dict is shared with it). Async: FastAPI runs a plain `def` dependency in
    a thread pool, a thread hop per request (seen in py-spy profiles of the ingress)."""
    route = request.scope.get("route")
    if route is not None:
        request.scope["route_template"] = getattr(route, "path", "unmatched")


app = FastAPI(
    title="MHA encoder service",
    version=SERVER_VERSION,
    description=service_doc,
    default_response_class=JSONResponse,
    dependencies=[Depends(_record_route)],
)


# --- errors ---------------------------------------------------------------------------------


def error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"type": type_, "message": message}}, status_code=status, headers=headers)


def _failed(request: Request, reason: str) -> None:
    """Tell the metrics middleware why this request failed, and on which route."""
    _record_route(request)
    request.scope["failure_reason"] = reason


@app.exception_handler(ServiceError)
async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    _failed(request, exc.type)
    return error_response(exc.status, exc.type, exc.message, exc.headers)


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple"}


def _describe(errors: list[dict]) -> str:
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
        return error_response(422, "validation", f"request body is not valid JSON ({errors[0].get('ctx', {}).get('error', 'decode error')})")
    content_type = request.headers.get("content-type", "")
    if "json" not in content_type and any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return error_response(
            422, "validation", f"request body must be a JSON object sent with Content-Type: application/json (got {content_type or 'none'!r})"
        )
    return error_response(422, "validation", _describe(errors))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http")
    _failed(request, "not_found" if exc.status_code == 404 else "validation")
    return error_response(exc.status_code, type_, str(exc.detail), getattr(exc, "headers", None))


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, RecursionError):  # absurdly nested JSON
        _failed(request, "validation")
        return error_response(422, "validation", "request body is nested too deeply")
    _failed(request, "backend")
    logger.exception("unexpected error")
    return error_response(500, "backend", f"internal error ({type(exc).__name__})")


class BodyLimitMiddleware:
    """Refuse request bodies over the limit with 413, whether or not Content-Length is sent.

    Pure ASGI, so the body is counted as it streams in and never buffered past the limit.
    """

    limit = 8 * 1024 * 1024  # replaced by the ingress from its settings

    def __init__(self, app_: Any) -> None:
        self.app = app_

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = BodyLimitMiddleware.limit
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, limit)
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await self._refuse(scope, receive, send, limit)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope: dict, receive: Any, send: Any, limit: int) -> None:
        response = error_response(413, "too_large", f"request body is larger than the limit of {limit} bytes")
        await response(scope, receive, send)


_REASON_BY_STATUS = {401: "unauthorized", 404: "not_found", 408: "timeout", 413: "too_large", 422: "validation",
                     429: "overloaded", 503: "overloaded"}


class MetricsMiddleware:
    """Counts every request by route template and status, its total time, in-flight requests,
    failures by reason, and response bytes (the routes report bytes per output kind)."""

    # Requests inside this replica's app now. A class attribute, not a module variable: Ray
    # Serve pickles the ingress's methods by value, module variables they read included, while
    # this class is imported by reference, so every reader sees the same number.
    in_flight = 0

    def __init__(self, app_: Any) -> None:
        self.app = app_

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics = service_metrics()
        started = time.perf_counter()
        status = 500
        sent = 0
        MetricsMiddleware.in_flight += 1
        metrics.in_flight.set(MetricsMiddleware.in_flight)

        async def counting_send(message: dict) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            MetricsMiddleware.in_flight -= 1
            metrics.in_flight.set(MetricsMiddleware.in_flight)
            # set by _record_route (or an error handler): the template, so label values stay few
            route = scope.get("route_template", "unmatched")
            metrics.requests.inc(tags={"route": route, "status_class": status_class(status)})
            metrics.duration.observe(time.perf_counter() - started, tags={"route": route, "stage": "total"})
            if status >= 400:
                reason = scope.get("failure_reason") or _REASON_BY_STATUS.get(status, "backend")
                metrics.failures.inc(tags={"route": route, "reason": reason})
            kinds: dict[str, int] = scope.get("response_kinds") or {}
            for kind, n in kinds.items():
                if n > 0:
                    metrics.response_bytes.inc(n, tags={"route": route, "kind": kind})
            other = sent - sum(kinds.values())
            if other > 0:
                metrics.response_bytes.inc(other, tags={"route": route, "kind": "other"})




class BearerAuthMiddleware:
    """Optional bearer-token authentication of the inference routes.

    Health, readiness, model metadata, /info and the docs stay open (probes and scrapers carry
    no token). A missing or wrong token is a 401 before the body is read: nothing reaches the
    tokenizer or the model. Tokens are compared in constant time.
    """

    token: bytes | None = None  # set by the ingress from its settings; None: authentication off

    def __init__(self, app_: Any) -> None:
        self.app = app_

    @staticmethod
    def protected(method: str, path: str) -> bool:
        return method == "POST" and (path.startswith("/v1/") or (path.startswith("/v2/models/") and path.endswith("/infer")))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        token = BearerAuthMiddleware.token
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # an application under a route prefix
            path = path[len(root):]
        if scope["type"] != "http" or token is None or not self.protected(scope.get("method", ""), path):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, provided = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(provided.strip(), token):
            return await self.app(scope, receive, send)
        scope["failure_reason"] = "unauthorized"
        response = error_response(
            401, "unauthorized", "missing or invalid bearer token", {"WWW-Authenticate": 'Bearer realm="encoder"'}
        )
        await response(scope, receive, send)


def load_token(settings: ServiceSettings) -> bytes | None:
    """The API token: from the file named in the settings (a mounted secret), else from the
    environment variable named in the settings; None when neither is set (authentication off)."""
    if settings.auth_token_file is not None:
        token = settings.auth_token_file.read_text().strip()
        if not token:
            raise ValueError(f"{settings.auth_token_file}: the token file is empty")
        return token.encode()
    value = os.environ.get(settings.auth_token_env, "").strip()
    return value.encode() if value else None


app.add_middleware(BodyLimitMiddleware)
app.add_middleware(BearerAuthMiddleware)
app.add_middleware(MetricsMiddleware)  # added last: outermost, so it sees every refusal too


# --- the ingress deployment ---------------------------------------------------------------


def _encode_array(array: np.ndarray, fmt: str, dtype: str) -> Any:
    """An array as nested floats or as base64 of little-endian bytes."""
    typed = array.astype("<f2" if dtype == "float16" else "<f4", copy=False)
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(typed).tobytes()).decode("ascii")
    # float16 goes out as the float32 of its rounded value: JSON has no half floats
    return np.ascontiguousarray(typed.astype(np.float32, copy=False))


class KindCounter:
    """Serialises each output once (as an orjson Fragment) and keeps its size by kind."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def fragment(self, kind: str, value: Any) -> orjson.Fragment:
        raw = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
        self.bytes[kind] = self.bytes.get(kind, 0) + len(raw)
        return orjson.Fragment(raw)

    def report(self, request: Request) -> None:
        """Hand the sizes to the metrics middleware; it adds the envelope as kind 'other'."""
        request.scope["response_kinds"] = self.bytes


# --- v2 wire format helpers -----------------------------------------------------------------


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
        raise InvalidRequest(_describe(list(exc.errors()))) from None


def _v2_texts(req: V2InferRequest, binary: bytes) -> list[str]:
    """The texts of the single BYTES input, from JSON data or binary length-prefixed strings."""
    if len(req.inputs) != 1 or req.inputs[0].name != V2_INPUT:
        raise InvalidRequest(f"expected exactly one input named {V2_INPUT!r} (BYTES, shape [n])")
    tensor = req.inputs[0]
    if tensor.datatype != "BYTES":
        raise InvalidRequest(f"input {V2_INPUT!r} must have datatype BYTES, got {tensor.datatype}")
    count = int(np.prod(tensor.shape)) if tensor.shape else 0
    if len(tensor.shape) not in (1, 2) or (len(tensor.shape) == 2 and tensor.shape[1] != 1) or count < 1:
        raise InvalidRequest(f"input {V2_INPUT!r} must have shape [n] or [n, 1] with n >= 1, got {tensor.shape}")
    binary_size = (tensor.parameters or {}).get("binary_data_size")
    if binary_size is not None:
        if not isinstance(binary_size, int) or binary_size != len(binary):
            raise InvalidRequest(f"binary_data_size {binary_size} does not match the {len(binary)} bytes sent")
        items, offset = [], 0
        while offset < len(binary):
            if offset + 4 > len(binary):
                raise InvalidRequest("truncated BYTES element in binary data")
            (length,) = struct.unpack_from("<I", binary, offset)
            offset += 4
            if offset + length > len(binary):
                raise InvalidRequest("truncated BYTES element in binary data")
            items.append(binary[offset : offset + length])
            offset += length
    else:
        items = tensor.data or []
        flat = []
        for item in items:  # JSON data may be nested per shape
            flat.extend(item if isinstance(item, list) else [item])
        items = flat
    if len(items) != count:
        raise InvalidRequest(f"input {V2_INPUT!r} has shape {tensor.shape} but {len(items)} elements")
    texts = []
    for i, item in enumerate(items):
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidRequest(f"element {i} of {V2_INPUT!r} is not valid UTF-8") from None
        if not isinstance(item, str):
            raise InvalidRequest(f"element {i} of {V2_INPUT!r} must be a string")
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
            entry["data"] = kinds.fragment(kind, array.reshape(-1))
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


# Everything the routes call is defined above the deployment: serve.ingress snapshots the
# FastAPI app (with its routes' globals) when the class is decorated.

@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    """Validates and tokenizes; sends each request to the encoder as one batch item."""

    def __init__(self, encoder: DeploymentHandle, settings: ServiceSettings) -> None:
        bundle = load_bundle(settings.bundle)
        self.manifest = bundle.manifest
        self.model = bundle.manifest.model
        self.bundle_sha256 = bundle.sha256
        self.settings = settings
        self.name = settings.model_name or self.model.name
        self.tokenizer = TextTokenizer(bundle.tokenizer_path, self.model.max_tokens)
        self.encoder = encoder
        BodyLimitMiddleware.limit = settings.max_body_bytes
        BearerAuthMiddleware.token = load_token(settings)
        if BearerAuthMiddleware.token is None:
            logger.warning("no API token configured (%s / auth_token_file): inference routes are open", settings.auth_token_env)
        refresh_periodically(lambda: service_metrics().in_flight.set(MetricsMiddleware.in_flight))

    # ---- shared steps ----

    def _texts(self, inputs: str | list[str]) -> list[str]:
        texts = as_list(inputs)
        if len(texts) > self.settings.max_inputs:
            raise TooLarge(f"{len(texts)} inputs; at most {self.settings.max_inputs} per request")
        for i, text in enumerate(texts):
            if len(text) > self.settings.max_text_chars:
                raise TooLarge(f"input {i} has {len(text)} characters; the limit is {self.settings.max_text_chars}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON allows "\ud800"; the tokenizer does not
                raise InvalidRequest(f"input {i} is not valid Unicode: {exc.reason} at character {exc.start}") from None
        return texts

    async def _tokenize(self, texts: list[str], truncate: bool, route: str) -> list[TokenizedText]:
        started = time.perf_counter()
        tokenized = await asyncio.to_thread(self.tokenizer.encode, texts, truncate)
        service_metrics().duration.observe(time.perf_counter() - started, tags={"route": route, "stage": "tokenization"})
        total = sum(t.n_tokens for t in tokenized)
        if total > self.settings.batching.max_batch_tokens:
            raise TooLarge(
                f"request has {total} tokens; at most {self.settings.batching.max_batch_tokens} per request "
                "(split it into smaller requests)"
            )
        return tokenized

    def _check_response_size(self, n_bytes: int) -> None:
        if n_bytes > self.settings.max_response_bytes:
            raise TooLarge(
                f"the response would be about {n_bytes} bytes; the limit is {self.settings.max_response_bytes} "
                "(ask for fewer texts, layers or heads, or base64 float16)"
            )

    def _indexes(self, requested: list[int] | None, count: int, what: str) -> tuple[int, ...]:
        if requested is None:
            return tuple(range(count))
        bad = [i for i in requested if not 0 <= i < count]
        if bad:
            raise InvalidRequest(f"unknown {what} index {bad[0]}: the model has {count} {what}s (0..{count - 1})")
        if len(set(requested)) != len(requested):
            raise InvalidRequest(f"duplicate {what} indexes in {requested}")
        return tuple(requested)

    async def _infer(self, job: EncodeJob) -> EncodeResult:
        """Send one job to the encoder; map Serve's failures to our taxonomy."""
        response = self.encoder.encode.remote(job)
        try:
            return await asyncio.wait_for(response, timeout=self.settings.request_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()  # drop it from the batch queue: nobody waits for it any more
            raise Timeout(f"inference did not finish within {self.settings.request_timeout_s:g}s") from None
        except BackPressureError:
            raise Overloaded(
                "the encoder's queue is full; retry later", headers={"Retry-After": str(self.settings.retry_after_s)}
            ) from None
        except DeploymentUnavailableError:
            raise NotReady(
                "no encoder replica is available", headers={"Retry-After": str(self.settings.retry_after_s)}
            ) from None
        except RequestCancelledError:
            raise Timeout("the request was cancelled") from None
        except ServiceError:
            raise
        except Exception as exc:  # a replica died mid-request, or the batch failed
            logger.warning("encoder call failed: %s: %s", type(exc).__name__, exc)
            raise BackendError(f"inference failed ({type(exc).__name__}); the request can be retried") from None

    # ---- native routes ----

    @app.post("/v1/encode", response_model=EncodeResponse, responses=ERROR_RESPONSES)
    async def encode(self, body: EncodeRequest, request: Request) -> JSONResponse:
        """Embeddings, token encodings, tokens with offsets, attention weights."""
        texts = self._texts(body.inputs)
        attention = None
        if body.attention is not None:
            attention = (
                self._indexes(body.attention.layers, self.model.num_layers, "layer"),
                self._indexes(body.attention.heads, self.model.num_heads, "head"),
            )
        tokenized = await self._tokenize(texts, body.truncate, "/v1/encode")
        self._check_response_size(self._encode_size(body, tokenized, attention))
        normalize = self.model.normalize if body.normalize is None else body.normalize
        job = EncodeJob(
            route="/v1/encode",
            ids=[t.ids for t in tokenized],
            normalize=normalize,
            want_embedding=body.embedding,
            want_hidden=body.token_embeddings,
            attention=attention,
        )
        result = await self._infer(job)
        kinds = KindCounter()
        data = []
        for i, tok in enumerate(tokenized):
            item: dict[str, Any] = {"index": i, "n_tokens": tok.n_tokens}
            if body.embedding:
                item["embedding"] = kinds.fragment(
                    "embedding", _encode_array(result.embeddings[i], body.encoding_format, "float32")
                )
            if body.token_embeddings:
                item["token_embeddings"] = kinds.fragment(
                    "token_embeddings", _encode_array(result.hidden[i], body.encoding_format, "float32")
                )
            if body.tokens:
                item["tokens"] = kinds.fragment("tokens", token_list(tok.encoding))
            if attention is not None:
                spec = body.attention
                item["attention"] = {
                    "layers": list(attention[0]),
                    "heads": list(attention[1]),
                    "shape": list(result.attentions[i].shape),
                    "dtype": spec.dtype,
                    "format": spec.format,
                    "data": kinds.fragment("attention", _encode_array(result.attentions[i], spec.format, spec.dtype)),
                }
            data.append(item)
        usage = {"tokens": sum(t.n_tokens for t in tokenized)}
        kinds.report(request)
        return JSONResponse({"model": self.name, "data": data, "usage": usage})

    def _encode_size(self, body: EncodeRequest, tokenized: list[TokenizedText], attention) -> int:
        """An upper bound of the response size, computed before any inference is spent."""
        d = self.model.hidden_size
        floats = 0
        for t in tokenized:
            n = t.n_tokens
            floats += d if body.embedding else 0
            floats += n * d if body.token_embeddings else 0
        size = floats * JSON_FLOAT_BYTES + 100 * len(tokenized)
        if body.tokens:
            size += sum(t.n_tokens for t in tokenized) * 80
        if attention is not None:
            per_value = JSON_FLOAT_BYTES
            if body.attention.format == "base64":
                per_value = (2 if body.attention.dtype == "float16" else 4) * 4 / 3
            size += int(sum(len(attention[0]) * len(attention[1]) * t.n_tokens**2 for t in tokenized) * per_value)
        return size

    @app.post("/v1/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(self, body: TokenizeRequest, request: Request) -> JSONResponse:
        """Tokens, ids and character offsets, exactly as /v1/encode sees them."""
        texts = self._texts(body.inputs)
        tokenized = await asyncio.to_thread(self.tokenizer.encode, texts, body.truncate)
        kinds = KindCounter()
        data = [
            {"index": i, "tokens": kinds.fragment("tokens", token_list(t.encoding)), "truncated": t.truncated}
            for i, t in enumerate(tokenized)
        ]
        kinds.report(request)
        return JSONResponse({"model": self.name, "data": data})

    # ---- OpenAI-compatible ----

    @app.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, responses=ERROR_RESPONSES)
    async def embeddings(self, body: OpenAIEmbeddingRequest, request: Request) -> JSONResponse:
        """OpenAI's embeddings API: works with the official `openai` client."""
        if body.model is not None and body.model != self.name:
            raise NotFound(f"model {body.model!r} is not served here; this service serves {self.name!r}")
        if body.dimensions is not None and body.dimensions > self.model.hidden_size:
            raise InvalidRequest(f"dimensions {body.dimensions} exceeds the model's {self.model.hidden_size}")
        texts = self._texts(body.input)
        tokenized = await self._tokenize(texts, True, "/v1/embeddings")
        result = await self._infer(
            EncodeJob(route="/v1/embeddings", ids=[t.ids for t in tokenized], normalize=self.model.normalize)
        )
        vectors = result.embeddings
        if body.dimensions is not None:  # shortened as OpenAI does: cut, then re-normalise
            vectors = np.ascontiguousarray(l2_normalize(vectors[:, : body.dimensions]).astype(np.float32))
        kinds = KindCounter()
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": kinds.fragment("embedding", _encode_array(v, body.encoding_format, "float32")),
            }
            for i, v in enumerate(vectors)
        ]
        kinds.report(request)
        tokens = sum(t.n_tokens for t in tokenized)
        return JSONResponse(
            {"object": "list", "data": data, "model": self.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        )

    # ---- service info and health ----

    async def _encoder_info(self, timeout: float = 2.0) -> dict:
        """Ask an encoder replica what it runs; fast enough for probes, which must not hang
        while no replica can serve."""
        try:
            return await asyncio.wait_for(self.encoder.info.remote(), timeout=timeout)
        except Exception as exc:
            raise NotReady(f"the encoder is not ready ({type(exc).__name__})", headers={"Retry-After": "1"}) from None

    @app.get("/health", responses=ERROR_RESPONSES)
    async def health(self) -> JSONResponse:
        """Ready when an encoder replica answers: 200, else 503."""
        info = await self._encoder_info()
        return JSONResponse({"status": "ok", "model": self.name, "provider": info["provider"]})

    @app.get("/info")
    async def info(self) -> JSONResponse:
        """The served model, where it runs, how requests are batched and limited, its parity report."""
        encoder = await self._encoder_info(timeout=10.0)
        s = self.settings
        return JSONResponse(
            {
                "model": self.name,
                "hidden_size": self.model.hidden_size,
                "num_layers": self.model.num_layers,
                "num_heads": self.model.num_heads,
                "max_tokens": self.model.max_tokens,
                "pooling": self.model.pooling,
                "normalize": self.model.normalize,
                "provider": encoder["provider"],
                "intra_op_threads": encoder["intra_op_threads"],
                "precision": encoder["precision"],
                "precision_requested": encoder["precision_requested"],
                "graphs": encoder["graphs"],
                "batching": encoder["batching"],
                "encoder_counters": encoder["counters"],  # of the replica that answered
                "replicas": {"encoder": s.encoder_replicas, "ingress": s.ingress_replicas},
                "limits": {
                    "max_inputs": s.max_inputs,
                    "max_text_chars": s.max_text_chars,
                    "max_body_bytes": s.max_body_bytes,
                    "max_response_bytes": s.max_response_bytes,
                    "max_request_tokens": s.batching.max_batch_tokens,
                    "request_timeout_s": s.request_timeout_s,
                    "encoder_max_queued_requests": s.encoder_max_queued_requests,
                },
                "bundle": {"path": str(s.bundle), "sha256": self.bundle_sha256, "opset": self.manifest.graph.opset},
                "parity": self.manifest.parity.model_dump(mode="json"),
                "variants": {
                    p: {"file": v.file, "fusions": v.fusions, "providers": v.providers,
                        "gate": (v.quality or v.parity).model_dump(mode="json")}
                    for p, v in self.manifest.variants.items()
                },
                "versions": self.manifest.versions,
            }
        )

    # ---- Open Inference Protocol v2 ----

    def _v2_model(self, name: str) -> None:
        if name != self.name:
            raise NotFound(f"model {name!r} not found; this service serves {self.name!r}")

    @app.get("/v2")
    async def v2_server(self) -> JSONResponse:
        return JSONResponse({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": ["binary_tensor_data"]})

    @app.get("/v2/health/live")
    async def v2_live(self) -> JSONResponse:
        """Liveness: this process answers. Never touches the model, so loading never fails it."""
        return JSONResponse({"live": True})

    @app.get("/v2/health/ready", responses=ERROR_RESPONSES)
    async def v2_ready(self) -> JSONResponse:
        await self._encoder_info()
        return JSONResponse({"ready": True})

    @app.get("/v2/models/{name}", response_model=V2ModelMetadata, responses=ERROR_RESPONSES)
    @app.get("/v2/models/{name}/versions/{version}", include_in_schema=False)
    async def v2_metadata(self, name: str, version: str = "1") -> JSONResponse:
        self._v2_model(name)
        d, L, H = self.model.hidden_size, self.model.num_layers, self.model.num_heads
        return JSONResponse(
            {
                "name": self.name,
                "versions": ["1"],
                "platform": "onnxruntime_onnx",
                "inputs": [{"name": V2_INPUT, "datatype": "BYTES", "shape": [-1]}],
                "outputs": [
                    {"name": "sentence_embedding", "datatype": "FP32", "shape": [-1, d]},
                    {"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, -1, d]},
                    {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1]},
                    {"name": "attentions", "datatype": "FP32", "shape": [L, -1, H, -1, -1]},
                ],
            }
        )

    @app.get("/v2/models/{name}/ready", responses=ERROR_RESPONSES)
    @app.get("/v2/models/{name}/versions/{version}/ready", include_in_schema=False)
    async def v2_model_ready(self, name: str, version: str = "1") -> JSONResponse:
        self._v2_model(name)
        await self._encoder_info()
        return JSONResponse({"name": self.name, "ready": True})

    @app.post("/v2/models/{name}/infer", responses=ERROR_RESPONSES)
    @app.post("/v2/models/{name}/versions/{version}/infer", include_in_schema=False)
    async def v2_infer(self, name: str, request: Request, version: str = "1") -> Response:
        """KServe/Triton inference: a BYTES tensor of texts in, the requested tensors out.

        Supports the binary tensor data extension that tritonclient uses by default.
        """
        self._v2_model(name)
        raw = await request.body()
        header_len = request.headers.get("inference-header-content-length")
        req, binary = _parse_v2_body(raw, header_len)
        texts = _v2_texts(req, binary)
        texts = self._texts(texts)
        params = req.parameters or {}
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise InvalidRequest("parameters.truncate must be a boolean")
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
        tokenized = await self._tokenize(texts, truncate, "/v2/models/{name}/infer")
        n, T = len(tokenized), max(t.n_tokens for t in tokenized)
        d, L, H = self.model.hidden_size, self.model.num_layers, self.model.num_heads
        sizes = {"sentence_embedding": n * d, "last_hidden_state": n * T * d, "attention_mask": n * T, "attentions": L * n * H * T * T}
        self._check_response_size(sum(sizes[k] * (4 if binary_out[k] else JSON_FLOAT_BYTES) for k in requested))
        job = EncodeJob(
            route="/v2/models/{name}/infer",
            ids=[t.ids for t in tokenized],
            normalize=self.model.normalize,
            want_hidden="last_hidden_state" in requested,
            attention=(tuple(range(L)), tuple(range(H))) if "attentions" in requested else None,
        )
        result = await self._infer(job)
        tensors = _v2_tensors(result, tokenized, requested, T)
        return _v2_response(
            {"model_name": self.name, "model_version": "1", "id": req.id or ""}, tensors, binary_out, request
        )
