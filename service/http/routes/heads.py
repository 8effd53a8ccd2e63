"""Sequence-classification bundles: POST /v1/rerank (a cross-encoder scores query-document pairs, in
the Jina/Cohere shape) and POST /v1/classify (every label's probability, as text-embeddings-inference's
/predict). Both go through the same batch queue as embeddings: a pair is one item, its tokens count.
`explain: true` attributes each score to words (service/engine/explain.py).

No `from __future__ import annotations` (see http/routes/native.py).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from fastapi import Depends, Request

from service.engine.engine import Engine
from service.engine.errors import InvalidRequest
from service.engine.explain import Occlusions, explanation, occlusions
from service.engine.runner import EncodeJob
from service.engine.encoder_service import EncoderService
from service.engine.tokenization import TokenizedText
from service.http.app import ERROR_RESPONSES, app
from service.http.context import infer, infer_all, model_for, service
from service.http.responses import JSONResponse
from service.http.schemas import ClassifyRequest, ClassifyResponse, RerankRequest, RerankResponse


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


# the manifest's score_activation: what CrossEncoder.predict applies to a cross-encoder's logit
SCORE_ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "sigmoid": sigmoid,
    "identity": lambda x: x.astype(np.float64),
    "tanh": lambda x: np.tanh(x.astype(np.float64)),
}


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


@dataclass
class Explaining:
    """What explain needs beyond the logits: each input's occlusions, their logits, its attention."""

    occluded: list[Occlusions]
    variant_logits: np.ndarray  # every input's variants, in order
    attentions: list[np.ndarray]  # per input (layers, heads, n, n)

    def words(self, scores: np.ndarray, score_rows: Callable[[np.ndarray, int], np.ndarray]) -> list[list[dict]]:
        """Per input, its words' attributions; score_rows(logits, i) scores input i's variants."""
        out, row = [], 0
        for i, occluded in enumerate(self.occluded):
            k = len(occluded.words)
            without = score_rows(self.variant_logits[row : row + k], i)
            out.append(explanation(occluded, float(scores[i]), without, self.attentions[i]))
            row += k
        return out


async def run_classifier(svc: EncoderService, engine: Engine, tokenized: list[TokenizedText],
                         texts: list, explain: bool, route: str, request: Request) -> tuple[np.ndarray, Explaining | None]:
    """The logits of every input (texts, or (query, document) pairs); with explain, also every word's
    occlusion variant and the inputs' attention weights. Explain's limits (words, attention size, each
    job's share of a batch) are all checked before anything runs; its variants, which the client cannot
    split, go in as as many jobs as the token budget needs, batched like any others."""
    pairs = isinstance(texts[0], tuple)
    job = EncodeJob(route=route, ids=[t.ids for t in tokenized], normalize=False,
                    type_ids=[t.type_ids for t in tokenized] if pairs else None)
    if not explain:
        return (await infer(svc, engine, job, request)).embeddings, None
    occluded = [occlusions(t, x) for t, x in zip(tokenized, texts, strict=True)]
    svc.check_explain(sum(len(o.words) for o in occluded))
    svc.check_attention_size(engine, tokenized)
    everything = (tuple(range(engine.model.num_layers)), tuple(range(engine.model.num_heads)))
    originals = svc.split_to_budget(replace(job, attention=everything), "explain: input",
                                    "its attention from every layer and head is what rollout reads; send a shorter text")
    variants = EncodeJob(route=route, ids=[v for o in occluded for v in o.ids], normalize=False,
                         type_ids=[v for o in occluded for v in o.type_ids] if pairs else None)
    parts = svc.split_to_budget(variants, "explain: occlusion variant", "send a shorter text") if variants.ids else []
    results = await infer_all(svc, engine, originals + parts, request)
    scored, varied = results[: len(originals)], results[len(originals) :]
    logits = np.concatenate([r.embeddings for r in scored])
    attentions = [a for r in scored for a in r.attentions]
    width = len(engine.model.labels or [])
    variant_logits = np.concatenate([r.embeddings for r in varied]) if varied else np.zeros((0, width), np.float32)
    return logits, Explaining(occluded, variant_logits, attentions)


