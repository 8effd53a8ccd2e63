"""Sequence-classification bundles on the native API: POST /v1/rerank (a cross-encoder scores
query-document pairs, in the Jina/Cohere shape) and POST /v1/classify (every label's probability, as
text-embeddings-inference's /predict). Both go through the same batch queue as embeddings: a pair is one
item, its tokens count. `explain: true` attributes each score to words (service/engine/explain.py). What
a score means is service/engine/scoring.py's.

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

import numpy as np
from fastapi import Depends, Request

from service.engine.encoder_service import EncoderService
from service.engine.late_interaction import is_late_interaction, late_interaction_scores
from service.engine.scoring import best_first, ranked, read_logits, relevance, rerank_pairs, run_classifier
from service.front.deps import api_router, model_for, reranker, runs, service
from service.front.responses import JSONResponse
from service.front.schemas import ERROR_RESPONSES
from service.apis.native.schemas import ClassifyRequest, ClassifyResponse, RerankRequest, RerankResponse

router = api_router()


@router.post("/v1/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES)
async def rerank(body: RerankRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Documents ranked by a cross-encoder's score for the query, as sentence-transformers'
    CrossEncoder.predict gives it: its one logit through the activation saved with the model (the
    manifest's score_activation: a sigmoid unless the model says otherwise); raw_scores: the logit."""
    engine = await reranker(svc, body.model, request)
    documents = body.documents
    if is_late_interaction(engine):  # a ColBERT or BGE-M3: MaxSim over token vectors (engine/late_interaction.py)
        late = await late_interaction_scores(svc, engine, body.query, documents, body.truncate, "/v1/rerank",
                                             runs(svc, engine, request), body.explain)
        scores, explained, tokens = late.scores, late.explanations, late.tokens
    else:
        logits, tokenized, explaining = await rerank_pairs(svc, engine, body.query, documents, body.truncate,
                                                           "/v1/rerank", runs(svc, engine, request), body.explain)
        score = relevance(engine, body.raw_scores)
        scores = score(logits)
        explained = [{"words": words} for words in explaining.words(scores, score)] if explaining else None
        tokens = sum(t.n_tokens for t in tokenized)
    order = best_first(scores, body.top_n)
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": documents[i]}} if body.return_documents else {}),
                **({"explanation": explained[i]} if explained else {})} for i in order]
    return JSONResponse({"model": engine.name, "results": results, "usage": {"total_tokens": tokens}})


@router.post("/v1/classify", response_model=ClassifyResponse, responses=ERROR_RESPONSES)
async def classify(body: ClassifyRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Every label with its score for each input, best first."""
    engine = await model_for(svc, body.model, request, task="classification")
    texts = svc.texts(body.input)
    tokenized = await svc.tokenize(engine, texts, body.truncate, "/v1/classify")
    logits, explaining = await run_classifier(svc, engine, tokenized, texts, body.explain, "/v1/classify",
                                              runs(svc, engine, request))
    scores = read_logits(logits, engine.model.problem_type)
    top = scores.argmax(axis=1)
    explained = None
    if explaining:  # attributions of each text's top label
        explained = explaining.words(scores[np.arange(len(top)), top],
                                     lambda rows, i: read_logits(rows, engine.model.problem_type)[:, top[i]])
    labels = engine.model.labels
    data = [{"index": i, "labels": ranked(labels, row),
             **({"explanation": {"label": labels[top[i]], "words": explained[i]}} if explained else {})}
            for i, row in enumerate(scores)]
    tokens = sum(t.n_tokens for t in tokenized)
    return JSONResponse({"model": engine.name, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
