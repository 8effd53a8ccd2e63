"""What an API's HTTP route gets, as FastAPI dependencies and helpers: the replica's EncoderService
(the deployment sets it when the replica starts: `serve_with`), the call record the HTTP transport
made for the request, and the call's jobs run within its deadline, cancelled when its client leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request

from service.engine.encoder_service import EncoderService
from service.engine.engine import Engine
from service.engine.runner import EncodeJob, EncodeResult
from service.engine.scoring import Run, reranker as find_reranker
from service.front.call import Call
from service.front.quotas import Quotas
from service.front.request_ids import new_request_id
from service.front.responses import JSONResponse

CALL_KEY = "encoder.call"  # where the HTTP transport keeps a request's Call in its ASGI scope

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


async def record_route(request: Request) -> None:
    """Every route's first dependency: the call's route template (templates, not paths, so label values
    stay few). Async: FastAPI runs a plain `def` dependency in a thread pool, a thread hop per request."""
    note_route(request)


def note_route(request: Request) -> None:
    route = request.scope.get("route")
    if route is not None:
        call_of(request).route = getattr(route, "path", "unmatched")


def api_router() -> APIRouter:
    """The router an API's module adds its routes to: each route notes its template on the call, and
    answers with our JSON (orjson) unless it says otherwise."""
    return APIRouter(dependencies=[Depends(record_route)], default_response_class=JSONResponse)


def call_of(request: Request) -> Call:
    """The request's call record (made by the HTTP transport; a bare one where no transport stands in
    front, as in a unit test of a route)."""
    call = request.scope.get(CALL_KEY)
    if call is None:
        call = request.scope[CALL_KEY] = Call(new_request_id(), "http", request.method, path=request.url.path)
    return call


async def model_for(svc: EncoderService, name: str | None, request: Request, required: bool = False,
                    task: str | None = "embedding", dense: bool = False) -> Engine:
    """The model a request names (EncoderService.model_for; a repository's loaded here first, within the call's
    deadline), noted on its call for the metrics and held loaded until the call ends. `dense`: the route returns
    dense embeddings, which a SPLADE or ColBERT model has not (a 400 naming what it gives)."""
    call = call_of(request)
    call.may_call(name)  # before a load: a key never loads a model it may not call
    await svc.load_if_needed(name, call.deadline(svc.settings.request_timeout_s))
    engine = call.serves(svc.model_for(name, request.url.path, required, task))
    if dense:
        svc.check_representations(engine, ["dense"])
    return engine


async def reranker(svc: EncoderService, name: str | None, request: Request) -> Engine:
    """The cross-encoder a rerank request names (engine/scoring.py reranker), loaded and noted on its call."""
    call = call_of(request)
    call.may_call(name)
    await svc.load_if_needed(name, call.deadline(svc.settings.request_timeout_s))
    return call.serves(find_reranker(svc, name, request.url.path))


async def _within_call(svc: EncoderService, request: Request, jobs: list[EncodeJob],
                       run: Callable[[float, asyncio.Future], Awaitable[Any]]) -> Any:
    """`run(timeout, gone)` for the call's jobs: charged to its key's tokens per minute (a 429 before they are
    batched), counted on the call, within its deadline, with one
    watcher of the client's disconnect. Ray's proxy actor cancels the handler of a client that left;
    HAProxy closes the connection to the replica only for some of them, so it is watched for here."""
    call = call_of(request)
    await Quotas.charge_tokens(call, call.tokens_of(jobs))  # a key's tokens per minute, before they are batched
    call.count(jobs)
    timeout = call.deadline(svc.settings.request_timeout_s)  # (after the charge: its wait is the call's too)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        return await run(timeout, gone)
    finally:
        gone.cancel()


async def infer(svc: EncoderService, engine: Engine, job: EncodeJob, request: Request) -> EncodeResult:
    """The job through the engine within the call's deadline, cancelled when its client leaves."""
    return await _within_call(svc, request, [job], lambda timeout, gone: svc.infer(engine, job, timeout, gone))


async def infer_all(svc: EncoderService, engine: Engine, jobs: list[EncodeJob], request: Request) -> list[EncodeResult]:
    """Several jobs of one request at once (EncoderService.infer_all), with one disconnect watcher
    for all of them: `receive()` hands the one `http.disconnect` message to one caller, so a watcher
    per job could leave the others computing for a client that left."""
    return await _within_call(svc, request, jobs, lambda timeout, gone: svc.infer_all(engine, jobs, timeout, gone))


def runs(svc: EncoderService, engine: Engine, request: Request) -> Run:
    """How engine/scoring.py runs this request's jobs: one alone (infer), several at once (infer_all)."""
    async def run(jobs: list[EncodeJob]) -> list[EncodeResult]:
        if len(jobs) == 1:
            return [await infer(svc, engine, jobs[0], request)]
        return await infer_all(svc, engine, jobs, request)

    return run


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the request's body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
