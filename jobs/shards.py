"""The job's output directory, and how a second run knows what the first finished.

    part-<first>-<last>.parquet   rows first..last (job row numbers) that embedded, whole: written under a
                                  temporary name, then renamed; the same range in its metadata
    _progress/part-<first>-<last>.json   the record that those rows are done (and which of them failed,
                                  with why, and the actor's process and Ray node), renamed into place after
                                  the shard: a range is done when its record exists, so a crash between the
                                  two only recomputes the range
    _progress/job.json            what the output was made with (bundle hash, inputs, columns, outputs): a
                                  different job on the same directory is refused, never mixed in
    errors.jsonl, _SUCCESS        written at the end from the records (_SUCCESS: the summary, rows by node)

A run first tidies what a crash left (temporary files, shards without a record), then plans the rows no
record covers; Ray retries a batch whose actor died, and a retried batch writes the same file names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from jobs.inputs import atomic_write

SHARD = re.compile(r"^part-(\d+)-(\d+)\.(parquet|json)$")
PROGRESS = "_progress"


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
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"jobs.embed": json.dumps(meta).encode()})
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


def tidy(output: Path) -> list[Record]:
    """Remove what a crash left (temporary files, a shard whose record was never written, a record or shard
    covered by another: a retried batch cut differently) and return the records of done rows, disjoint."""
    for tmp in [*output.glob(".*.tmp-*"), *(output / PROGRESS).glob(".*.tmp-*")]:
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
        if shard.stem not in recorded:
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


def check_job(output: Path, identity: dict) -> None:
    """Record what this output is made of, or refuse a job that differs from the one that began it."""
    before = begun_with(output)
    if before:
        if before != identity:
            changed = sorted(k for k in set(before) | set(identity) if before.get(k) != identity.get(k))
            raise ValueError(f"{output} holds the output of another job (it differs in {', '.join(changed)}): give a "
                             "new --output, or delete that directory to start again")
        return
    atomic_write(job_path(output), lambda f: f.write(json.dumps(identity, indent=1).encode()))


def finish(output: Path, records: list[Record], success: dict) -> None:
    """errors.jsonl (every failed row, in row order) and _SUCCESS, from the records."""
    failures = sorted((f for r in records for f in r.failures), key=lambda f: f["row"])
    lines = b"".join(json.dumps({"id": f["id"], "reason": f["reason"]}).encode() + b"\n" for f in failures)
    atomic_write(output / "errors.jsonl", lambda f: f.write(lines))
    atomic_write(output / "_SUCCESS", lambda f: f.write(json.dumps(success, indent=1).encode()))
