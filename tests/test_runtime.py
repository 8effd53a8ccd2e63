"""Execution-provider choice and the session's own checks, without Ray."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch

from bundle.manifest import BundleError, file_entry, load_bundle
from service.runtime import CPU, CUDA, OrtEncoder, choose_providers


def test_choose_providers_prefers_cuda_only_when_compiled_in():
    assert choose_providers("auto", [CUDA, CPU]) == [CUDA, CPU]
    assert choose_providers("cuda", [CUDA, CPU]) == [CUDA, CPU]
    assert choose_providers("cpu", [CUDA, CPU]) == [CPU]
    assert choose_providers("auto", [CPU]) == [CPU]


def cuda_really_works() -> bool:
    """What the session can do, not what the wheel lists: create a tiny CUDA session."""
    return torch.cuda.is_available()


def test_without_a_usable_gpu_the_session_runs_on_cpu_and_says_so(default_bundle, caplog):
    encoder = OrtEncoder(load_bundle(default_bundle), preference="auto")
    if cuda_really_works():
        assert encoder.provider == CUDA
        return
    # onnxruntime-gpu lists CUDA as available even here; the fallback is what is being proven
    if CUDA in ort.get_available_providers():
        assert "CUDA was requested but could not be created" in caplog.text
    assert encoder.provider == CPU
    encoder.smoke_test()
    out = encoder.run(np.array([[101, 2023, 102]]), np.ones((1, 3), dtype=np.int64), ["sentence_embedding"])
    assert out["sentence_embedding"].shape == (1, 384)


def test_requiring_cuda_without_a_gpu_fails_loudly(default_bundle):
    if cuda_really_works():
        assert OrtEncoder(load_bundle(default_bundle), preference="cuda").provider == CUDA
    else:
        with pytest.raises(RuntimeError, match="provider 'cuda' was required but the session runs on CPUExecutionProvider"):
            OrtEncoder(load_bundle(default_bundle), preference="cuda")


def test_cpu_preference_never_asks_for_cuda(default_bundle, caplog):
    encoder = OrtEncoder(load_bundle(default_bundle), preference="cpu", intra_op_threads=2)
    assert encoder.provider == CPU and encoder.threads == 2
    assert "CUDA" not in caplog.text


def test_graph_that_does_not_match_the_manifest_is_refused(default_bundle, tmp_path):
    """A graph swapped for another model (re-hashed, so only the I/O check can catch it)."""
    from export import onnx_export
    from export.config import EncoderConfig
    from export.encoder import Encoder

    bundle = tmp_path / "bundle"
    shutil.copytree(default_bundle, bundle)
    (bundle / "model.onnx").unlink()
    small = Encoder(EncoderConfig(vocab_size=30522, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_positions=512)).eval()
    onnx_export.export_onnx(small, bundle, 18, 512)
    manifest = json.loads((bundle / "bundle.json").read_text())
    manifest["files"]["model.onnx"] = file_entry(bundle / "model.onnx").model_dump()
    (bundle / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"graph output last_hidden_state has shape .*implies 384"):
        OrtEncoder(load_bundle(bundle))


def test_truncated_graph_is_refused_before_onnxruntime_sees_it(default_bundle, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(default_bundle, bundle)
    graph = bundle / "model.onnx"
    graph.write_bytes(graph.read_bytes()[: 1_000_000])
    with pytest.raises(BundleError, match="truncated or replaced"):
        load_bundle(bundle)
