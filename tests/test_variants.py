"""The encodings-only graphs: each passes its own gate (checked again here, not read from the
manifest), a broken int8 variant fails its gate, requests are routed to the right graph, and
fp16 falls back to fp32 on a CPU-only replica."""

from __future__ import annotations

import httpx
import numpy as np
import onnx
import pytest

from bundle.contract import (
    DEFAULT_ATOL,
    DEFAULT_COSINE_FLOOR,
    DEFAULT_MEAN_COSINE,
    DEFAULT_OPSET,
    DEFAULT_RTOL,
    ENCODINGS_OUTPUT_NAMES,
)
from bundle.manifest import load_bundle
from export import optimize, parity, quality
from service.engine.runner import plan_sub_batches
from service.runtimes.onnxruntime import CPU, OrtEncoder
from tests.conftest import deploy
from tests.hardware import int8_gate_passes_here
from tests.metrics_scrape import poll, settled, total

TEXTS = ["How do I reset my password?", "Die Lieferung kam zwei Tage zu spät.", "ok", "敏捷的棕色狐狸跳过了懒狗。"]


def _gate(checkpoint, path, mean=DEFAULT_MEAN_COSINE, floor=DEFAULT_COSINE_FLOOR):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint.tokenizer_path))
    return quality.check_quality(checkpoint.encoder, tokenizer, path, checkpoint.max_tokens, 0, mean, floor)


def test_fp32_encodings_graph_is_fused_and_passes_the_strict_gate(default_bundle, checkpoint):
    bundle = load_bundle(default_bundle)
    variant = bundle.manifest.variants["fp32"]
    model = onnx.load(str(bundle.variant_path("fp32")))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Attention") == 6 and variant.fusions["Attention"] == 6  # one fused attention per layer
    assert [o.name for o in model.graph.output] == list(ENCODINGS_OUTPUT_NAMES)
    from tokenizers import Tokenizer

    probes = parity.make_probes(256, 30522, 0, Tokenizer.from_file(str(checkpoint.tokenizer_path)))
    report = parity.check_parity(checkpoint.encoder, bundle.variant_path("fp32"), probes, DEFAULT_ATOL, DEFAULT_RTOL,
                                 outputs=ENCODINGS_OUTPUT_NAMES)
    assert report.passed, report


def test_int8_and_fp16_graphs_pass_their_gates_where_this_cpu_allows(default_bundle, checkpoint, tmp_path):
    """fp16 passes everywhere. int8 is quantized here again from the bundle's fp32 graph, as the export
    does, and gated: it passes where the CPU has int8 dot products and fails on the per-text floor where
    it has AVX2 only (tests/hardware.py); the bundle holds it exactly when it passed."""
    bundle = load_bundle(default_bundle)
    gate = _gate(checkpoint, bundle.variant_path("fp16"))
    assert gate.passed and gate.mean_cosine >= 0.99 and gate.top1_agreement == gate.queries == 10, gate
    assert gate.candidate_hits >= gate.reference_hits
    fp16 = onnx.load(str(bundle.variant_path("fp16")))
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in fp16.graph.initializer)

    int8_path = tmp_path / "encodings-int8.onnx"
    optimize.quantize_int8(bundle.variant_path("fp32"), int8_path)
    model = onnx.load(str(int8_path))
    assert any(n.op_type.startswith(("DynamicQuantize", "QAttention", "MatMulInteger")) for n in model.graph.node)
    gate = _gate(checkpoint, int8_path)
    assert gate.passed == int8_gate_passes_here() == ("int8" in bundle.manifest.variants), gate
    if gate.passed:
        assert gate.mean_cosine >= 0.99 and gate.top1_agreement == gate.queries == 10
    else:
        assert any(f"< {DEFAULT_COSINE_FLOOR}" in p for p in gate.problems), gate.problems


def test_int8_gate_rejects_a_variant_that_breaks_it(default_bundle, checkpoint, tmp_path):
    """Per-tensor int8 scales are a real, common quantization choice that loses too much here."""
    broken = tmp_path / "per-tensor-int8.onnx"
    optimize.quantize_int8(load_bundle(default_bundle).variant_path("fp32"), broken, per_channel=False)
    gate = _gate(checkpoint, broken)
    assert not gate.passed
    assert gate.mean_cosine < DEFAULT_MEAN_COSINE and any("mean cosine" in p for p in gate.problems)


