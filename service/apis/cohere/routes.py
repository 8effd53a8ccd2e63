"""Cohere's API v2, so that a script written for Cohere (the official `cohere` SDK's ClientV2, and what
calls it) changes only its base URL: POST /v2/embed and POST /v2/rerank. Cohere's model names reach our
models through a bundle's `aliases` setting; its input types map onto the model's prompts
(service/engine/prompts.py cohere_prompt_name).

Thin routes over the same engine calls as ours, with the same limits, auth and metrics. Errors carry
Cohere's body, `{"id", "message"}` (the id is the request's X-Request-Id), with our statuses.

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

import base64
import math
import uuid

import numpy as np
from fastapi import Depends, Request

from service.engine.engine import Engine
from service.engine.errors import BadRequest, EmptyInput
from service.engine.prompts import check_dimensions, cohere_prompt_name, prompt_chars, shortened
from service.engine.runner import EncodeJob
from service.engine.encoder_service import EncoderService
from service.engine.late_interaction import is_late_interaction, late_interaction_scores
from service.engine.scoring import best_first, relevance, rerank_pairs
from service.front.deps import api_router, call_of, infer, model_for, reranker, runs, service
from service.front.request_ids import current_request_id
from service.front.responses import JSONResponse, KindCounter
from service.front.schemas import ERROR_RESPONSES
from service.apis.cohere.schemas import CohereEmbedRequest, CohereEmbedResponse, CohereRerankRequest, CohereRerankResponse

router = api_router()

API_VERSION = {"version": "2"}
DEFAULT_MAX_TOKENS_PER_DOC = 4096  # Cohere's default for rerank's max_tokens_per_doc


def response_id() -> str:
    """Cohere's `id` of a response: the request's X-Request-Id, so a log line can be found from it."""
    return current_request_id.get() or str(uuid.uuid4())


def packed_bits(vectors: np.ndarray) -> np.ndarray:
    """One bit per dimension (> 0), eight to a byte, the first dimension the highest bit: what
    sentence-transformers' quantize_embeddings(precision="ubinary") gives, and Cohere's ubinary."""
    return np.packbits(vectors > 0, axis=-1)


def by_type(vectors: np.ndarray, types: list[str], kinds: KindCounter) -> dict:
    """The embeddings in each requested type, Cohere's `embeddings` object."""
    out = {}
    for kind in dict.fromkeys(types):  # each once, in the order asked
        if kind == "float":
            out["float"] = kinds.array("embedding", vectors, "float", "float32")
        elif kind == "base64":  # little-endian float32 bytes, one string per text (as vLLM's Cohere route)
            out["base64"] = kinds.fragment("embedding", [base64.b64encode(v.astype("<f4").tobytes()).decode()
                                                         for v in vectors])
        elif kind == "ubinary":
            out["ubinary"] = kinds.fragment("embedding", packed_bits(vectors).tolist())
        elif kind == "binary":  # the same bits as signed bytes: ubinary - 128, as sentence-transformers' binary
            out["binary"] = kinds.fragment("embedding", (packed_bits(vectors).astype(np.int16) - 128).tolist())
    return out


async def cut(svc: EncoderService, engine: Engine, texts: list[str], tokens: int, from_start: bool, refuse: bool,
              field: str, route: str) -> list[str]:
    """Each text cut to `tokens` tokens (at its end, or start), tokenized off the event loop when large;
    with `refuse` (truncate NONE), a text over it is a 400 naming it instead. At or past the model's own
    limit there is nothing to do here: tokenizing cuts (or refuses) there."""
    if tokens >= engine.model.max_tokens:
        return texts
    out = []
    for i, (text, was_cut) in enumerate(await svc.cut_to_tokens(engine, texts, tokens, from_start, route)):
        if was_cut and refuse:
            raise BadRequest(f"texts.{i} has more than {field} {tokens} tokens and truncate is NONE")
        out.append(text)
    return out


