"""OpenAI's Files and Batches routes, as the `openai` SDK calls them (`client.files.create/retrieve/content/delete`,
`client.batches.create/retrieve/list/cancel`). They only keep state in the store (store.py); the work of a batch
is done by the runner (runner.py), beside the online requests.

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

import asyncio
import hashlib
import time
from email.message import Message
from email.parser import BytesHeaderParser

from fastapi import Depends, Query, Request
from starlette.responses import FileResponse

from service.apis.openai_batch.schemas import BatchCreateRequest
from service.apis.openai_batch.store import TERMINAL, new_id, public, store_at
from service.config import ServiceSettings
from service.engine.encoder_service import EncoderService
from service.engine.errors import BadRequest, TooLarge
from service.front.deps import api_router, service
from service.front.gate import Gate
from service.front.responses import JSONResponse
from service.front.schemas import ERROR_RESPONSES

router = api_router()

# What a multipart upload adds around the file's bytes (boundaries, part headers, the `purpose` field): the
# body may be this much larger than batch_max_file_bytes before it is refused while it streams in
UPLOAD_ALLOWANCE = 64 * 1024


async def owner(request: Request) -> str:
    """Whose files and batches a request sees: the SHA-256 of its bearer token (the gate has checked it before
    the route runs), or "" when authentication is off. Async: FastAPI runs a plain `def` dependency in a
    thread pool."""
    if Gate.token is None:
        return ""
    token = request.headers.get("authorization", "").partition(" ")[2].strip()
    return hashlib.sha256(token.encode("latin-1", "replace")).hexdigest()


@router.post("/v1/files", responses=ERROR_RESPONSES)
async def file_create(request: Request, who: str = Depends(owner),
                      svc: EncoderService = Depends(service)) -> JSONResponse:
    """`client.files.create(file=..., purpose="batch")`: a JSONL file of request lines, multipart. Its size is
    counted as it streams in (413 past batch_max_file_bytes), then its lines (batch_max_lines,
    batch_max_line_bytes), before anything is stored."""
    settings = svc.settings
    content_type = request.headers.get("content-type", "")
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str) or not boundary:
        raise BadRequest("POST /v1/files takes multipart/form-data with the fields `purpose` and `file`")
    limit = settings.batch_max_file_bytes
    received, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + UPLOAD_ALLOWANCE:
            raise TooLarge(_too_large(limit))
        received.append(chunk)
    # the parse, the checks of every line and the write off the event loop (a file may be 100 MB)
    record = await asyncio.to_thread(stored_upload, settings, who, b"".join(received), boundary.encode("latin-1"))
    return JSONResponse(public(record))


def stored_upload(settings: ServiceSettings, who: str, body: bytes, boundary: bytes) -> dict:
    """The upload's file, checked against the limits, stored."""
    fields = multipart_fields(body, boundary)
    purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
    if purpose != "batch":
        raise BadRequest(f"purpose {purpose!r}: this service keeps files of purpose 'batch' only")
    if "file" not in fields:
        raise BadRequest("no `file` part in the upload")
    filename, data = fields["file"]
    limit = settings.batch_max_file_bytes
    if len(data) > limit:
        raise TooLarge(_too_large(limit))
    lines = data.splitlines()
    if len(lines) > settings.batch_max_lines:
        raise TooLarge(f"the file has {len(lines)} lines; the limit is {settings.batch_max_lines} "
                       "(batch_max_lines): split it into several batches")
    for number, line in enumerate(lines, 1):
        if len(line) > settings.batch_max_line_bytes:
            raise TooLarge(f"line {number} has {len(line)} bytes; the limit is {settings.batch_max_line_bytes} "
                           "(batch_max_line_bytes)")
    return store_at(settings.jobs_dir).add_file(who, filename or "upload.jsonl", purpose, data)


@router.get("/v1/files/{file_id}", responses=ERROR_RESPONSES)
async def file_retrieve(file_id: str, who: str = Depends(owner), svc: EncoderService = Depends(service)) -> JSONResponse:
    return JSONResponse(public(store_at(svc.settings.jobs_dir).file(who, file_id)))


@router.get("/v1/files/{file_id}/content", responses=ERROR_RESPONSES)
async def file_content(file_id: str, who: str = Depends(owner), svc: EncoderService = Depends(service)) -> FileResponse:
    """The file's bytes (`client.files.content`): an uploaded file, or a batch's output or error file."""
    store = store_at(svc.settings.jobs_dir)
    store.file(who, file_id)
    return FileResponse(store.files / f"{file_id}.jsonl", media_type="application/jsonl")  # streamed from disk


@router.delete("/v1/files/{file_id}", responses=ERROR_RESPONSES)
async def file_delete(file_id: str, who: str = Depends(owner), svc: EncoderService = Depends(service)) -> JSONResponse:
    store_at(svc.settings.jobs_dir).delete_file(who, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.post("/v1/batches", responses=ERROR_RESPONSES)
async def batch_create(body: BatchCreateRequest, who: str = Depends(owner),
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
        "created_ns": created_ns, "output_expires_s": (body.output_expires_after.seconds if body.output_expires_after
                                                       else settings.batch_output_expires_s),
    }
    # counted and stored as one step under the owner's lock (other replicas share the directory), off the loop
    unfinished = await asyncio.to_thread(store.create_batch, record, settings.batch_max_per_token)
    if unfinished is not None:
        raise BadRequest(f"{unfinished} batches of this token are unfinished; the limit is "
                         f"{settings.batch_max_per_token} (batch_max_per_token): wait for one to end, or cancel one")
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


def multipart_fields(body: bytes, boundary: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's parts by name: (filename, bytes). The body is already bounded."""
    fields: dict[str, tuple[str | None, bytes]] = {}
    delimiter = b"--" + boundary
    for part in body.split(delimiter)[1:]:
        if part.startswith(b"--"):  # the closing delimiter
            break
        head, separator, content = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not separator:
            raise BadRequest("a part of the multipart body has no blank line after its headers")
        headers = BytesHeaderParser().parsebytes(head + b"\r\n\r\n")
        name = headers.get_param("name", header="content-disposition")
        if isinstance(name, str) and name not in fields:
            fields[name] = (headers.get_filename(), content.removesuffix(b"\r\n"))
    return fields


def _too_large(limit: int) -> str:
    return f"the file is larger than the limit of {limit} bytes (batch_max_file_bytes): split it into several batches"
