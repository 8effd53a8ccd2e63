"""The Batch API's files and batches in one directory (settings.jobs_dir), shared by every replica that
mounts it: a restarted service, or another replica, finds them all there.

  files/<file id>.json      the file object (OpenAI's shape) and its owner
  files/<file id>.jsonl     its bytes
  files/owners/<owner>/<file id>.<bytes>   an empty marker per uploaded file of the owner ("_": no token): what
                            counts against batch_max_files_per_token and batch_max_bytes_per_token
  files/owners/<owner>.lock held (fcntl) while an upload of the owner is checked against them and stored, so
                            that replicas sharing jobs_dir cannot both take the last place
  files/.upload-*.tmp       an upload being received (uploads.py), renamed into place when it passed
  batches/<batch id>.json   the batch object and its owner; written by its creator, then only by the runner
                            that holds batches/<batch id>.lock (fcntl: released when that process dies)
  batches/<batch id>.cancel asked to stop (the cancel route writes it, the runner acts on it)
  batches/<batch id>.parts/ the outcome of each chunk of lines done, one JSONL file per chunk (resumption)
  batches/<batch id>.job/   the embedding job's input and output
  batches/unfinished/<created_ns>.<owner key>.<batch id>   an empty mark per unfinished batch: what the
                            runners scan and what the per-token count counts (never every record)
  batches/by-owner/<owner key>/<created_ns>.<batch id>     an empty mark per batch: its owner's list, in order
  batches/owners/<owner key>.lock   held (fcntl) while a batch of that owner is created: the per-token count
                            and the new batch are one step for every replica sharing the directory

A batch's working data (.parts, .job, .cancel, .lock) is removed when it ends; the sweeper (runner.py) removes
files past their `expires_at` and ended batches past their retention.

Every write is a temp file renamed into place, so a reader sees the old or the new whole file.
Owners are the SHA-256 of the bearer token (never the token), or "" with authentication off. Records keep two
keys OpenAI's objects have not (`public` leaves them out): `owner`, and `created_ns`, their order (created_at
is in whole seconds), and those in PRIVATE.
"""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

from service.engine.errors import BadRequest, NotFound, TooLarge

TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
_ID = re.compile(r"(file-|batch_)[0-9a-f]{24}")  # fullmatch only: `$` would accept a trailing newline
# what a record keeps that OpenAI's object has not: its owner, the key its lines run as, its order, the seconds its outputs live
# (`output_expires_after`), the runner's failed tries, the embedding job's summary
PRIVATE = frozenset({"owner", "key", "created_ns", "output_expires_s", "tries", "job"})
INDEX_VERSION = ".index-v1"  # the marks below exist for every batch (made once from the records for an older store)