def test_runtime_routes_by_output_and_fp16_falls_back_to_fp32_on_cpu(default_bundle):
    bundle = load_bundle(default_bundle)
    encoder = OrtEncoder(bundle, "cpu", intra_op_threads=1, precision="fp16")
    assert (encoder.precision_requested, encoder.precision, encoder.fast.label) == ("fp16", "fp32", "encodings-fp32")
    assert encoder.graph_for(["sentence_embedding"]) is encoder.fast
    assert encoder.graph_for(["sentence_embedding", "last_hidden_state"]) is encoder.fast
    assert encoder.graph_for(["sentence_embedding", "attentions"]) is encoder.full
    assert encoder.fast.provider == encoder.full.provider == CPU
    ids = np.array([[101, 7592, 2088, 102]])
    fast = encoder.run(ids, np.ones_like(ids), ["sentence_embedding"])["sentence_embedding"]
    full = encoder.run(ids, np.ones_like(ids), ["sentence_embedding", "attentions"])["sentence_embedding"]
    np.testing.assert_allclose(fast, full, atol=1e-5)


# the per-text floor of an int8 graph published on a CPU without int8 dot products (tests/hardware.py)
AVX2_INT8_FLOOR = 0.94


@pytest.fixture(scope="module")
def int8_bundle(default_bundle, tmp_path_factory):
    """A bundle with a published int8 graph: the default one where int8 passes its gate on this CPU, else
    the default model exported again with int8 held to a floor this CPU's kernels meet, so that serving
    int8 is tested on every machine."""
    if int8_gate_passes_here():
        return default_bundle, DEFAULT_COSINE_FLOOR
    from export.pipeline import ExportOptions, build_bundle

    out = tmp_path_factory.mktemp("int8") / "bundle"
    build_bundle(ExportOptions("default", out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, lossy=("int8",),
                               mean_cosine=0.985, cosine_floor=AVX2_INT8_FLOOR), progress=lambda _: None)
    assert "int8" in load_bundle(out).manifest.variants
    return out, AVX2_INT8_FLOOR


def test_service_routes_attention_requests_to_the_full_graph_and_serves_int8(ray_serve, service_url, metrics_url, int8_bundle):
    bundle, floor = int8_bundle
    deploy({"precision": "int8", "num_cpus": 0.5}, "int8", "/int8", bundle)
    try:
        app = {"application": "int8"}

        def runs(f):
            return (total(f, "ray_encoder_inference_runs_total", **app, graph="full"),
                    total(f, "ray_encoder_inference_runs_total", **app, graph="encodings-int8"))

        with httpx.Client(base_url=ray_serve.url, timeout=60) as client:
            info = client.get("/int8/info").json()
            # int8 runs padded: the packed graph is fp32 (and bf16 on OpenVINO), never int8
            assert (info["precision"], info["graphs"]) == ("int8", {"attentions": "full", "encodings": "encodings-int8",
                                                                   "packed": None})
            assert info["variants"]["int8"]["gate"]["passed"] is True
            lengths = [len(d["tokens"]) for d in client.post("/int8/v1/tokenize", json={"inputs": TEXTS}).json()["data"]]
            expected_runs = len(plan_sub_batches(lengths, 4096, 64, 0.1))  # the default sub-batch bounds
            before = runs(settled(metrics_url, runs))
            int8 = client.post("/int8/v1/encode", json={"inputs": TEXTS}).json()
            attention = client.post("/int8/v1/encode", json={"inputs": TEXTS[:1], "attention": {"layers": [5], "heads": [0]}}).json()
            fp32 = client.post("/v1/encode", json={"inputs": TEXTS, "attention": {"layers": [5], "heads": [0]}}).json()
        after = runs(poll(metrics_url, lambda f: runs(f)[0] > before[0] and runs(f)[1] > before[1],
                          "runs on both graphs to be counted"))
        assert (after[0] - before[0], after[1] - before[1]) == (1, expected_runs)

        a = np.array([d["embedding"] for d in int8["data"]])
        b = np.array([d["embedding"] for d in fp32["data"]])
        cosines = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        # the gate's per-text floor (its mean is over its 50-text corpus; these 4 include a one-word
        # text, where int8 moves most)
        assert cosines.min() >= floor and cosines.mean() >= 0.98, cosines
        # attention weights come from the full fp32 graph, whatever the precision of the fast one
        np.testing.assert_allclose(np.array(attention["data"][0]["attention"]["data"]), np.array(fp32["data"][0]["attention"]["data"]), atol=1e-5)
    finally:
        from ray import serve

        serve.delete("int8")
