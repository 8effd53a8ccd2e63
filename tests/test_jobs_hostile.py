"""The embedding job against a careless user and hostile inputs, end to end on real Ray on loopback (issue 55):
an unreachable cluster is one line within the bound, two runs on one output (the second refused, the first
unharmed), the output read whole as a Parquet dataset by pandas and pyarrow, the runtime and precision a
resumed output keeps, and 10 MiB texts cut or refused by characters before the tokenizer sees them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tests.reliability import record
from tests.test_jobs import assert_every_row_once, cluster, corpus, records_of, shards_of, tiny  # noqa: F401
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict:
    """This process's environment at the call (the cluster fixture's ray.init sets RAY_AUTH_MODE: a driver in
    another process needs it to reach that cluster), with this checkout importable."""
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def embed_command(bundle: Path, inputs: Path, output: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "jobs", "embed", "--bundle", str(bundle), "--input", str(inputs), "--output",
            str(output), *flags]


def test_an_unreachable_cluster_is_one_line_and_exit_1_within_the_bound(tiny, tmp_path):
    """--address 127.0.0.1:1 (nothing listens): one line at once (before: still waiting after 5 minutes). A port
    that accepts and never answers (not a GCS): a line saying what it waits for, then one saying it gave up,
    within --connect-timeout. Neither leaves an output directory behind."""
    _, bundle = tiny
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n')
    started = time.monotonic()
    refused = subprocess.run(embed_command(bundle, tmp_path / "in.jsonl", tmp_path / "out", "--address", "127.0.0.1:1"),
                             cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    refused_s = time.monotonic() - started
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "cannot connect to the Ray cluster at 127.0.0.1:1: connection " \
                                                "refused" in refused.stderr
    assert refused_s < 60 and not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()  # an empty directory given: left empty
    again = subprocess.run(embed_command(bundle, tmp_path / "in.jsonl", tmp_path / "empty", "--address", "127.0.0.1:1"),
                           cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and list((tmp_path / "empty").iterdir()) == []

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # accepts connections (the kernel's backlog) and never says a word
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        started = time.monotonic()
        hung = subprocess.run(embed_command(bundle, tmp_path / "in.jsonl", tmp_path / "out2", "--address", address,
                                            "--connect-timeout", "8"),
                              cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
        hung_s = time.monotonic() - started
    finally:
        silent.close()
    ours = [line for line in hung.stderr.splitlines() if line.startswith("python -m jobs embed:")]
    assert hung.returncode == 1 and hung.stdout == ""
    assert ours == [f"python -m jobs embed: waiting for the Ray cluster at {address} to answer (giving up after 8 s: "
                    "--connect-timeout)",
                    f"python -m jobs embed: the Ray cluster at {address} did not answer within 8 s "
                    "(--connect-timeout); check --address"]
    assert hung.stderr.splitlines()[-1] == ours[-1]  # the last word is ours (Ray logs its retries before it)
    assert 8 <= hung_s < 8 + 40 and not (tmp_path / "out2").exists()  # the bound, plus Python's and Ray's imports
    record("job given an unreachable cluster", "python -m jobs embed --address 127.0.0.1:1, and a port that never "
           "answers with --connect-timeout 8", f"one line, exit 1 after {refused_s:.1f} s; after {hung_s:.1f} s",
           note="no output directory left")


def test_a_second_run_on_an_output_is_refused_and_the_output_is_a_parquet_dataset(tiny, cluster, tmp_path):
    """Two `python -m jobs embed` on one output at once: the second says the first holds it (one line, exit 1)
    and writes nothing; the first finishes every row once. The directory then reads whole with
    pandas.read_parquet and pyarrow.parquet.read_table (before: errors.jsonl beside the shards broke both),
    records the runtime and precision its actors ran and the inputs' sizes and times."""
    import pandas as pd

    _, bundle = tiny
    texts = corpus(3000, seed=7)
    texts[5] = "   "  # a bad row: _errors.jsonl is not empty
    pq.write_table(pa.table({"text": texts}), tmp_path / "in.parquet")
    output = tmp_path / "out"
    command = embed_command(bundle, tmp_path / "in.parquet", output, "--address", cluster, "--batch-size", "100",
                            "--concurrency", "1")
    first = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(records_of(output)) >= 2 if (output / "_progress").exists() else False,
                   "the first run's shards", timeout=180)
        second = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
        out, err = first.communicate(timeout=300)
    finally:
        first.kill()
    assert second.returncode == 1 and second.stdout == ""
    assert second.stderr.count("\n") == 1
    assert f"is being written by another run of the job (process {first.pid})" in second.stderr
    assert first.returncode == 0, err[-2000:]
    assert out.strip().startswith("embedded 3000 rows (2999 written, 1 failed, 3000 this run)")
    assert_every_row_once(output, 3000, failed=1)

    # beside the shards only `_` names: the input's one group of 3,000 rows is staged (more than 4 ranges of 100)
    assert sorted(p.name for p in output.iterdir() if not p.name.startswith("part-")) == [
        "_SUCCESS", "_errors.jsonl", "_progress", "_staging"]
    assert [json.loads(line) for line in (output / "_errors.jsonl").read_text().splitlines()] == [
        {"id": 5, "reason": "empty text"}]
    frame = pd.read_parquet(output)
    table = pq.read_table(output)
    assert len(frame) == table.num_rows == 2999
    assert sorted(frame["row"]) == sorted(table.column("row").to_pylist()) == [r for r in range(3000) if r != 5]
    assert table.column_names == ["row", "text_sha256", "embedding"]

    summary = json.loads((output / "_SUCCESS").read_text())
    ran = json.loads((output / "_progress" / "runtime.json").read_text())
    assert summary["precision"] == f"{ran['runtime']} {ran['precision']}"
    job = json.loads((output / "_progress" / "job.json").read_text())
    assert job["input_files"] == [{"path": str((tmp_path / "in.parquet").resolve()),
                                   "size": (tmp_path / "in.parquet").stat().st_size,
                                   "mtime_ns": (tmp_path / "in.parquet").stat().st_mtime_ns}]
    record("two embedding jobs on one output", "python -m jobs embed started again on the output of one running",
           "the second: one line, exit 1; the first: every row once", note="output lock (fcntl) under _progress")


