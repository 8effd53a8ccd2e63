"""OpenAI's Files and Batches routes, as the `openai` SDK calls them (`client.files.create/retrieve/content/delete`,
`client.batches.create/retrieve/list/cancel`). They only keep state in the store (store.py); the work of a batch
is done by the runner (runner.py), beside the online requests.

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

import asyncio
import hashlib
import time

from fastapi import Depends, Query, Request
from starlette.requests import ClientDisconnect
from starlette.responses import FileResponse

from service.apis.openai_batch.schemas import BatchCreateRequest
from service.apis.openai_batch.store import TERMINAL, new_id, public, store_at
from service.apis.openai_batch.uploads import (UPLOAD_ALLOWANCE, Limits, UploadSink, UploadSlots, boundary_of, expires_at,
                                               read_upload)
from service.engine.encoder_service import EncoderService
from service.engine.errors import BadRequest, ClientGone, NotFound, TooLarge
from service.front.deps import CALL_KEY, api_router, call_of, service
from service.front.gate import Gate
from service.front.keys import TOKEN_KEY_NAME
from service.front.responses import JSONResponse
from service.front.schemas import ERROR_RESPONSES

router = api_router()



async def owner(request: Request) -> str:
    """Whose files and batches a request sees: its key's name (the gate has identified it before the route
    runs), so that a key's secret can be rotated without orphaning them; the single token's, as before keys
    files, the SHA-256 of the token; "" when authentication is off. Async: FastAPI runs a plain `def`
    dependency in a thread pool."""
    if Gate.keyring is None:
        return ""
    key = call_of(request).key
    if key is None or key.name == TOKEN_KEY_NAME:
        token = request.headers.get("authorization", "").partition(" ")[2].strip()
        return hashlib.sha256(token.encode("latin-1", "replace")).hexdigest()
    return hashlib.sha256(f"key:{key.name}".encode()).hexdigest()  # (hex: the store names paths by it)


def quotas(request: Request, settings) -> tuple[tuple[int, str], tuple[int, str], tuple[int, str]]:
    """The caller's Batch API quotas, each with the name a refusal gives it: files, bytes, unfinished batches;
    its key's (batch_files, batch_bytes, unfinished_batches in the keys file), else the service's."""
    key = call_of(request).key

    def one(of_key: str, setting: str) -> tuple[int, str]:
        given = getattr(key, of_key, None) if key is not None else None
        return (given, f"the key's {of_key}") if given is not None else (getattr(settings, setting), setting)

    return (one("batch_files", "batch_max_files_per_token"), one("batch_bytes", "batch_max_bytes_per_token"),
            one("unfinished_batches", "batch_max_per_token"))


@router.post("/v1/files", responses=ERROR_RESPONSES)
async def file_create(request: Request, who: str = Depends(owner),
                      svc: EncoderService = Depends(service)) -> JSONResponse:
    """`client.files.create(file=..., purpose="batch", expires_after=...)`: a JSONL file of request lines,
    multipart, streamed to disk as it arrives (uploads.py): its bytes, lines and line lengths are counted as they
    come (413 the moment one passes its limit), and it is stored only when the body is whole and the token's
    files leave room for it (batch_max_files_per_token, batch_max_bytes_per_token)."""
    settings = svc.settings
    boundary = boundary_of(request.headers.get("content-type", ""))
    store = store_at(settings.jobs_dir)
    (max_files, files_name), (max_bytes, bytes_name), _ = quotas(request, settings)
    count, used = await asyncio.to_thread(store.usage, who)  # refused before a byte is read; rechecked to store
    if count >= max_files:
        raise BadRequest(f"this token has {count} files; the limit is {max_files} ({files_name}): delete one first")
    left = max_bytes - used
    if left <= 0:
        raise TooLarge(f"this token's files hold {used} bytes, the limit of {max_bytes} ({bytes_name}): delete some "
                       "first")
    limits = Limits(min(settings.batch_max_file_bytes, left), settings.batch_max_lines, settings.batch_max_line_bytes,
                    "batch_max_file_bytes" if settings.batch_max_file_bytes <= left else bytes_name)
    body_limit = settings.batch_max_file_bytes + UPLOAD_ALLOWANCE
    with UploadSlots(settings.batch_max_concurrent_uploads):
        sink = UploadSink(boundary, limits, store.files)
        try:
            upload = await read_upload(request.stream(), sink, body_limit)
            created_at = int(time.time())
            expiry = expires_at(upload.fields, created_at, settings.batch_file_expires_after_s)
            record = await asyncio.to_thread(
                store.add_upload, who, upload.filename, upload.size, upload.path, expiry, created_at,
                max_files, max_bytes, files_name, bytes_name)
        except ClientDisconnect:
            if CALL_KEY in request.scope:
                request.scope[CALL_KEY].client_gone = True
            raise ClientGone("the client left while uploading") from None
        finally:
            sink.discard()  # here, not in a thread: it runs when the request is cancelled too
    return JSONResponse(public(record))


@router.get("/v1/files/{file_id}", responses=ERROR_RESPONSES)
async def file_retrieve(file_id: str, who: str = Depends(owner), svc: EncoderService = Depends(service)) -> JSONResponse:
    return JSONResponse(public(store_at(svc.settings.jobs_dir).file(who, file_id)))


@router.get("/v1/files/{file_id}/content", responses=ERROR_RESPONSES)
async def file_content(file_id: str, who: str = Depends(owner), svc: EncoderService = Depends(service)) -> FileResponse:
    """The file's bytes (`client.files.content`): an uploaded file, or a batch's output or error file."""
    store = store_at(svc.settings.jobs_dir)
    store.file(who, file_id)
    path = store.files / f"{file_id}.jsonl"
    if not path.is_file():  # its bytes removed under its record (an expiry sweep between the two): a 404, not a 500
        raise NotFound(f"no file {file_id!r}")
    return FileResponse(path, media_type="application/jsonl")  # streamed from disk


@router.delete("/v1/files/{file_id}", responses=ERROR_RESPONSES)
async def file_delete(file_id: str, who: str = Depends(owner), svc: EncoderService = Depends(service)) -> JSONResponse:
    store_at(svc.settings.jobs_dir).delete_file(who, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.post("/v1/batches", responses=ERROR_RESPONSES)
async def batch_create(body: BatchCreateRequest, request: Request, who: str = Depends(owner),
                       svc: EncoderService = Depends(service)) -> JSONResponse:
    """`client.batches.create(...)`: the batch is stored as `validating`; a runner takes it from there."""
    settings = svc.settings
    store = store_at(settings.jobs_dir)
    source = store.file(who, body.input_file_id)
    if source["purpose"] != "batch":
        raise BadRequest(f"file {body.input_file_id} has purpose {source['purpose']!r}; a batch reads a 'batch' file")
    created_ns = time.time_ns()
    now = created_ns // 10**9
    record = {
        "id": new_id("batch_"), "object": "batch", "endpoint": body.endpoint, "errors": None,
        "input_file_id": body.input_file_id, "completion_window": body.completion_window, "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
        "expires_at": now + settings.batch_completion_window_s, "finalizing_at": None, "completed_at": None, "failed_at": None,
        "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": body.metadata, "owner": who,
        # the key its lines run as (its name: its models and limits per minute, read when each line runs)
        "key": call_of(request).key.name if call_of(request).key is not None else None,
        "created_ns": created_ns, "output_expires_s": (body.output_expires_after.seconds if body.output_expires_after
                                                       else settings.batch_output_expires_s),
    }
    # counted and stored as one step under the owner's lock (other replicas share the directory), off the loop
    max_unfinished, unfinished_name = quotas(request, settings)[2]
    unfinished = await asyncio.to_thread(store.create_batch, record, max_unfinished)
    if unfinished is not None:
        raise BadRequest(f"{unfinished} batches of this token are unfinished; the limit is "
                         f"{max_unfinished} ({unfinished_name}): wait for one to end, or cancel one")
    return JSONResponse(public(record))


@router.get("/v1/batches/{batch_id}", responses=ERROR_RESPONSES)
async def batch_retrieve(batch_id: str, who: str = Depends(owner), svc: EncoderService = Depends(service)) -> JSONResponse:
    return JSONResponse(public(store_at(svc.settings.jobs_dir).batch(who, batch_id)))


@router.get("/v1/batches", responses=ERROR_RESPONSES)
async def batch_list(who: str = Depends(owner), after: str | None = Query(None, max_length=64),
                     limit: int = Query(20, ge=1, le=100), svc: EncoderService = Depends(service)) -> JSONResponse:
    """The token's batches, newest first, a page at a time (`after`: the last id of the page before)."""
    # the owner's index and the page's records only, off the loop
    found, more = await asyncio.to_thread(store_at(svc.settings.jobs_dir).batch_page, who, after, limit)
    page = [public(b) for b in found]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": more})


@router.post("/v1/batches/{batch_id}/cancel", responses=ERROR_RESPONSES)
async def batch_cancel(batch_id: str, who: str = Depends(owner), svc: EncoderService = Depends(service)) -> JSONResponse:
    """`client.batches.cancel(id)`: `cancelling` until the runner stops at its next chunk of lines and writes the
    outputs of the lines done (then `cancelled`); a batch already ended is answered as it is."""
    store = store_at(svc.settings.jobs_dir)
    record = store.batch(who, batch_id)
    if record["status"] not in TERMINAL:
        store.ask_cancel(batch_id)
        record = store.batch(who, batch_id)
    return JSONResponse(public(record))
