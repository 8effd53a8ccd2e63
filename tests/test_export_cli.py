"""python -m export end to end: a verified bundle on success; on a parity failure a non-zero
exit and nothing published (no bundle, no half-written staging directory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from bundle.contract import GRAPH_FILE
from bundle.manifest import load_bundle
from export import __main__ as cli
from export import onnx_export
from service.runtimes.openvino import check_openvino
from tests.conftest import wait_until
from tests.hardware import int8_gate_passes_here


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_default_bundle_is_complete_and_verified(default_bundle):
    bundle = load_bundle(default_bundle)
    m = bundle.manifest
    assert (m.model.name, m.model.hidden_size, m.model.num_layers, m.model.num_heads) == ("all-MiniLM-L6-v2", 384, 6, 12)
    assert (m.model.max_tokens, m.model.pooling, m.model.normalize) == (256, "mean", True)
    assert m.graph.opset >= 17
    # bf16 is gated (and published) only where this CPU has bf16 units: a gate that ran in f32 would prove
    # nothing; int8 passes its gate only where the CPU has int8 dot products (tests/hardware.py)
    bf16 = {"bf16"} if check_openvino().bf16_units else set()
    int8 = {"int8"} if int8_gate_passes_here() else set()
    assert set(m.files) == {"model.onnx", "tokenizer.json", "encodings-fp32.onnx", "encodings-fp16.onnx",
                            "packed-fp32.onnx"} | {f"encodings-{p}.onnx" for p in int8}
    assert set(m.variants) == {"fp32", "fp16"} | int8 | bf16 and all(v.passed for v in m.variants.values())
    assert m.parity.passed and [o.output for o in m.parity.outputs] == ["last_hidden_state", "sentence_embedding", "attentions"]
    for o in m.parity.outputs:
        assert o.passed and o.values > 0 and o.atol <= 1e-4 and o.max_abs_diff <= o.atol
    assert {"torch", "onnx", "onnxruntime"} <= set(m.versions)
    assert leftovers(default_bundle.parent) == []


def test_bundle_graph_has_dynamic_batch_and_sequence(default_bundle):
    import onnxruntime as ort

    session = ort.InferenceSession(str(default_bundle / GRAPH_FILE), providers=["CPUExecutionProvider"])
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert all(isinstance(d, str) for shape in shapes.values() for d in shape), shapes
    for batch, seq in [(1, 3), (5, 40)]:
        feed = {name: np.ones((batch, seq), dtype=np.int64) for name in shapes}
        hidden, embedding, attentions = session.run(None, feed)
        assert hidden.shape == (batch, seq, 384) and embedding.shape == (batch, 384)
        assert attentions.shape == (6, batch, 12, seq, seq)


def test_bundle_tokenizer_truncates_at_model_limit_without_fixed_padding(default_bundle):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(default_bundle / "tokenizer.json"))
    assert tokenizer.padding is None
    assert len(tokenizer.encode("word " * 1000).ids) == 256
    assert len(tokenizer.encode("hi").ids) == 3


def test_cli_publishes_a_bundle_and_prints_the_parity_table(tmp_path):
    """Also: an int8 graph held to a gate it cannot meet is not published, the rest is, and
    the service then refuses to serve int8 from that bundle (before starting Ray)."""
    out = tmp_path / "b"
    result = subprocess.run(
        [sys.executable, "-m", "export", "--checkpoint", "default", "--out", str(out),
         "--lossy", "int8", "--mean-cosine", "0.9999"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for step in ("[1/7]", "[2/7]", "[3/7]", "[4/7]", "[5/7]", "[6/7]", "[7/7]"):
        assert step in result.stdout
    table = [line for line in result.stdout.splitlines() if "PASS (atol" in line]
    assert len(table) == 6, result.stdout  # full graph: 3 outputs; fp32 encodings graph: 2; packed graph: 1
    assert "int8 rejected by its gate: not published" in result.stdout
    assert "published" in result.stdout
    # the export says only what matters: no exporter progress, torchvision notices or FutureWarnings
    noise = [line for line in (result.stdout + result.stderr).splitlines()
             if any(word in line for word in ("[torch.onnx]", "torchvision", "Warning", "copyreg"))]
    assert not noise, noise
    bundle = load_bundle(out)
    assert set(bundle.manifest.variants) == {"fp32"} and not (out / "encodings-int8.onnx").exists()
    refused = subprocess.run(
        [sys.executable, "-m", "service", "--bundle", str(out), "--precision", "int8"],
        capture_output=True, text=True, timeout=120,
    )
    assert refused.returncode == 1 and "no int8 encodings graph in this bundle (has fp32)" in refused.stderr
    # refuses to overwrite without --force, and leaves the bundle as it was
    before = (out / "bundle.json").read_text()
    again = subprocess.run(
        [sys.executable, "-m", "export", "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 1 and "already exists" in again.stderr
    assert (out / "bundle.json").read_text() == before


def _corrupt_weight(path: Path) -> None:
    """Nudge layer 3's value-projection bias, as a bad conversion of one tensor would."""
    model = onnx.load(str(path))
    init = next(i for i in model.graph.initializer if i.name == "layers.3.attention.w_v.bias")
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + 0.05, init.name))
    onnx.save(model, str(path))


