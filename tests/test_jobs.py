"""The embedding job (python -m jobs embed, issue 50) on a local Ray of 2 CPUs on loopback, with a tiny random
BERT exported by the real pipeline: Parquet and JSONL in, Parquet out, every row's vector equal to
sentence-transformers'; an actor killed mid-job and a driver killed then run again, every row exactly once;
bad rows in _errors.jsonl while the job goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from benchmarks.corpus import sentences
from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
from tests.conftest import exported_once, shared_dir, wait_until

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, bundle) of a tiny random BERT sentence-transformer (mean pooling), exported once per run."""
    from export.pipeline import ExportOptions, build_bundle
    from tests.families import make_checkpoint

    root = shared_dir(tmp_path_factory, "jobs")
    checkpoint = root / "tiny-ckpt"

    def export(out: Path) -> None:
        make_checkpoint("bert", checkpoint)
        build_bundle(ExportOptions(str(checkpoint), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, name="tiny"),
                     progress=lambda _: None)

    bundle = exported_once(root / "tiny", export)
    return checkpoint, bundle


@pytest.fixture(scope="module")
def cluster(ray_serve):
    """The session's Ray (conftest's ray_serve: one Ray per test process, the service's apps running on it, as a
    job runs beside a serving cluster); its GCS address for drivers in other processes."""
    import ray

    return ray.get_runtime_context().gcs_address


def corpus(n: int, seed: int = 0) -> list[str]:
    return sentences(n, min_words=3, max_words=16, seed=seed)


def shards_of(output: Path, key: str) -> pa.Table:
    """Every shard's rows together, in key order; each shard's metadata names its rows."""
    tables = []
    for path in sorted(output.glob("part-*.parquet")):
        table = pq.read_table(path)
        first, last = json.loads(table.schema.metadata[b"jobs.embed"])["rows"]
        assert path.name == f"part-{first}-{last}.parquet"
        tables.append(table.replace_schema_metadata(None))
    return pa.concat_tables(tables).sort_by(key)


def records_of(output: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in (output / "_progress").glob("part-*.json")]


def assert_every_row_once(output: Path, total: int, failed: int = 0) -> pa.Table:
    """The records cover rows 0..total-1 once each, and the shards hold every good row once."""
    records = sorted(records_of(output), key=lambda r: r["first"])
    covered = [row for r in records for row in range(r["first"], r["last"] + 1)]
    assert covered == list(range(total))
    table = shards_of(output, "row")
    assert table.column("row").to_pylist() == sorted(set(range(total)) - {f["row"] for r in records
                                                                          for f in r["failures"]})
    assert table.num_rows == total - failed
    return table


def test_parquet_and_jsonl_in_vectors_equal_sentence_transformers(tiny, cluster, tmp_path):
    from sentence_transformers import SentenceTransformer

    from jobs.embed import run

    checkpoint, bundle = tiny
    texts = corpus(3000)
    ids = [f"doc-{i:05d}" for i in range(3000)]
    pq.write_table(pa.table({"doc_id": ids[:2000], "text": texts[:2000]}), tmp_path / "a.parquet", row_group_size=300)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"doc_id": i, "text": t}) + "\n"
                                              for i, t in zip(ids[2000:], texts[2000:], strict=True)))
    summary = run({"bundle": bundle, "inputs": [tmp_path / "a.parquet", tmp_path / "b.jsonl"],
                   "output": tmp_path / "out", "id_column": "doc_id", "batch_size": 700, "precision": "fp32"})
    assert summary["rows"] == 3000 and summary["written"] == 3000 and summary["failures"] == 0
    assert summary["model"] == "tiny" and summary["precision"] == "onnxruntime fp32"
    assert json.loads((tmp_path / "out" / "_SUCCESS").read_text())["rows"] == 3000
    import ray

    assert summary["rows_by_node"] == {ray.get_runtime_context().get_node_id(): 3000}  # the one node's actors did all
    # the actors' CPU by stage (docs/jobs.md): every stage there, the model's runs and the shards' writing cost some
    from jobs.embed import STAGES

    cpu = summary["actor_cpu_s"]
    assert set(cpu) == set(STAGES) and all(v >= 0 for v in cpu.values()), cpu
    assert cpu["model"] > 0 and cpu["shard"] > 0 and cpu["tokenize"] > 0, cpu
    assert (tmp_path / "out" / "_errors.jsonl").read_text() == ""
    table = shards_of(tmp_path / "out", "doc_id")
    assert table.column_names == ["doc_id", "text_sha256", "embedding"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert table.column("doc_id").to_pylist() == ids  # every row once, under its own id
    got = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    expected = SentenceTransformer(str(checkpoint), device="cpu").encode(texts, batch_size=256)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-4)
    import hashlib

    assert table.column("text_sha256").to_pylist() == [hashlib.sha256(t.encode()).hexdigest() for t in texts]
    again = run({"bundle": bundle, "inputs": [tmp_path / "a.parquet", tmp_path / "b.jsonl"],
                 "output": tmp_path / "out", "id_column": "doc_id", "batch_size": 700, "precision": "fp32"})
    assert again["rows_this_run"] == 0 and again["written"] == 3000  # all done: nothing computed twice


