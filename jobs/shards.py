"""The job's output directory, and how a second run knows what the first finished.

    part-<first>-<last>.parquet   rows first..last (job row numbers) that embedded, whole: written under a
                                  temporary name, then renamed; the same range in its metadata
    _progress/part-<first>-<last>.json   the record that those rows are done (and which of them failed,
                                  with why, and the actor's process and Ray node), renamed into place after
                                  the shard: a range is done when its record exists, so a crash between the
                                  two only recomputes the range
    _progress/job.json            what the output was made with (bundle hash, inputs and their sizes and
                                  times, columns, outputs): a different job on the same directory is refused,
                                  never mixed in
    _progress/runtime.json        the runtime and precision the job's actors ran (the first to load claims
                                  it): every later actor, and every resumed run, runs that one
    _progress/.lock               held (fcntl) by the run writing the directory: a second run is refused
    _errors.jsonl, _SUCCESS       written at the end from the records (_SUCCESS: the summary, rows by node)

Everything but the shards starts with `_` or `.`, so the directory is a Parquet dataset that pandas,
pyarrow, Spark and DuckDB read whole. A run refuses a directory that holds anything and is not one of
these jobs' outputs; it first tidies what a crash left (its own temporary files, shards of its own naming
and metadata without a record), never another file, then plans the rows no record covers; Ray retries a
batch whose actor died, and a retried batch writes the same file names.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from jobs.inputs import atomic_write

SHARD = re.compile(r"^part-(\d+)-(\d+)\.(parquet|json)$")
TEMPORARY = re.compile(r"^\..+\.tmp-[0-9a-f]{32}$")  # atomic_write's names: ours to remove after a crash
PROGRESS = "_progress"
ERRORS = "_errors.jsonl"
METADATA_KEY = b"jobs.embed"  # in every shard's Parquet schema metadata


@dataclass(frozen=True)
class Record:
    first: int
    last: int
    written: int  # rows in the shard
    failures: list  # [{"row", "id", "reason"}]
    tokens: int
    worker: int = 0  # the process id of the actor that wrote it (which worker did what, after a crash)
    node: str = ""  # the Ray node id of that actor; "" in records written before it was recorded

    @property
    def name(self) -> str:
        return f"part-{self.first}-{self.last}"


def shard_path(output: Path, first: int, last: int) -> Path:
    return output / f"part-{first}-{last}.parquet"


def record_path(output: Path, first: int, last: int) -> Path:
    return output / PROGRESS / f"part-{first}-{last}.json"


def write_shard(output: Path, table, record: Record, metadata: dict) -> None:
    """The shard, then its record: both whole or absent."""
    import pyarrow.parquet as pq

    meta = {**metadata, "rows": [record.first, record.last]}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), METADATA_KEY: json.dumps(meta).encode()})
    atomic_write(shard_path(output, record.first, record.last), lambda f: pq.write_table(table, f))
    body = json.dumps({"first": record.first, "last": record.last, "written": record.written,
                       "failures": record.failures, "tokens": record.tokens, "worker": record.worker,
                       "node": record.node}).encode()
    atomic_write(record_path(output, record.first, record.last), lambda f: f.write(body))


def read_records(output: Path) -> list[Record]:
    records = []
    for path in (output / PROGRESS).glob("part-*.json"):
        raw = json.loads(path.read_text())
        records.append(Record(raw["first"], raw["last"], raw["written"], raw["failures"], raw["tokens"],
                              raw.get("worker", 0), raw.get("node", "")))
    return sorted(records, key=lambda r: (r.first, r.last))


UNKNOWN_NODE = "unknown"  # rows_by_node's key for records that name no node (written before nodes were recorded)


def rows_by_node(records: list[Record]) -> dict[str, int]:
    """The rows each Ray node computed (failed rows included: the node did them), by node id, most first;
    they add up to the rows the records cover."""
    rows: dict[str, int] = {}
    for r in records:
        node = r.node or UNKNOWN_NODE
        rows[node] = rows.get(node, 0) + r.last - r.first + 1
    return dict(sorted(rows.items(), key=lambda kv: (-kv[1], kv[0])))


def ours(shard: Path) -> bool:
    """Whether a file named like a shard is one this job wrote: its Parquet metadata says so."""
    import pyarrow.parquet as pq

    try:
        return METADATA_KEY in (pq.read_schema(shard).metadata or {})
    except Exception:  # noqa: BLE001 - unreadable: not known to be ours, so left alone
        return False


def tidy(output: Path) -> list[Record]:
    """Remove what a crash left (our temporary files, a shard of ours whose record was never written, a
    record or shard covered by another: a retried batch cut differently) and return the records of done
    rows, disjoint. Nothing our names and metadata do not mark is touched."""
    for folder in (output, output / PROGRESS, output / "_staging"):
        for tmp in folder.glob(".*.tmp-*"):
            if TEMPORARY.match(tmp.name) and tmp.is_file():
                tmp.unlink(missing_ok=True)
    kept: list[Record] = []
    for record in sorted(read_records(output), key=lambda r: (r.first, -(r.last - r.first))):
        if kept and record.first <= kept[-1].last:  # overlaps one kept: a duplicate of rows already done
            if record.last > kept[-1].last:
                raise RuntimeError(f"{output}: records {kept[-1].name} and {record.name} overlap in part; delete the "
                                   "output directory and run the job again")
            shard_path(output, record.first, record.last).unlink(missing_ok=True)
            record_path(output, record.first, record.last).unlink(missing_ok=True)
            continue
        kept.append(record)
    recorded = {r.name for r in kept}
    for shard in output.glob("part-*.parquet"):
        if SHARD.match(shard.name) and shard.stem not in recorded and ours(shard):
            shard.unlink()
    return kept


def gaps(records: list[Record], total: int, size: int) -> list[tuple[int, int]]:
    """The row ranges (first, last) no record covers, cut into ranges of at most `size` rows."""
    todo, at = [], 0
    for r in [*records, Record(total, total, 0, [], 0)]:
        for start in range(at, r.first, size):
            todo.append((start, min(start + size, r.first) - 1))
        at = max(at, r.last + 1)
    return todo


def job_path(output: Path) -> Path:
    return output / PROGRESS / "job.json"


def begun_with(output: Path) -> dict:
    """What the job that began this output was made with (check_job's record), or {} for a new output."""
    path = job_path(output)
    return json.loads(path.read_text()) if path.exists() else {}


LATER_FIELDS = ("input_files",)  # identity fields records written before them lack: added, not refused


def check_job(output: Path, identity: dict) -> None:
    """Record what this output is made of, or refuse a job that differs from the one that began it (a
    record from before a field of LATER_FIELDS existed gets it added instead)."""
    before = begun_with(output)
    if before:
        compared = {k: v for k, v in identity.items() if k in before or k not in LATER_FIELDS}
        if before != compared:
            changed = sorted(k for k in set(before) | set(compared) if before.get(k) != compared.get(k))
            raise ValueError(f"{output} holds the output of another job (it differs in {', '.join(changed)}): give a "
                             "new --output, or delete that directory to start again")
        if compared == identity:
            return
    atomic_write(job_path(output), lambda f: f.write(json.dumps(identity, indent=1).encode()))


def runtime_path(output: Path) -> Path:
    return output / PROGRESS / "runtime.json"


def ran_with(output: Path) -> dict:
    """{"runtime", "precision"} the job's actors ran, or {} before any ran. Outputs from before it was
    recorded: what a shard's metadata says, where one is left."""
    try:
        return json.loads(runtime_path(output).read_text())
    except FileNotFoundError:
        pass
    import pyarrow.parquet as pq

    for shard in sorted(output.glob("part-*.parquet")):
        if SHARD.match(shard.name) and ours(shard):
            meta = json.loads(pq.read_schema(shard).metadata[METADATA_KEY])
            if meta.get("runtime") and meta.get("precision"):
                return {"runtime": meta["runtime"], "precision": meta["precision"]}
    return {}


def claim_runtime(output: Path, ran: dict) -> dict:
    """Record `ran` as what this output runs, unless an actor recorded one first; returns the one recorded
    (created whole or not at all: written aside, then linked into place, which fails if it exists)."""
    path = runtime_path(output)
    tmp = path.with_name(f".{path.name}.tmp-{os.urandom(16).hex()}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(ran))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return json.loads(path.read_text())


class OutputRefused(ValueError):
    """An output directory this run may not write: someone else's files, or another run holds it."""


def foreign(output: Path) -> bool:
    """Whether `output` holds anything while not being one of these jobs' outputs (no record of a job, no
    lock of a run that began one)."""
    if not output.exists():
        return False
    if not output.is_dir():
        return True
    if (output / PROGRESS / "job.json").is_file() or (output / PROGRESS / ".lock").is_file():
        return False
    return any(output.iterdir())


def refuse_foreign(output: Path) -> None:
    """OutputRefused where `output` is someone else's (foreign): said before anything in it is touched."""
    if foreign(output):
        what = "a file" if not output.is_dir() else "files that are not an embedding job's output"
        raise OutputRefused(f"{output} holds {what}: give an empty or new --output (nothing in it was touched)")


_held: set[str] = set()  # outputs locked by this process: POSIX locks do not exclude the process holding them
_held_lock = threading.Lock()


class OutputLock:
    """The output directory for this run alone: refuses someone else's directory (anything in it and no
    record of one of our jobs) without touching it, then holds an fcntl lock on _progress/.lock (released
    by the kernel if the process dies; POSIX locks also hold across NFS, the RayJob's shared volume)."""

    def __init__(self, output: Path) -> None:
        self.output, self.fd = Path(output), None

    def __enter__(self) -> OutputLock:
        import fcntl

        output = self.output
        refuse_foreign(output)
        (output / PROGRESS).mkdir(parents=True, exist_ok=True)
        key = str(output.resolve())
        with _held_lock:
            if key in _held:
                raise OutputRefused(f"{output} is being written by another run of the job in this process: wait for "
                                    "it to end, or give another --output")
            fd = os.open(output / PROGRESS / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputRefused(f"{output} is being written by another run of the job (process {holder}): wait "
                                    "for it to end, or give another --output") from None
            _held.add(key)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd, self.key = fd, key
        return self

    def __exit__(self, *exc) -> None:
        with _held_lock:
            os.close(self.fd)  # closing releases the lock
            _held.discard(self.key)


def finish(output: Path, records: list[Record], success: dict) -> None:
    """_errors.jsonl (every failed row, in row order) and _SUCCESS, from the records; an errors.jsonl an
    earlier version wrote beside the shards is removed (it kept dataset readers from reading the directory)."""
    failures = sorted((f for r in records for f in r.failures), key=lambda f: f["row"])
    lines = b"".join(json.dumps({"id": f["id"], "reason": f["reason"]}).encode() + b"\n" for f in failures)
    atomic_write(output / ERRORS, lambda f: f.write(lines))
    (output / "errors.jsonl").unlink(missing_ok=True)
    atomic_write(output / "_SUCCESS", lambda f: f.write(json.dumps(success, indent=1).encode()))
