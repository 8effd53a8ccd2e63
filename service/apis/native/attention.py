"""The attention product: POST /v1/attention (rollout, entropy, top-k, weights, word level, bertviz's
format) and POST /v1/similarity (cosine, with each token's exact share of it).

The summaries are computed in the replica that ran the model, from the full graph's attention
probabilities (analysis.py), so only what the client asked for crosses the network.

No `from __future__ import annotations` in route modules (see encode.py).
"""

import asyncio
from typing import Any

import numpy as np
from fastapi import Depends, Request

from service.engine.analysis import NoExactSplit, Units, check_explainable, contributions, entropy, rollout, to_units, token_units, top_k, word_units
from service.engine.errors import InvalidRequest, TooLarge
from service.engine.runner import EncodeJob
from service.engine.encoder_service import EncoderService
from service.engine.tokenization import TokenizedText
from service.front.deps import api_router, call_of, infer, model_for, service
from service.front.responses import JSON_FLOAT_BYTES, JSONResponse, KindCounter, respond, value_bytes
from service.front.schemas import ERROR_RESPONSES
from service.apis.native.schemas import AttentionRequest, AttentionResponse, SimilarityRequest, SimilarityResponse

router = api_router()

# Analyses of more values than this run in a worker thread, off the replica's event loop.
INLINE_ANALYSIS_VALUES = 200_000
UNIT_JSON_BYTES = 120  # a unit's description in JSON, at most for ordinary words


def attention_response_size(body: AttentionRequest, tokenized: list[TokenizedText], n_layers: int, n_heads: int) -> int:
    """An upper bound of a /v1/attention response's size (units are at most tokens), before inference."""
    size = 0
    for t in tokenized:
        n = t.n_tokens
        size += n * UNIT_JSON_BYTES + 200
        if "rollout" in body.summaries:
            size += n * n * JSON_FLOAT_BYTES
        if "entropy" in body.summaries:
            size += n_layers * n_heads * JSON_FLOAT_BYTES
        if "top_k" in body.summaries:
            size += n * min(body.top_k, n) * (JSON_FLOAT_BYTES + 8)
        if body.weights or body.format == "bertviz":
            size += int(n_layers * n_heads * n * n * value_bytes(body.format, body.dtype))
    return size


def units_of(tokenized: TokenizedText, text: str, level: str) -> Units:
    return word_units(tokenized.encoding, text) if level == "word" else token_units(tokenized.encoding)


def analyse(body: AttentionRequest, attention: np.ndarray, units: Units) -> dict[str, Any]:
    """One text's summaries (and weights, when asked) from its (layers, heads, n, n) probabilities."""
    per_unit = to_units(attention, units)
    out: dict[str, Any] = {}
    if "rollout" in body.summaries or "top_k" in body.summaries:
        r = rollout(per_unit)
        if "rollout" in body.summaries:
            out["rollout"] = r.astype(np.float32)
        if "top_k" in body.summaries:
            out["top_k"] = top_k(r, body.top_k)
    if "entropy" in body.summaries:
        out["entropy"] = entropy(per_unit).astype(np.float32)
    if body.format == "bertviz":
        out["tokens"] = [u["text"] for u in units.units]
        out["attention"] = [layer[None].astype(np.float32) for layer in per_unit]  # [1, heads, n, n] each
    elif body.weights:
        out["weights"] = per_unit.astype(np.float32)
    return out