def test_bad_rows_go_to_the_errors_file_and_the_job_goes_on(tiny, cluster, tmp_path):
    from jobs.embed import run

    _, bundle = tiny
    good = sentences(40, min_words=1, max_words=3, seed=1)  # within the tiny model's 64 tokens
    lines = [json.dumps({"id": f"g{i}", "text": t}) for i, t in enumerate(good)]
    lines[3] = json.dumps({"id": "empty", "text": "   "})
    lines[7] = json.dumps({"id": "number", "text": 42})
    lines[11] = json.dumps({"id": "missing", "body": "no text field"})
    lines[13] = "{not json"
    lines[17] = json.dumps({"id": "long", "text": "word " * 2000})  # past the model's limit, truncate off
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    # a CSV after it: its rows numbered after the JSONL's, a quoted field with a newline in it one row
    (tmp_path / "more.csv").write_text('id,text\nc0,"two\nlines"\nc1,\nc2,plain words\n')
    summary = run({"bundle": bundle, "inputs": [tmp_path / "in.jsonl", tmp_path / "more.csv"],
                   "output": tmp_path / "out", "id_column": "id", "truncate": False, "batch_size": 16,
                   "concurrency": 2})
    errors = [json.loads(line) for line in (tmp_path / "out" / "_errors.jsonl").read_text().splitlines()]
    assert [e["id"] for e in errors] == ["empty", "number", "missing", None, "long", "c1"]
    reasons = [e["reason"] for e in errors]
    assert reasons[0] == "empty text" and reasons[1] == "not text: 'text' is int" and reasons[2] == "no 'text' field"
    assert reasons[3].startswith("not JSON") and "limit of" in reasons[4] and "--no-truncate" in reasons[4]
    assert reasons[5] == "empty text"
    assert summary["rows"] == 43 and summary["failures"] == 6 and summary["written"] == 37
    table = shards_of(tmp_path / "out", "id")
    assert sorted(table.column("id").to_pylist()) == sorted(
        [f"g{i}" for i in range(40) if i not in (3, 7, 11, 13, 17)] + ["c0", "c2"])


def test_a_worker_killed_mid_job_costs_only_its_blocks(tiny, cluster, tmp_path):
    from jobs.embed import run

    _, bundle = tiny
    pq.write_table(pa.table({"text": corpus(3000, seed=2)}), tmp_path / "in.parquet")
    output = tmp_path / "out"
    outcome: dict = {}
    job = threading.Thread(target=lambda: outcome.update(run({
        "bundle": bundle, "inputs": [tmp_path / "in.parquet"], "output": output, "batch_size": 100,
        "concurrency": 1})))
    job.start()
    wait_until(lambda: len(records_of(output)) >= 3 if (output / "_progress").exists() else False,
               "the job's first shards", timeout=120)
    victim = records_of(output)[0]["worker"]
    os.kill(victim, signal.SIGKILL)  # the actor's process, mid-job
    job.join(timeout=300)
    assert not job.is_alive()
    assert outcome["rows"] == 3000 and outcome["failures"] == 0
    assert_every_row_once(output, 3000)
    workers = {r["worker"] for r in records_of(output)}
    assert victim in workers and len(workers) >= 2  # Ray started another actor, which finished the job


