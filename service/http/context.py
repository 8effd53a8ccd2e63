"""What a route gets, and the HTTP side of a request's steps.

Routes take the replica's EncoderService (service/engine/encoder_service.py) as a FastAPI dependency,
`svc: EncoderService = Depends(service)`: the deployment sets it when the replica starts
(`serve_with`). The helpers here add what only HTTP knows: the model named in the request
(noted for the metrics' model label), the client's own deadline header, and a client that
closes its connection while its job waits.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from service.engine.engine import Engine
from service.engine.errors import InvalidRequest
from service.engine.prompts import prompt_for
from service.engine.runner import EncodeJob, EncodeResult
from service.engine.encoder_service import EncoderService
from service.http.middleware import HEADER_DEADLINE_MARGIN_S, TIMEOUT_HEADER, asked_deadline_s


_current: list[EncoderService] = []  # this replica's, once it has started


def serve_with(svc: EncoderService) -> None:
    """The deployment's part: the service every route of this replica uses from now on."""
    _current[:] = [svc]


async def service() -> EncoderService:
    """The FastAPI dependency of every route that runs a model or describes one. Async: FastAPI runs
    a plain `def` dependency in a thread pool, a thread hop per request (0.4 ms of the replica's CPU
    per single text, `make profile`)."""
    if not _current:
        raise RuntimeError("no EncoderService: the deployment sets one when the replica starts (serve_with)")
    return _current[0]


# What each kind of model serves, for the 422 of a route that does not fit a model's task.
ROUTES_BY_TASK = {
    "embedding": "/v1/embeddings, /v1/encode, /v1/similarity, /v1/attention, /v2/models/{name}/infer, /v1/tokenize",
    "classification": "/v1/classify, /v1/rerank (one label: a cross-encoder), /v2/models/{name}/infer (text, "
                      "text_pair -> logits, scores), /v1/tokenize",
}


def model_for(svc: EncoderService, name: str | None, request: Request, required: bool = False,
              task: str | None = "embedding") -> Engine:
    """The model a request names (404 naming the served ones), noted for the metrics' model label.
    `task`: what the route needs; a model of another task is a 422 that says which routes it serves.
    Left out, the model is the default, or the first served model of the route's task."""
    if name is None and task is not None and svc.engines.default.model.task != task:
        name = next((e.name for e in svc.engines if e.model.task == task), None)
    engine = svc.engines.get(name, required)
    if task is not None and engine.model.task != task:
        raise InvalidRequest(
            f"model {engine.name!r} is a model of task {engine.model.task}: it serves {ROUTES_BY_TASK[engine.model.task]}; "
            f"{request.url.path} needs a model of task {task} (served: "
            + ", ".join(f"{e.name!r} ({e.model.task})" for e in svc.engines) + ")")
    request.scope["model"] = engine.name
    request.scope["task"] = engine.model.task
    return engine


def prompted(svc: EncoderService, engine: Engine, texts: list[str], prompt_name: str | None,
             input_type: str | None, pooled_only: bool = True, chunked: bool = False) -> tuple[list[str], int]:
    """The texts with the request's prompt before each (service/engine/prompts.py), and how many of
    their first tokens pooling leaves out (EncodeJob.pool_skip). `pooled_only`: the request wants
    nothing but pooled outputs (no token encodings, no attention)."""
    prompt = prompt_for(engine.model, engine.name, prompt_name, input_type)
    if prompt is None:
        return texts, 0
    if chunked:
        raise InvalidRequest(f"chunking with a prompt ({prompt.name!r}) is not supported: a prompt goes before a "
                             "whole text, not before each of its windows")
    if prompt.pool_skip and engine.model.dense_layers:
        # pooled here without the prompt, a Dense projection inside the graph would be skipped: such a
        # text must run on a packed row, which pools by weights before the Dense
        packs = engine.runner.runtime.packed is not None and bool(svc.batching.packed_tokens)
        if not (packs and pooled_only):
            raise InvalidRequest(f"prompt {prompt.name!r} on model {engine.name!r} (its pooling leaves the prompt out, "
                                 "then a Dense projection follows) is served for pooled embeddings on packed rows only"
                                 + ("" if packs else ": packing is off on this replica"))
    return prompt.apply(texts), prompt.pool_skip


def prompt_chars(prompted_texts: list[str], texts: list[str]) -> int:
    """The characters of the prompt `prompted` put before every text (0 without one): what left
    truncation keeps (EncoderService.tokenize's `kept`)."""
    return len(prompted_texts[0]) - len(texts[0])


def normalization(asked: bool | None, engine: Engine) -> bool:
    """Whether a request's embeddings are L2-normalised: as asked, else as the model was trained."""
    normalize = engine.model.normalize if asked is None else asked
    if engine.model.normalize and not normalize and engine.model.dense_layers:
        # the raw embedding is re-pooled from the token encodings, which would skip the Dense projection
        raise InvalidRequest("normalize: false is not available for this model: it normalises after a Dense "
                             "projection inside its graph, so only the normalised embedding exists")
    return normalize


def deadline(request: Request, svc: EncoderService) -> float:
    """Seconds this request has left: the service's limit, or the client's when it is shorter,
    counted from its arrival (MetricsMiddleware notes it), so the time spent reading, parsing and
    tokenizing it counts, as it does on Serve's clock for the same header."""
    limit = svc.settings.request_timeout_s
    asked = asked_deadline_s(request.scope)
    if asked is not None and (not asked > 0 or asked == float("inf")):
        raise InvalidRequest(f"{TIMEOUT_HEADER} must be a positive number of seconds, "
                             f"got {request.headers.get(TIMEOUT_HEADER)!r}")
    allowed = limit if asked is None else min(asked - HEADER_DEADLINE_MARGIN_S, limit)
    arrived = request.scope.get("arrived")
    spent = time.perf_counter() - arrived if arrived is not None else 0.0
    return max(allowed - spent, 0.001)


async def infer(svc: EncoderService, engine: Engine, job: EncodeJob, request: Request) -> EncodeResult:
    """The job through the engine within the request's deadline. Ray's proxy actor cancels the
    handler of a client that left; HAProxy closes the connection to the replica only for some of
    them, so the disconnect is also watched for here."""
    timeout = deadline(request, svc)
    count(request.scope, [job])
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        return await svc.infer(engine, job, timeout, gone)
    finally:
        gone.cancel()


async def infer_all(svc: EncoderService, engine: Engine, jobs: list[EncodeJob], request: Request) -> list[EncodeResult]:
    """Several jobs of one request at once (EncoderService.infer_all), with one disconnect watcher
    for all of them: `receive()` hands the one `http.disconnect` message to one caller, so a watcher
    per job could leave the others computing for a client that left."""
    timeout = deadline(request, svc)
    count(request.scope, jobs)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        return await svc.infer_all(engine, jobs, timeout, gone)
    finally:
        gone.cancel()


def count(scope: dict, jobs: list[EncodeJob]) -> None:
    """Texts and tokens a request sends to inference, for its access log line (`scope`: the request's
    ASGI scope, or a gRPC call's)."""
    scope["texts"] = scope.get("texts", 0) + sum(len(job.ids) for job in jobs)
    scope["tokens"] = scope.get("tokens", 0) + sum(len(ids) for job in jobs for ids in job.ids)


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the request's body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