def atomic_write(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all: written beside it under a temp name, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def derived_id(prefix: str, of: str, what: str) -> str:
    """An id made from another's, so that writing an object again (a finalize redone after a restart)
    replaces it instead of adding a second one."""
    return prefix + hashlib.sha256(f"{of}/{what}".encode()).hexdigest()[:24]


@cache
def store_at(root: Path) -> Store:
    """The store of a jobs_dir (its folders are made on first use, so a service never asked for a batch
    leaves no trace)."""
    return Store(root)


class Store:
    """Files and batches under one directory; every lookup takes the caller's owner and answers 404 for
    another owner's objects, as for missing ones (no one learns what others have)."""

    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        self.files = self.root / "files"
        self.batches = self.root / "batches"
        self.unfinished = self.batches / "unfinished"
        self.by_owner = self.batches / "by-owner"
        self.owner_locks = self.batches / "owners"
        for folder in (self.files, self.batches, self.unfinished, self.by_owner, self.owner_locks):
            folder.mkdir(parents=True, exist_ok=True)
        if not (self.batches / INDEX_VERSION).exists():
            self.reindex()

    # ---- files ----

    def add_file(self, owner: str, filename: str, purpose: str, data: bytes, file_id: str | None = None) -> dict:
        file_id = file_id or new_id("file-")
        atomic_write(self.files / f"{file_id}.jsonl", data)
        return self._record_file(file_id, owner, filename, purpose, len(data), int(time.time()), None)

    def _record_file(self, file_id: str, owner: str, filename: str, purpose: str, size: int, created_at: int,
                     expires_at: int | None) -> dict:
        """The file object (OpenAI's shape, and its owner), written after its bytes are in place: a reader
        never finds a record without its bytes."""
        record = {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
                  "purpose": purpose, "status": "processed", "expires_at": expires_at, "status_details": None,
                  "owner": owner}
        atomic_write(self.files / f"{file_id}.json", json.dumps(record).encode())
        return record

    def add_upload(self, owner: str, filename: str, size: int, tmp: Path, expires_at: int | None, created_at: int,
                   max_files: int, max_bytes: int, files_name: str = "batch_max_files_per_token",
                   bytes_name: str = "batch_max_bytes_per_token") -> dict:
        """An upload received whole in `tmp` (beside the files), stored under a new id if the owner's uploads
        leave room for it (max_files, max_bytes: 400 / 413 naming the setting); checked and stored under the
        owner's lock, so that two replicas cannot both take the last place."""
        with self.owner_lock(owner):
            count, used = self.usage(owner)
            if count + 1 > max_files:
                raise BadRequest(f"this token has {count} files; the limit is {max_files} ({files_name}): "
                                 "delete one first")
            if used + size > max_bytes:
                raise TooLarge(f"this token's files hold {used} bytes; with this one's {size} that passes the limit "
                               f"of {max_bytes} ({bytes_name}): delete some first")
            file_id = new_id("file-")
            os.replace(tmp, self.files / f"{file_id}.jsonl")
            record = self._record_file(file_id, owner, filename, "batch", size, created_at, expires_at)
            marker = self._owner_dir(owner) / f"{file_id}.{size}"
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        return record

    def usage(self, owner: str) -> tuple[int, int]:
        """The owner's uploaded files and their bytes (the markers of files deleted meanwhile are removed)."""
        count = total = 0
        folder = self._owner_dir(owner)
        for marker in folder.glob("file-*") if folder.is_dir() else ():
            file_id, _, size = marker.name.partition(".")
            if not (self.files / f"{file_id}.json").exists() or not size.isdigit():
                marker.unlink(missing_ok=True)
                continue
            count, total = count + 1, total + int(size)
        return count, total

    @contextmanager
    def owner_lock(self, owner: str) -> Iterator[None]:
        """The owner's quota lock (fcntl, on jobs_dir: every replica sharing it takes the same one)."""
        path = self._owner_dir(owner).with_suffix(".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        with exclusive(path):
            yield

    def _owner_dir(self, owner: str) -> Path:
        return self.files / "owners" / (owner if re.fullmatch(r"[0-9a-f]{64}", owner) else "_")

    def file(self, owner: str, file_id: str) -> dict:
        record = _read(self.files / f"{file_id}.json") if _ID.fullmatch(file_id) else None
        if record is None or record["owner"] != owner:
            raise NotFound(f"no file {file_id!r}")
        return record

    def file_bytes(self, owner: str, file_id: str) -> bytes:
        self.file(owner, file_id)
        try:
            return (self.files / f"{file_id}.jsonl").read_bytes()
        except FileNotFoundError:
            raise NotFound(f"no file {file_id!r}") from None

    def delete_file(self, owner: str, file_id: str) -> None:
        self.file(owner, file_id)
        (self.files / f"{file_id}.json").unlink(missing_ok=True)
        (self.files / f"{file_id}.jsonl").unlink(missing_ok=True)
        folder = self._owner_dir(owner)
        for marker in folder.glob(f"{file_id}.*") if folder.is_dir() else ():
            marker.unlink(missing_ok=True)

    def adopt_file(self, owner: str, filename: str, purpose: str, written: Path, file_id: str,
                   expires_after_s: int | None) -> dict:
        """A file written whole elsewhere in files/ (a batch's output, streamed), renamed into place and
        recorded: the bytes first, then the record, so a reader never finds a record without its bytes. It
        expires `expires_after_s` after its creation (OpenAI's `output_expires_after`), or never (None)."""
        size = written.stat().st_size
        os.replace(written, self.files / f"{file_id}.jsonl")
        now = int(time.time())
        return self._record_file(file_id, owner, filename, purpose, size, now,
                                 None if expires_after_s is None else now + expires_after_s)

    def file_exists(self, file_id: str) -> bool:
        """Whether a file's record is there (the runner's view, any owner)."""
        return (self.files / f"{file_id}.json").exists()

    # ---- batches ----

    def save_batch(self, record: dict) -> None:
        """The record, whole; an ended batch leaves the unfinished marks (the runners stop seeing it)."""
        atomic_write(self.batches / f"{record['id']}.json", json.dumps(record).encode())
        if record["status"] in TERMINAL:
            (self.unfinished / _unfinished_name(record)).unlink(missing_ok=True)

    def create_batch(self, record: dict, limit: int) -> int | None:
        """Store a new batch unless its owner has `limit` unfinished already (then that count, and nothing
        stored). Counted and stored under the owner's lock, so replicas sharing the directory cannot both
        pass the count."""
        with exclusive(self.owner_locks / f"{_owner_key(record['owner'])}.lock"):
            unfinished = self.unfinished_of(record["owner"])
            if unfinished >= limit:
                return unfinished
            self.save_batch(record)
            self._index(record)
            return None

    def _index(self, record: dict) -> None:
        order = f"{creation_order(record)[0]:020d}"
        folder = self.by_owner / _owner_key(record["owner"])
        folder.mkdir(exist_ok=True)
        (folder / f"{order}.{record['id']}").touch()
        if record["status"] not in TERMINAL:
            (self.unfinished / _unfinished_name(record)).touch()

    def reindex(self) -> None:
        """The marks of every batch, made from the records (a store written before they existed); idempotent."""
        for path in self.batches.glob("batch_*.json"):
            record = _read(path)
            if record is not None:
                self._index(record)
        (self.batches / INDEX_VERSION).touch()

    def unfinished_of(self, owner: str) -> int:
        """How many of the owner's batches are unfinished (a directory listing, no record read)."""
        key = _owner_key(owner)
        return sum(1 for name in os.listdir(self.unfinished) if name.count(".") == 2 and name.split(".")[1] == key)

    def unfinished_ids(self) -> list[str]:
        """The ids of the unfinished batches, oldest first (a directory listing, no record read)."""
        return [name.split(".")[2] for name in sorted(os.listdir(self.unfinished)) if name.count(".") == 2]

    def record(self, batch_id: str) -> dict | None:
        """A batch as stored (the runner's view)."""
        return _read(self.batches / f"{batch_id}.json") if _ID.fullmatch(batch_id) else None

    def batch(self, owner: str, batch_id: str) -> dict:
        """A batch as its owner sees it: a cancel asked for and not yet acted on shows as `cancelling`."""
        record = self.record(batch_id)
        if record is None or record["owner"] != owner:
            raise NotFound(f"no batch {batch_id!r}")
        return self._with_cancel(record)

    def batch_page(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """A page of the owner's batches, newest first (OpenAI's order), after the id `after`: the
        page and whether more follow. Reads the owner's index and only the page's records."""
        try:
            names = sorted(os.listdir(self.by_owner / _owner_key(owner)), reverse=True)
        except FileNotFoundError:
            names = []
        ids = [name.partition(".")[2] for name in names]
        if after is not None:
            ids = ids[ids.index(after) + 1:] if after in ids else []
        page: list[dict] = []
        for batch_id in ids:
            record = self.record(batch_id)
            if record is None or record["owner"] != owner:  # removed meanwhile (retention)
                continue
            if len(page) == limit:
                return page, True
            page.append(self._with_cancel(record))
        return page, False

    def batches_of(self, owner: str) -> list[dict]:
        """Every batch of the owner, newest first."""
        return self.batch_page(owner, None, 10**9)[0]

    def remove_working_data(self, batch_id: str) -> None:
        """What an ended batch no longer needs: its chunks' outcomes, the embedding job's input (every text)
        and output, its cancel mark and its lock (unlinked while held: a runner that opens it afterwards
        finds the batch ended and unlinks its own)."""
        shutil.rmtree(self.parts_dir(batch_id), ignore_errors=True)
        shutil.rmtree(self.batches / f"{batch_id}.job", ignore_errors=True)
        (self.batches / f"{batch_id}.cancel").unlink(missing_ok=True)
        (self.batches / f"{batch_id}.lock").unlink(missing_ok=True)

    def forget_batch(self, record: dict) -> None:
        """An ended batch past its retention: its record, marks and any working data left."""
        self.remove_working_data(record["id"])
        order = f"{creation_order(record)[0]:020d}"
        (self.by_owner / _owner_key(record["owner"]) / f"{order}.{record['id']}").unlink(missing_ok=True)
        (self.unfinished / _unfinished_name(record)).unlink(missing_ok=True)
        (self.batches / f"{record['id']}.json").unlink(missing_ok=True)

    def indexed(self) -> list[tuple[int, str, str]]:
        """(created_ns, owner key, batch id) of every batch in the owners' index (the sweeper's view)."""
        found = []
        for folder in self.by_owner.iterdir():
            for name in os.listdir(folder):
                order, _, batch_id = name.partition(".")
                found.append((int(order), folder.name, batch_id))
        return found

    def ask_cancel(self, batch_id: str) -> None:
        marker = self.batches / f"{batch_id}.cancel"
        if not marker.exists():
            atomic_write(marker, str(int(time.time())).encode())

    def cancel_asked_at(self, batch_id: str) -> int | None:
        try:
            return int((self.batches / f"{batch_id}.cancel").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _with_cancel(self, record: dict) -> dict:
        asked = self.cancel_asked_at(record["id"])
        if asked is not None and record["status"] not in TERMINAL and record["status"] != "cancelling":
            record = {**record, "status": "cancelling", "cancelling_at": asked}
        return record

    def parts_dir(self, batch_id: str) -> Path:
        return self.batches / f"{batch_id}.parts"

    def claim(self, batch_id: str) -> Any | None:
        """The batch's lock, held until the returned file is closed (or this process dies); None when
        another runner holds it."""
        lock = open(self.batches / f"{batch_id}.lock", "a+b")  # noqa: SIM115 (held while the batch runs)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        return lock


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Held (fcntl, waiting for it) by one process at a time among all that share jobs_dir; released when
    the block ends or the process dies."""
    with open(path, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def public(record: dict) -> dict:
    """The object as OpenAI's API answers it: without the keys only the service reads (PRIVATE)."""
    return {k: v for k, v in record.items() if k not in PRIVATE}


def creation_order(record: dict) -> tuple[int, str]:
    return record.get("created_ns", record["created_at"] * 10**9), record["id"]


def _owner_key(owner: str) -> str:
    """An owner as a file name: the token's SHA-256 (hex), or `anyone` with authentication off."""
    return owner or "anyone"


def _unfinished_name(record: dict) -> str:
    return f"{creation_order(record)[0]:020d}.{_owner_key(record['owner'])}.{record['id']}"


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
