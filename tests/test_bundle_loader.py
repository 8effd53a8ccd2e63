"""The torch-free bundle loader refuses anything that is not exactly what was exported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bundle.manifest import BundleError, load_bundle


@pytest.fixture()
def bundle_copy(default_bundle, tmp_path) -> Path:
    target = tmp_path / "bundle"
    shutil.copytree(default_bundle, target)
    return target


def test_tampered_file_is_refused(bundle_copy):
    graph = bundle_copy / "model.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    graph.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"model.onnx: sha256 .* does not match manifest"):
        load_bundle(bundle_copy)


def test_truncated_file_is_refused(bundle_copy):
    tok = bundle_copy / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:1000])
    with pytest.raises(BundleError, match=r"tokenizer.json: size 1000 bytes"):
        load_bundle(bundle_copy)


def test_missing_file_is_refused(bundle_copy):
    (bundle_copy / "model.onnx").unlink()
    with pytest.raises(BundleError, match=r"model.onnx: missing"):
        load_bundle(bundle_copy)


def test_missing_manifest_is_refused(bundle_copy):
    (bundle_copy / "bundle.json").unlink()
    with pytest.raises(BundleError, match=r"bundle.json: missing"):
        load_bundle(bundle_copy)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(unexpected=1), "Extra inputs are not permitted"),
        (lambda m: m["model"].update(hidden_size="wide"), "model.hidden_size"),
        (lambda m: m["graph"].update(outputs=["last_hidden_state"]), "is not the contract"),
        (lambda m: m["parity"].update(passed=False), "parity report says failed"),
        (lambda m: m["files"].update({"../escape": m["files"]["tokenizer.json"]}), "escapes the bundle"),
    ],
    ids=["unknown-key", "wrong-type", "io-contract", "failed-parity", "path-escape"],
)
def test_invalid_manifest_is_refused(bundle_copy, edit, message):
    path = bundle_copy / "bundle.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=message):
        load_bundle(bundle_copy)


def test_refusal_is_one_line_and_exit_code_one(bundle_copy):
    (bundle_copy / "tokenizer.json").write_text("{}")
    result = subprocess.run([sys.executable, "-m", "bundle", str(bundle_copy)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "tokenizer.json" in result.stderr


def test_loader_does_not_import_torch(default_bundle):
    code = (
        "import sys; from bundle.manifest import load_bundle; "
        f"load_bundle({str(default_bundle)!r}); "
        "assert 'torch' not in sys.modules, 'torch was imported'; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def with_external_data(bundle: Path, graph: str = "model.onnx", location: str | None = None,
                       listed: bool = False) -> Path:
    """`graph` re-saved with its weights in `<graph>.data` beside it, as the export writes a graph over 2 GB, and the
    manifest re-hashed for the graph (and, when `listed`, for its data file). location: what the graph then says
    its data file is (written into every external tensor's entry, the file itself left where onnx wrote it)."""
    import onnx

    from bundle.manifest import file_entry

    model = onnx.load(str(bundle / graph))
    onnx.save_model(model, str(bundle / graph), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=graph + ".data", size_threshold=1024)
    if location is not None:
        model = onnx.load(str(bundle / graph), load_external_data=False)
        for tensor in model.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = location
        onnx.save_model(model, str(bundle / graph))
    manifest = json.loads((bundle / "bundle.json").read_text())
    manifest["files"][graph] = file_entry(bundle / graph).model_dump()
    if listed:
        manifest["files"][graph + ".data"] = file_entry(bundle / (graph + ".data")).model_dump()
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    return bundle / (graph + ".data")


@pytest.mark.parametrize("graph", ["model.onnx", "encodings-fp32.onnx"])
def test_a_graph_s_external_data_must_be_listed_and_verified(bundle_copy, graph):
    """A graph's weights in `<graph>.data` beside it: not listed in 'files', they could be replaced (here: one bit
    flipped) and the bundle loaded, its hash unchanged. The file is now required in 'files' and verified."""
    data = with_external_data(bundle_copy, graph)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError) as caught:
        load_bundle(bundle_copy)
    assert str(caught.value) == (f"{bundle_copy / graph}: external data {graph}.data has no hash in 'files' "
                                 "(bundle.json must list every file a graph reads)")


def test_listed_external_data_loads_and_is_verified(bundle_copy):
    data = with_external_data(bundle_copy, listed=True)
    assert load_bundle(bundle_copy).manifest.files["model.onnx.data"].bytes == data.stat().st_size
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match=r"model.onnx.data: sha256 .* does not match manifest"):
        load_bundle(bundle_copy)


@pytest.mark.parametrize("location", ["../model.onnx.data", "/tmp/model.onnx.data"])
def test_external_data_outside_the_bundle_is_refused(bundle_copy, location):
    with_external_data(bundle_copy, location=location)
    with pytest.raises(BundleError) as caught:
        load_bundle(bundle_copy)
    assert str(caught.value) == f"{bundle_copy / 'model.onnx'}: external data {location!r} is outside the bundle directory"
