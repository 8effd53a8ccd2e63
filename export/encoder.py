"""Our multi-head-attention Transformer encoder, written as the classic texts describe it.

Scaled dot-product attention, heads split with view/transpose and joined by W_o, Add & Norm,
a position-wise feed-forward network, token + position + segment embeddings, and pooling.
Not nn.MultiheadAttention and not transformers' classes: this module is the reference we
export, so every step is visible here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bundle.manifest import SPLADE_POOLINGS
from export import contrib_ops
from export.config import DenseLayer, EncoderConfig, Pooling

POOLINGS: tuple[str, ...] = Pooling.__args__  # type: ignore[attr-defined]


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    dropout: nn.Module | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T / sqrt(d_k) + bias) V; `mask` is boolean, True where a query may attend a key;
    `bias` (broadcastable to (..., Tq, Tk)) is added to the scores, as relative positions are.

    Returns (context, weights); weights are the probabilities before dropout.
    """
    d_k = q.size(-1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (..., Tq, Tk)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        # An additive bias of the dtype's minimum on hidden keys: exp(min - max) is exactly 0
        # for them, and a row with every key hidden gets uniform weights instead of NaN (-inf
        # would give NaN). Written as BERT writes it, (1 - mask) * min added to the scores, so
        # that onnxruntime's transformer optimizer recognises the pattern and fuses attention.
        scores = scores + (1.0 - mask.to(scores.dtype)) * torch.finfo(scores.dtype).min
    weights = scores.softmax(dim=-1)
    attended = dropout(weights) if dropout is not None else weights
    return attended @ v, weights


def attention_mask(
    q_len: int,
    k_len: int,
    device: torch.device,
    key_padding_mask: torch.Tensor | None = None,
    valid_lens: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor | None:
    """Combine the three ways to hide keys into one boolean mask broadcastable to (B, H, Tq, Tk).

    key_padding_mask: (B, Tk), true/1 for real keys. valid_lens: (B,) or (B, Tq), the number of
    valid keys per example (or per query), as d2l's masked_softmax takes them. causal: query i
    sees keys 0..i only (the look-ahead mask of a decoder).
    """
    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask.bool()[:, None, None, :]  # (B, 1, 1, Tk)
    if valid_lens is not None:
        keys = torch.arange(k_len, device=device)
        if valid_lens.dim() == 1:
            by_len = keys[None, None, None, :] < valid_lens[:, None, None, None]  # (B, 1, 1, Tk)
        else:
            by_len = keys[None, None, None, :] < valid_lens[:, None, :, None]  # (B, 1, Tq, Tk)
        mask = by_len if mask is None else mask & by_len
    if causal:
        look_ahead = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()[None, None]
        mask = look_ahead if mask is None else mask & look_ahead
    return mask


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (offset + weight), in float32: no centring and no bias (Llama's and
    Qwen's with offset 0; Gemma's stores the weight around 0 and scales by 1 + weight)."""

    def __init__(self, width: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((width,), 1.0 - offset))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # as Gemma computes it: in float32, then cast
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


def make_norm(config: EncoderConfig, width: int) -> nn.Module:
    """The family's norm: LayerNorm (BERT's; without a bias for ModernBERT) or RMSNorm."""
    if config.norm == "rmsnorm":
        return RMSNorm(width, config.layer_norm_eps, config.norm_weight_offset)
    return nn.LayerNorm(width, eps=config.layer_norm_eps, bias=config.norm_bias)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (B, heads, T, d_k): each pair (x_i, x_{i + d/2}) turned by its position times its frequency."""
    half = x.size(-1) // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


class RotaryPositions(nn.Module):
    """cos and sin of position * inv_freq, inv_freq_i = theta^(-2i/d): what `rotate` turns queries and
    keys by, so that their product depends on the distance between their positions only."""

    def __init__(self, config: EncoderConfig, theta: float) -> None:
        super().__init__()
        d = config.d_k
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin (B, 1, T, d_k), broadcast over heads."""
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, d/2)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, d)
        return angles.cos(), angles.sin()


class MultiHeadAttention(nn.Module):
    """Multi-head attention over separate query, key and value inputs (self- or cross-attention).

    Inputs may have their own widths (query_dim, key_dim, value_dim); each is projected to
    n_heads of d_k (d_model / n_heads unless head_dim says), attended, joined and passed through W_o
    back to d_model. Keys and values may have fewer heads (n_kv_heads: grouped-query attention, each
    shared by n_heads / n_kv_heads query heads); `qk_norm` normalises each head's queries and keys.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        query_dim: int | None = None,
        key_dim: int | None = None,
        value_dim: int | None = None,
        bias: bool = True,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: Callable[[int], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        assert head_dim or d_model % n_heads == 0, f"d_model {d_model} not divisible by n_heads {n_heads}"
        self.d_model, self.n_heads, self.d_k = d_model, n_heads, head_dim or d_model // n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.w_q = nn.Linear(query_dim or d_model, n_heads * self.d_k, bias=bias)
        self.w_k = nn.Linear(key_dim or d_model, self.n_kv_heads * self.d_k, bias=bias)
        self.w_v = nn.Linear(value_dim or d_model, self.n_kv_heads * self.d_k, bias=bias)
        self.w_o = nn.Linear(n_heads * self.d_k, d_model, bias=bias)
        self.q_norm = qk_norm(self.d_k) if qk_norm else None
        self.k_norm = qk_norm(self.d_k) if qk_norm else None
        self.dropout = nn.Dropout(dropout)

    def split_heads(self, x: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        B, T, _ = x.size()
        return x.view(B, T, heads or self.n_heads, self.d_k).transpose(1, 2)  # (B, heads, T, d_k)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        valid_lens: torch.Tensor | None = None,
        causal: bool = False,
        mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query (B, Tq, Dq), key (B, Tk, Dk), value (B, Tk, Dv) -> (B, Tq, d_model), (B, heads, Tq, Tk).

        mask: a boolean mask broadcastable to (B, heads, Tq, Tk), true where a query may attend a key,
        for what the three ways above cannot say (packed texts: each attends only its own tokens).
        bias: added to the scores, broadcastable to (B, heads, Tq, Tk) (relative positions).
        rotary: (cos, sin) of the positions (self-attention), which queries and keys are turned by.
        """
        B, Tq, _ = query.size()
        Tk = key.size(1)
        if contrib_ops.emitting():  # tracing for onnxruntime's contrib operators (export/contrib_ops.py)
            hidden = attention_mask(Tq, Tk, query.device, None, valid_lens, causal)
            mask = hidden if mask is None else mask if hidden is None else mask & hidden
            return self.contrib_forward(query, key, value, key_padding_mask, mask, bias, rotary)
        q = self.split_heads(self.w_q(query))  # (B, heads, Tq, d_k)
        k = self.split_heads(self.w_k(key), self.n_kv_heads)  # (B, kv_heads, Tk, d_k)
        v = self.split_heads(self.w_v(value), self.n_kv_heads)  # (B, kv_heads, Tk, d_k)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        if self.n_kv_heads != self.n_heads:  # each key/value head serves n_heads / n_kv_heads query heads
            group = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        hidden = attention_mask(Tq, Tk, query.device, key_padding_mask, valid_lens, causal)
        mask = hidden if mask is None else mask if hidden is None else mask & hidden
        context, weights = scaled_dot_product_attention(q, k, v, mask, self.dropout, bias)
        context = context.transpose(1, 2).contiguous().view(B, Tq, self.n_heads * self.d_k)
        return self.w_o(context), weights

    def contrib_forward(self, query, key, value, key_padding_mask, mask, bias,
                        rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() as onnxruntime's MultiHeadAttention and RotaryEmbedding operators compute it, heads kept
        in (B, T, heads * d_k) throughout; the same numbers. The weights are not computed (the operator does
        not return them): an empty tensor in their place, for the encodings graph, which has no such output."""
        assert key is query and value is query, "contrib operators: self-attention only"
        B, T, _ = query.size()
        q, k, v = self.w_q(query), self.w_k(key), self.w_v(value)  # (B, T, heads * d_k)
        if self.q_norm is not None:  # per head: the norm is over each head's d_k
            q = self.q_norm(q.view(B, T, self.n_heads, self.d_k)).view(B, T, -1)
            k = self.k_norm(k.view(B, T, self.n_kv_heads, self.d_k)).view(B, T, -1)
        if rotary is not None:
            q, k = contrib_ops.rotary(q, *rotary, self.n_heads), contrib_ops.rotary(k, *rotary, self.n_kv_heads)
        if self.n_kv_heads != self.n_heads:  # each key/value head repeated for its n_heads / n_kv_heads query heads
            group = self.n_heads // self.n_kv_heads

            def repeat(x: torch.Tensor) -> torch.Tensor:
                x = x.view(B, T, self.n_kv_heads, 1, self.d_k).expand(B, T, self.n_kv_heads, group, self.d_k)
                return x.reshape(B, T, self.n_heads * self.d_k)
            k, v = repeat(k), repeat(v)
        context = contrib_ops.multi_head_attention(q, k, v, key_padding_mask, contrib_ops.attention_bias(mask, bias, T),
                                                   self.n_heads, self.d_k)
        return self.w_o(context), context.new_zeros(0)


class FeedForward(nn.Module):
    """Position-wise feed-forward: the same two-layer MLP applied to every token, linear2(act(linear1(x))),
    or gated (gated_mlp: SwiGLU with silu, GeGLU with gelu), linear2(act(linear1(x)) * up(x))."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        gate_bias = config.bias if config.gate_bias is None else config.gate_bias
        self.linear1 = nn.Linear(config.d_model, config.d_ff, bias=gate_bias if config.gated_mlp else config.bias)
        self.up = nn.Linear(config.d_model, config.d_ff, bias=gate_bias) if config.gated_mlp else None
        self.linear2 = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.activation = {
            "gelu": nn.GELU(),
            "gelu_tanh": nn.GELU(approximate="tanh"),
            "relu": nn.ReLU(),
            "silu": nn.SiLU(),
        }[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.linear1(x))
        return self.linear2(h * self.up(x) if self.up is not None else h)


class EncoderLayer(nn.Module):
    """Self-attention and feed-forward, each wrapped in a residual connection and LayerNorm."""

    def __init__(self, config: EncoderConfig, index: int = 0) -> None:
        super().__init__()
        self.norm_first, self.causal = config.norm_first, config.causal
        self.attention = MultiHeadAttention(
            config.d_model, config.n_heads, config.attention_dropout, bias=config.bias, n_kv_heads=config.n_kv_heads,
            head_dim=config.head_dim, qk_norm=(lambda width: make_norm(config, width)) if config.qk_norm else None)
        # ModernBERT's first layer attends its embeddings as they are: they leave a norm already
        keep_norm1 = index > 0 or config.first_attention_norm or not config.norm_first
        self.norm1 = make_norm(config, config.d_model) if keep_norm1 else nn.Identity()
        self.ffn = FeedForward(config)
        self.norm2 = make_norm(config, config.d_model)
        # Gemma's sandwich: each sub-layer's output is normed too, before it joins the residual stream
        post = config.post_sublayer_norm
        self.post_norm1 = make_norm(config, config.d_model) if post else nn.Identity()
        self.post_norm2 = make_norm(config, config.d_model) if post else nn.Identity()
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None, mask: torch.Tensor | None = None,
                bias: torch.Tensor | None = None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        attend = dict(key_padding_mask=key_padding_mask, mask=mask, bias=bias, rotary=rotary, causal=self.causal)
        if self.norm_first:  # pre-norm: x + Sublayer(LayerNorm(x)) (Gemma: x + Norm(Sublayer(Norm(x))))
            h = self.norm1(x)
            attended, weights = self.attention(h, h, h, **attend)
            x = x + self.dropout(self.post_norm1(attended))
            x = x + self.dropout(self.post_norm2(self.ffn(self.norm2(x))))
        else:  # post-norm (BERT): LayerNorm(x + Sublayer(x))
            attended, weights = self.attention(x, x, x, **attend)
            x = self.norm1(x + self.dropout(attended))
            x = self.norm2(x + self.dropout(self.ffn(x)))
        return x, weights


def relative_position_bucket(relative: torch.Tensor, buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bidirectional buckets of key position - query position, as MPNet computes them: half the
    buckets for keys before the query, half for keys after; in each half, distances below a quarter
    of the buckets get one each, larger ones share logarithmically wider buckets up to max_distance."""
    n = -relative
    half = buckets // 2
    bucket = (n < 0).to(torch.long) * half
    n = n.abs()
    exact = half // 2
    is_small = n < exact
    # log(0) is -inf for n = 0; is_small picks the exact bucket there, as transformers' code does
    large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (half - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, half - 1))
    return bucket + torch.where(is_small, n, large)


def window_mask(positions: torch.Tensor, window: int) -> torch.Tensor:
    """positions (B, T) -> (B, 1, T, T), true where key j lies at most `window` positions from query i
    (a bidirectional sliding window: ModernBERT's local layers)."""
    return ((positions[:, :, None] - positions[:, None, :]).abs() <= window)[:, None]


class RelativePositionBias(nn.Module):
    """One (rows, heads) table of score biases for every layer, indexed by the bucket of each key's
    position relative to its query (MPNet's relative_attention_bias)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.table = nn.Embedding(config.relative_buckets, config.n_heads)
        self.bucketing, self.max_distance = config.relative_bucketing, config.relative_max_distance

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (B, T) -> the bias (B, heads, T, T) of key j for query i."""
        relative = positions[:, None, :] - positions[:, :, None]  # (B, Tq, Tk): key - query
        buckets = relative_position_bucket(relative, self.bucketing, self.max_distance)
        return self.table(buckets).permute(0, 3, 1, 2)  # (B, heads, Tq, Tk)


def sinusoidal_positions(n_positions: int, d_model: int) -> torch.Tensor:
    """P[i, 2j] = sin(i / 10000^(2j/d)), P[i, 2j+1] = cos(i / 10000^(2j/d)); shape (n, d)."""
    i = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (n, 1)
    two_j = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d/2,)
    angle = i / torch.pow(10000.0, two_j / d_model)  # (n, d/2)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class Embeddings(nn.Module):
    """Token + position + segment embeddings, then LayerNorm and dropout (and a projection to d_model
    when the embeddings are narrower, as ELECTRA's are)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        width = config.d_embed
        self.position_kind = config.position_kind
        self.position_offset = config.position_offset
        self.token = nn.Embedding(config.vocab_size, width)
        if config.position_kind == "learned":
            self.position = nn.Embedding(config.max_positions, width)
            self.register_buffer("position_ids", torch.arange(config.max_positions)[None], persistent=False)
        elif config.position_kind == "sinusoidal":
            self.register_buffer("sinusoid", sinusoidal_positions(config.max_positions, width), persistent=False)
        if config.embedding_scale is not None:
            self.scale = config.embedding_scale
        elif config.position_kind == "rotary":
            self.scale = 1.0  # positions turn queries and keys in every layer; nothing is added here
        else:
            # "Attention Is All You Need" scales token embeddings by sqrt(d_model) so that the
            # fixed [-1, 1] positional signal does not drown them; learned positions need no scale.
            self.scale = 1.0 if config.position_kind == "learned" else math.sqrt(width)
        self.segment = nn.Embedding(config.type_vocab_size, width) if config.type_vocab_size else None
        self.norm = make_norm(config, width) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.dropout)
        self.project = nn.Linear(width, config.d_model) if width != config.d_model else None

    def counted_positions(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, T) position ids counted over real tokens from position_offset; padding at offset - 1.

        RoBERTa's rule (fairseq's make_positions), computed from the mask inside the graph, so a
        caller sends only input_ids and attention_mask: with right padding the real tokens get
        offset, offset + 1, ... and every padding token gets padding_idx.
        """
        mask = attention_mask.to(torch.long)
        return torch.cumsum(mask, dim=1) * mask + (self.position_offset - 1)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """position_ids (B, T): given, they are used as they are (packed texts each count from
        position_offset); else they are those of right-padded rows, as each family counts them."""
        T = input_ids.size(1)
        x = self.token(input_ids) * self.scale  # (B, T, width)
        if self.position_kind == "rotary":
            pass  # RotaryPositions, in every layer's attention
        elif position_ids is not None:
            x = x + (self.position(position_ids) if self.position_kind == "learned" else self.sinusoid[position_ids])
        elif self.position_offset:
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            positions = self.counted_positions(mask)  # (B, T)
            x = x + (self.position(positions) if self.position_kind == "learned" else self.sinusoid[positions])
        elif self.position_kind == "learned":
            x = x + self.position(self.position_ids[:, :T])  # (1, T, width) broadcast over B
        else:
            x = x + self.sinusoid[:T][None]  # (1, T, width)
        if self.segment is not None:
            if self.segment.num_embeddings == 1:
                # A single token type (the RoBERTa family): the same vector for every token, whatever
                # ids a caller sends; transformers would fail on a non-zero id instead.
                x = x + self.segment.weight[0]
            else:
                if token_type_ids is None:
                    token_type_ids = torch.zeros_like(input_ids)
                x = x + self.segment(token_type_ids)
        x = self.dropout(self.norm(x))
        return self.project(x) if self.project is not None else x  # (B, T, d_model)


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Pool (B, T, d) token encodings to (B, d) over real tokens, as sentence-transformers 6's Pooling
    does for right-padded rows (the service pads right; packed rows pool by weights instead)."""
    if how == "cls":
        return hidden[:, 0]
    keep = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    if how in ("mean", "mean_sqrt_len_tokens"):
        # clamp as sentence-transformers does, so an all-padding row gives 0, not NaN
        count = keep.sum(dim=1).clamp(min=1e-9)
        return (hidden * keep).sum(dim=1) / (count if how == "mean" else count.sqrt())
    if how == "weightedmean":  # token i of a text weighs i + 1 (positional weighting, SGPT)
        weights = keep * torch.arange(1, hidden.size(1) + 1, dtype=hidden.dtype, device=hidden.device)[None, :, None]
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    if how == "lasttoken":  # the last real token (a decoder's EOS): mask.sum - 1 in a right-padded row
        last = (mask.to(torch.long).sum(dim=1) - 1).clamp(min=0)  # (B,)
        return hidden[torch.arange(hidden.size(0), device=hidden.device), last]
    if how == "max":
        return hidden.masked_fill(keep == 0, torch.finfo(hidden.dtype).min).max(dim=1).values
    if how in SPLADE_POOLINGS:
        raise ValueError(f"{how} pools the masked-LM head's logits, not encodings: export.heads.SpladeEncoder")
    raise ValueError(f"unknown pooling {how!r}: expected one of {', '.join(POOLINGS)}")


DENSE_ACTIVATIONS = {"identity": nn.Identity, "tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU, "sigmoid": nn.Sigmoid}


class DenseHead(nn.Module):
    """sentence-transformers' Dense: activation(W x + b) on the pooled embedding, plus x (projected
    when the widths differ) with use_residual."""

    def __init__(self, layer: DenseLayer) -> None:
        super().__init__()
        self.linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
        self.activation = DENSE_ACTIVATIONS[layer.activation]()
        self.residual = (
            None if not layer.residual
            else nn.Identity() if layer.in_features == layer.out_features
            else nn.Linear(layer.in_features, layer.out_features, bias=False)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, in) -> (B, out)
        out = self.activation(self.linear(x))
        return out if self.residual is None else out + self.residual(x)


class Encoder(nn.Module):
    """Embeddings, n_layers encoder layers, pooling, optional Dense projections.

    forward(input_ids, attention_mask, token_type_ids) returns
    (last_hidden_state (B, T, d), sentence_embedding (B, sentence_dim), attentions (layers, B, heads, T, T)).
    """

    task = "embedding"  # what bundle.contract.output_names calls the outputs; export/heads.py's classifier differs

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(EncoderLayer(config, i) for i in range(config.n_layers))
        self.relative = RelativePositionBias(config) if config.relative_buckets else None
        rotary = config.position_kind == "rotary"
        self.rotary = RotaryPositions(config, config.rope_theta) if rotary else None
        # local layers: their own window and, where the family says so, their own rotary base
        self.local_rotary = RotaryPositions(config, config.local_rope_theta) \
            if rotary and config.sliding_layers and config.local_rope_theta is not None else self.rotary
        # Pre-norm leaves the residual stream un-normalised; one final norm fixes that.
        self.final_norm = make_norm(config, config.d_model) if config.norm_first else nn.Identity()
        self.dense = nn.ModuleList(DenseHead(layer) for layer in config.dense)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embeddings(input_ids, token_type_ids, attention_mask)  # (B, T, d_model)
        # positions of right-padded rows: token indexes
        positions = torch.arange(input_ids.size(1), device=input_ids.device)[None]  # (1, T)
        all_weights = []
        for layer, (mask, bias, rotary) in zip(self.layers, self.layer_inputs(positions, None)):
            x, weights = layer(x, attention_mask, mask, bias, rotary)
            all_weights.append(weights)  # (B, heads, T, T)
        x = self.final_norm(x)
        embedding = self.pooled(x, attention_mask)  # (B, sentence_dim)
        return x, embedding, torch.stack(all_weights)  # attentions: (layers, B, heads, T, T)

    def pooled(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The final encodings (B, T, d_model) of right-padded rows -> the second output (B, sentence_dim):
        pooled, then finished (export/heads.py's SpladeEncoder pools its head's logits instead)."""
        return self.finish(pool(x, attention_mask, self.config.pooling))

    def layer_inputs(self, positions: torch.Tensor, mask: torch.Tensor | None):
        """Each layer's (mask, score bias, rotary cos/sin), computed once from the positions (B, T) for all
        layers, as MPNet and the RoPE families do: local layers add their window to `mask` and rotate by
        their own base."""
        bias = self.relative(positions) if self.relative is not None else None  # (B, H, T, T)
        rotary = self.rotary(positions) if self.rotary is not None else None  # cos, sin (B, 1, T, d_k)
        local = None
        if self.config.sliding_layers:
            window = window_mask(positions, self.config.sliding_window)  # (B, 1, T, T)
            local_rotary = rotary if self.local_rotary is self.rotary else self.local_rotary(positions)
            local = (window if mask is None else mask & window, bias, local_rotary)
        full = (mask, bias, rotary)
        return [local if i in self.config.sliding_layers else full for i in range(len(self.layers))]

    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        """What follows pooling: the Dense projections and the L2 normalisation, (B, d_model) -> (B, sentence_dim)."""
        for head in self.dense:
            pooled = head(pooled)
        if self.config.normalize:
            pooled = F.normalize(pooled, p=2.0, dim=-1)
        return pooled

    def packed(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        position_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        pool_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Several texts in one row, without padding: what forward() returns as its second output.

        input_ids, token_type_ids, position_ids, segment_ids: (1, T), the texts one after another,
        each with its own positions (from position_offset) and its index in segment_ids; a token
        attends only the tokens of its own segment (a block-diagonal mask), so each text is encoded
        exactly as it would be alone. pool_weights (B, T): row b pools text b's tokens (mean: 1/n
        on each; cls: 1 on its first), so pooling is one matrix product. On a CPU this spends no
        work on padding, and a few short texts make one run instead of several small ones.
        """
        x = self.embeddings(input_ids, token_type_ids, position_ids=position_ids)  # (1, T, d_model)
        own_segment = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # (1, 1, T, T)
        # within a text, position differences are index differences (relative biases, rotations and
        # windows alike); across texts the mask hides them
        for layer, (mask, bias, rotary) in zip(self.layers, self.layer_inputs(position_ids, own_segment)):
            x, _ = layer(x, None, mask, bias, rotary)
        x = self.final_norm(x)
        # a weighted sum rather than a matrix product: OpenVINO at bf16 runs matrix products in bf16,
        # and a bf16 pooling product cost short texts fidelity (gate minimum cosine 0.99982, here 0.99995)
        return self.finish((pool_weights[:, :, None] * x).sum(dim=1))  # (B, sentence_dim)
