"""onnxruntime's contrib attention operators, emitted by our encoder while it is traced.

onnxruntime's transformer optimizer fuses BERT's attention pattern only: MPNet's relative-position
bias, RoPE, grouped-query heads and sliding windows stay a chain of MatMul, Add and Softmax nodes.
Our encoder is ours, so instead of matching its graph afterwards it emits the operators itself
(docs/ContribOperators.md in microsoft/onnxruntime):

- com.microsoft MultiHeadAttention: queries, keys, values as (B, T, heads * d_k); the padding as its
  `key_padding_mask` (B, Tk), every other score bias (relative positions, causal and window masks) in one
  additive `attention_bias` (1, heads or 1, Tq, Tk); grouped-query heads are repeated to the query heads
  first (the GroupQueryAttention operator is a decoder's: causal only, with its own KV-cache inputs).
- com.microsoft RotaryEmbedding: RoPE on (B, T, heads * d_k), the halves rotated (interleaved 0),
  with the cos/sin of positions 0..T-1 as its cache and each row's positions 0..T-1.

Each operator is a torch.autograd.Function whose forward computes what the operator computes (so a
traced run, and any run under `emit_contrib_ops`, gives the numbers of the plain encoder) and whose
`symbolic` writes the node: the TorchScript exporter (dynamo=False, what the encodings graph uses)
calls it. The graph is then held to the same strict parity gate as the unfused one.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch.onnx import symbolic_helper

DOMAIN = "com.microsoft"
CUSTOM_OPSETS = {DOMAIN: 1}

# What a hidden key gets added to its score: onnxruntime's own mask_filter_value. Not the dtype's
# minimum, as the plain encoder adds: added to a relative bias, float32's minimum stays finite, but the
# fp16 graph (CUDA) clips constants to -65504 and the sum would overflow to -inf. exp(-10000) is 0 in
# either precision, so the probabilities of real keys are the same.
MASK_VALUE = -10000.0

_emitting = False


@contextlib.contextmanager
def emit_contrib_ops():
    """While active, export.encoder.MultiHeadAttention runs (and a tracer records) these operators."""
    global _emitting
    before, _emitting = _emitting, True
    try:
        yield
    finally:
        _emitting = before


def emitting() -> bool:
    return _emitting


def _absent(g):
    """An omitted optional input (an empty name in the node's inputs)."""
    return symbolic_helper._optional_input_placeholder_tensor(g)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """export.encoder.rotate on (B, T, heads * d) with cos, sin of (T, d / 2)."""
    B, T, width = x.shape
    d = width // heads
    x = x.reshape(B, T, heads, d)
    cos = torch.cat((cos, cos), dim=-1)[None, :, None, :]  # (1, T, 1, d)
    sin = torch.cat((sin, sin), dim=-1)[None, :, None, :]
    half = d // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated_half * sin).reshape(B, T, width)


class RotaryEmbedding(torch.autograd.Function):
    """com.microsoft RotaryEmbedding (non-interleaved: the halves of each head, as RoPE's rotate_half)."""

    @staticmethod
    def forward(ctx, x, position_ids, cos_cache, sin_cache, heads: int):
        positions = position_ids[0]  # every row counts 0..T-1 in the padded graph
        return _rotate(x, cos_cache[positions], sin_cache[positions], heads)

    @staticmethod
    def symbolic(g, x, position_ids, cos_cache, sin_cache, heads: int):
        # head size is read from the cache (2 x its width), the heads from the input's width
        out = g.op(f"{DOMAIN}::RotaryEmbedding", x, position_ids, cos_cache, sin_cache, interleaved_i=0)
        out.setType(x.type())  # the input's type and shape: the exporter's shape inference knows no contrib op
        return out


class MultiHeadAttention(torch.autograd.Function):
    """com.microsoft MultiHeadAttention on (B, T, heads * d_k) queries, keys and values, with an optional
    additive attention_bias (B or 1, heads or 1, Tq, Tk)."""

    @staticmethod
    def forward(ctx, q, k, v, key_padding_mask, attention_bias, heads: int, scale: float):
        B, Tq, width = q.shape
        d = width // heads

        def split(x):
            return x.reshape(B, x.size(1), heads, d).transpose(1, 2)

        scores = split(q) @ split(k).transpose(-2, -1) * scale
        if key_padding_mask is not None:
            scores = scores + (1.0 - key_padding_mask.to(scores.dtype))[:, None, None, :] * MASK_VALUE
        if attention_bias is not None:
            scores = scores + attention_bias
        return (scores.softmax(dim=-1) @ split(v)).transpose(1, 2).reshape(B, Tq, width)

    @staticmethod
    def symbolic(g, q, k, v, key_padding_mask, attention_bias, heads: int, scale: float):
        padding, bias = (_absent(g) if symbolic_helper._is_none(x) else x for x in (key_padding_mask, attention_bias))
        # inputs: query, key, value, bias (of the projections: none, they stay MatMul + Add), key_padding_mask,
        # attention_bias
        out = g.op(f"{DOMAIN}::MultiHeadAttention", q, k, v, _absent(g), padding, bias,
                   num_heads_i=heads, scale_f=scale, mask_filter_value_f=MASK_VALUE)
        out.setType(q.type())  # (B, Tq, heads * d_k), as the query
        return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """RoPE on x (B, T, heads * d_k), by the encoder's (cos, sin) of (B', 1, T, d_k) for positions 0..T-1."""
    half = cos.size(-1) // 2
    B, T, _ = x.shape
    position_ids = torch.arange(T, device=x.device)[None].expand(B, T)
    return RotaryEmbedding.apply(x, position_ids, cos[0, 0, :, :half].contiguous(), sin[0, 0, :, :half].contiguous(),
                                 heads)


def attention_bias(mask: torch.Tensor | None, bias: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    """One additive bias for the operator, for what a padding mask cannot say: the score bias (relative
    positions), plus MASK_VALUE where the boolean mask (windows, causal; broadcastable to (B, heads, Tq, Tk))
    hides a key; expanded to every query where it says one row for all, as the operator takes
    (B or 1, heads or 1, Tq, Tk) only."""
    hidden = None if mask is None else (1.0 - mask.to(torch.float32)) * MASK_VALUE
    total = hidden if bias is None else bias if hidden is None else bias + hidden
    if total is None or total.size(2) == q_len:
        return total
    return total.expand(-1, -1, q_len, -1)


def multi_head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
                         bias: torch.Tensor | None, heads: int, d_k: int) -> torch.Tensor:
    """(B, T, heads * d_k) each -> (B, T, heads * d_k), scaled by 1 / sqrt(d_k) as the encoder's attention is.
    key_padding_mask (B, Tk), 1 for real keys: the operator's own input, so that a batch's padding is not
    written out as a (B, 1, Tq, Tk) bias in every layer."""
    padding = None if key_padding_mask is None else key_padding_mask.to(torch.int32)
    return MultiHeadAttention.apply(q, k, v, padding, bias, heads, 1.0 / math.sqrt(d_k))
