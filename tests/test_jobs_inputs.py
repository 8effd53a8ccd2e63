"""The embedding job's inputs and output directory at function level, no Ray (issue 55): hostile JSONL lines,
CSV with quoted newlines over many blocks, Parquet files of many and of one huge row group (time per range and
rows across group boundaries), someone else's files in the output directory, the lock, the output's identity
(changed inputs) and the runtime it ran, and the character bound on a text."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.inputs import InputError, plan_inputs, read_rows
from tests.reliability import record

ROOT = Path(__file__).resolve().parents[1]


def all_rows(files, text_column: str = "text", id_column: str | None = None, size: int = 2048) -> pa.Table:
    """Every row of the planned inputs, read range by range as the job's read stage does (ranges cross files)."""
    total = sum(f.rows for f in files)
    parts = []
    for first in range(0, total, size):
        last = min(first + size, total) - 1
        for f in files:
            a, b = max(first, f.first), min(last, f.first + f.rows - 1)
            if a <= b:
                parts.append(read_rows(f, a, b, text_column, id_column))
    return pa.concat_tables(parts)


def test_a_deeply_nested_or_otherwise_hostile_jsonl_line_is_one_bad_row(tmp_path):
    lines = [json.dumps({"text": "first"}).encode(), b"[" * 100_000,
             b'{"text": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001, b"\xff\xfe{", b'{"text": "\xc3"}',
             json.dumps({"text": "last"}).encode()]
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    files = plan_inputs([tmp_path / "in.jsonl"], None, "text", None, tmp_path / "_staging")
    table = all_rows(files)
    assert table.column("_row").to_pylist() == list(range(6))
    assert table.column("_text").to_pylist() == ["first", None, None, None, None, "last"]
    errors = table.column("_error").to_pylist()
    assert errors[0] is None and errors[5] is None
    assert errors[1] == errors[2] == "not JSON: nested too deeply"
    assert all(e.startswith("not JSON") for e in errors[3:5])
    record("embedding job given a deeply nested JSONL line", 'lines of "[" * 100000, a 50,000-deep object, bytes that '
           "are not UTF-8", "each one bad row with its reason; the rows around them read", note="was a RecursionError "
           "that failed the whole job")


def quoted_csv(n: int) -> tuple[str, list[str]]:
    texts = [f"row {i} line one\nline two of {i}, with a comma\n\nand \"\"quotes\"\" " + "x" * (i % 50)
             for i in range(n)]
    body = "id,text\n" + "".join(f'r{i},"{t}"\n' for i, t in enumerate(texts))
    return body, [t.replace('""', '"') for t in texts]


def test_csv_with_quoted_newlines_over_many_blocks_reads_every_row(tmp_path):
    """A 3 MiB CSV (three of pyarrow's 1 MiB blocks) with newlines inside quoted fields on every row: staged
    whole (before: `CSV parser got out of sync with chunker` past the first block)."""
    body, texts = quoted_csv(40_000)
    (tmp_path / "in.csv").write_text(body)
    assert len(body.encode()) > 3 << 20
    files = plan_inputs([tmp_path / "in.csv"], None, "text", "id", tmp_path / "_staging")
    table = all_rows(files, id_column="id")
    assert table.column("_text").to_pylist() == texts
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(40_000)]


def test_a_csv_that_fails_past_the_first_block_leaves_no_temporary_file(tmp_path):
    body, _ = quoted_csv(40_000)
    (tmp_path / "in.csv").write_text(body + "r-bad,three,fields\n" + "r-x,after\n")  # in the third block
    staging = tmp_path / "_staging"
    with pytest.raises(InputError, match=r"in\.csv: not readable as CSV"):
        plan_inputs([tmp_path / "in.csv"], None, "text", "id", staging)
    assert list(staging.iterdir()) == []  # no half-written copy, no temporary file


def per_range_seconds(path: Path, rows: int, ranges: int = 12, size: int = 2048) -> float:
    """The median time to read one range, at ranges spread over the whole file."""
    from jobs.inputs import InputFile

    file = InputFile(str(path), "parquet", 0, rows)
    times = []
    for first in np.linspace(0, rows - size, ranges).astype(int):
        started = time.perf_counter()
        read_rows(file, int(first), int(first) + size - 1, "text", None)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