def test_the_driver_killed_then_run_again_resumes_without_a_duplicate(tiny, cluster, tmp_path):
    """`python -m jobs embed` as a subprocess against the running cluster (--address), killed, then run again."""
    _, bundle = tiny
    pq.write_table(pa.table({"text": corpus(3000, seed=3)}), tmp_path / "in.parquet")
    output = tmp_path / "out"
    command = [sys.executable, "-m", "jobs", "embed", "--bundle", str(bundle), "--input", str(tmp_path / "in.parquet"),
               "--output", str(output), "--address", cluster, "--batch-size", "100", "--concurrency", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(records_of(output)) >= 3 if (output / "_progress").exists() else False,
                   "the first run's shards", timeout=120)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    done_before = sum(r["last"] - r["first"] + 1 for r in records_of(output))
    assert 0 < done_before < 3000 and not (output / "_SUCCESS").exists()
    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    lines = second.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedded 3000 rows (3000 written, 0 failed, ")
    summary = json.loads((output / "_SUCCESS").read_text())
    assert summary["rows_this_run"] <= 3000 - done_before + 100  # at most a block in flight is computed again
    assert summary["output"] == str(output.resolve()) and "texts_s" in summary and "tokens_s" in summary
    assert_every_row_once(output, 3000)


def test_records_with_and_without_their_node_load_and_rows_by_node_adds_up(tmp_path):
    """A record written before records named their Ray node still loads (its rows under "unknown"), and the
    rows by node (the summary's, make bench-jobs --nodes') add up to the rows the records cover."""
    from jobs.shards import UNKNOWN_NODE, Record, read_records, rows_by_node, write_shard

    (tmp_path / "_progress").mkdir()
    (tmp_path / "_progress" / "part-0-99.json").write_text(json.dumps(  # as written before: no "node"
        {"first": 0, "last": 99, "written": 99, "failures": [{"row": 5, "id": 5, "reason": "empty text"}],
         "tokens": 900, "worker": 11}))
    for first, last, node in ((100, 249, "node-a"), (250, 299, "node-b"), (300, 399, "node-a")):
        write_shard(tmp_path, pa.table({"row": list(range(first, last + 1))}),
                    Record(first, last, last - first + 1, [], 0, 12, node), {})
    assert json.loads((tmp_path / "_progress" / "part-250-299.json").read_text())["node"] == "node-b"
    records = read_records(tmp_path)
    assert [(r.first, r.worker, r.node) for r in records] == [(0, 11, ""), (100, 12, "node-a"), (250, 12, "node-b"),
                                                               (300, 12, "node-a")]
    by_node = rows_by_node(records)
    assert by_node == {"node-a": 250, UNKNOWN_NODE: 100, "node-b": 50}
    assert list(by_node) == ["node-a", UNKNOWN_NODE, "node-b"]  # most rows first
    assert sum(by_node.values()) == sum(r.last - r.first + 1 for r in records) == 400


def test_an_output_keeps_the_job_that_began_it_and_refuses_another(tmp_path):
    """check_job records the first job's identity (begun_with reads it back), lets the same job resume, and
    refuses one that differs, naming what differs; nothing is rewritten."""
    from jobs.shards import begun_with, check_job

    assert begun_with(tmp_path) == {}
    (tmp_path / "_progress").mkdir()
    first = {"bundle_sha256": "abc", "precision": "openvino bf16", "inputs": ["in.parquet"]}
    check_job(tmp_path, first)
    assert begun_with(tmp_path) == first
    check_job(tmp_path, dict(first))  # the same job, resumed
    with pytest.raises(ValueError, match=r"holds the output of another job \(it differs in precision\)"):
        check_job(tmp_path, {**first, "precision": "onnxruntime int8"})
    assert begun_with(tmp_path) == first


def test_a_bad_argument_is_one_line_on_stderr_and_a_nonzero_exit(tiny, tmp_path):
    _, bundle = tiny
    (tmp_path / "in.txt").write_text("hello\n")
    done = subprocess.run([sys.executable, "-m", "jobs", "embed", "--bundle", str(bundle), "--input",
                           str(tmp_path / "in.txt"), "--output", str(tmp_path / "out")],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "--format parquet|jsonl|csv" in done.stderr


def test_sparse_vectors_are_sparse_encoders(cluster, tmp_path_factory, tmp_path):
    """--outputs sparse on a tiny SPLADE (exported where conftest's representation_bundles puts it, so either
    fixture reuses the other's export): every row's sparse vector = SparseEncoder.encode's; embedding refused."""
    from sentence_transformers import SparseEncoder

    from export.pipeline import ExportOptions, build_bundle
    from jobs.embed import run
    from tests.splade_models import make_sparse_encoder

    root = shared_dir(tmp_path_factory, "representations")

    def export(out: Path) -> None:
        checkpoint = make_sparse_encoder("bert", root / "splade-ckpt", pooling="max")
        build_bundle(ExportOptions(str(checkpoint), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, name="splade"),
                     progress=lambda _: None)

    bundle = exported_once(root / "splade", export)
    texts = sentences(200, min_words=2, max_words=8, seed=4)
    pq.write_table(pa.table({"text": texts}), tmp_path / "in.parquet")
    with pytest.raises(ValueError, match="gives sparse, not dense"):
        run({"bundle": bundle, "inputs": [tmp_path / "in.parquet"], "output": tmp_path / "refused"})
    summary = run({"bundle": bundle, "inputs": [tmp_path / "in.parquet"], "output": tmp_path / "out",
                   "outputs": "sparse", "precision": "fp32", "batch_size": 64, "concurrency": 2})
    assert summary["written"] == 200 and summary["outputs"] == ["sparse"]
    table = shards_of(tmp_path / "out", "row")
    assert table.column_names == ["row", "text_sha256", "sparse_indices", "sparse_values"]
    expected = SparseEncoder(str(root / "splade-ckpt"), device="cpu").encode(
        texts, convert_to_tensor=True).to_dense().numpy()
    for indices, values, row in zip(table.column("sparse_indices").to_pylist(), table.column("sparse_values").to_pylist(),
                                    expected, strict=True):
        assert indices == np.flatnonzero(row).tolist()
        np.testing.assert_allclose(values, row[row != 0], atol=1e-4)


def test_multivector_rows_are_pylates_document_vectors(cluster, tmp_path_factory, tmp_path):
    """--outputs multivector on a tiny PyLate ColBERT (exported where conftest's representation_bundles puts it):
    every row's token vectors = PyLate's ColBERT.encode(is_query=False), run in the reference environment, at 1e-4
    (a job embeds documents: their marker, no query expansion, the skiplist applied)."""
    from export.pipeline import ExportOptions, build_bundle
    from jobs.embed import run
    from tests.late_interaction_models import make_pylate_colbert
    from tests.reference_env import run_references

    root = shared_dir(tmp_path_factory, "representations")

    def export(out: Path) -> None:
        checkpoint = make_pylate_colbert(root / "colbert-ckpt")
        build_bundle(ExportOptions(str(checkpoint), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, name="colbert"),
                     progress=lambda _: None)

    bundle = exported_once(root / "colbert", export)
    texts = sentences(40, min_words=2, max_words=12, seed=5) + ["Stocks fell, again; sadly!", "A zebra."]
    pq.write_table(pa.table({"text": texts}), tmp_path / "in.parquet")
    summary = run({"bundle": bundle, "inputs": [tmp_path / "in.parquet"], "output": tmp_path / "out",
                   "outputs": "multivector", "precision": "fp32", "batch_size": 16,
                   "concurrency": 2})
    assert summary["written"] == len(texts) and summary["failures"] == 0 and summary["outputs"] == ["multivector"]
    table = shards_of(tmp_path / "out", "row")
    assert table.column_names == ["row", "text_sha256", "multivector"]
    [expected] = run_references([("pylate-encode", {"model": str(root / "colbert-ckpt"), "texts": texts,
                                                    "is_query": False})])
    for got, reference, text in zip(table.column("multivector").to_pylist(), expected, texts, strict=True):
        got = np.array(got, dtype=np.float32)
        assert got.shape == reference.shape, text
        np.testing.assert_allclose(got, reference, atol=1e-4)
