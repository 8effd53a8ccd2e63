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

Every write is a temp file renamed into place, so a reader sees the old or the new whole file.
Owners are the SHA-256 of the bearer token (never the token), or "" with authentication off. Records keep two
keys OpenAI's objects have not (`public` leaves them out): `owner`, and `created_ns`, their order (created_at
is in whole seconds).
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
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

from service.engine.errors import BadRequest, NotFound, TooLarge

TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
_ID = re.compile(r"(file-|batch_)[0-9a-f]{24}")  # fullmatch only: `$` would accept a trailing newline


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
        self.files.mkdir(parents=True, exist_ok=True)
        self.batches.mkdir(parents=True, exist_ok=True)

    # ---- files ----

    def add_file(self, owner: str, filename: str, purpose: str, data: bytes, file_id: str | None = None) -> dict:
        file_id = file_id or new_id("file-")
        atomic_write(self.files / f"{file_id}.jsonl", data)
        record = {"id": file_id, "object": "file", "bytes": len(data), "created_at": int(time.time()),
                  "filename": filename, "purpose": purpose, "status": "processed", "expires_at": None,
                  "status_details": None, "owner": owner}
        atomic_write(self.files / f"{file_id}.json", json.dumps(record).encode())
        return record

    def add_upload(self, owner: str, filename: str, size: int, tmp: Path, expires_at: int | None, created_at: int,
                   max_files: int, max_bytes: int) -> dict:
        """An upload received whole in `tmp` (beside the files), stored under a new id if the owner's uploads
        leave room for it (max_files, max_bytes: 400 / 413 naming the setting); checked and stored under the
        owner's lock, so that two replicas cannot both take the last place."""
        with self.owner_lock(owner):
            count, used = self.usage(owner)
            if count + 1 > max_files:
                raise BadRequest(f"this token has {count} files; the limit is {max_files} (batch_max_files_per_token): "
                                 "delete one first")
            if used + size > max_bytes:
                raise TooLarge(f"this token's files hold {used} bytes; with this one's {size} that passes the limit "
                               f"of {max_bytes} (batch_max_bytes_per_token): delete some first")
            file_id = new_id("file-")
            os.replace(tmp, self.files / f"{file_id}.jsonl")
            record = {"id": file_id, "object": "file", "bytes": size, "created_at": created_at, "filename": filename,
                      "purpose": "batch", "status": "processed", "expires_at": expires_at, "status_details": None,
                      "owner": owner}
            atomic_write(self.files / f"{file_id}.json", json.dumps(record).encode())
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
        with open(path, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield  # released when the file is closed

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

    # ---- batches ----

    def save_batch(self, record: dict) -> None:
        atomic_write(self.batches / f"{record['id']}.json", json.dumps(record).encode())

    def record(self, batch_id: str) -> dict | None:
        """A batch as stored (the runner's view)."""
        return _read(self.batches / f"{batch_id}.json") if _ID.fullmatch(batch_id) else None

    def batch(self, owner: str, batch_id: str) -> dict:
        """A batch as its owner sees it: a cancel asked for and not yet acted on shows as `cancelling`."""
        record = self.record(batch_id)
        if record is None or record["owner"] != owner:
            raise NotFound(f"no batch {batch_id!r}")
        return self._with_cancel(record)

    def all_batches(self) -> list[dict]:
        records = (_read(p) for p in self.batches.glob("batch_*.json"))
        return [self._with_cancel(r) for r in records if r is not None]

    def batches_of(self, owner: str) -> list[dict]:
        """The owner's batches, newest first (OpenAI's order)."""
        return sorted((r for r in self.all_batches() if r["owner"] == owner), key=creation_order, reverse=True)

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


def public(record: dict) -> dict:
    """The object as OpenAI's API answers it: without its owner and order."""
    return {k: v for k, v in record.items() if k not in ("owner", "created_ns")}


def creation_order(record: dict) -> tuple[int, str]:
    return record.get("created_ns", record["created_at"] * 10**9), record["id"]


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None