@pytest.mark.serial
def test_a_parquet_file_of_one_huge_row_group_is_read_once_not_once_per_range(tmp_path):
    """pyarrow's default writer: one group of 400,000 rows. Each range read from it decodes the whole group
    (the file read with the square of its size); the job stages it once into groups of one range each."""
    texts = [f"text number {i} " + "w" * (i % 40) for i in range(400_000)]
    pq.write_table(pa.table({"text": texts, "other": np.arange(400_000)}), tmp_path / "big.parquet")
    assert pq.ParquetFile(tmp_path / "big.parquet").metadata.num_row_groups == 1
    direct = per_range_seconds(tmp_path / "big.parquet", 400_000)
    started = time.perf_counter()
    [file] = plan_inputs([tmp_path / "big.parquet"], None, "text", None, tmp_path / "_staging", 2048)
    staging_s = time.perf_counter() - started
    assert Path(file.path).parent == tmp_path / "_staging" and file.rows == 400_000
    assert pq.ParquetFile(file.path).metadata.row_group(0).num_rows == 2048
    staged = per_range_seconds(Path(file.path), 400_000)
    print(f"per 2,048-row range: {direct * 1e3:.1f} ms from the single group, {staged * 1e3:.2f} ms staged; "
          f"staging once {staging_s:.2f} s")
    assert staged * 5 < direct  # measured 50 ms against 1 ms
    assert all_rows([file]).column("_text").to_pylist() == texts  # every row, in order, across every group
    again = plan_inputs([tmp_path / "big.parquet"], None, "text", None, tmp_path / "_staging", 2048)
    assert again == [file]  # a second run reuses the copy


def test_ranges_cross_row_group_and_file_boundaries(tmp_path):
    """Groups of 300 rows read in place, groups of 10,000 (past 4 ranges of 700) staged; ranges of 700 rows
    cross groups and files, and every row comes back once, in order, with its id."""
    a = [f"a{i}" for i in range(2_000)]
    b = [f"b{i}" for i in range(25_000)]
    pq.write_table(pa.table({"id": a, "text": a}), tmp_path / "a.parquet", row_group_size=300)
    pq.write_table(pa.table({"id": b, "text": b}), tmp_path / "b.parquet", row_group_size=10_000)
    files = plan_inputs([tmp_path / "a.parquet", tmp_path / "b.parquet"], None, "text", "id", tmp_path / "_staging", 700)
    assert files[0].path == str((tmp_path / "a.parquet").resolve())  # small groups: read where it is
    assert Path(files[1].path).parent == tmp_path / "_staging" and files[1].first == 2_000
    table = all_rows(files, id_column="id", size=700)
    assert table.column("_text").to_pylist() == a + b
    assert table.column("id").to_pylist() == a + b
    assert table.column("_row").to_pylist() == list(range(27_000))


def spark_output(out: Path) -> dict[str, str]:
    """A directory as Spark writes one: part files, their .crc, a _SUCCESS; returns each file's sha256."""
    out.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": [f"theirs {i}"]}), out / f"part-0000{i}-1b2c-4d5e-c000.snappy.parquet")
        (out / f".part-0000{i}-1b2c-4d5e-c000.snappy.parquet.crc").write_bytes(b"crc")
    (out / "_SUCCESS").write_bytes(b"")
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}


