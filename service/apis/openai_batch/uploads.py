"""POST /v1/files, the upload itself: a multipart body parsed as it streams in (python-multipart's
MultipartParser, the parser Starlette uses), its `file` part written straight to a temporary file under
jobs_dir while its bytes, lines and each line's length are counted, refused (413, the setting named) the
moment one passes its limit. Nothing of the body is held beyond the chunk in hand and the small fields
(`purpose`, `expires_after[...]`); the temporary file becomes the stored file only when every check has
passed (store.py `add_upload`), and is removed on any failure.

The per-chunk work (parsing, counting, writing) runs in a worker thread, a chunk of at most 64 KiB at a
time, so the event loop that answers online requests is never held by an upload.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from email.message import Message
from pathlib import Path
from typing import IO

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from service.apis.openai_batch.schemas import EXPIRES_AFTER_S
from service.engine.errors import BadRequest, ServiceError, TooLarge

# What a multipart upload may add around the file's bytes (boundaries, part headers, the small fields): the
# body may be this much larger than batch_max_file_bytes before it is refused while it streams in
MAX_PART_HEADER_BYTES = 16 * 1024  # all the header lines of one part (a real one is ~100 bytes)
MAX_PARTS = 8  # purpose, file, expires_after[anchor], expires_after[seconds], and a few a client may add
MAX_FIELD_BYTES = 1024  # the value of a field that is not the file (purpose, expires_after[...])
UPLOAD_ALLOWANCE = MAX_PARTS * (MAX_PART_HEADER_BYTES + MAX_FIELD_BYTES + 256)
# python-multipart logs a warning for every malformed body: a hostile client would write a line per request
logging.getLogger("python_multipart.multipart").setLevel(logging.ERROR)
# the most bytes the parser gets in one call: bounds the time one call holds the GIL (a part's headers are
# parsed a byte at a time in Python: about 10 ms per 64 KiB)
PIECE = 64 * 1024
FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")


class UploadsBusy(ServiceError):
    """Every upload slot of this replica is taken (batch_max_concurrent_uploads): 503 with Retry-After."""

    type = "overloaded"


class UploadSlots:
    """The uploads this replica is reading now. A class attribute, not a module variable: Ray Serve pickles
    the routes' module variables by value (service/http/middleware.py says why)."""

    active = 0

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __enter__(self) -> UploadSlots:
        if UploadSlots.active >= self.limit:
            raise UploadsBusy(f"{UploadSlots.active} uploads are being read by this replica; the limit is {self.limit} "
                              "(batch_max_concurrent_uploads): retry shortly", retry_after_s=1)
        UploadSlots.active += 1
        return self

    def __exit__(self, *exc: object) -> None:
        UploadSlots.active -= 1


def boundary_of(content_type: str) -> bytes:
    """The multipart boundary of a Content-Type; 400 for anything but multipart/form-data with one."""
    header = Message()
    header["content-type"] = content_type
    boundary = header.get_param("boundary")
    if header.get_content_type() != "multipart/form-data" or not isinstance(boundary, str) or not boundary \
            or len(boundary) > 70:  # RFC 2046's longest boundary
        raise BadRequest("POST /v1/files takes multipart/form-data with the fields `purpose` and `file`")
    try:
        return boundary.encode("latin-1")
    except UnicodeEncodeError:
        raise BadRequest("the multipart boundary is not ASCII") from None


@dataclass
class Limits:
    """What one upload may hold: the file's bytes (the smaller of batch_max_file_bytes and what is left of the
    token's batch_max_bytes_per_token: `bytes_setting` names which), its lines and each line's bytes."""

    file_bytes: int
    lines: int
    line_bytes: int
    bytes_setting: str = "batch_max_file_bytes"


