"""API keys as data (issue 58; docs/access.md): a keys file, each key with a name, the sha256 of its secret
(never the secret), the models it may call and its limits, re-read without a restart when it changes.

    keys:
      - name: team-a
        sha256: <hex sha256 of the secret>
        models: [all-MiniLM-L6-v2]        # optional; default every model
        requests_per_minute: 600          # optional; default no limit
        tokens_per_minute: 200000
        concurrent: 16
        priority: interactive             # or batch
        batch_files: 100                  # the Batch API's quotas (default: the service's batch_max_*)
        batch_bytes: 1000000000
        unfinished_batches: 10

A secret is found by its sha256 (a dict lookup: what leaks by timing is at most a hash of a secret, never the
secret) and compared again in constant time. The single token (ENCODER_API_TOKEN, auth_token_file) is one more
key, named TOKEN_KEY_NAME, with no limits. The file is looked at again at most every RELOAD_CHECK_S: a key
removed is refused from then on (requests in flight finish), one added is taken; a file that fails to parse
leaves the last good keys in place and says why once in the log (Keyring.errors counts them).

`python -m service.front.keys --keys-file PATH --name NAME [...]` adds a key: it prints the secret once and
writes only its hash.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import secrets
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger("ray.serve")

RELOAD_CHECK_S = 1.0  # the keys file is looked at again (its size, modification time, inode) at most this often
TOKEN_KEY_NAME = "token"  # the single token's key, when there is one
INTERNAL_KEY_NAME = "batch-runner"  # the key the Batch API's runner calls its own replica with (never leaves it)
# the Batch API's runner names the key whose batch line it runs (the line then runs as that key: front/gate.py);
# any other caller's is ignored
ON_BEHALF_HEADER = "x-encoder-on-behalf-of"
KEY_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # names are metric label values and access log fields: few, tame


class ApiKey(BaseModel):
    """One key of the keys file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=KEY_NAME)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex sha256 of the key's secret")
    models: tuple[str, ...] | None = Field(None, description="the models it may call; null: every model")
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    concurrent: int | None = Field(None, ge=1)
    priority: Literal["interactive", "batch"] = "interactive"
    # the Batch API's quotas of this key (null: the service's batch_max_files_per_token, batch_max_bytes_per_token,
    # batch_max_per_token)
    batch_files: int | None = Field(None, ge=0)
    batch_bytes: int | None = Field(None, ge=0)
    unfinished_batches: int | None = Field(None, ge=0)

    def may_call(self, model: str) -> bool:
        return self.models is None or model in self.models


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[ApiKey]

    @model_validator(mode="after")
    def _distinct(self) -> KeysFile:
        for what in ("name", "sha256"):
            values = [getattr(k, what) for k in self.keys]
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                shown = twice if what == "name" else [v[:12] + "..." for v in twice]
                raise ValueError(f"two keys with the same {what}: {', '.join(shown)}")
        for reserved in (TOKEN_KEY_NAME, INTERNAL_KEY_NAME):
            if any(k.name == reserved for k in self.keys):
                raise ValueError(f"the key name {reserved!r} is the service's own (the single token's, the Batch API "
                                 "runner's)")
        return self


