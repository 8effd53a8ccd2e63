"""A bad bundle makes the service refuse to start: one-line reason, non-zero exit, nothing served."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bundle.manifest import file_entry
from tests.conftest import free_port
from tests.reliability import record

ROOT = Path(__file__).resolve().parents[1]


def _missing_file(bundle: Path) -> str:
    (bundle / "tokenizer.json").unlink()
    return "tokenizer.json: missing"


def _tampered(bundle: Path) -> str:
    graph = bundle / "model.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 3] ^= 0x01
    graph.write_bytes(bytes(data))
    return "does not match manifest"


def _truncated(bundle: Path) -> str:
    graph = bundle / "model.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    return "truncated or replaced"


def _wrong_graph(bundle: Path) -> str:
    """Another model's graph with the manifest re-hashed: only the I/O check can catch it."""
    from export import onnx_export
    from export.config import EncoderConfig
    from export.encoder import Encoder

    (bundle / "model.onnx").unlink()
    other = Encoder(EncoderConfig(vocab_size=30522, d_model=64, n_layers=2, n_heads=4, d_ff=128)).eval()
    onnx_export.export_onnx(other, bundle, 18, 512)
    manifest = json.loads((bundle / "bundle.json").read_text())
    manifest["files"]["model.onnx"] = file_entry(bundle / "model.onnx").model_dump()
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    return "manifest implies 384"


def _unlisted_external_data(bundle: Path) -> str:
    """The graph's weights moved to model.onnx.data (as a graph over 2 GB ships), left out of 'files', one bit flipped."""
    from tests.test_bundle_loader import with_external_data

    data = with_external_data(bundle)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    return "external data model.onnx.data has no hash in 'files'"


CASES = {
    "missing file": (_missing_file, "tokenizer.json deleted"),
    "tampered hash": (_tampered, "one bit flipped in model.onnx"),
    "truncated ONNX": (_truncated, "model.onnx cut in half"),
    "graph does not match manifest": (_wrong_graph, "a 64-wide 2-layer graph, manifest re-hashed"),
    "unlisted external data": (_unlisted_external_data, "model.onnx's weights in model.onnx.data, not in 'files', "
                               "one bit flipped"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_service_refuses_a_bad_bundle(case, default_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(default_bundle, bundle)
    breaker, injected = CASES[case]
    expected = breaker(bundle)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "service", "--bundle", str(bundle), "--port", str(free_port()),
         "--metrics-port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("service refused to start:"), result.stderr
    assert expected in lines[0]
    assert "serving" not in result.stdout
    reason = lines[0].replace(str(bundle), "<bundle>")
    record(f"bad artifact: {case}", injected, f"refused to start in {elapsed:.1f} s, exit 1: `{reason}`")
