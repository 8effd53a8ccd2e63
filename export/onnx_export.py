"""Trace the encoder to ONNX with dynamic batch and sequence axes, then check the graph."""

from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings
from pathlib import Path

import onnx
import torch

from torch import nn

from bundle.contract import (
    DYNAMIC_AXES,
    GRAPH_FILE,
    INPUT_NAMES,
    MIN_OPSET,
    OUTPUT_NAMES,
    PACKED_DYNAMIC_AXES,
    PACKED_INPUT_NAMES,
    encodings_output_names,
    output_names,
    packed_output_names,
)
from export import contrib_ops
from export.encoder import Encoder

# Graphs over this size must keep weights in an external data file (protobuf's 2 GB cap).
_SINGLE_FILE_LIMIT = 1_500_000_000


def example_inputs(batch: int = 2, seq: int = 16, vocab_size: int = 1000) -> tuple[torch.Tensor, ...]:
    """A padded example batch: the exporter must not see all-ones masks and specialise on them."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, vocab_size, (batch, seq), generator=generator)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[-1, seq // 2 :] = 0
    token_type_ids = torch.zeros(batch, seq, dtype=torch.long)
    return input_ids, attention_mask, token_type_ids


def export_onnx(encoder: Encoder, directory: Path, opset: int, max_seq: int) -> list[str]:
    """Export `encoder` to directory/model.onnx with torch's torch.export-based exporter.

    The outputs are named by the model's task (bundle.contract.output_names). Returns the names of
    the files written (the graph, plus external data for huge models).
    """
    if opset < MIN_OPSET:
        raise ValueError(f"opset {opset} is below the minimum {MIN_OPSET}")
    encoder.eval()
    path = directory / GRAPH_FILE
    batch = torch.export.Dim("batch")
    seq = torch.export.Dim("seq", max=max_seq)
    axes = {0: batch, 1: seq}
    n_bytes = sum(p.numel() * p.element_size() for p in encoder.parameters())
    before = set(directory.iterdir())
    with warnings.catch_warnings():
        # The exporter narrates axis renames as UserWarnings and its pytree use as FutureWarnings, and
        # says once per operator of torchvision (never installed here) that it skips it: nothing
        # actionable; the export's own numbered steps, and the parity gate after it, say what matters.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        torch.onnx.export(
            encoder,
            example_inputs(vocab_size=encoder.config.vocab_size),
            str(path),
            input_names=list(INPUT_NAMES),
            output_names=list(output_names(encoder.task)),
            dynamic_shapes=(axes, axes, axes),
            opset_version=opset,
            dynamo=True,
            external_data=n_bytes > _SINGLE_FILE_LIMIT,
            verbose=False,  # its progress lines; a failure still raises, with its own message
        )
    check_graph(path, output_names(encoder.task))
    return sorted(p.name for p in set(directory.iterdir()) - before)


class EncodingsOnly(nn.Module):
    """The encoder without its attention-weights output: what the fused graphs compute (the sentence
    embedding, or a classifier's logits, stays the second output)."""

    def __init__(self, encoder: Encoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.reads_token_types = encoder.config.type_vocab_size > 1

    def forward(self, input_ids, attention_mask, token_type_ids):
        if not self.reads_token_types:
            # A family with one token type (RoBERTa) or none (DistilBERT) never reads token_type_ids,
            # and both the TorchScript tracer and the transformer optimizer prune an unread input
            # (a no-op Reshape by its shape is removed too); the contract, and so the service,
            # feeds it all the same. Adding it times zero to input_ids keeps it, for one integer
            # multiply-add per token.
            input_ids = input_ids + token_type_ids * 0
        hidden, pooled_or_logits, _ = self.encoder(input_ids, attention_mask, token_type_ids)
        return hidden, pooled_or_logits


def needs_external_data(encoder: Encoder) -> bool:
    """Whether a graph of this encoder keeps its weights in an external data file beside it
    (<graph>.data): protobuf caps one file at 2 GB (a Qwen3-0.6B holds 1.9 to 2.4 GB of weights)."""
    return sum(p.numel() * p.element_size() for p in encoder.parameters()) > _SINGLE_FILE_LIMIT


def _export_legacy(module: nn.Module, inputs: tuple, path: Path, large: bool, **options) -> None:
    """The TorchScript-based exporter into `path`; with `large`, the weights end in one `<path>.data`
    (the exporter itself scatters a file per tensor past 2 GB, so it writes into a scratch directory
    first and the graph is saved again from there)."""
    with warnings.catch_warnings():
        # TorchScript-exporter deprecation and tracer warnings: known, and the parity gate is the check.
        warnings.simplefilter("ignore")
        if not large:
            torch.onnx.export(module, inputs, str(path), dynamo=False, **options)
            return
        with tempfile.TemporaryDirectory(prefix="onnx-export-") as scratch:
            traced = Path(scratch) / path.name
            torch.onnx.export(module, inputs, str(traced), dynamo=False, **options)
            model = onnx.load(str(traced))  # with whatever external files the exporter wrote
            onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=path.name + ".data", size_threshold=1024)


def contrib_attention_kind(encoder: Encoder) -> str | None:
    """Which attention onnxruntime's optimizer cannot fuse the encoder has, so that the contrib operators can
    stand in for it (export/contrib_ops.py): "relative" (MPNet's relative-position bias), "rotary" (RoPE, with
    grouped-query heads, QK-norms, windows or a causal mask as the family has them), "masked" (any of those
    without RoPE); None for BERT's own pattern, which the optimizer fuses already."""
    c = encoder.config
    if c.relative_buckets:
        return "relative"
    if c.position_kind == "rotary":
        return "rotary"
    if (c.n_kv_heads or c.n_heads) != c.n_heads or c.qk_norm or c.sliding_layers or c.causal:
        return "masked"
    return None


def export_encodings_onnx(encoder: Encoder, path: Path, opset: int, contrib: bool = False) -> None:
    """Export the encodings-only graph with the TorchScript-based exporter; with `contrib`, its attention as
    onnxruntime's MultiHeadAttention and RotaryEmbedding operators (export/contrib_ops.py).

    Why not torch.export here: onnxruntime's transformer optimizer matches the node patterns
    the TorchScript exporter writes (MatMul + Add projections, the additive mask); on the
    torch.export graph its symbolic shape inference fails and it fuses nothing (measured:
    0 Attention and 0 SkipLayerNormalization fusions, against 6 and 13 here). The full graph,
    which needs no fusion, stays on torch.export.
    """
    encoder.eval()
    outputs = encodings_output_names(encoder.task)
    names = [*INPUT_NAMES, *outputs]
    with contrib_ops.emit_contrib_ops() if contrib else contextlib.nullcontext():
        _export_legacy(EncodingsOnly(encoder), example_inputs(vocab_size=encoder.config.vocab_size), path,
                       needs_external_data(encoder), input_names=list(INPUT_NAMES), output_names=list(outputs),
                       dynamic_axes={name: DYNAMIC_AXES[name] for name in names}, opset_version=opset,
                       **({"custom_opsets": contrib_ops.CUSTOM_OPSETS} if contrib else {}))
    check_graph(path, outputs)


class Packed(nn.Module):
    """Encoder.packed as a module's forward, for the exporter."""

    def __init__(self, encoder: Encoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.reads_token_types = encoder.config.type_vocab_size > 1

    def forward(self, input_ids, token_type_ids, position_ids, segment_ids, pool_weights):
        if not self.reads_token_types:  # kept as an input all the same: see EncodingsOnly.forward
            input_ids = input_ids + token_type_ids * 0
        return self.encoder.packed(input_ids, token_type_ids, position_ids, segment_ids, pool_weights)


def example_packed_inputs(encoder: Encoder) -> tuple[torch.Tensor, ...]:
    """Two texts of 5 and 3 tokens in one row, mean-pooled (the weights' values do not shape the graph)."""
    from service.runtimes.packing import pack

    generator = torch.Generator().manual_seed(0)
    vocab = encoder.config.vocab_size
    ids = [torch.randint(1, vocab, (n,), generator=generator).numpy() for n in (5, 3)]
    feed = pack(ids, None, encoder.config.position_offset, "mean")
    return tuple(torch.from_numpy(feed[name]) for name in PACKED_INPUT_NAMES)


def export_packed_onnx(encoder: Encoder, path: Path, opset: int) -> None:
    """Export the packed graph (Encoder.packed) with the TorchScript-based exporter, as the encodings
    graph is; onnxruntime's transformer optimizer is not run on it: its attention fusion reads a
    padding mask, not a block-diagonal one (measured: fused, it fails at run time; with only the
    LayerNorm and Gelu fusions, no faster than onnxruntime's own load-time fusions)."""
    encoder.eval()
    outputs = packed_output_names(encoder.task)
    _export_legacy(Packed(encoder), example_packed_inputs(encoder), path, needs_external_data(encoder),
                   input_names=list(PACKED_INPUT_NAMES), output_names=list(outputs),
                   dynamic_axes={name: PACKED_DYNAMIC_AXES[name] for name in [*PACKED_INPUT_NAMES, *outputs]},
                   opset_version=opset)
    check_graph(path, outputs, PACKED_INPUT_NAMES)


def check_graph(path: Path, outputs: tuple[str, ...] = OUTPUT_NAMES, inputs: tuple[str, ...] = INPUT_NAMES) -> None:
    """onnx.checker with shape inference, plus our I/O contract."""
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    got_inputs = [i.name for i in model.graph.input]
    got_outputs = [o.name for o in model.graph.output]
    if tuple(got_inputs) != inputs or tuple(got_outputs) != outputs:
        raise ValueError(f"{path}: graph I/O {got_inputs} -> {got_outputs}, expected {inputs} -> {outputs}")


def graph_opset(path: Path) -> int:
    """The default-domain opset the graph was written with."""
    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