def read_keys(path: Path) -> KeysFile:
    """The keys file (YAML, or JSON, which YAML reads); ValueError saying in one line what is wrong."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML or JSON: {str(exc).splitlines()[0]}") from None
    try:
        return KeysFile.model_validate(data if data is not None else {"keys": []})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise ValueError(f"{path}: {where}: {first['msg']} ({exc.error_count()} error(s))") from None


def digest(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()


def _stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class Keyring:
    """The keys a replica knows: the keys file's (the last good one), and the single token's."""

    path: Path | None
    token: bytes | None = None
    by_hash: dict[str, ApiKey] = field(default_factory=dict)
    batch_work: dict[str, ApiKey] = field(default_factory=dict)  # name -> the key its Batch API lines run as
    stamp: tuple[int, int, int] | None = None
    checked_at: float = float("-inf")
    error: str = ""  # why the file on disk is not the one in use ("" when it is)
    errors: int = 0  # files that failed to parse since start
    # a secret made for this process, that only it knows: the Batch API's runner calls the routes with it
    internal: bytes = field(default_factory=lambda: secrets.token_urlsafe(32).encode())

    @classmethod
    def load(cls, path: Path | None, token: bytes | None) -> Keyring:
        """At start: a keys file that does not parse stops the replica with that one line."""
        ring = cls(path, token)
        if path is not None:
            ring.stamp = _stamp(path)
        ring._take(read_keys(path) if path is not None else KeysFile(keys=[]))
        ring.checked_at = time.monotonic()
        return ring

    def _take(self, keys: KeysFile) -> None:
        by_hash = {k.sha256: k for k in keys.keys}
        if self.token is not None:
            by_hash[digest(self.token)] = ApiKey(name=TOKEN_KEY_NAME, sha256=digest(self.token))
        by_hash[digest(self.internal)] = ApiKey(name=INTERNAL_KEY_NAME, sha256=digest(self.internal), priority="batch")
        self.by_hash = by_hash
        self.batch_work = {k.name: k.model_copy(update={"priority": "batch", "concurrent": None}) for k in by_hash.values()}

    def refresh(self) -> None:
        """The keys file again when it changed (looked at most every RELOAD_CHECK_S)."""
        now = time.monotonic()
        if self.path is None or now - self.checked_at < RELOAD_CHECK_S:
            return
        self.checked_at = now
        try:
            stamp = _stamp(self.path)
        except OSError as exc:
            self._failed(f"{self.path}: {exc.strerror or exc}", None)
            return
        if stamp == self.stamp:
            return
        try:
            keys = read_keys(self.path)
        except ValueError as exc:
            self._failed(str(exc), stamp)
            return
        self.stamp, self.error = stamp, ""
        self._take(keys)
        logger.info("keys file %s read again: %d keys", self.path, len(keys.keys))

    def _failed(self, why: str, stamp: tuple[int, int, int] | None) -> None:
        if stamp is not None and stamp == self.stamp:
            return
        self.stamp = stamp  # said once per version of the file
        if why != self.error:
            self.errors += 1
            logger.error("keys file not read, the last good keys stay in use: %s", why)
            from service.observability.metrics import service_metrics  # (here: the CLI below needs no Ray)

            service_metrics().keys_file_errors.inc()
        self.error = why

    def identify(self, secret: bytes) -> ApiKey | None:
        """The key whose secret this is, or None."""
        self.refresh()
        found = digest(secret)
        key = self.by_hash.get(found)
        return key if key is not None and hmac.compare_digest(key.sha256, found) else None

    def batch_work_of(self, name: str) -> ApiKey | None:
        """The key a Batch API line runs as: its batch's owner's, with its models and limits per minute, as
        `batch` priority and without its `concurrent` (the runner's own CONCURRENT_LINES bound a batch's lines
        in flight; a batch must not take its owner's interactive slots). None when the key left the file."""
        self.refresh()
        return self.batch_work.get(name)


# ---- the command line: add a key ----


def add_key(path: Path, name: str, models: list[str] | None = None, requests_per_minute: int | None = None,
            tokens_per_minute: int | None = None, concurrent: int | None = None,
            priority: str = "interactive") -> str:
    """Add a key to the keys file (made if missing) and return its secret, which is written nowhere: only its
    hash is. The file is replaced whole (a replica never reads half of it)."""
    keys = read_keys(path) if path.exists() else KeysFile(keys=[])
    secret = "enc-" + secrets.token_urlsafe(32)
    key = ApiKey(name=name, sha256=digest(secret.encode()), models=tuple(models) if models else None,
                 requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute, concurrent=concurrent,
                 priority=priority)
    updated = KeysFile(keys=[*keys.keys, key])  # a name used already is refused here
    text = yaml.safe_dump(updated.model_dump(mode="json", exclude_none=True, exclude_defaults=True), sort_keys=False)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return secret


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.front.keys", description="Add an API key to a keys file (made "
                                "if missing): prints its secret once, writes only its sha256 (docs/access.md).")
    p.add_argument("--keys-file", type=Path, required=True)
    p.add_argument("--name", required=True, help="the key's name: letters, digits, '.', '_', '-'")
    p.add_argument("--models", nargs="+", help="the models it may call (default: every model)")
    p.add_argument("--requests-per-minute", type=int)
    p.add_argument("--tokens-per-minute", type=int)
    p.add_argument("--concurrent", type=int)
    p.add_argument("--priority", choices=["interactive", "batch"], default="interactive")
    args = p.parse_args(argv)
    try:
        secret = add_key(args.keys_file, args.name, args.models, args.requests_per_minute, args.tokens_per_minute,
                         args.concurrent, args.priority)
    except (ValueError, OSError) as exc:
        message = str(exc).splitlines()[0] if not isinstance(exc, ValidationError) else \
            f"{exc.errors()[0]['loc'][-1] if exc.errors()[0]['loc'] else 'key'}: {exc.errors()[0]['msg']}"
        print(f"error: {message}", file=sys.stderr)
        return 2
    print(f"key {args.name!r} added to {args.keys_file}; its secret, shown this once:\n{secret}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
