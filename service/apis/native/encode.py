"""The native API's /v1/encode (embeddings, token encodings, tokens, attention weights; long texts
chunked on request) and /v1/tokenize.

No `from __future__ import annotations` in route modules: FastAPI must see real annotation
objects in the route functions' signatures.
"""

from typing import Any

from fastapi import Depends, Request

from service.engine.errors import InvalidRequest
from service.engine.engine import Engine
from bundle.representations import top_terms
from service.engine.runner import EncodeJob, mean_of_chunks
from service.engine.encoder_service import EncoderService
from service.engine.tokenization import TokenizedText, char_span, token_list
from service.engine.prompts import normalization
from service.front.deps import api_router, call_of, infer, model_for, service
from service.front.responses import JSONResponse, KindCounter, respond, value_bytes
from service.front.schemas import ERROR_RESPONSES
from service.apis.native.schemas import EncodeRequest, EncodeResponse, TokenizeRequest, TokenizeResponse

router = api_router()


# a sparse term in JSON: its index, its weight and their separators; its token string when asked
SPARSE_TERM_BYTES, SPARSE_TOKEN_BYTES = 24, 24


def encode_size(body: EncodeRequest, tokenized: list[TokenizedText], attention, hidden_size: int,
                sentence_dim: int | None = None, wants: "Representations | None" = None,
                run_lengths: list[int] | None = None) -> int:
    """An upper bound of a /v1/encode response's size, computed before any inference is spent.
    `run_lengths`: each text's tokens as it runs (a ColBERT's marker and query expansion included). A
    SPLADE vector's terms are not bounded by its tokens: they are counted at top_k here, and exactly
    before the response is written."""
    wants = wants or Representations(embedding=body.embedding is not False)
    lengths = run_lengths or [t.n_tokens for t in tokenized]
    floats = 0
    for t, n in zip(tokenized, lengths, strict=True):
        floats += (sentence_dim or hidden_size) if wants.embedding else 0
        floats += t.n_tokens * hidden_size if body.token_embeddings else 0
        floats += n * wants.multivector_dim
    # what will be written: a JSON float, or a float32's share of base64 (a third of the bytes)
    size = int(floats * value_bytes(body.encoding_format, "float32")) + 100 * len(tokenized)
    size += sum(wants.sparse_terms(n) for n in lengths) * sparse_term_bytes(body)
    if body.tokens:
        size += sum(t.n_tokens for t in tokenized) * 80
    if attention is not None:
        per_value = value_bytes(body.attention.format, body.attention.dtype)
        size += int(sum(len(attention[0]) * len(attention[1]) * t.n_tokens**2 for t in tokenized) * per_value)
    return size


def sparse_term_bytes(body: EncodeRequest) -> int:
    return SPARSE_TERM_BYTES + (SPARSE_TOKEN_BYTES if body.sparse_tokens else 0)


class Representations:
    """What one /v1/encode request asks of its model, checked against what the model gives (a 400 that
    says which it gives), with what its response's size bound needs to know."""

    def __init__(self, embedding: bool, sparse: bool = False, multivector: bool = False, engine: Engine | None = None,
                 top_k: int | None = None) -> None:
        self.embedding, self.sparse, self.multivector = embedding, sparse, multivector
        model = engine.model if engine is not None else None
        self.multivector_dim = model.multivector.dim if multivector and model is not None else 0
        self.splade = bool(sparse and model is not None and model.sparse.kind == "splade")
        self.top_k = top_k

    def sparse_terms(self, n_tokens: int) -> int:
        """The most terms a text's sparse vector may have, known before inference: one per token (BGE-M3);
        a SPLADE vector's are bounded by the vocabulary only, so counted at top_k, and checked again once known."""
        if not self.sparse:
            return 0
        if self.splade:
            return self.top_k or 0
        return min(n_tokens, self.top_k or n_tokens)

    @classmethod
    def asked(cls, body: EncodeRequest, engine: Engine, svc: EncoderService) -> "Representations":
        """The request's representations: `embedding` left out means the model's dense embedding where it has
        one; a request that asks for nothing at all gets the model's own representations (a SPLADE model's
        sparse vector, a ColBERT's token vectors)."""
        has = engine.model.representations
        embedding = ("dense" in has) if body.embedding is None else body.embedding
        sparse, multivector = body.sparse, body.multivector
        nothing = not (embedding or sparse or multivector or body.token_embeddings or body.tokens
                       or body.attention is not None)
        if nothing and body.embedding is None:
            sparse, multivector = "sparse" in has, "multivector" in has
        svc.check_representations(engine, [name for name, on in (("dense", embedding), ("sparse", sparse),
                                                                  ("multivector", multivector)) if on])
        if (body.sparse_tokens or body.top_k is not None) and not sparse:
            raise InvalidRequest("sparse_tokens and top_k shape the sparse vector: ask sparse: true")
        if body.normalize is not None and "dense" not in has:
            raise InvalidRequest(f"normalize applies to the dense embedding, which model {engine.name!r} has not "
                                 f"(it gives {', '.join(has)}, normalised as the model was trained)")
        return cls(embedding, sparse, multivector, engine, body.top_k)


