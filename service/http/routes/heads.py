"""Sequence-classification bundles: POST /v1/rerank (a cross-encoder scores query-document pairs, in
the Jina/Cohere shape) and POST /v1/classify (every label's probability, as text-embeddings-inference's
/predict). Both go through the same batch queue as embeddings: a pair is one item, its tokens count.

No `from __future__ import annotations` (see http/routes/native.py).
"""

import numpy as np
from fastapi import Depends, Request

from service.engine.errors import InvalidRequest
from service.engine.runner import EncodeJob
from service.engine.service import EncoderService
from service.http.app import ERROR_RESPONSES, app
from service.http.context import infer, model_for, service
from service.http.responses import JSONResponse
from service.http.schemas import ClassifyRequest, ClassifyResponse, RerankRequest, RerankResponse


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def read_logits(logits: np.ndarray, problem_type: str) -> np.ndarray:
    """Scores from logits as transformers reads them: softmax over labels (single label), sigmoid per
    label (multi label), the value itself (regression)."""
    x = logits.astype(np.float64)
    if problem_type == "single_label_classification":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if problem_type == "multi_label_classification":
        return sigmoid(x)
    return x


@app.post("/v1/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES)
async def rerank(body: RerankRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Documents ranked by a cross-encoder's score for the query: sigmoid of its one logit, as
    sentence-transformers' CrossEncoder.predict gives it (raw_scores: the logit)."""
    engine = model_for(svc, body.model, request, task="classification")
    labels = engine.model.labels or []
    if len(labels) != 1:
        raise InvalidRequest(f"model {engine.name!r} has {len(labels)} labels ({', '.join(labels)}); /v1/rerank needs "
                             "a one-label model (a cross-encoder): use /v1/classify for this one")
    documents = svc.texts(body.documents)
    svc.texts([body.query])
    tokenized = await svc.tokenize_pairs(engine, [(body.query, d) for d in documents], body.truncate, "/v1/rerank")
    job = EncodeJob(route="/v1/rerank", ids=[t.ids for t in tokenized], normalize=False,
                    type_ids=[t.type_ids for t in tokenized])
    result = await infer(svc, engine, job, request)
    logits = result.embeddings[:, 0]
    scores = logits.astype(np.float64) if body.raw_scores else sigmoid(logits)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: body.top_n]
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": documents[i]}} if body.return_documents else {})} for i in order]
    return JSONResponse({"model": engine.name, "results": results,
                         "usage": {"total_tokens": sum(t.n_tokens for t in tokenized)}})


@app.post("/v1/classify", response_model=ClassifyResponse, responses=ERROR_RESPONSES)
async def classify(body: ClassifyRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Every label with its score for each input, best first."""
    engine = model_for(svc, body.model, request, task="classification")
    texts = svc.texts(body.input)
    tokenized = await svc.tokenize(engine, texts, body.truncate, "/v1/classify")
    job = EncodeJob(route="/v1/classify", ids=[t.ids for t in tokenized], normalize=False)
    result = await infer(svc, engine, job, request)
    scores = read_logits(result.embeddings, engine.model.problem_type)
    labels = engine.model.labels
    data = [{"index": i, "labels": [{"label": labels[k], "score": float(row[k])} for k in np.argsort(-row, kind="stable")]}
            for i, row in enumerate(scores)]
    tokens = sum(t.n_tokens for t in tokenized)
    return JSONResponse({"model": engine.name, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
