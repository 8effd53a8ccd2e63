"""The native API's /v1/encode (embeddings, token encodings, tokens, attention weights; long texts
chunked on request) and /v1/tokenize.

No `from __future__ import annotations` in route modules: FastAPI must see real annotation
objects in the route functions' signatures.
"""

from typing import Any

from fastapi import Depends, Request

from service.engine.errors import InvalidRequest
from service.engine.engine import Engine
from service.engine.runner import EncodeJob, mean_of_chunks
from service.engine.encoder_service import EncoderService
from service.engine.tokenization import TokenizedText, char_span, token_list
from service.engine.prompts import normalization
from service.front.deps import api_router, call_of, infer, model_for, service
from service.front.responses import JSONResponse, KindCounter, respond, value_bytes
from service.front.schemas import ERROR_RESPONSES
from service.apis.native.schemas import EncodeRequest, EncodeResponse, TokenizeRequest, TokenizeResponse

router = api_router()


def encode_size(body: EncodeRequest, tokenized: list[TokenizedText], attention, hidden_size: int,
                sentence_dim: int | None = None) -> int:
    """An upper bound of a /v1/encode response's size, computed before any inference is spent."""
    floats = 0
    for t in tokenized:
        floats += (sentence_dim or hidden_size) if body.embedding else 0
        floats += t.n_tokens * hidden_size if body.token_embeddings else 0
    # what will be written: a JSON float, or a float32's share of base64 (a third of the bytes)
    size = int(floats * value_bytes(body.encoding_format, "float32")) + 100 * len(tokenized)
    if body.tokens:
        size += sum(t.n_tokens for t in tokenized) * 80
    if attention is not None:
        per_value = value_bytes(body.attention.format, body.attention.dtype)
        size += int(sum(len(attention[0]) * len(attention[1]) * t.n_tokens**2 for t in tokenized) * per_value)
    return size


@router.post("/v1/encode", response_model=EncodeResponse, responses=ERROR_RESPONSES)
async def encode(body: EncodeRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Embeddings, token encodings, tokens with offsets, attention weights."""
    engine = model_for(svc, body.model, request)
    pooled_only = not (body.token_embeddings or body.attention is not None)
    texts, skip = svc.prompted(engine, svc.texts(body.inputs), body.prompt_name, body.input_type, pooled_only,
                           chunked=body.chunking is not None)
    if body.chunking is not None:
        return await encode_chunked(body, engine, texts, request, svc)
    attention = None
    if body.attention is not None:
        attention = (
            svc.indexes(body.attention.layers, engine.model.num_layers, "layer"),
            svc.indexes(body.attention.heads, engine.model.num_heads, "head"),
        )
    tokenized = await svc.tokenize(engine, texts, body.truncate, "/v1/encode")
    if attention is not None:
        svc.check_attention_size(engine, tokenized)
    estimate = encode_size(body, tokenized, attention, engine.model.hidden_size, engine.model.sentence_dim)
    svc.check_response_size(estimate)
    normalize = normalization(body.normalize, engine.model)
    job = EncodeJob(
        route="/v1/encode",
        ids=[t.ids for t in tokenized],
        normalize=normalize,
        want_embedding=body.embedding,
        want_hidden=body.token_embeddings,
        attention=attention,
        pool_skip=skip,
    )
    result = await infer(svc, engine, job, request)
    kinds = KindCounter()

    def build() -> dict:  # on the event loop when small, else in a worker thread (responses.respond)
        data = []
        for i, tok in enumerate(tokenized):
            item: dict[str, Any] = {"index": i, "n_tokens": tok.n_tokens}
            if body.embedding:
                item["embedding"] = kinds.array("embedding", result.embeddings[i], body.encoding_format, "float32")
            if body.token_embeddings:
                item["token_embeddings"] = kinds.array("token_embeddings", result.hidden[i], body.encoding_format,
                                                       "float32")
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
                    "data": kinds.array("attention", result.attentions[i], spec.format, spec.dtype),
                }
            data.append(item)
        return {"model": engine.name, "data": data, "usage": {"tokens": sum(t.n_tokens for t in tokenized)}}

    response = await respond(build, estimate)
    kinds.report(call_of(request))
    return response


@router.post("/v1/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Tokens, ids and character offsets, exactly as /v1/encode sees them."""
    engine = model_for(svc, body.model, request, task=None)  # every model has a tokenizer
    texts = svc.texts(body.inputs)
    tokenized = await svc.tokenize(engine, texts, body.truncate, "/v1/tokenize", limit_tokens=False)
    kinds = KindCounter()
    data = [
        {"index": i, "tokens": kinds.fragment("tokens", token_list(t.encoding)), "truncated": t.truncated}
        for i, t in enumerate(tokenized)
    ]
    kinds.report(call_of(request))
    return JSONResponse({"model": engine.name, "data": data})


async def encode_chunked(body: EncodeRequest, engine: Engine, texts: list[str], request: Request,
                         svc: EncoderService) -> JSONResponse:
    """/v1/encode with chunking: every chunk's embedding and character span, and the text's embedding,
    the normalised mean of its chunks'. Every chunk counts toward the token budget and the response size."""
    if body.token_embeddings or body.tokens or body.attention is not None:
        raise InvalidRequest("chunking returns embeddings (each chunk's and the text's): leave token_embeddings, "
                             "tokens and attention out")
    spec = body.chunking
    chunks = await svc.tokenize_chunks(engine, texts, spec.tokens, spec.overlap, "/v1/encode")
    flat = [c for text in chunks for c in text]
    estimate = int((len(flat) + len(texts)) * engine.model.sentence_dim * value_bytes(body.encoding_format, "float32"))
    svc.check_response_size(estimate + 100 * (len(flat) + len(texts)))
    job = EncodeJob(route="/v1/encode", ids=[c.ids for c in flat], normalize=normalization(body.normalize, engine.model))
    result = await infer(svc, engine, job, request)
    means = mean_of_chunks(result.embeddings, [len(c) for c in chunks])
    kinds = KindCounter()

    def build() -> dict:
        data, row = [], 0
        for i, text in enumerate(chunks):
            items = []
            for chunk in text:
                start, end = char_span(chunk.encoding)
                items.append({"start": start, "end": end, "n_tokens": chunk.n_tokens, "embedding": kinds.array(
                    "embedding", result.embeddings[row], body.encoding_format, "float32")})
                row += 1
            data.append({"index": i, "n_tokens": sum(c.n_tokens for c in text),
                         "embedding": kinds.array("embedding", means[i], body.encoding_format, "float32"), "chunks": items})
        return {"model": engine.name, "data": data, "usage": {"tokens": sum(c.n_tokens for c in flat)}}

    response = await respond(build, estimate)
    kinds.report(call_of(request))
    return response
