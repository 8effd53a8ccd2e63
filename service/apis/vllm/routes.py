"""vLLM's score API: POST /v1/score (and /score, where vLLM moved it), `text_1` against `text_2` with vLLM's
pairing (1:1, 1:N, N:N), for every model kind that scores:

- a cross-encoder: each pair's CrossEncoder.predict score (the logit through the model's saved
  activation; `use_activation: false`, the logit), as /v1/rerank;
- a ColBERT or BGE-M3: each pair's late-interaction score, as /v1/rerank gives it (engine/late_interaction.py);
- a bi-encoder: the cosine of the two texts' dense embeddings, as vLLM scores embedding models.

Thin routes over the same engine calls as ours, with the same limits, auth and metrics. Errors in vLLM's
body (service/apis/vllm/__init__.py).

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

import time
import uuid

import numpy as np
from fastapi import Depends, Request

from service.apis.vllm.schemas import VLLMError, VLLMScoreRequest, VLLMScoreResponse
from service.engine.encoder_service import EncoderService
from service.engine.engine import Engine
from service.engine.errors import BadRequest
from service.engine.late_interaction import is_late_interaction, late_interaction_pair_scores
from service.engine.runner import EncodeJob
from service.engine.scoring import relevance, reranker, run_classifier
from service.front.deps import api_router, call_of, infer, model_for, runs, service
from service.front.request_ids import current_request_id
from service.front.responses import JSONResponse

router = api_router()

VLLM_ERROR_RESPONSES = {code: {"model": VLLMError} for code in (400, 401, 404, 413, 422, 429, 503)}


def paired(text_1: list[str], text_2: list[str]) -> list[str]:
    """text_1 as long as text_2: vLLM's rules (its score utils' _validate_score_input_lens), in its words."""
    if len(text_1) > 1 and len(text_1) != len(text_2):
        raise BadRequest("Input lengths must be either 1:1, 1:N or N:N")
    if not text_1:
        raise BadRequest("At least one text element must be given")
    if not text_2:
        raise BadRequest("At least one text_pair element must be given")
    return text_1 * len(text_2) if len(text_1) == 1 else text_1


def truncation(engine: Engine, tokens: int | None) -> bool:
    """vLLM's truncate_prompt_tokens: null refuses an input past the model's limit, -1 cuts it there."""
    if tokens is None:
        return False
    if tokens in (-1, engine.model.max_tokens):
        return True
    raise BadRequest(f"truncate_prompt_tokens {tokens}: model {engine.name!r} cuts at its limit only, "
                     f"{engine.model.max_tokens} tokens: send -1 (or null to refuse longer inputs)")


async def cross_encoder_scores(svc: EncoderService, engine: Engine, pairs: list[tuple[str, str]], truncate: bool,
                               activation: bool, request: Request) -> tuple[np.ndarray, int]:
    tokenized = await svc.tokenize_pairs(engine, pairs, truncate, call_of(request).route)
    svc.check_tokens(sum(t.n_tokens for t in tokenized), "send fewer pairs")
    logits, _ = await run_classifier(svc, engine, tokenized, pairs, False, call_of(request).route,
                                     runs(svc, engine, request))
    return relevance(engine, not activation)(logits), sum(t.n_tokens for t in tokenized)


async def cosine_scores(svc: EncoderService, engine: Engine, text_1: list[str], text_2: list[str], truncate: bool,
                        request: Request) -> tuple[np.ndarray, int]:
    """The cosine of each pair's dense embeddings: every distinct text embedded once, in one job."""
    distinct = list(dict.fromkeys(text_1 + text_2))
    texts, skip = svc.prompted(engine, distinct, None, None)
    tokenized = await svc.tokenize(engine, texts, truncate, call_of(request).route)
    job = EncodeJob(route=call_of(request).route, ids=[t.ids for t in tokenized], normalize=True, pool_skip=skip)
    vectors = (await infer(svc, engine, job, request)).embeddings.astype(np.float64)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    row = {text: i for i, text in enumerate(distinct)}
    scores = np.array([vectors[row[a]] @ vectors[row[b]] for a, b in zip(text_1, text_2, strict=True)])
    return scores, sum(t.n_tokens for t in tokenized)


@router.post("/v1/score", response_model=VLLMScoreResponse, responses=VLLM_ERROR_RESPONSES, tags=["vLLM"])
@router.post("/score", response_model=VLLMScoreResponse, responses=VLLM_ERROR_RESPONSES, tags=["vLLM"])
async def score(body: VLLMScoreRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """vLLM's score: `data[i].score` for the pair (text_1[i], text_2[i]), text_1 repeated when it is one."""
    engine = await model_for(svc, body.model, request, task=None)
    if body.priority != 0:
        raise BadRequest(f"priority {body.priority}: this server schedules without priorities; send 0")
    text_2 = svc.texts(body.text_2)
    text_1 = paired(svc.texts(body.text_1), text_2)
    truncate = truncation(engine, body.truncate_prompt_tokens)
    if engine.model.task == "classification":
        reranker(svc, engine.name, call_of(request).route)  # a one-label model (a cross-encoder), else a 422 saying so
        activation = next((v for v in (body.use_activation, body.activation, body.softmax) if v is not None), True)
        scores, tokens = await cross_encoder_scores(svc, engine, list(zip(text_1, text_2, strict=True)), truncate,
                                                    activation, request)
    elif is_late_interaction(engine):
        late = await late_interaction_pair_scores(svc, engine, text_1, text_2, truncate, call_of(request).route,
                                                  runs(svc, engine, request))
        scores, tokens = late.scores, late.tokens
    elif "dense" in engine.model.representations:
        scores, tokens = await cosine_scores(svc, engine, text_1, text_2, truncate, request)
    else:
        raise BadRequest(f"model {engine.name!r} gives {', '.join(engine.model.representations)} only: /v1/score scores "
                         "with a cross-encoder, a dense embedding (cosine) or token vectors (MaxSim); its sparse "
                         "vectors are POST /v1/encode's")
    return JSONResponse({
        "id": f"score-{current_request_id.get() or uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": engine.name, "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None}})
