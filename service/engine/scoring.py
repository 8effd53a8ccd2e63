"""What a score means: sequence-classification logits read as transformers and sentence-transformers
read them (softmax, sigmoid, the value; a cross-encoder's relevance through its saved activation), the
order of results, and the classifier's job with `explain` (occlusion variants, attention), for every
API that classifies or reranks (ours, TEI's, Cohere's, KServe v2's).

The engine knows no protocol: an API hands in `run`, its way of running a call's jobs (the call's
deadline, a client that leaves).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import numpy as np

from service.engine.encoder_service import EncoderService
from service.engine.engine import Engine
from service.engine.errors import InvalidRequest
from service.engine.explain import Occlusions, explanation, occlusions
from service.engine.runner import EncodeJob, EncodeResult
from service.engine.tokenization import TokenizedText

# How an API runs a call's jobs: within the call's deadline, cancelled when its client leaves.
Run = Callable[[list[EncodeJob]], Awaitable[list[EncodeResult]]]


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


def relevance(engine: Engine, raw_scores: bool) -> Callable[[np.ndarray, int], np.ndarray]:
    """Per row of logits, the relevance of its pair as CrossEncoder.predict gives it: the one logit through
    the activation saved with the model (the manifest's score_activation), or the logit itself."""
    activation = SCORE_ACTIVATIONS["identity" if raw_scores else engine.model.score_activation]
    return lambda logits, _=0: activation(logits[:, 0])


def label_scores(engine: Engine, logits: np.ndarray, raw_scores: bool) -> np.ndarray:
    """Each input's score per label: a cross-encoder's (one label) as CrossEncoder.predict gives it, a
    classifier's as its problem_type reads the logits (softmax, sigmoid per label, the value); or the logits."""
    if raw_scores:
        return logits.astype(np.float64)
    if logits.shape[1] == 1:
        return relevance(engine, False)(logits)[:, None]
    return read_logits(logits, engine.model.problem_type)


def applied(engine: Engine, logits: np.ndarray, function: str | None) -> np.ndarray:
    """The logits through a named function (softmax, sigmoid, none: the Hugging Face Inference API's
    `function_to_apply`); left out, as label_scores reads them."""
    if function == "softmax":
        return read_logits(logits, "single_label_classification")
    if function == "sigmoid":
        return SCORE_ACTIVATIONS["sigmoid"](logits)
    if function == "none":
        return logits.astype(np.float64)
    return label_scores(engine, logits, False)


def best_first(scores: np.ndarray, top_n: int | None = None) -> list[int]:
    """Indexes by score, highest first (ties in input order), the first top_n (all when None)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]


def ranked(labels: list[str], row: np.ndarray, top_k: int | None = None) -> list[dict]:
    """Every label (or the top_k) with its score, best first (ties in label order)."""
    return [{"label": labels[k], "score": float(row[k])} for k in np.argsort(-row, kind="stable")[:top_k]]


def classification_job(route: str, tokenized: list[TokenizedText], pairs: bool, protocol: str = "http") -> EncodeJob:
    """The job of texts (or text pairs, whose second text gets its token type) through a classifier."""
    return EncodeJob(route=route, ids=[t.ids for t in tokenized], normalize=False, protocol=protocol,
                     type_ids=[t.type_ids for t in tokenized] if pairs else None)


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


async def run_classifier(svc: EncoderService, engine: Engine, tokenized: list[TokenizedText], texts: list,
                         explain: bool, route: str, run: Run) -> tuple[np.ndarray, Explaining | None]:
    """The logits of every input (texts, or (query, document) pairs); with explain, also every word's
    occlusion variant and the inputs' attention weights. Explain's limits (words, attention size, each
    job's share of a batch) are all checked before anything runs; its variants, which the client cannot
    split, go in as as many jobs as the token budget needs, batched like any others."""
    pairs = isinstance(texts[0], tuple)
    job = classification_job(route, tokenized, pairs)
    if not explain:
        return (await run([job]))[0].embeddings, None
    occluded = [occlusions(t, x) for t, x in zip(tokenized, texts, strict=True)]
    svc.check_explain(sum(len(o.words) for o in occluded))
    svc.check_attention_size(engine, tokenized)
    everything = (tuple(range(engine.model.num_layers)), tuple(range(engine.model.num_heads)))
    originals = svc.split_to_budget(replace(job, attention=everything), "explain: input",
                                    "its attention from every layer and head is what rollout reads; send a shorter text")
    variants = EncodeJob(route=route, ids=[v for o in occluded for v in o.ids], normalize=False,
                         type_ids=[v for o in occluded for v in o.type_ids] if pairs else None)
    parts = svc.split_to_budget(variants, "explain: occlusion variant", "send a shorter text") if variants.ids else []
    results = await run(originals + parts)
    scored, varied = results[: len(originals)], results[len(originals) :]
    logits = np.concatenate([r.embeddings for r in scored])
    attentions = [a for r in scored for a in r.attentions]
    width = len(engine.model.labels or [])
    variant_logits = np.concatenate([r.embeddings for r in varied]) if varied else np.zeros((0, width), np.float32)
    return logits, Explaining(occluded, variant_logits, attentions)


def reranker(svc: EncoderService, name: str | None, asked_by: str) -> Engine:
    """The model a rerank request names, or the first served one that reranks: a cross-encoder (a
    one-label classifier), else a late-interaction model (a ColBERT or BGE-M3: engine/late_interaction.py).
    Any other model is a 422 that says what reranks."""
    if name is None and not any(e.model.task == "classification" for e in svc.engines):
        name = next((e.name for e in svc.engines if e.model.multivector is not None), None)
    if name is not None and svc.engines.get(name).model.multivector is not None:
        return svc.engines.get(name)
    engine = svc.model_for(name, asked_by, task="classification")
    labels = engine.model.labels or []
    if len(labels) != 1:
        raise InvalidRequest(f"model {engine.name!r} has {len(labels)} labels ({', '.join(labels)}); reranking needs "
                             "a one-label model (a cross-encoder): use /v1/classify for this one")
    return engine


async def rerank_pairs(svc: EncoderService, engine: Engine, query: str, documents: list[str], truncate: bool,
                       route: str, run: Run, explain: bool = False,
                       from_start: bool = False) -> tuple[np.ndarray, list[TokenizedText], Explaining | None]:
    """Every (query, document) pair through the cross-encoder: their logits, tokens and, with explain,
    what explaining them needs. Every API that reranks (ours, TEI's, Cohere's) goes through here."""
    svc.texts([query])
    pairs = [(query, d) for d in svc.texts(documents)]
    tokenized = await svc.tokenize_pairs(engine, pairs, truncate, route, from_start)
    logits, explaining = await run_classifier(svc, engine, tokenized, pairs, explain, route, run)
    return logits, tokenized, explaining
