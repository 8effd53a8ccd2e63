"""int8 held to the 0.999 floor (export/int8.py): onnxruntime's calibrated QDQ graph and NNCF's OpenVINO model
load and run, the export records the method it keeps and its gate figures, and a graph below the floor is not
published as holding it (on a tiny random BERT: hidden 32, 2 layers)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from tokenizers import Tokenizer

from bundle.contract import DEFAULT_ATOL, DEFAULT_MEAN_COSINE, DEFAULT_OPSET, DEFAULT_RTOL, ENCODINGS_OUTPUT_NAMES
from bundle.manifest import load_bundle
from export import int8, quality
from export.checkpoint import load_checkpoint
from export.int8 import (CALIBRATION_TEXTS, STATIC_METHODS, calibration_feeds, choose_int8,
                         quantize_static_int8)
from export.pipeline import ExportOptions, build_bundle
from export.sessions import OpenVinoSession, ort_session
from tests.families import make_checkpoint

MINMAX = STATIC_METHODS[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random BERT, its checkpoint loaded, and its fp32 bundle: the graph every method quantizes."""
    root = tmp_path_factory.mktemp("int8-static")
    checkpoint = make_checkpoint("bert", root / "bert", normalize=True)
    lines: list[str] = []
    build_bundle(ExportOptions(str(checkpoint), root / "bundle", DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, lossy=()),
                 progress=lines.append)
    ckpt = load_checkpoint(str(checkpoint))
    return ckpt, Tokenizer.from_file(str(ckpt.tokenizer_path)), root / "bundle", lines


def _gate(ckpt, tokenizer, session, floor):
    return quality.check_quality(ckpt.encoder, tokenizer, None, ckpt.max_tokens, ckpt.config.pad_token_id,
                                 DEFAULT_MEAN_COSINE, floor, session=session)


def test_calibration_texts_are_none_of_the_gates_texts():
    gate_texts = {*quality.CORPUS, *(q for q, _ in quality.QUERIES), *quality.DOCUMENTS}
    assert not gate_texts & set(CALIBRATION_TEXTS)
    assert len({t[:12] for t in CALIBRATION_TEXTS}) == len(CALIBRATION_TEXTS)  # no text twice


@pytest.mark.parametrize("method", [MINMAX, next(m for m in STATIC_METHODS if m.histogram)], ids=lambda m: m.name)
def test_static_graph_has_int8_matmuls_and_runs_in_onnxruntime(tiny, tmp_path, method):
    ckpt, tokenizer, bundle, _ = tiny
    target = tmp_path / "int8.onnx"
    feeds = calibration_feeds(tokenizer, ckpt.max_tokens, ckpt.config.pad_token_id, one_batch=method.histogram)
    quantize_static_int8(load_bundle(bundle).variant_path("fp32"), target, feeds, method)
    graph = onnx.load(str(target))
    quantized = {n.input[0] for n in graph.graph.node if n.op_type == "MatMul"} & {
        n.output[0] for n in graph.graph.node if n.op_type == "DequantizeLinear"}
    assert quantized, "no MatMul reads a dequantized int8 tensor"
    gate = _gate(ckpt, tokenizer, ort_session(target), 0.0)
    assert np.isfinite(gate.min_cosine) and 0.5 < gate.min_cosine <= gate.mean_cosine <= 1.0 + 1e-9, gate


def test_nncf_int8_model_runs_in_openvino(tiny, tmp_path):
    import openvino as ov

    ckpt, tokenizer, bundle, _ = tiny
    model = int8.quantize_nncf_int8(load_bundle(bundle).variant_path("fp32"),
                                    calibration_feeds(tokenizer, ckpt.max_tokens, ckpt.config.pad_token_id))
    ov.save_model(model, str(tmp_path / "nncf.xml"))
    assert any(op.get_type_name() == "FakeQuantize" for op in model.get_ops())
    gate = _gate(ckpt, tokenizer, OpenVinoSession(tmp_path / "nncf.xml", ENCODINGS_OUTPUT_NAMES, "fp32"), 0.0)
    assert np.isfinite(gate.min_cosine) and gate.min_cosine > 0.5, gate


def test_a_static_graph_that_holds_is_kept_with_its_gate(tiny, tmp_path):
    ckpt, tokenizer, bundle, _ = tiny
    target = tmp_path / "encodings-int8.onnx"
    choice = choose_int8(load_bundle(bundle).variant_path("fp32"), target,
                         lambda path: _gate(ckpt, tokenizer, ort_session(path), 0.9), tokenizer, ckpt.max_tokens,
                         ckpt.config.pad_token_id, methods=(MINMAX,))
    assert choice.method == MINMAX and choice.gate.passed and choice.gate.min_cosine >= 0.9 and target.exists()
    assert "QuantizeLinear" in {n.op_type for n in onnx.load(str(target)).graph.node}


def test_a_graph_below_the_floor_is_not_kept(tiny, tmp_path):
    """Held to a floor no graph meets, every method is tried and none is left at the target; the summary gives
    the best figure."""
    ckpt, tokenizer, bundle, _ = tiny
    target = tmp_path / "encodings-int8.onnx"
    choice = choose_int8(load_bundle(bundle).variant_path("fp32"), target,
                         lambda path: _gate(ckpt, tokenizer, ort_session(path), 1.0 + 1e-9), tokenizer,
                         ckpt.max_tokens, ckpt.config.pad_token_id, methods=STATIC_METHODS[:2])
    assert choice.method is None and choice.gate is None and not target.exists()
    assert [name for name, _ in choice.tried] == [m.name for m in STATIC_METHODS[:2]]
    best = max(g.min_cosine for _, g in choice.tried)
    assert "no method held" in choice.summary() and f"best min cosine {best:.5f}" in choice.summary()