class LineCounter:
    """Counts the lines of a stream of bytes as Python's `bytes.splitlines()` splits them (\\n, \\r, \\r\\n), and
    refuses a line or a count over its limit the moment it is passed, holding only counts (never a line)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.lines = 0  # lines ended so far
        self.open = 0  # bytes of the line not ended yet
        self.after_cr = False  # the last piece ended with \r: a \n first in the next ends the same line

    def feed(self, data: bytes) -> None:
        if self.after_cr and data[:1] == b"\n":
            data = data[1:]
        self.after_cr = False
        if not data:
            return
        ends = data.count(b"\n") + data.count(b"\r") - data.count(b"\r\n")
        if ends == 0:
            self.open += len(data)
            self._check_line(self.open)
            return
        first = min(i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0)
        last = max(data.rfind(b"\n"), data.rfind(b"\r"))
        self._check_line(self.open + first)
        if last - first > self.limits.line_bytes:  # a line between the first and last end may be too long
            after_first = first + (2 if data[first:first + 2] == b"\r\n" else 1)
            for number, line in enumerate(data[after_first:last].splitlines(), 2):
                self._check_line(len(line), self.lines + number)
        self.lines += ends
        self.open = len(data) - last - 1
        self.after_cr = data[-1] == 13
        self._check_count(self.lines + (self.open > 0))
        self._check_line(self.open)

    def total(self) -> int:
        """Lines in the whole stream (a last line without its end counts)."""
        return self.lines + (self.open > 0)

    def _check_line(self, length: int, number: int | None = None) -> None:
        if length > self.limits.line_bytes:
            number = number or self.lines + 1
            raise TooLarge(f"line {number} has more than {self.limits.line_bytes} bytes, the limit "
                           "(batch_max_line_bytes)")

    def _check_count(self, lines: int) -> None:
        if lines > self.limits.lines:
            raise TooLarge(f"the file has more than {self.limits.lines} lines, the limit (batch_max_lines): "
                           "split it into several batches")


@dataclass
class Received:
    """What a complete upload held: its fields, the file's name, size and lines, and where its bytes are."""

    fields: dict[str, str]
    filename: str
    size: int
    lines: int
    path: Path


