"""Execution-provider choice and the session's own checks, without Ray."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch

from bundle.manifest import BundleError, file_entry, load_bundle
from service.runtimes.onnxruntime import CPU, CUDA, CudaCheck, OrtEncoder, check_cuda, choose_providers


def test_choose_providers_asks_for_cuda_only_where_it_can_work():
    usable, unusable = CudaCheck(True), CudaCheck(False, "no GPU")
    assert choose_providers("auto", usable) == [CUDA, CPU]
    assert choose_providers("auto", unusable) == [CPU]
    assert choose_providers("cuda", unusable) == [CUDA, CPU]  # asked for: tried, and its failure reported
    assert choose_providers("cpu", usable) == [CPU]


def cuda_really_works() -> bool:
    """What the machine can do, not what the wheel lists."""
    return torch.cuda.is_available()


def test_without_a_usable_gpu_auto_runs_on_cpu_quietly_and_says_why(default_bundle, caplog, capfd):
    caplog.set_level(logging.INFO, logger="service.runtimes.onnxruntime")
    encoder = OrtEncoder(load_bundle(default_bundle), preference="auto")
    if cuda_really_works():
        assert encoder.provider == CUDA and encoder.provider_note == ""
        return
    assert encoder.provider == CPU
    assert encoder.provider_note == check_cuda().reason
    assert f"CUDA not used: {check_cuda().reason}; running on CPUExecutionProvider" in caplog.text
    # nothing from onnxruntime's own logger: no red provider errors, no CUDA warnings
    err = capfd.readouterr().err
    assert "[E:onnxruntime" not in err and "[W:onnxruntime" not in err and "\x1b[1;31m" not in err, err
    encoder.smoke_test()
    out = encoder.run(np.array([[101, 2023, 102]]), np.ones((1, 3), dtype=np.int64), ["sentence_embedding"])
    assert out["sentence_embedding"].shape == (1, 384)


def test_requiring_cuda_without_a_gpu_fails_with_the_real_reason(default_bundle):
    if cuda_really_works():
        assert OrtEncoder(load_bundle(default_bundle), preference="cuda").provider == CUDA
    else:
        with pytest.raises(RuntimeError, match="provider 'cuda' was required but CUDA cannot be used: ") as info:
            OrtEncoder(load_bundle(default_bundle), preference="cuda")
        assert check_cuda().reason in str(info.value)


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


def test_threads_come_from_the_replica_cpu_share_not_the_machine(monkeypatch):
    """Four replicas of 1 CPU on a 4-CPU pod get one thread per session, not four; several models
    and concurrent batches share the replica's CPUs; an explicit setting wins."""
    from service.engine import runner as batching
    from service.config import ServiceSettings

    monkeypatch.setattr(batching, "available_cpus", lambda: 4)  # the pod's CPUs, as the process sees them
    one = {"max_concurrent_batches": 1}
    assert batching.intra_op_threads(ServiceSettings(num_cpus=1, batching=one)) == 1
    assert batching.intra_op_threads(ServiceSettings(num_cpus=4, batching=one)) == 4
    assert batching.intra_op_threads(ServiceSettings(num_cpus=4)) == 2  # two batches at once
    assert batching.intra_op_threads(ServiceSettings(num_cpus=4, bundles=["a", "b"], batching=one)) == 2
    assert batching.intra_op_threads(ServiceSettings(num_cpus=8, batching=one)) == 4  # never past the pod's
    assert batching.intra_op_threads(ServiceSettings(num_cpus=0, batching=one)) == 4  # no share: the process's
    assert batching.intra_op_threads(ServiceSettings(num_cpus=0.5, batching=one)) == 1
    assert batching.intra_op_threads(ServiceSettings(num_cpus=1, intra_op_threads=3)) == 3