@router.post("/v2/embed", response_model=CohereEmbedResponse, responses=ERROR_RESPONSES, tags=["Cohere"])
async def embed(body: CohereEmbedRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Cohere's embed (v2): the texts' embeddings in each requested type (`embeddings_by_type`)."""
    engine = await model_for(svc, body.model, request, required=True, dense=True)
    if body.images or body.inputs:
        raise BadRequest(f"model {engine.name!r} embeds text only: send `texts` (images and inputs are not served)")
    if not body.texts:
        raise EmptyInput("texts: required, and at least one text")
    quantized = [t for t in body.embedding_types if t in ("int8", "uint8")]
    if quantized:
        raise BadRequest(f"embedding_types {quantized[0]!r} needs calibration ranges (each dimension's minimum and "
                         "maximum over a corpus), which no bundle ships; ask for float, base64, binary or ubinary")
    check_dimensions(engine.model, engine.name, body.output_dimension)
    prompt_name = cohere_prompt_name(engine.model, engine.name, body.input_type)
    raw = svc.texts(body.texts)
    refuse, from_start = body.truncate == "NONE", body.truncate == "START"
    if body.max_tokens is not None:
        raw = await cut(svc, engine, raw, body.max_tokens, from_start, refuse, "max_tokens", "/v2/embed")
    texts, skip = svc.prompted(engine, raw, prompt_name, None)
    # truncate START cuts the text's start, never the prompt before it
    tokenized = await svc.tokenize(engine, texts, not refuse, "/v2/embed", from_start=from_start,
                                   kept=prompt_chars(texts, raw))
    job = EncodeJob(route="/v2/embed", ids=[t.ids for t in tokenized], normalize=engine.model.normalize, pool_skip=skip)
    vectors = (await infer(svc, engine, job, request)).embeddings
    if body.output_dimension is not None:
        vectors = shortened(vectors, body.output_dimension)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    kinds = KindCounter()
    embeddings = by_type(vectors, body.embedding_types, kinds)
    kinds.report(call_of(request))
    tokens = sum(t.n_tokens for t in tokenized)
    return JSONResponse({"id": response_id(), "response_type": "embeddings_by_type", "embeddings": embeddings,
                         "texts": body.texts, "meta": {"api_version": API_VERSION, "billed_units": {"input_tokens": tokens},
                                                       "tokens": {"input_tokens": tokens}}})


@router.post("/v2/rerank", response_model=CohereRerankResponse, responses=ERROR_RESPONSES, tags=["Cohere"])
async def rerank(body: CohereRerankRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Cohere's rerank (v2): the documents' indexes by relevance to the query, most relevant first; the
    score is CrossEncoder.predict's (the logit through the model's saved activation); on a ColBERT or
    BGE-M3, its late-interaction score, as /v1/rerank gives it."""
    engine = await reranker(svc, body.model, request)
    if not body.documents:
        raise EmptyInput("documents: at least one document")
    documents = svc.texts(body.documents)
    documents = await cut(svc, engine, documents, body.max_tokens_per_doc or DEFAULT_MAX_TOKENS_PER_DOC, False, False,
                          "max_tokens_per_doc", "/v2/rerank")
    if is_late_interaction(engine):
        late = await late_interaction_scores(svc, engine, body.query, documents, True, "/v2/rerank",
                                             runs(svc, engine, request))
        scores, tokens = late.scores, late.tokens
    else:
        logits, tokenized, _ = await rerank_pairs(svc, engine, body.query, documents, True, "/v2/rerank",
                                                  runs(svc, engine, request))
        scores, tokens = relevance(engine, False)(logits), sum(t.n_tokens for t in tokenized)
    order = best_first(scores, body.top_n)
    return JSONResponse({"id": response_id(), "results": [{"index": i, "relevance_score": float(scores[i])} for i in order],
                         "meta": {"api_version": API_VERSION,
                                  "billed_units": {"search_units": math.ceil(len(documents) / 100)},
                                  "tokens": {"input_tokens": tokens}}})