def best_first(scores: np.ndarray, top_n: int | None = None) -> list[int]:
    """Indexes by score, highest first (ties in input order), the first top_n (all when None)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]


def ranked(labels: list[str], row: np.ndarray, top_k: int | None = None) -> list[dict]:
    """Every label (or the top_k) with its score, best first (ties in label order)."""
    return [{"label": labels[k], "score": float(row[k])} for k in np.argsort(-row, kind="stable")[:top_k]]


def reranker(svc: EncoderService, name: str | None, request: Request) -> Engine:
    """The cross-encoder a rerank request names (or the first served classifier): one label, else a 422
    that points to /v1/classify."""
    engine = model_for(svc, name, request, task="classification")
    labels = engine.model.labels or []
    if len(labels) != 1:
        raise InvalidRequest(f"model {engine.name!r} has {len(labels)} labels ({', '.join(labels)}); reranking needs "
                             "a one-label model (a cross-encoder): use /v1/classify for this one")
    return engine


def relevance(engine: Engine, raw_scores: bool) -> Callable[[np.ndarray, int], np.ndarray]:
    """Per row of logits, the relevance of its pair as CrossEncoder.predict gives it: the one logit through
    the activation saved with the model (the manifest's score_activation), or the logit itself."""
    activation = SCORE_ACTIVATIONS["identity" if raw_scores else engine.model.score_activation]
    return lambda logits, _=0: activation(logits[:, 0])


async def rerank_pairs(svc: EncoderService, engine: Engine, query: str, documents: list[str], truncate: bool,
                       route: str, request: Request, explain: bool = False,
                       from_start: bool = False) -> tuple[np.ndarray, list[TokenizedText], Explaining | None]:
    """Every (query, document) pair through the cross-encoder: their logits, tokens and, with explain,
    what explaining them needs. Every route that reranks (ours, TEI's, Cohere's) goes through here."""
    svc.texts([query])
    pairs = [(query, d) for d in svc.texts(documents)]
    tokenized = await svc.tokenize_pairs(engine, pairs, truncate, route, from_start)
    logits, explaining = await run_classifier(svc, engine, tokenized, pairs, explain, route, request)
    return logits, tokenized, explaining


@app.post("/v1/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES)
async def rerank(body: RerankRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Documents ranked by a cross-encoder's score for the query, as sentence-transformers'
    CrossEncoder.predict gives it: its one logit through the activation saved with the model (the
    manifest's score_activation: a sigmoid unless the model says otherwise); raw_scores: the logit."""
    engine = reranker(svc, body.model, request)
    documents = body.documents
    logits, tokenized, explaining = await rerank_pairs(svc, engine, body.query, documents, body.truncate,
                                                       "/v1/rerank", request, body.explain)
    score = relevance(engine, body.raw_scores)
    scores = score(logits)
    explained = explaining.words(scores, score) if explaining else None
    order = best_first(scores, body.top_n)
    results = [{"index": i, "relevance_score": float(scores[i]),
                **({"document": {"text": documents[i]}} if body.return_documents else {}),
                **({"explanation": {"words": explained[i]}} if explained else {})} for i in order]
    return JSONResponse({"model": engine.name, "results": results,
                         "usage": {"total_tokens": sum(t.n_tokens for t in tokenized)}})


@app.post("/v1/classify", response_model=ClassifyResponse, responses=ERROR_RESPONSES)
async def classify(body: ClassifyRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Every label with its score for each input, best first."""
    engine = model_for(svc, body.model, request, task="classification")
    texts = svc.texts(body.input)
    tokenized = await svc.tokenize(engine, texts, body.truncate, "/v1/classify")
    logits, explaining = await run_classifier(svc, engine, tokenized, texts, body.explain, "/v1/classify", request)
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