@router.post("/v1/attention", response_model=AttentionResponse, responses=ERROR_RESPONSES)
async def attention(body: AttentionRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Attention rollout, per-head entropy and top-k per unit (token or word); weights on request."""
    engine = await model_for(svc, body.model, request)
    texts = svc.texts(body.inputs)
    # in model order: rollout multiplies layers in the order the model applies them
    layers = tuple(sorted(svc.indexes(body.layers, engine.model.num_layers, "layer")))
    heads = tuple(sorted(svc.indexes(body.heads, engine.model.num_heads, "head")))
    tokenized = await svc.tokenize(engine, texts, body.truncate, "/v1/attention")
    svc.check_attention_size(engine, tokenized)
    estimate = attention_response_size(body, tokenized, len(layers), len(heads))
    svc.check_response_size(estimate)
    job = EncodeJob(route="/v1/attention", ids=[t.ids for t in tokenized], normalize=engine.model.normalize,
                    attention=(layers, heads))
    result = await infer(svc, engine, job, request)
    units = [units_of(t, text, body.level) for t, text in zip(tokenized, texts, strict=True)]

    def analyse_all() -> list[dict[str, Any]]:
        return [analyse(body, a, u) for a, u in zip(result.attentions, units, strict=True)]

    values = sum(a.size for a in result.attentions)
    analyses = analyse_all() if values <= INLINE_ANALYSIS_VALUES else await asyncio.to_thread(analyse_all)
    kinds = KindCounter()

    def build() -> dict:  # on the event loop when small, else in a worker thread (responses.respond)
        data = []
        for i, (tok, unit, found) in enumerate(zip(tokenized, units, analyses, strict=True)):
            item: dict[str, Any] = {"index": i, "n_tokens": tok.n_tokens, "n_units": len(unit),
                                    "units": kinds.fragment("units", unit.units)}
            for key in ("rollout", "entropy", "top_k", "tokens"):
                if key in found:
                    item[key] = kinds.fragment(key, found[key])
            if "attention" in found:  # bertviz: one [1, heads, n, n] list per layer
                item["attention"] = [kinds.array("attention", layer, "float", "float32")
                                     for layer in found["attention"]]
            elif "weights" in found:
                w = found["weights"]
                item["attention"] = {
                    "layers": list(layers), "heads": list(heads), "shape": list(w.shape), "dtype": body.dtype,
                    "format": body.format, "data": kinds.array("attention", w, body.format, body.dtype),
                }
            data.append(item)
        return {"model": engine.name, "level": body.level, "layers": list(layers), "heads": list(heads),
                "data": data, "usage": {"tokens": sum(t.n_tokens for t in tokenized)}}

    response = await respond(build, estimate)
    kinds.report(call_of(request))
    return response


@router.post("/v1/similarity", response_model=SimilarityResponse, responses=ERROR_RESPONSES)
async def similarity(body: SimilarityRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """Cosine similarity of text pairs; with explain, each token's (or word's) exact share of it."""
    engine = await model_for(svc, body.model, request, dense=True)
    pooling = engine.model.pooling
    if body.explain:
        try:
            check_explainable(pooling, engine.model.dense_layers)
        except NoExactSplit as exc:
            raise InvalidRequest(f"explain: {exc}") from None
    if 2 * len(body.pairs) > svc.settings.max_inputs:
        raise TooLarge(f"{len(body.pairs)} pairs are {2 * len(body.pairs)} texts; at most "
                       f"{svc.settings.max_inputs} texts ({svc.settings.max_inputs // 2} pairs) per request")
    texts = svc.texts([text for pair in body.pairs for text in pair])
    tokenized = await svc.tokenize(engine, texts, body.truncate, "/v1/similarity")
    if body.explain:
        svc.check_response_size(sum(t.n_tokens * (UNIT_JSON_BYTES + JSON_FLOAT_BYTES) for t in tokenized))
    job = EncodeJob(route="/v1/similarity", ids=[t.ids for t in tokenized], normalize=engine.model.normalize,
                    want_hidden=body.explain)
    result = await infer(svc, engine, job, request)
    kinds = KindCounter()
    data = []
    for p in range(len(body.pairs)):
        a, b = 2 * p, 2 * p + 1
        if not body.explain:
            e_a, e_b = result.embeddings[a].astype(np.float64), result.embeddings[b].astype(np.float64)
            score = float(e_a @ e_b / max(np.linalg.norm(e_a) * np.linalg.norm(e_b), 1e-12))
            data.append({"index": p, "score": score})
            continue
        score, share_a, share_b = contributions(result.hidden[a], result.hidden[b], pooling)
        explained = []
        for t, shares in ((a, share_a), (b, share_b)):
            units = units_of(tokenized[t], texts[t], body.level)
            explained.append({"units": [
                {**unit, "contribution": float(shares[group].sum())}
                for unit, group in zip(units.units, units.groups, strict=True)
            ]})
        data.append({"index": p, "score": score, "texts": kinds.fragment("contributions", explained)})
    kinds.report(call_of(request))
    note = None
    if pooling == "cls":
        note = "the model pools with cls: the embedding is the first token's, so each text's whole score is on its first token"
    return JSONResponse({
        "model": engine.name, "pooling": pooling, "level": body.level, "note": note, "data": data,
        "usage": {"tokens": sum(t.n_tokens for t in tokenized)},
    })

