"""Scores from token vectors: reranking by late interaction (MaxSim) on a ColBERT or BGE-M3 model, with
what each score is made of when asked.

A ColBERT's score is PyLate's (rank.rerank): the sum over the query's tokens of each one's best dot
product with a document token. BGE-M3's is FlagEmbedding's compute_score "colbert+sparse+dense": the weighted
mean (BGE_M3_WEIGHTS, its defaults: the plain mean) of its dense score, its lexical (sparse) score and its
MaxSim averaged over the query's tokens. The query and the documents go in as two jobs of one call, batched with everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bundle.representations import BGE_M3_WEIGHTS, MaxSim, kept_tokens, maxsim, sparse_dot
from service.engine.engine import Engine
from service.engine.encoder_service import EncoderService
from service.engine.runner import EncodeJob, EncodeResult
from service.engine.scoring import Run


@dataclass
class LateScores:
    """Each document's score, the tokens the call ran, and, with explain, what each score is made of."""

    scores: np.ndarray
    tokens: int
    explanations: list[dict] | None = None


def is_late_interaction(engine: Engine) -> bool:
    return engine.model.multivector is not None


async def late_interaction_scores(svc: EncoderService, engine: Engine, query: str, documents: list[str],
                                  truncate: bool, route: str, run: Run, explain: bool = False,
                                  protocol: str = "http") -> LateScores:
    """The documents' scores for the query by MaxSim (and, for BGE-M3, its dense and sparse scores too)."""
    svc.texts([query])
    sides = await _late_jobs(svc, engine, query, svc.texts(documents), truncate, route, protocol)
    svc.check_tokens(sum(job.n_tokens for job in sides), "send fewer or shorter documents")
    q, d = await run(sides)
    return _late_scores(engine, sides, q, d, explain)


async def late_interaction_pair_scores(svc: EncoderService, engine: Engine, text_1: list[str], text_2: list[str],
                                       truncate: bool, route: str, run: Run, protocol: str = "http") -> LateScores:
    """Each pair (text_1[i], text_2[i])'s late-interaction score (vLLM's N:N): the pairs grouped by their
    query, every group tokenized and the whole request's tokens held against the budget before any group
    runs (one budget check per group let 64 pairs of 60 tokens through a budget of 300), then every
    group's jobs run at once."""
    groups: dict[str, list[int]] = {}
    for i, query in enumerate(text_1):
        groups.setdefault(query, []).append(i)
    svc.texts(list(groups))
    text_2 = svc.texts(text_2)
    sides = [await _late_jobs(svc, engine, query, [text_2[i] for i in rows], truncate, route, protocol)
             for query, rows in groups.items()]
    tokens = sum(job.n_tokens for group in sides for job in group)
    svc.check_tokens(tokens, "send fewer or shorter pairs", f" in {len(text_2)} pairs")
    results = await run([job for group in sides for job in group])
    scores = np.zeros(len(text_2))
    for k, (group, rows) in enumerate(zip(sides, groups.values(), strict=True)):
        scores[rows] = _late_scores(engine, group, results[2 * k], results[2 * k + 1], False).scores
    return LateScores(scores, tokens)


async def _late_jobs(svc: EncoderService, engine: Engine, query: str, documents: list[str], truncate: bool,
                     route: str, protocol: str) -> list[EncodeJob]:
    """The query's job and its documents' job, tokenized as the model's multi-vector output wants them."""
    model = engine.model
    bge_m3 = model.multivector.kind == "bge-m3"
    sides = []
    for texts, is_query in (([query], True), (documents, False)):
        _, ids, attended = await svc.tokenize_for_model(engine, texts, truncate, route, is_query, protocol)
        sides.append(EncodeJob(route=route, ids=ids, normalize=model.normalize, want_embedding=bge_m3, sparse=bge_m3,
                               multivector=True, is_query=is_query, attended=attended, protocol=protocol))
    return sides


def _late_scores(engine: Engine, sides: list[EncodeJob], q: EncodeResult, d: EncodeResult,
                 explain: bool) -> LateScores:
    """The documents' scores from the query's and documents' results."""
    bge_m3 = engine.model.multivector.kind == "bge-m3"
    matches = [maxsim(q.multivectors[0], vectors, mean=bge_m3) for vectors in d.multivectors]
    if bge_m3:
        parts = [{"dense": float(q.embeddings[0] @ d.embeddings[i]), "sparse": sparse_dot(q.sparse[0], d.sparse[i]),
                  "multivector": matches[i].score} for i in range(len(d.multivectors))]
        w_dense, w_sparse, w_multi = BGE_M3_WEIGHTS
        scores = np.array([(w_dense * p["dense"] + w_sparse * p["sparse"] + w_multi * p["multivector"])
                           / sum(BGE_M3_WEIGHTS) for p in parts])
    else:
        parts, scores = None, np.array([m.score for m in matches])
    tokens = sum(job.n_tokens for job in sides)
    if not explain:
        return LateScores(scores, tokens)
    return LateScores(scores, tokens, explanations(engine, sides, q, d, matches, parts))


def explanations(engine: Engine, sides: list[EncodeJob], q: EncodeResult, d: EncodeResult, matches: list[MaxSim],
                 parts: list[dict] | None) -> list[dict]:
    """Per document: which document token each query token matched, its similarity and its share of the
    MaxSim; for BGE-M3 also the three scores, their weights, and the terms query and document share."""
    info, tokenizer = engine.model.multivector, engine.tokenizer
    query_ids = sides[0].ids[0]
    query_tokens = tokenizer.tokens_of(query_ids[kept_tokens(query_ids, info, True)])
    out = []
    for i, match in enumerate(matches):
        doc_ids = sides[1].ids[i]
        positions = np.flatnonzero(kept_tokens(doc_ids, info, False))
        doc_tokens = tokenizer.tokens_of(doc_ids[positions])
        total = float(match.similarity.sum()) or 1.0
        item: dict = {"maxsim": [
            {"query_token": query_tokens[k], "document_token": doc_tokens[int(best)],
             "document_position": int(positions[int(best)]), "similarity": float(match.similarity[k]),
             "share": float(match.similarity[k]) / total}
            for k, best in enumerate(match.best)]}
        if parts is not None:
            item["scores"] = parts[i] | {"weights": dict(zip(("dense", "sparse", "multivector"), BGE_M3_WEIGHTS,
                                                             strict=True))}
            item["terms"] = shared_terms(tokenizer, q.sparse[0], d.sparse[i])
        out.append(item)
    return out


def shared_terms(tokenizer, query: tuple[np.ndarray, np.ndarray], document: tuple[np.ndarray, np.ndarray]) -> list[dict]:
    """The terms a query's and a document's sparse vectors share, each with its two weights and their
    product (its part of the lexical score), largest first."""
    shared, qi, di = np.intersect1d(query[0], document[0], assume_unique=True, return_indices=True)
    tokens = tokenizer.tokens_of(shared)
    terms = [{"token": tokens[k], "id": int(shared[k]), "query_weight": float(query[1][qi[k]]),
              "document_weight": float(document[1][di[k]]), "product": float(query[1][qi[k]] * document[1][di[k]])}
             for k in range(len(shared))]
    return sorted(terms, key=lambda t: -t["product"])
