"""OpenAI's embeddings API, POST /v1/embeddings: works with the official `openai` client.

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

from datetime import datetime

from fastapi import Depends, Request

from bundle.manifest import BundleManifest
from service.engine.runner import EncodeJob, mean_of_chunks
from service.engine.encoder_service import EncoderService
from service.engine.prompts import check_dimensions, describe, shortened
from service.front.deps import api_router, call_of, infer, model_for, service
from service.front.identity import SERVER_NAME
from service.front.responses import JSONResponse, KindCounter, encode_array
from service.front.schemas import ERROR_RESPONSES
from service.apis.openai.schemas import OpenAIEmbeddingRequest, OpenAIEmbeddingResponse

router = api_router()


@router.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, responses=ERROR_RESPONSES)
async def embeddings(body: OpenAIEmbeddingRequest, request: Request, svc: EncoderService = Depends(service)) -> JSONResponse:
    """OpenAI's embeddings API: works with the official `openai` client."""
    engine = await model_for(svc, body.model, request, required=True, dense=True)
    check_dimensions(engine.model, engine.name, body.dimensions)
    texts, skip = svc.prompted(engine, svc.texts(body.input), body.prompt_name, body.input_type,
                           chunked=body.chunking is not None)
    if body.chunking is not None:  # each text the normalised mean of its chunks' embeddings
        chunks = await svc.tokenize_chunks(engine, texts, body.chunking.tokens, body.chunking.overlap, "/v1/embeddings")
        tokenized = [c for text in chunks for c in text]
        svc.check_response_size(len(texts) * engine.model.sentence_dim * 20)
    else:
        tokenized = await svc.tokenize(engine, texts, True, "/v1/embeddings")
    job = EncodeJob(route="/v1/embeddings", ids=[t.ids for t in tokenized], normalize=engine.model.normalize,
                    pool_skip=skip)
    result = await infer(svc, engine, job, request)
    vectors = result.embeddings if body.chunking is None else mean_of_chunks(result.embeddings, [len(c) for c in chunks])
    if body.dimensions is not None:  # shortened as OpenAI does: cut, then re-normalise
        vectors = shortened(vectors, body.dimensions)
    kinds = KindCounter()
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": kinds.fragment("embedding", encode_array(v, body.encoding_format, "float32")),
        }
        for i, v in enumerate(vectors)
    ]
    kinds.report(call_of(request))
    tokens = sum(t.n_tokens for t in tokenized)
    return JSONResponse(
        {"object": "list", "data": data, "model": engine.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    )


@router.get("/v1/models")
async def models_list(svc: EncoderService = Depends(service)) -> JSONResponse:
    """The served models, in OpenAI's list format (`client.models.list()` works unchanged); with a model
    repository, every model in it, `loaded` saying whether this replica holds it now."""
    if svc.repository is None:
        return JSONResponse({"object": "list", "data": [_model(m.name, m.manifest, list(m.aliases), True)
                                                        for m in svc.engines]})
    return JSONResponse({"object": "list", "data": [
        _model(name, engine.manifest if engine else manifest, list(engine.aliases) if engine else [], engine is not None)
        for name, engine, manifest in svc.repository.models()]})


@router.get("/v1/models/{name}", responses=ERROR_RESPONSES)
async def model_retrieve(name: str, svc: EncoderService = Depends(service)) -> JSONResponse:
    """One served model (OpenAI's `client.models.retrieve`), described without loading it."""
    if svc.repository is not None and name not in svc.engines.by_name and name not in svc.engines.by_alias:
        for listed, engine, manifest in svc.repository.models():
            if listed == name:
                return JSONResponse(_model(name, manifest, [], engine is not None))
    m = svc.engines.get(name)
    return JSONResponse(_model(m.name, m.manifest, list(m.aliases), True))


def _model(name: str, manifest: BundleManifest | None, aliases: list[str], loaded: bool) -> dict:
    """OpenAI's model object, with what the bundle's manifest says of it (nothing more when it is unreadable)."""
    if manifest is None:
        return {"id": name, "object": "model", "created": 0, "owned_by": SERVER_NAME, "loaded": loaded}
    return {"id": name, "object": "model", "created": _unix_time(manifest.created_at), "owned_by": SERVER_NAME,
            "task": manifest.model.task, "aliases": aliases, "loaded": loaded, **describe(manifest.model)}


def _unix_time(iso: str) -> int:
    """The bundle's export time as OpenAI's `created` (seconds since the epoch); 0 when unreadable."""
    try:
        return int(datetime.fromisoformat(iso).timestamp())
    except ValueError:
        return 0