def test_a_resumed_output_keeps_the_runtime_and_precision_it_began_with(tiny, cluster, tmp_path):
    """An output begun where its actors ran OpenVINO (at this CPU's precision; `auto` does not choose it here),
    resumed with the same arguments after its last range was lost: the resumed range runs OpenVINO too, not
    what this machine would choose (before: `auto` again, a second runtime mixed into one output)."""
    from jobs.embed import run
    from jobs.shards import record_path, shard_path

    _, bundle = tiny
    pq.write_table(pa.table({"text": corpus(300, seed=8)}), tmp_path / "in.parquet")
    spec = {"bundle": bundle, "inputs": [tmp_path / "in.parquet"], "output": tmp_path / "out", "batch_size": 100,
            "concurrency": 1}
    chosen = run({**spec, "output": tmp_path / "auto"})["precision"]  # what auto runs on this machine
    begun = run({**spec, "runtime": "openvino"})  # as on a machine whose auto chose OpenVINO
    # OpenVINO at this CPU's precision: fp32, or bf16 on a CPU with bf16 units (where the bundle has that variant)
    runtime, precision = begun["precision"].split()
    assert runtime == "openvino" and precision in ("fp32", "bf16") and begun["precision"] != chosen, (begun, chosen)
    assert json.loads((tmp_path / "out" / "_progress" / "runtime.json").read_text()) == {"runtime": "openvino",
                                                                                         "precision": precision}
    shard_path(tmp_path / "out", 200, 299).unlink()  # its last range lost: a crash before its record
    record_path(tmp_path / "out", 200, 299).unlink()
    resumed = run(spec)  # the same arguments: auto, on this machine, would choose `chosen`
    assert resumed["rows_this_run"] == 100 and resumed["precision"] == begun["precision"]
    meta = json.loads(pq.read_schema(shard_path(tmp_path / "out", 200, 299)).metadata[b"jobs.embed"])
    assert (meta["runtime"], meta["precision"]) == ("openvino", precision)


def test_ten_mib_texts_are_cut_or_refused_by_characters_before_the_tokenizer(tiny, cluster, tmp_path):
    """A 10 MiB text of words is cut by the engine's characters bound (max_tokens * 32) and embeds exactly as the text cut
    at the model's limit does; 10 MiB without whitespace is a bad row (a cut could change it); with
    --no-truncate both are bad rows with their reason. Before: 21.6 s and +1.36 GiB in the tokenizer per text."""
    from jobs.embed import run

    _, bundle = tiny
    words = "word " * (2 << 20)
    rows = [{"id": "words", "text": words}, {"id": "solid", "text": "x" * (10 << 20)},
            {"id": "short", "text": "word " * 100}, {"id": "plain", "text": "a plain sentence"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"bundle": bundle, "inputs": [tmp_path / "in.jsonl"], "id_column": "id", "precision": "fp32",
            "concurrency": 1}
    started = time.perf_counter()
    cut = run({**spec, "output": tmp_path / "cut"})
    cut_s = time.perf_counter() - started
    errors = [json.loads(line) for line in (tmp_path / "cut" / "_errors.jsonl").read_text().splitlines()]
    assert [e["id"] for e in errors] == ["solid"] and "too few to cut it exactly" in errors[0]["reason"]
    table = shards_of(tmp_path / "cut", "id")
    assert table.column("id").to_pylist() == ["plain", "short", "words"]
    vectors = dict(zip(table.column("id").to_pylist(), np.array(table.column("embedding").to_pylist()), strict=True))
    np.testing.assert_allclose(vectors["words"], vectors["short"], atol=1e-6)  # both: the first 64 tokens
    import hashlib

    assert table.column("text_sha256").to_pylist()[2] == hashlib.sha256(words.encode()).hexdigest()  # the whole text's

    started = time.perf_counter()
    strict = run({**spec, "output": tmp_path / "strict", "truncate": False})
    strict_s = time.perf_counter() - started
    errors = {e["id"]: e["reason"] for e in map(json.loads, (tmp_path / "strict" / "_errors.jsonl").read_text().splitlines())}
    assert sorted(errors) == ["short", "solid", "words"] and strict["written"] == 1
    assert errors["words"].startswith("more than the model's limit of 64 tokens") and f"of {len(words)} characters" in errors["words"]
    assert "limit of 64 tokens" in errors["short"]
    print(f"4 rows, two of 10 MiB: {cut_s:.1f} s cutting, {strict_s:.1f} s refusing")
    record("embedding job given 10 MiB texts", "two 10 MiB rows (words; no whitespace) in a JSONL job",
           f"cut and embedded, or a bad row with its reason; job {cut_s:.1f} s", note="bound: max_tokens x 32 characters (service/engine/tokenization.py)")