@router.post("/v1/encode", response_model=EncodeResponse, responses=ERROR_RESPONSES)
async def encode(body: EncodeRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Embeddings, sparse vectors, token vectors (multi-vector), token encodings, tokens with offsets,
    attention weights: any mix, from one forward pass."""
    engine = await model_for(svc, body.model, request)
    wants = Representations.asked(body, engine, svc)
    pooled_only = not (body.token_embeddings or body.attention is not None or wants.multivector
                       or engine.model.needs_heads and wants.sparse)
    texts, skip = svc.prompted(engine, svc.texts(body.inputs), body.prompt_name, body.input_type, pooled_only,
                               chunked=body.chunking is not None)
    if body.chunking is not None:
        if wants.sparse or wants.multivector:
            raise InvalidRequest("chunking returns embeddings (each chunk's and the text's): leave sparse and "
                                 "multivector out")
        return await encode_chunked(body, engine, texts, request, svc)
    attention = None
    if body.attention is not None:
        attention = (
            svc.indexes(body.attention.layers, engine.model.num_layers, "layer"),
            svc.indexes(body.attention.heads, engine.model.num_heads, "head"),
        )
    is_query = body.input_type == "query"
    tokenized, ids, attended = await svc.tokenize_for_model(engine, texts, body.truncate, "/v1/encode", is_query)
    if attention is not None:
        svc.check_attention_size(engine, tokenized)
    estimate = encode_size(body, tokenized, attention, engine.model.hidden_size, engine.model.sentence_dim, wants,
                           [len(i) for i in ids])
    svc.check_response_size(estimate)
    normalize = normalization(body.normalize, engine.model) if "dense" in engine.model.representations \
        else engine.model.normalize
    job = EncodeJob(
        route="/v1/encode",
        ids=ids,
        normalize=normalize,
        want_embedding=wants.embedding,
        want_hidden=body.token_embeddings,
        attention=attention,
        pool_skip=skip,
        sparse=wants.sparse,
        multivector=wants.multivector,
        is_query=is_query,
        attended=attended,
    )
    result = await infer(svc, engine, job, request)
    sparse = None
    if wants.sparse:
        sparse = [top_terms(*terms, body.top_k) for terms in result.sparse]
        if engine.model.sparse.kind == "splade":  # its terms known now: the response's size, before it is written
            svc.check_response_size(estimate + sum(len(i) for i, _ in sparse) * sparse_term_bytes(body))
    kinds = KindCounter()

    def build() -> dict:  # on the event loop when small, else in a worker thread (responses.respond)
        data = []
        for i, tok in enumerate(tokenized):
            item: dict[str, Any] = {"index": i, "n_tokens": tok.n_tokens}
            if wants.embedding:
                item["embedding"] = kinds.array("embedding", result.embeddings[i], body.encoding_format, "float32")
            if sparse is not None:
                indices, values = sparse[i]
                vector: dict[str, Any] = {"indices": indices, "values": values}
                if body.sparse_tokens:
                    vector["tokens"] = engine.tokenizer.tokens_of(indices)
                item["sparse"] = kinds.fragment("sparse", vector)
            if wants.multivector:
                vectors = result.multivectors[i]
                item["multivector"] = {"shape": list(vectors.shape), "data": kinds.array(
                    "multivector", vectors, body.encoding_format, "float32")}
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
        return {"model": engine.name, "data": data, "usage": {"tokens": sum(len(i) for i in ids)}}

    response = await respond(build, estimate)
    kinds.report(call_of(request))
    return response


@router.post("/v1/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Tokens, ids and character offsets, exactly as /v1/encode sees them."""
    engine = await model_for(svc, body.model, request, task=None)  # every model has a tokenizer
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