def test_resized_sessions_run_with_the_new_threads_while_the_old_keep_theirs(default_bundle):
    """A live max_concurrent_batches resizes a replica's sessions: every graph in a new session of the
    new thread count (read back from the sessions), the old encoder untouched for batches still on it,
    the same numbers from both; asked again for the same size, nothing is rebuilt."""
    old = OrtEncoder(load_bundle(default_bundle), preference="cpu", intra_op_threads=2)
    new = old.resized(1, 2)
    graphs = lambda e: [g for g in (e.full, e.fast, e.packed) if g is not None]  # noqa: E731
    assert new is not old and new.threads == 1 and old.threads == 2
    assert [g.threads for g in graphs(new)] == [1] * len(graphs(old)) and {g.threads for g in graphs(old)} == {2}
    assert all(a.session is not b.session for a, b in zip(graphs(old), graphs(new), strict=True))
    assert [g.label for g in graphs(new)] == [g.label for g in graphs(old)]  # the runs-by-graph counters carry on
    ids = np.array([[101, 7592, 2088, 102], [101, 2023, 102, 0]])
    mask = (ids > 0).astype(np.int64)
    for outputs in (["sentence_embedding"], ["sentence_embedding", "attentions"]):
        np.testing.assert_allclose(new.run(ids, mask, outputs)["sentence_embedding"],
                                   old.run(ids, mask, outputs)["sentence_embedding"], atol=1e-5)
    assert new.resized(1, 3) is new  # onnxruntime has no streams: the same threads need no new sessions


def expected_choice(runtime: str, precision: str, cuda: bool, bf16: bool, fidelity: bool) -> tuple[str, str] | None:
    """What serves the encodings graph, (runtime, precision), written from docs/configuration.md's `runtime`
    and `precision` rows, independently of choice.RULES: onnxruntime resolves its own precision ("as
    resolved") on CUDA, for int8 and fp16, and when asked for by name; `auto` on a CPU serves OpenVINO
    bf16 only where it can run (measuring it against onnxruntime fp32 unless bf16 is asked for), else
    onnxruntime fp32; `openvino` runs on the CPU (None: its onnxruntime side never asks for CUDA),
    bf16 where it can run and is not declined, else f32. Under precision `auto`, bf16 only where its gate
    holds the fidelity floor (`fidelity`); asked for by name, bf16 whatever the floor says."""
    if runtime == "openvino" and cuda:
        return None
    if runtime == "onnxruntime" or precision in ("int8", "fp16") or cuda:
        return ("onnxruntime", "as resolved")
    if runtime == "auto":
        if precision == "auto" and bf16 and fidelity:
            return ("faster", "bf16|fp32")
        return ("openvino", "bf16") if precision == "bf16" and bf16 else ("onnxruntime", "fp32")
    served_bf16 = bf16 and (precision == "bf16" or (precision == "auto" and fidelity))
    return ("openvino", "bf16") if served_bf16 else ("openvino", "fp32")


def test_the_runtime_table_decides_every_configuration_the_settings_accept():
    """choice.RULES is read top to bottom: every combination of the factors that the settings accept
    has a row, the first row that matches serves what the documented rules say, and the line /info
    shows for it says so."""
    from itertools import product
    from types import SimpleNamespace

    from service.config import ServiceSettings
    from service.runtimes import choice

    decided = 0
    for runtime, precision, cuda, bf16, fidelity in product(("auto", "onnxruntime", "openvino"),
                                                            ("auto", "fp32", "bf16", "int8", "fp16"),
                                                            (False, True), (False, True), (False, True)):
        try:
            ServiceSettings(runtime=runtime, precision=precision)
        except ValueError:
            continue  # refused at start-up (a runtime that cannot run the precision)
        expected = expected_choice(runtime, precision, cuda, bf16, fidelity)
        if expected is None:
            continue  # cannot happen: runtime openvino's onnxruntime encoder runs on the CPU (choose_runtime)
        found = SimpleNamespace(runtime=runtime, precision=precision, cuda=cuda, bf16=bf16, fidelity=fidelity)
        rows = [r for r in choice.RULES if r.matches(found)]
        assert rows, f"no row for {found}"
        assert (rows[0].serves, rows[0].precision_served) == expected, (found, rows[0])
        line = choice.TABLE[choice.RULES.index(rows[0])]
        if expected[0] == "openvino":
            assert line.endswith(f"-> openvino {expected[1]}"), line
        elif expected[0] == "faster":
            assert line.endswith("-> the faster on a probe batch of openvino bf16 and onnxruntime fp32"), line
        else:
            assert line.split(" -> ")[1].startswith("onnxruntime"), line
        decided += 1
    # 3 runtimes x 5 precisions x CUDA or not x bf16 or not x the floor held or not = 120, less 24 refused
    # (onnxruntime bf16; openvino int8, fp16), less 12 unreachable (openvino on CUDA)
    assert decided == 84
