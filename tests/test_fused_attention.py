"""The encodings graph with onnxruntime's contrib attention operators (export/contrib_ops.py), on every family
whose attention onnxruntime's optimizer cannot fuse: MPNet's relative bias, RoPE (ModernBERT with its windows,
GTE, NomicBert), grouped-query heads with QK-norm (Gemma3 with windows, Qwen3 causal). Each family's tiny
checkpoint is traced with the operators and held to the strict parity gate against PyTorch on onnxruntime and
on OpenVINO at f32 (OpenVINO compiles the fp32 file for bf16). The export publishes it as the fp32 variant only
where it was measured faster on both CPU runtimes (export/optimize.py's CPU_GAIN; as measured, nowhere), always as
the fp16 (CUDA) variant, and says which in the manifest; BERT's graph stays as onnxruntime's optimizer fuses it.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from tokenizers import Tokenizer

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL, encodings_output_names
from bundle.manifest import load_bundle
from export import onnx_export, optimize, parity
from export.checkpoint import load_checkpoint
from export.pipeline import ExportOptions, build_bundle
from export.sessions import OpenVinoSession
from tests.families import DEFAULT_POOLING, make_checkpoint

# family -> MultiHeadAttention and RotaryEmbedding nodes per layer (a rotation of queries and one of keys)
CONTRIB_FAMILIES = {"mpnet": (1, 0), "modernbert": (1, 2), "gte": (1, 2), "nomic": (1, 2), "gemma3": (1, 2),
                    "qwen3": (1, 2)}


@pytest.fixture(scope="module")
def fused_graphs(tmp_path_factory) -> dict[str, tuple]:
    """family -> (checkpoint, fused fp32 encodings graph, probes), each traced and optimised once."""
    root = tmp_path_factory.mktemp("fused")
    graphs = {}
    for family in CONTRIB_FAMILIES:
        ckpt = load_checkpoint(str(make_checkpoint(family, root / family, pooling=DEFAULT_POOLING.get(family, "mean"))))
        traced, graph = root / f"{family}-traced.onnx", root / f"{family}.onnx"
        onnx_export.export_encodings_onnx(ckpt.encoder, traced, DEFAULT_OPSET, contrib=True)
        optimize.optimize_fp32(traced, graph, ckpt.config)
        cfg = ckpt.config
        probes = parity.make_probes(ckpt.max_tokens, cfg.vocab_size, cfg.pad_token_id,
                                    Tokenizer.from_file(str(ckpt.tokenizer_path)))
        graphs[family] = (ckpt, graph, probes)
    return graphs


def contrib_nodes(graph: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in onnx.load(str(graph)).graph.node:
        if node.domain == "com.microsoft" and node.op_type in optimize.CONTRIB_OPERATORS:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


@pytest.mark.parametrize("family", CONTRIB_FAMILIES)
def test_the_fused_graph_holds_the_strict_gate_on_onnxruntime_and_openvino(family, fused_graphs):
    ckpt, graph, probes = fused_graphs[family]
    assert onnx_export.contrib_attention_kind(ckpt.encoder) is not None
    attention, rotary = CONTRIB_FAMILIES[family]
    layers = ckpt.config.n_layers
    assert contrib_nodes(graph) == {k: n * layers for k, n in
                                    (("MultiHeadAttention", attention), ("RotaryEmbedding", rotary)) if n}
    outputs = encodings_output_names(ckpt.task)
    for session in (None, OpenVinoSession(graph, outputs, "fp32")):  # None: onnxruntime's CPU session
        report = parity.check_parity(ckpt.encoder, graph, probes, DEFAULT_ATOL, DEFAULT_RTOL, outputs=outputs,
                                     session=session)
        assert report.passed, [(line.output, line.max_abs_diff, line.problems) for line in report.outputs]
        assert all(line.values > 0 for line in report.outputs)


def test_bert_keeps_the_graph_onnxruntime_fuses(tmp_path):
    """BERT's attention is onnxruntime's optimizer's own pattern (one Attention node, QKV projections included)."""
    ckpt = load_checkpoint(str(make_checkpoint("bert", tmp_path / "bert")))
    assert onnx_export.contrib_attention_kind(ckpt.encoder) is None


@pytest.mark.parametrize(("family", "lossy"), [("qwen3", ("fp16",)), ("mpnet", ("fp16",))])
def test_the_export_publishes_the_graph_that_won_and_says_so(family, lossy, tmp_path):
    """The fp32 variant carries the contrib operators where they were measured faster on the CPU (optimize.CPU_GAIN),
    and its manifest names them and the figure; the fp16 variant (CUDA) carries them in any case and passes its
    gate; the service's loader accepts the bundle, and onnxruntime and OpenVINO both run its fp32 graph."""
    from service.runtimes.onnxruntime import OrtEncoder
    from service.runtimes.openvino import preflight

    checkpoint = make_checkpoint(family, tmp_path / family, pooling=DEFAULT_POOLING.get(family, "mean"))
    build_bundle(ExportOptions(str(checkpoint), tmp_path / "bundle", DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL,
                               lossy=lossy), progress=lambda line: None)
    bundle = load_bundle(tmp_path / "bundle")
    kind = onnx_export.contrib_attention_kind(load_checkpoint(str(checkpoint)).encoder)
    layers = bundle.manifest.model.num_layers
    rotations = 2 * layers if kind == "rotary" else 0
    fused = {k: n for k, n in (("MultiHeadAttention", layers), ("RotaryEmbedding", rotations)) if n}
    fp32 = bundle.manifest.variants["fp32"]
    assert contrib_nodes(bundle.variant_path("fp32")) == (fused if optimize.contrib_wins_on_cpu(kind) else {})
    assert fp32.optimizer == optimize.optimizer_label(fp32.fusions, kind)
    assert f"{optimize.CPU_GAIN[kind][0]:.2f}x the unfused graph" in fp32.optimizer
    assert fp32.parity is not None and fp32.parity.passed
    if "fp16" in lossy:
        fp16 = bundle.manifest.variants["fp16"]
        assert contrib_nodes(bundle.variant_path("fp16")) == fused
        assert fp16.quality is not None and fp16.quality.passed
        assert fp16.optimizer.startswith(optimize.CONTRIB_OPTIMIZER)
    OrtEncoder(bundle, "cpu", intra_op_threads=1, precision="fp32").smoke_test()
    preflight(bundle)  # OpenVINO compiles the fp32 graph and computes finite numbers with it