def test_someone_elses_directory_is_refused_and_left_untouched(tmp_path):
    """`python -m jobs embed --output` a directory of Spark's files: one line on stderr, exit 1, before Ray or the
    bundle is loaded; every file is still there with the same bytes (before: the part files were deleted)."""
    out = tmp_path / "theirs"
    before = spark_output(out)
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    done = subprocess.run([sys.executable, "-m", "jobs", "embed", "--bundle", str(tmp_path / "no-bundle"), "--input",
                           str(tmp_path / "in.jsonl"), "--output", str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "holds files that are not an embedding job's output" in done.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == before
    record("embedding job given someone else's output directory", "--output a directory of Spark's part files, .crc "
           "files and _SUCCESS", "one line, exit 1; every file unchanged", note="they were deleted before")


def test_tidy_removes_only_what_its_own_names_and_metadata_mark(tmp_path):
    """In one of our outputs: our temporary files and our unrecorded shard go; a file named like a shard that
    our metadata does not mark, Spark's part files and other hidden files stay."""
    from jobs.shards import Record, tidy, write_shard

    write_shard(tmp_path, pa.table({"row": [0, 1]}), Record(0, 1, 2, [], 4), {"model": "m"})
    write_shard(tmp_path, pa.table({"row": [2, 3]}), Record(2, 3, 2, [], 4), {"model": "m"})
    (tmp_path / "_progress" / "part-2-3.json").unlink()  # a crash between the shard and its record
    (tmp_path / f".part-4-5.parquet.tmp-{'a' * 32}").write_bytes(b"half")
    (tmp_path / "_progress" / f".part-4-5.json.tmp-{'b' * 32}").write_bytes(b"half")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "part-6-7.parquet")  # named like ours, not ours
    pq.write_table(pa.table({"x": [1]}), tmp_path / "part-00000-abc.snappy.parquet")
    (tmp_path / ".notes.tmp-mine").write_bytes(b"keep")
    records = tidy(tmp_path)
    assert [(r.first, r.last) for r in records] == [(0, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.tmp-mine", "_progress", "part-0-1.parquet",
                                                          "part-00000-abc.snappy.parquet", "part-6-7.parquet"]
    assert sorted(p.name for p in (tmp_path / "_progress").iterdir()) == ["part-0-1.json"]


HOLD = """
import sys, time
from pathlib import Path
from jobs.shards import OutputLock
with OutputLock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


def test_an_output_another_process_writes_is_refused_and_free_once_it_ends(tmp_path):
    from jobs.shards import OutputLock, OutputRefused

    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputRefused, match=rf"being written by another run of the job \(process {holder.pid}\)"):
            with OutputLock(out):
                pass
    finally:
        holder.kill()  # the kernel releases its lock
        holder.wait(timeout=30)
    with OutputLock(out), pytest.raises(OutputRefused, match="in this process"):
        with OutputLock(out):
            pass
    with OutputLock(out):
        pass


def test_a_changed_input_is_another_job_and_old_records_still_load(tmp_path):
    """The output's identity holds every input file's size and modification time: an input appended to (or
    rewritten) is refused; a job.json written before input_files existed loads and gets them."""
    from jobs.embed import EmbedSpec, _plan
    from jobs.shards import begun_with, check_job, job_path

    (tmp_path / "in.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    spec = EmbedSpec(bundle=tmp_path, inputs=[tmp_path / "in.jsonl"], output=tmp_path / "out")
    bundle = SimpleNamespace(sha256="abc")
    _, identity = _plan(spec, bundle)
    assert identity["input_files"] == [{"path": str((tmp_path / "in.jsonl").resolve()), "size": 32,
                                        "mtime_ns": (tmp_path / "in.jsonl").stat().st_mtime_ns}]
    old = {k: v for k, v in identity.items() if k != "input_files"}
    job_path(spec.output).parent.mkdir(parents=True)
    job_path(spec.output).write_text(json.dumps(old))  # as written before this change
    check_job(spec.output, identity)
    assert begun_with(spec.output) == identity
    with (tmp_path / "in.jsonl").open("a") as f:
        f.write('{"text": "three"}\n')
    _, changed = _plan(spec, bundle)
    with pytest.raises(ValueError, match=r"differs in input_files, rows"):
        check_job(spec.output, changed)
    os.utime(tmp_path / "in.jsonl", ns=(0, identity["input_files"][0]["mtime_ns"] + 1))
    with pytest.raises(ValueError, match=r"differs in input_files"):
        check_job(spec.output, _plan(spec, bundle)[1])


def test_the_first_runtime_recorded_is_the_outputs_and_old_shards_tell_theirs(tmp_path):
    from jobs.shards import Record, claim_runtime, ran_with, write_shard

    assert ran_with(tmp_path) == {}
    write_shard(tmp_path, pa.table({"row": [0]}), Record(0, 0, 1, [], 1),
                {"runtime": "openvino", "precision": "bf16"})  # a shard from before runtime.json
    assert ran_with(tmp_path) == {"runtime": "openvino", "precision": "bf16"}
    assert claim_runtime(tmp_path, {"runtime": "onnxruntime", "precision": "int8"}) == {"runtime": "onnxruntime",
                                                                                        "precision": "int8"}
    assert claim_runtime(tmp_path, {"runtime": "openvino", "precision": "bf16"})["precision"] == "int8"  # first wins
    assert ran_with(tmp_path) == {"runtime": "onnxruntime", "precision": "int8"}
    assert [p.name for p in (tmp_path / "_progress").iterdir() if p.name.startswith(".")] == []