@dataclass
class UploadSink:
    """One upload's multipart body, fed a chunk at a time (`feed`, in a worker thread): the parser's callbacks
    write the `file` part to a temporary file in `directory` and count it; `finish` checks that the body was
    whole; `discard` removes the temporary file (after a failure, or after the store took it)."""

    boundary: bytes
    limits: Limits
    directory: Path
    fields: dict[str, str] = field(default_factory=dict)
    filename: str = "upload.jsonl"
    size: int = 0
    parts: int = 0
    complete: bool = False
    path: Path | None = None
    _out: IO[bytes] | None = None
    _seen_file: bool = False
    _discarded: bool = False
    _part: str | None = None  # "file", a field's name, or None (a part we do not keep)
    _field: bytearray = field(default_factory=bytearray)
    _header_bytes: int = 0
    _header: tuple[bytearray, bytearray] = field(default_factory=lambda: (bytearray(), bytearray()))
    _headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    _lines: LineCounter | None = None

    def __post_init__(self) -> None:
        self._busy = threading.Lock()  # `discard` (on the loop, when cancelled) waits for a `feed` in its thread
        # python-multipart's own caps are a backstop past ours, which the callbacks check (at the latest at the end
        # of each piece) and which name the limit
        self._parser = MultipartParser(self.boundary, callbacks={
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_part_end": self._part_end, "on_end": self._end,
        }, max_header_count=MAX_PART_HEADER_BYTES, max_header_size=MAX_PART_HEADER_BYTES + 2 * PIECE)
        self._lines = LineCounter(self.limits)

    def feed(self, chunk: bytes) -> None:
        """Parse (and store) one chunk of the body, in pieces of at most PIECE bytes."""
        with self._busy:
            if self._discarded:
                return
            try:
                for start in range(0, len(chunk), PIECE):
                    self._parser.write(chunk[start:start + PIECE] if len(chunk) > PIECE else chunk)
            except MultipartParseError as exc:
                raise BadRequest(f"the multipart body is malformed: {exc}") from None

    def finish(self) -> Received:
        """The upload, once the body has ended: 400 when it was cut short or lacks a part."""
        if not self.complete:
            raise BadRequest("the multipart body ends before its closing boundary")
        if not self._seen_file or self.path is None:
            raise BadRequest("no `file` part in the upload")
        purpose = self.fields.get("purpose", "").strip()
        if purpose != "batch":
            raise BadRequest(f"purpose {purpose!r}: this service keeps files of purpose 'batch' only")
        return Received(self.fields, self.filename, self.size, self._lines.total(), self.path)

    def discard(self) -> None:
        """Close and remove the temporary file, if it is still there."""
        with self._busy:
            self._discarded = True
            if self._out is not None:
                self._out.close()
                self._out = None
            if self.path is not None:
                self.path.unlink(missing_ok=True)

    # ---- the parser's callbacks ----

    def _part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise BadRequest(f"the upload has more than {MAX_PARTS} parts")
        self._header_bytes = 0
        self._headers = []
        self._part = None

    def _count_header(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_PART_HEADER_BYTES:
            raise TooLarge(f"a part's headers are larger than {MAX_PART_HEADER_BYTES} bytes")

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self._header[0].extend(data[start:end])

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        self._header[1].extend(data[start:end])

    def _header_end(self) -> None:
        self._count_header(2)  # its CRLF: a million empty header lines count too
        name, value = self._header
        self._headers.append((bytes(name).strip().lower(), bytes(value).strip()))
        self._header = (bytearray(), bytearray())

    def _headers_finished(self) -> None:
        disposition = next((v for k, v in self._headers if k == b"content-disposition"), b"")
        try:
            _, options = parse_options_header(disposition)
        except Exception:  # noqa: BLE001 (any header a client can write is a 400, never a 500)
            raise BadRequest("a part's Content-Disposition header cannot be parsed") from None
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name == "file":
            if self._seen_file:
                raise BadRequest("the upload has more than one `file` part")
            self._seen_file = True
            filename = options.get(b"filename", b"").decode("utf-8", "replace").strip()
            self.filename = filename[:255] or self.filename
            fd, tmp = _temp_file(self.directory)
            self.path = Path(tmp)
            self._out = os.fdopen(fd, "wb")
            self._part = "file"
        elif name in FIELDS:
            if name in self.fields:
                raise BadRequest(f"the upload has the field {name!r} twice")
            self._part = name
            self._field = bytearray()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part == "file":
            piece = data[start:end]
            self.size += len(piece)
            if self.size > self.limits.file_bytes:
                raise TooLarge(f"the file is larger than {self.limits.file_bytes} bytes, the limit "
                               f"({self.limits.bytes_setting})")
            self._lines.feed(piece)
            self._out.write(piece)
        elif self._part is not None:
            if len(self._field) + end - start > MAX_FIELD_BYTES:
                raise BadRequest(f"the field {self._part!r} is longer than {MAX_FIELD_BYTES} bytes")
            self._field.extend(data[start:end])

    def _part_end(self) -> None:
        if self._part == "file" and self._out is not None:
            self._out.flush()
            os.fsync(self._out.fileno())
            self._out.close()
            self._out = None
        elif self._part is not None:
            self.fields[self._part] = bytes(self._field).decode("utf-8", "replace")
            if self._part == "purpose" and self.fields["purpose"].strip() != "batch":  # before the file is read
                raise BadRequest(f"purpose {self.fields['purpose'].strip()!r}: this service keeps files of "
                                 "purpose 'batch' only")
        self._part = None

    def _end(self) -> None:
        self.complete = True


async def read_upload(chunks: AsyncIterator[bytes], sink: UploadSink, body_limit: int) -> Received:
    """The body, chunk by chunk, into the sink (each chunk parsed, counted and written in a worker thread);
    413 the moment it passes `body_limit` bytes (the file's limit and what multipart adds around it)."""
    received = 0
    async for chunk in chunks:
        received += len(chunk)
        if received > body_limit:
            raise TooLarge(f"the upload is larger than {body_limit} bytes: the file's limit (batch_max_file_bytes) "
                           f"and {UPLOAD_ALLOWANCE} bytes of multipart around it")
        if chunk:
            await asyncio.to_thread(sink.feed, chunk)
    return await asyncio.to_thread(sink.finish)


def _temp_file(directory: Path) -> tuple[int, str]:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".upload-{secrets.token_hex(8)}.tmp"
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), str(path)


def expires_at(fields: dict[str, str], created_at: int, default_s: int) -> int | None:
    """The stored file's `expires_at` (unix seconds, None: never), from OpenAI's `expires_after[anchor]`
    (`created_at`, the only anchor) and `expires_after[seconds]` (3600..2592000), or else the service's
    batch_file_expires_after_s (0: never)."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return created_at + default_s if default_s > 0 else None
    if anchor is None or seconds is None:
        raise BadRequest("expires_after takes both `anchor` and `seconds`")
    if anchor.strip() != "created_at":
        raise BadRequest(f"expires_after[anchor] {anchor.strip()[:40]!r}: the only anchor is 'created_at'")
    try:
        value = int(seconds.strip())
    except ValueError:
        raise BadRequest(f"expires_after[seconds] {seconds.strip()[:40]!r} is not a whole number") from None
    low, high = EXPIRES_AFTER_S
    if not low <= value <= high:
        raise BadRequest(f"expires_after[seconds] must be between {low} and {high} (one hour and 30 days)")
    return created_at + value