def _corrupt_graph(path: Path) -> None:
    """Turn the first Add of the graph into a Sub: a structural bug, every weight intact."""
    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.op_type == "Add")
    node.op_type = "Sub"
    onnx.save(model, str(path))


@pytest.mark.parametrize("corrupt", [_corrupt_weight, _corrupt_graph], ids=["weight", "graph"])
def test_parity_gate_rejects_a_corrupted_graph_and_publishes_nothing(tmp_path, monkeypatch, capsys, corrupt):
    real_export = onnx_export.export_onnx

    def export_then_corrupt(encoder, directory, opset, max_seq):
        written = real_export(encoder, directory, opset, max_seq)
        corrupt(directory / GRAPH_FILE)
        return written

    monkeypatch.setattr(onnx_export, "export_onnx", export_then_corrupt)
    out = tmp_path / "bundle"
    code = cli.main(["--checkpoint", "default", "--out", str(out)])
    captured = capsys.readouterr()
    assert code != 0
    assert "FAIL" in captured.out and "parity gate failed" in captured.err
    assert not out.exists()
    assert leftovers(tmp_path) == []


def test_cli_rejects_an_opset_below_17(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "export", "--out", str(tmp_path / "x"), "--opset", "13"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "--opset must be >= 17" in result.stderr


def test_bundle_cli_verifies_and_prints_the_table(default_bundle):
    result = subprocess.run([sys.executable, "-m", "bundle", str(default_bundle)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # parity rows: the full graph's 3 outputs, the fp32 encodings graph's 2, the packed graph's 1
    assert "files verified" in result.stdout and result.stdout.count("PASS (atol") == 6 and "fp16: cosine vs pytorch fp32" in result.stdout
    assert ("int8: cosine vs pytorch fp32" in result.stdout) == int8_gate_passes_here()
    assert "packed graph packed-fp32.onnx" in result.stdout
    assert json.loads((default_bundle / "bundle.json").read_text())["parity"]["passed"] is True


READER = r"""
import json, os, sys
out, stop, ready = sys.argv[1], sys.argv[2], sys.argv[3]
reads, problems, versions = 0, [], set()
while not os.path.exists(stop):
    try:
        root = os.path.realpath(out)  # as load_bundle does: resolved once, then every file from there
        manifest = json.load(open(os.path.join(root, "bundle.json")))
        for name, size in manifest["files"].items():
            data = open(os.path.join(root, name), "rb").read()
            if len(data) != size or set(data) != {manifest["version"] % 256}:
                problems.append(f"{name} of version {manifest['version']}: {len(data)} bytes, not whole")
        versions.add(manifest["version"])
        reads += 1
        if reads == 1:
            open(ready, "w").close()
    except Exception as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    sys.stderr.write("read\n")  # progress, a line per attempt: the publisher keeps pace with it
    sys.stderr.flush()
print(json.dumps({"reads": reads, "versions": len(versions), "problems": problems[:5], "failed": len(problems)}))
"""


def test_replacing_a_bundle_never_leaves_a_reader_without_a_whole_one(tmp_path):
    """Another process reads the bundle in a loop while it is replaced 150 times: every read finds
    bundle.json and each file it lists, whole and of one version. (Renaming the old directory away
    and the new one in left moments with no bundle at all.)"""
    from export.pipeline import _publish

    out = tmp_path / "bundle"

    def staged(version: int) -> Path:
        staging = Path(tempfile.mkdtemp(prefix=".bundle.tmp-", dir=tmp_path))
        for name in ("model.onnx", "tokenizer.json"):
            (staging / name).write_bytes(bytes([version % 256]) * 65536)
        (staging / "bundle.json").write_text(json.dumps(
            {"version": version, "files": {"model.onnx": 65536, "tokenizer.json": 65536}}))
        return staging

    _publish(staged(0), out)
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    reader = subprocess.Popen([sys.executable, "-c", READER, str(out), str(stop), str(ready)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: ready.exists() or reader.poll() is not None, "the reader's first read", timeout=60,
                   interval=0.01)
        reads = 0
        for version in range(1, 151):
            _publish(staged(version), out)
            # at least as many reads as versions published, so that the reader reads all along the
            # replacements on a loaded machine too (a slow reader once made 150 reads or fewer)
            while reads < version and reader.stderr.readline():
                reads += 1
    finally:
        stop.touch()
        result = json.loads(reader.communicate(timeout=60)[0])
    assert result["failed"] == 0, result
    assert result["reads"] > 150 and result["versions"] > 10, result  # it really read while versions changed
    assert json.loads((out / "bundle.json").read_text())["version"] == 150
    assert leftovers(tmp_path) == [] and not list(tmp_path.glob(".bundle.link-*"))
    # versions replaced longer ago than the grace period go; the current one and the one before stay
    _publish(staged(151), out, keep_s=0)
    assert sorted(p.name for p in tmp_path.glob(".bundle.v*")) == sorted({os.readlink(out), _previous(tmp_path, out)})


def _previous(parent: Path, out: Path) -> str:
    names = sorted((p.name for p in parent.glob(".bundle.v*")), key=lambda n: int(n.rsplit(".v", 1)[-1]))
    return names[names.index(os.readlink(out)) - 1]


def test_a_bundle_directory_from_before_versions_is_replaced_by_the_link(tmp_path):
    """An existing plain bundle directory (published by an older version) becomes a version of its own."""
    from export.pipeline import _publish

    out = tmp_path / "bundle"
    out.mkdir()
    (out / "bundle.json").write_text("old")
    staging = tmp_path / ".bundle.tmp-x"
    staging.mkdir()
    (staging / "bundle.json").write_text("new")
    _publish(staging, out)
    assert out.is_symlink() and (out / "bundle.json").read_text() == "new"
    kept = [p for p in tmp_path.glob(".bundle.v*") if p.name != os.readlink(out)]
    assert len(kept) == 1 and (kept[0] / "bundle.json").read_text() == "old"  # the previous version stays


def hub_cache_entry(cache: Path, repo_id: str, checkpoint: Path, commit: str = "0123456789abcdef0123456789abcdef01234567"):
    """`checkpoint`'s files as the Hugging Face cache holds a downloaded snapshot: blobs named by their hash,
    snapshots/<commit>/ of links to them, refs/main naming the commit (what `hf download` leaves)."""
    import hashlib

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for f in checkpoint.rglob("*"):
        if f.is_file():
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            blob.write_bytes(f.read_bytes())
            link = repo / "snapshots" / commit / f.relative_to(checkpoint)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    return commit


def test_a_hugging_face_model_id_is_exported_from_the_local_cache_and_never_downloaded(tmp_path):
    """`--checkpoint org/name` (TEI's and vLLM's `--model-id`) reads the snapshot in HF_HOME's cache, pinned by
    `--revision`; an id not in the cache is refused in one line naming the cache, with the network off."""
    from huggingface_hub import scan_cache_dir

    from tests.families import make_checkpoint

    checkpoint = make_checkpoint("bert", tmp_path / "ckpt", pooling="mean", normalize=True)
    home = tmp_path / "hf"
    commit = hub_cache_entry(home / "hub", "acme/tiny-bert", checkpoint)
    cached = scan_cache_dir(home / "hub")  # huggingface_hub reads it as its own
    assert [r.repo_id for r in cached.repos] == ["acme/tiny-bert"] and not cached.warnings
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    for revision, out in ((None, tmp_path / "by-ref"), (commit, tmp_path / "by-commit")):
        args = [sys.executable, "-m", "export", "--checkpoint", "acme/tiny-bert", "--out", str(out), "--lossy", ""]
        done = subprocess.run(args + (["--revision", revision] if revision else []), env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        bundle = load_bundle(out)
        assert bundle.manifest.model.name == "tiny-bert" and bundle.manifest.parity.passed
    missing = subprocess.run([sys.executable, "-m", "export", "--checkpoint", "acme/not-cached", "--out",
                              str(tmp_path / "none")], env=env, capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and not (tmp_path / "none").exists()
    line = missing.stderr.strip().splitlines()[-1]
    assert "acme/not-cached" in line and str(home / "hub") in line and "nothing is downloaded" in line, missing.stderr
