"""Encodings-only graph variants: fused by onnxruntime's transformer optimizer, int8, fp16.

Only onnxruntime's own tools rewrite graphs here; what they produce is gated by the caller
(export.parity for fp32, export.quality for the lossy precisions) before it is published.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import onnx

from export.config import EncoderConfig

OPTIMIZER = "onnxruntime.transformers.optimizer (model_type bert)"
# what the encoder emits itself at export (export/contrib_ops.py), before the optimizer fuses the rest
CONTRIB_OPERATORS = ("MultiHeadAttention", "RotaryEmbedding")
CONTRIB_OPTIMIZER = ("export.contrib_ops (com.microsoft MultiHeadAttention, RotaryEmbedding at export), then "
                     + OPTIMIZER)
# The contrib graph against the optimizer-only one, by attention kind (export.onnx_export.contrib_attention_kind):
# unfused CPU time / contrib CPU time (above 1 the contrib graph is faster) on onnxruntime CPU fp32 and on OpenVINO
# bf16 (which compiles the same fp32 file), one thread, the median of rounds run back to back (2026-11-27, 2-core
# AMD EPYC with AVX512_BF16 shared by other jobs: CPU time, as wall time was noise), random weights at the base
# shape named, right-padded batches of 8 x 64 tokens (the figures kept here) and 2 x 256. The fp32 variant carries
# the contrib operators only where they won on both runtimes: as measured, on neither kind (onnxruntime gained
# 1 to 3% with RoPE, OpenVINO, the default on bf16 CPUs, lost 2 to 5%). The fp16 variant (CUDA's kernels,
# measured by `make gpu-check`) always carries them.
CPU_GAIN: dict[str, tuple[float, float, str]] = {
    "relative": (0.98, 1.00, "mpnet-base; at 2 x 256 tokens 0.99x and 0.98x"),
    "rotary": (1.01, 0.98, "modernbert-base; at 2 x 256 tokens 1.03x and 0.95x"),
}


@contextlib.contextmanager
def _quiet():
    """The optimizer and quantizer print and log every pattern they try and every hint they have;
    the fusion counts and the gates we record say what they did."""
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(logging.NOTSET)


def _optimize(source: Path, config: EncoderConfig, for_gpu: bool):
    """Attention, SkipLayerNormalization and BiasGelu fusions; returns the optimizer's model."""
    from onnxruntime.transformers import optimizer

    with _quiet():
        return optimizer.optimize_model(
            str(source),
            model_type="bert",
            num_heads=config.n_heads,
            hidden_size=config.d_model,
            opt_level=0,  # onnxruntime's session does its own graph optimisations at load time
            use_gpu=for_gpu,
        )


def _fusion_counts(model) -> dict[str, int]:
    return {op: n for op, n in sorted(model.get_fused_operator_statistics().items()) if n}


def external_data_of(graph: Path) -> Path:
    """Where a graph too large for one file keeps its weights (onnxruntime's and our exporter's name)."""
    return graph.with_name(graph.name + ".data")


def _save(model, source: Path, target: Path) -> None:
    """Save as the source was saved: with its weights in `<target>.data` when the source had external data."""
    model.save_model_to_file(str(target), use_external_data_format=external_data_of(source).exists())


def has_contrib_attention(fusions: dict[str, int]) -> bool:
    """Whether a graph of these fusions was exported with the contrib attention operators (the optimizer's own
    model_type bert never writes MultiHeadAttention or RotaryEmbedding)."""
    return any(fusions.get(op) for op in CONTRIB_OPERATORS)


def contrib_wins_on_cpu(kind: str | None) -> bool:
    """Whether the contrib graph of this attention kind was measured faster on the CPU than the unfused one, on
    onnxruntime fp32 and on OpenVINO bf16 both (one file serves both)."""
    return kind in CPU_GAIN and CPU_GAIN[kind][0] > 1.0 and CPU_GAIN[kind][1] >= 1.0


def optimizer_label(fusions: dict[str, int], kind: str | None) -> str:
    """The variant's `optimizer` field: what rewrote the graph and, for an attention kind the contrib operators
    could fuse, what they were measured to gain on the CPU (the figures the choice rests on)."""
    label = CONTRIB_OPTIMIZER if has_contrib_attention(fusions) else OPTIMIZER
    if kind is None:
        return label
    if kind not in CPU_GAIN:
        return f"{label} (contrib attention: {kind}, not measured on the CPU)"
    ort, ov, detail = CPU_GAIN[kind]
    return (f"{label} (contrib attention, {kind}: {ort:.2f}x the unfused graph on onnxruntime CPU fp32, "
            f"{ov:.2f}x on OpenVINO bf16, {detail})")


def optimize_fp32(source: Path, target: Path, config: EncoderConfig) -> dict[str, int]:
    """The fp32 encodings graph; returns the fused operators by type."""
    model = _optimize(source, config, for_gpu=False)
    _save(model, source, target)
    return _fusion_counts(model)


def quantize_int8(source: Path, target: Path, per_channel: bool = True) -> None:
    """Dynamic int8 quantization: weights of every MatMul and Attention, activations per run.

    per_channel: one scale per output column. Measured on all-MiniLM-L6-v2 against PyTorch fp32:
    mean cosine 0.991 with it, 0.950 without (per-tensor scales fail the gate).
    DefaultTensorType: the optimizer's fused nodes carry no type information for some
    intermediate tensors, and quantize_dynamic refuses to guess without it.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with _quiet():
        quantize_dynamic(
            str(source),
            str(target),
            weight_type=QuantType.QInt8,
            per_channel=per_channel,
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
            use_external_data_format=external_data_of(source).exists(),
        )


def optimize_fp16(source: Path, target: Path, config: EncoderConfig) -> dict[str, int]:
    """Fused for the CUDA provider, then weights and activations in fp16 (inputs/outputs keep their types)."""
    model = _optimize(source, config, for_gpu=True)
    counts = _fusion_counts(model)
    with _quiet():
        model.convert_float_to_float16(keep_io_types=True)
    _save(model, source, target)
    return counts
