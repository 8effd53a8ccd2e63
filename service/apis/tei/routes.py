"""text-embeddings-inference's API, so that clients written for TEI change only their URL:
huggingface_hub's InferenceClient (and LangChain's, Haystack's and LlamaIndex's TEI classes over it or
beside it) post here. POST /embed, /embed_sparse, /embed_all, /rerank, /predict, /tokenize, /decode, and POST / (TEI's
root: /embed or /predict by the default model's task; also the `{"inputs", "parameters"}` body of the
Hugging Face Inference API, which huggingface_hub's text_classification sends).

Thin routes over the same engine calls as ours (tokenize, the batch queue, service/engine/scoring.py),
with the same limits, auth and metrics (the route label is the path). Errors in TEI's body,
`{"error", "error_type"}`, with its statuses (service/apis/tei/__init__.py). Where TEI's routes share a
path with ours (`/info`, `/health`), ours answer.

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

from typing import Any

import numpy as np
from fastapi import Body, Depends, Request
from pydantic import BaseModel, ValidationError

from service.engine.engine import Engine
from service.engine.errors import BackendError, EmptyInput, InvalidRequest, TooLarge
from service.engine.late_interaction import is_late_interaction, late_interaction_scores
from service.engine.prompts import check_dimensions, normalization, prompt_chars, shortened
from service.engine.runner import EncodeJob
from service.engine.encoder_service import EncoderService, as_list
from service.engine.scoring import applied, best_first, classification_job, label_scores, ranked, relevance, rerank_pairs
from service.front.deps import api_router, call_of, infer, model_for, reranker, runs, service
from service.front.errors import describe
from service.front.responses import JSON_FLOAT_BYTES, JSONResponse, KindCounter, respond
from service.apis.tei.schemas import (TEIDecodeRequest, TEIEmbedAllRequest, TEIEmbedRequest, TEIEmbedSparseRequest,
                                      TEIError, TEILabelScore, TEIPredictRequest, TEIRerankRequest, TEIRerankResult,
                                      TEISparseValue, TEIToken, TEITokenizeRequest, InferenceAPIClassifyRequest)

router = api_router()

TEI_ERROR_RESPONSES = {code: {"model": TEIError} for code in (400, 401, 413, 422, 424, 429, 503)}
# One /tokenize token in JSON but its text, `{"id":2054,"text":"","special":false,"start":12345,"stop":12350},`
TOKEN_JSON_BYTES = 64
# One /embed_sparse term in JSON, `{"index":250001,"value":0.123456789},`
SPARSE_VALUE_JSON_BYTES = 40


def truncation(truncate: bool | None, direction: str) -> tuple[bool, bool]:
    """(truncate, from the start): TEI cuts by default (its auto-truncate), at the end unless told left."""
    return truncate is None or truncate, direction.lower() == "left"


def texts_of(svc: EncoderService, inputs: str | list[str]) -> list[str]:
    """The request's texts within the limits; an empty list is TEI's 400 `Empty`."""
    texts = as_list(inputs)
    if not texts:
        raise EmptyInput("`inputs` cannot be empty")
    return svc.texts(texts)


async def embeddings(body: TEIEmbedRequest, request: Request, svc: EncoderService, route: str) -> JSONResponse:
    """The pooled embedding of every input, `[[floats]]` (a single text too), normalised by default
    (TEI's `normalize: true`); `dimensions` cuts before normalising, as TEI does."""
    engine = await model_for(svc, body.model, request, dense=True)
    raw = texts_of(svc, body.inputs)
    check_dimensions(engine.model, engine.name, body.dimensions)
    texts, skip = svc.prompted(engine, raw, body.prompt_name, None)
    truncate, from_start = truncation(body.truncate, body.truncation_direction)
    tokenized = await svc.tokenize(engine, texts, truncate, route, from_start=from_start, kept=prompt_chars(texts, raw))
    normalize = normalization(body.normalize, engine.model)
    result = await infer(svc, engine, EncodeJob(route=route, ids=[t.ids for t in tokenized], normalize=normalize,
                                                pool_skip=skip), request)
    vectors = result.embeddings
    if body.dimensions is not None:  # cut before normalising, as TEI does
        vectors = shortened(vectors, body.dimensions, body.normalize)
    kinds = KindCounter()
    content = kinds.array("embedding", np.ascontiguousarray(vectors, dtype=np.float32), "float", "float32")
    kinds.report(call_of(request))
    return JSONResponse(content)


@router.post("/embed", response_model=list[list[float]], responses=TEI_ERROR_RESPONSES, tags=["TEI"])
async def embed(body: TEIEmbedRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """TEI's /embed: the pooled embedding of every input."""
    return await embeddings(body, request, svc, "/embed")


@router.post("/embed_sparse", response_model=list[list[TEISparseValue]], responses=TEI_ERROR_RESPONSES, tags=["TEI"])
async def embed_sparse(body: TEIEmbedSparseRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """TEI's /embed_sparse: every input's sparse vector, its non-zero weights as `[{"index", "value"}]` in
    vocabulary order (a single text too is a list of one). A SPLADE model's, as TEI serves it, and BGE-M3's
    (its lexical weights, which TEI does not serve); any other model is TEI's 424."""
    engine = await model_for(svc, body.model, request)
    raw = texts_of(svc, body.inputs)
    if "sparse" not in engine.model.representations:  # TEI's words and status (its infer.rs embed_sparse)
        raise BackendError(f"Backend error: Model is not an embedding model with SPLADE pooling: {engine.name!r} gives "
                           f"{', '.join(engine.model.representations)} (a SPLADE or BGE-M3 model gives sparse vectors)")
    texts, skip = svc.prompted(engine, raw, body.prompt_name, None, pooled_only=not engine.model.needs_heads)
    truncate, from_start = truncation(body.truncate, body.truncation_direction)
    _, ids, attended = await svc.tokenize_for_model(engine, texts, truncate, "/embed_sparse", False,
                                                    from_start=from_start, kept=prompt_chars(texts, raw))
    splade = engine.model.sparse.kind == "splade"
    if not splade:  # BGE-M3: at most a term per token, known before inference
        svc.check_response_size(sum(len(i) for i in ids) * SPARSE_VALUE_JSON_BYTES)
    job = EncodeJob(route="/embed_sparse", ids=ids, normalize=engine.model.normalize, want_embedding=False,
                    pool_skip=skip, sparse=True, attended=attended)
    result = await infer(svc, engine, job, request)
    estimate = sum(len(indices) for indices, _ in result.sparse) * SPARSE_VALUE_JSON_BYTES
    if splade:  # a SPLADE vector's terms are bounded by the vocabulary only: counted once known
        svc.check_response_size(estimate)
    kinds = KindCounter()
    response = await respond(lambda: [kinds.fragment("sparse", [{"index": int(i), "value": float(v)}
                                                                for i, v in zip(indices, values, strict=True)])
                                      for indices, values in result.sparse], estimate)
    kinds.report(call_of(request))
    return response


@router.post("/embed_all", response_model=list[list[list[float]]], responses=TEI_ERROR_RESPONSES, tags=["TEI"])
async def embed_all(body: TEIEmbedAllRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """TEI's /embed_all: every token's encoding (the last hidden state), per input."""
    engine = await model_for(svc, body.model, request)
    raw = texts_of(svc, body.inputs)
    texts, _ = svc.prompted(engine, raw, body.prompt_name, None, pooled_only=False)
    truncate, from_start = truncation(body.truncate, body.truncation_direction)
    tokenized = await svc.tokenize(engine, texts, truncate, "/embed_all", from_start=from_start,
                                   kept=prompt_chars(texts, raw))
    estimate = sum(t.n_tokens for t in tokenized) * engine.model.hidden_size * JSON_FLOAT_BYTES
    svc.check_response_size(estimate)
    job = EncodeJob(route="/embed_all", ids=[t.ids for t in tokenized], normalize=engine.model.normalize,
                    want_embedding=False, want_hidden=True)
    result = await infer(svc, engine, job, request)
    kinds = KindCounter()
    # up to the response limit of floats: built in a worker thread when large, as /v1/encode's
    response = await respond(lambda: [kinds.array("token_embeddings", h, "float", "float32") for h in result.hidden],
                             estimate)
    kinds.report(call_of(request))
    return response


@router.post("/rerank", response_model=list[TEIRerankResult], responses=TEI_ERROR_RESPONSES, tags=["TEI"])
async def rerank(body: TEIRerankRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """TEI's /rerank: every text's score for the query, best first: CrossEncoder.predict's (the logit
    through the model's saved activation, a sigmoid unless it saved another), or the logit (raw_scores);
    on a ColBERT or BGE-M3, its late-interaction score, as /v1/rerank gives it (raw already)."""
    engine = await reranker(svc, body.model, request)
    if not body.texts:
        raise EmptyInput("`texts` cannot be empty")
    truncate, from_start = truncation(body.truncate, body.truncation_direction)
    if is_late_interaction(engine):
        if from_start:
            raise InvalidRequest(f"truncation_direction left: model {engine.name!r} scores by late interaction, whose "
                                 "texts are cut at their end as the model was trained; send right")
        scores = (await late_interaction_scores(svc, engine, body.query, body.texts, truncate, "/rerank",
                                                runs(svc, engine, request))).scores
    else:
        logits, _, _ = await rerank_pairs(svc, engine, body.query, body.texts, truncate, "/rerank",
                                          runs(svc, engine, request), from_start=from_start)
        scores = relevance(engine, body.raw_scores)(logits)
    return JSONResponse([{"index": i, "score": float(scores[i]), **({"text": body.texts[i]} if body.return_text else {})}
                         for i in best_first(scores)])


def predict_inputs(inputs: str | list[str] | list[list[str]]) -> tuple[list[tuple[str, ...]], bool]:
    """TEI's /predict inputs as (text,) or (text, text_pair) tuples, and whether it was one input: a
    string, or a list of one or two strings (TEI reads ["a", "b"] as one pair, not two texts); a batch is
    a list of such lists."""
    if isinstance(inputs, str):
        return [(inputs,)], True
    if not inputs:
        raise EmptyInput("`inputs` cannot be empty")
    if isinstance(inputs[0], str):
        if len(inputs) > 2:
            raise InvalidRequest(f"inputs: a list of strings is one input, [text] or [text, text_pair], not {len(inputs)} "
                                 "strings; send a batch as [[text], [text, text_pair], ...]")
        return [tuple(inputs)], True
    for i, item in enumerate(inputs):
        if len(item) not in (1, 2):
            raise InvalidRequest(f"inputs.{i}: an input is [text] or [text, text_pair], not {len(item)} strings")
    return [tuple(item) for item in inputs], False


async def classify(inputs: list[tuple[str, ...]], truncate: bool, from_start: bool, request: Request,
                   svc: EncoderService, route: str, model: str | None = None) -> tuple[Engine, np.ndarray]:
    """The logits of texts and text pairs (one job: a pair's second text gets its token type)."""
    engine = await model_for(svc, model, request, task="classification")
    if len(inputs) > svc.settings.max_inputs:
        raise TooLarge(f"{len(inputs)} inputs; at most {svc.settings.max_inputs} per request")
    for item in inputs:
        svc.texts(list(item))
    singles = [i for i, item in enumerate(inputs) if len(item) == 1]
    pairs = [i for i, item in enumerate(inputs) if len(item) == 2]
    tokenized: list = [None] * len(inputs)
    if singles:
        for i, t in zip(singles, await svc.tokenize(engine, [inputs[i][0] for i in singles], truncate, route,
                                                    from_start=from_start), strict=True):
            tokenized[i] = t
    if pairs:
        for i, t in zip(pairs, await svc.tokenize_pairs(engine, [inputs[i] for i in pairs], truncate, route,
                                                        from_start), strict=True):
            tokenized[i] = t
    svc.check_tokens(sum(t.n_tokens for t in tokenized), "send fewer inputs")
    return engine, (await infer(svc, engine, classification_job(route, tokenized, bool(pairs)), request)).embeddings


@router.post("/predict", response_model=list[TEILabelScore] | list[list[TEILabelScore]], responses=TEI_ERROR_RESPONSES,
          tags=["TEI"])
async def predict(body: TEIPredictRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """TEI's /predict: every label with its score, best first; one input answers one list, a batch a list
    of them."""
    inputs, single = predict_inputs(body.inputs)
    truncate, from_start = truncation(body.truncate, body.truncation_direction)
    route = call_of(request).route  # /predict, or / when the root route hands a classifier's body here
    engine, logits = await classify(inputs, truncate, from_start, request, svc, route, body.model)
    scores = label_scores(engine, logits, body.raw_scores)
    answers = [ranked(engine.model.labels, row) for row in scores]
    return JSONResponse(answers[0] if single else answers)


@router.post("/tokenize", response_model=list[list[TEIToken]], responses=TEI_ERROR_RESPONSES, tags=["TEI"])
async def tokenize(body: TEITokenizeRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """TEI's /tokenize: each input's tokens (the whole text, never truncated, as TEI), with character
    offsets; within the response limit, its tokens counted before any is listed (a 413 past it), and
    tokenized and listed off the event loop when large."""
    engine = await model_for(svc, body.model, request, task=None)
    texts = texts_of(svc, body.inputs)
    if body.prompt_name is not None:
        texts, _ = svc.prompted(engine, texts, body.prompt_name, None)
    limit = svc.settings.max_response_bytes
    text_bytes = sum(len(t) for t in texts)  # each token's `text` is its span of the text: about once over
    encodings = await svc.tokenize_whole(engine, texts, body.add_special_tokens, "/tokenize",
                                         max(limit - text_bytes, 0) // TOKEN_JSON_BYTES)
    estimate = sum(len(e) for e in encodings) * TOKEN_JSON_BYTES + text_bytes
    kinds = KindCounter()

    def build() -> list:  # a text's token dicts at a time, each serialised (and freed) before the next
        return [kinds.fragment("tokens", [
            {"id": i, "text": token if special else text[a:b], "special": bool(special),
             "start": None if special else a, "stop": None if special else b}
            for i, token, (a, b), special in zip(e.ids, e.tokens, e.offsets, e.special_tokens_mask, strict=True)])
            for text, e in zip(texts, encodings, strict=True)]

    response = await respond(build, estimate)
    svc.check_response_size(len(response.body))  # the estimate is one: the limit holds on what was written
    kinds.report(call_of(request))
    return response


@router.post("/decode", response_model=list[str], responses=TEI_ERROR_RESPONSES, tags=["TEI"])
async def decode(body: TEIDecodeRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """TEI's /decode: token ids back to text, one string per list of ids."""
    engine = await model_for(svc, body.model, request, task=None)
    if not body.ids:
        raise EmptyInput("`ids` cannot be empty")
    rows = [body.ids] if isinstance(body.ids[0], int) else body.ids
    svc.check_tokens(sum(len(r) for r in rows), "send fewer ids")
    return JSONResponse(engine.tokenizer.decode(rows, body.skip_special_tokens))


# ---- POST /: TEI's root, and the Hugging Face Inference API's body ----


def parsed(model: type[BaseModel], body: dict) -> Any:
    """A body validated as `model` would be by FastAPI, its errors as our one-line 422."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(describe(list(exc.errors()))) from None


@router.post("/", responses=TEI_ERROR_RESPONSES, tags=["TEI"])
async def root(request: Request, body: dict[str, Any] = Body(examples=[{"inputs": "The cat sat on the mat."}]),
               svc: EncoderService = Depends(service)) -> JSONResponse:
    """TEI's root route: /embed for an embedding model, /predict for a classifier (the task of the model
    the body names, else of the default model). A `parameters` object is read as the Hugging Face
    Inference API's: its fields join the body's (huggingface_hub's feature_extraction sends them flat,
    its text_classification inside `parameters`), and a classifier then answers as that API does, a
    list of labels per input (`top_k`, `function_to_apply`: softmax, sigmoid or none)."""
    parameters = body.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequest("parameters: must be an object")
    merged = {**{k: v for k, v in body.items() if k != "parameters"}, **(parameters or {})}
    name = merged.get("model")
    if name is not None and not isinstance(name, str):
        raise InvalidRequest("model: must be a string")
    if svc.engines.get(name).model.task != "classification":
        return await embeddings(parsed(TEIEmbedRequest, merged), request, svc, "/")
    if parameters is None:
        return await predict(parsed(TEIPredictRequest, merged), request, svc)
    asked = parsed(InferenceAPIClassifyRequest, merged)
    texts = as_list(asked.inputs)
    if not texts:
        raise EmptyInput("`inputs` cannot be empty")
    engine, logits = await classify([(t,) for t in texts], asked.truncate is None or asked.truncate, False, request,
                                    svc, "/", name)
    scores = applied(engine, logits, asked.function_to_apply)
    return JSONResponse([ranked(engine.model.labels, row, asked.top_k) for row in scores])
