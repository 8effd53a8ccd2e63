"""The attention module against a direct computation of softmax(QK^T/sqrt(d_k))V, and the
classic textbook formulations (d2l, "Attention Is All You Need")."""

from __future__ import annotations

import math

import pytest
import torch

from export.encoder import MultiHeadAttention, attention_mask, scaled_dot_product_attention

torch.manual_seed(0)


def direct_attention(q, k, v, allowed=None):
    """softmax(QK^T/sqrt(d_k))V written out with explicit exp and sums, masked keys given zero weight."""
    scores = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = torch.where(allowed, scores, torch.tensor(-1e30))
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    if allowed is not None:
        e = e * allowed
    weights = e / e.sum(dim=-1, keepdim=True)
    return torch.einsum("...qk,...kd->...qd", weights, v), weights


def heads_of(x, n_heads):
    B, T, D = x.shape
    return x.reshape(B, T, n_heads, D // n_heads).permute(0, 2, 1, 3)


def reference_mha(mha: MultiHeadAttention, query, key, value, allowed=None):
    """Multi-head attention computed head by head with the module's own weights."""
    q, k, v = mha.w_q(query), mha.w_k(key), mha.w_v(value)
    contexts, all_weights = [], []
    for h in range(mha.n_heads):
        sl = slice(h * mha.d_k, (h + 1) * mha.d_k)
        head_allowed = None if allowed is None else allowed[:, 0]
        c, w = direct_attention(q[..., sl], k[..., sl], v[..., sl], head_allowed)
        contexts.append(c)
        all_weights.append(w)
    return mha.w_o(torch.cat(contexts, dim=-1)), torch.stack(all_weights, dim=1)


def test_scaled_dot_product_matches_direct_formula():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    context, weights = scaled_dot_product_attention(q, k, v)
    ref_context, ref_weights = direct_attention(q, k, v)
    torch.testing.assert_close(context, ref_context, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def test_self_attention_3x2_input_projected_to_width_4():
    """The textbook toy: 3 tokens of width 2, Q/K/V projections to width 4, one head."""
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])  # (1, 3, 2)
    attn = MultiHeadAttention(d_model=4, n_heads=1, query_dim=2, key_dim=2, value_dim=2).eval()
    context, weights = attn(x, x, x)
    assert context.shape == (1, 3, 4)
    assert weights.shape == (1, 1, 3, 3)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 1, 3))
    ref_context, ref_weights = reference_mha(attn, x, x, x)
    torch.testing.assert_close(context, ref_context, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def test_multi_head_attention_512_wide_8_heads_with_padding_mask():
    x = torch.randn(2, 5, 512)
    padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    attn = MultiHeadAttention(d_model=512, n_heads=8).eval()
    out, weights = attn(x, x, x, key_padding_mask=padding)
    assert out.shape == (2, 5, 512)
    assert weights.shape == (2, 8, 5, 5)
    assert torch.all(weights[1, :, :, 3:] == 0), "padded keys must get exactly zero weight"
    allowed = padding.bool()[:, None, None, :].expand(2, 1, 5, 5)
    ref_out, ref_weights = reference_mha(attn, x, x, x, allowed)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def test_cross_attention_with_different_widths_and_valid_lengths():
    """d2l's example: 4 queries, 6 key/value pairs, 100 hidden, 5 heads, valid lengths [3, 2]."""
    queries, keys, values = torch.randn(2, 4, 20), torch.randn(2, 6, 30), torch.randn(2, 6, 40)
    valid_lens = torch.tensor([3, 2])
    attn = MultiHeadAttention(d_model=100, n_heads=5, query_dim=20, key_dim=30, value_dim=40).eval()
    out, weights = attn(queries, keys, values, valid_lens=valid_lens)
    assert out.shape == (2, 4, 100)
    assert weights.shape == (2, 5, 4, 6)
    assert torch.all(weights[0, :, :, 3:] == 0) and torch.all(weights[1, :, :, 2:] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 5, 4))
    allowed = (torch.arange(6)[None, :] < valid_lens[:, None])[:, None, None, :].expand(2, 1, 4, 6)
    ref_out, ref_weights = reference_mha(attn, queries, keys, values, allowed)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def test_per_query_valid_lengths():
    """valid_lens of shape (B, Tq): each query row has its own number of visible keys."""
    x = torch.randn(1, 3, 8)
    valid = torch.tensor([[1, 2, 3]])
    attn = MultiHeadAttention(d_model=8, n_heads=2).eval()
    _, weights = attn(x, x, x, valid_lens=valid)
    visible = (weights[0, 0] > 0).sum(-1)
    assert visible.tolist() == [1, 2, 3]


def test_causal_mask_hides_future_keys():
    x = torch.randn(2, 6, 16)
    attn = MultiHeadAttention(d_model=16, n_heads=4).eval()
    out, weights = attn(x, x, x, causal=True)
    future = torch.ones(6, 6, dtype=torch.bool).triu(diagonal=1)
    assert torch.all(weights[..., future] == 0)
    allowed = (~future)[None, None].expand(2, 1, 6, 6)
    ref_out, ref_weights = reference_mha(attn, x, x, x, allowed)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    # Changing a later token must not change an earlier output: nothing leaks backwards.
    x2 = x.clone()
    x2[:, -1] += 10
    out2, _ = attn(x2, x2, x2, causal=True)
    torch.testing.assert_close(out2[:, :-1], out[:, :-1])


def test_causal_and_padding_masks_combine():
    mask = attention_mask(4, 4, torch.device("cpu"), key_padding_mask=torch.tensor([[1, 1, 1, 0]]), causal=True)
    expected = torch.tensor(
        [[True, False, False, False], [True, True, False, False], [True, True, True, False], [True, True, True, False]]
    )
    assert torch.equal(mask[0, 0], expected)


def test_padding_does_not_change_real_token_outputs():
    x = torch.randn(1, 4, 32)
    attn = MultiHeadAttention(d_model=32, n_heads=4).eval()
    out, _ = attn(x, x, x)
    padded = torch.cat([x, torch.randn(1, 3, 32)], dim=1)
    out_padded, _ = attn(padded, padded, padded, key_padding_mask=torch.tensor([[1, 1, 1, 1, 0, 0, 0]]))
    torch.testing.assert_close(out_padded[:, :4], out, atol=1e-6, rtol=1e-5)


def test_attention_dropout_is_active_only_in_training():
    x = torch.randn(2, 5, 64)
    attn = MultiHeadAttention(d_model=64, n_heads=4, dropout=0.5)
    attn.eval()
    eval_a, weights_a = attn(x, x, x)
    eval_b, _ = attn(x, x, x)
    assert torch.equal(eval_a, eval_b), "eval mode must be deterministic"
    attn.train()
    torch.manual_seed(1)
    train_a, train_weights = attn(x, x, x)
    torch.manual_seed(2)
    train_b, _ = attn(x, x, x)
    assert not torch.allclose(train_a, eval_a, atol=1e-3), "dropout must change training outputs"
    assert not torch.allclose(train_a, train_b, atol=1e-3), "different seeds, different dropout masks"
    # The returned weights are the probabilities; dropout only acts on what multiplies V.
    torch.testing.assert_close(train_weights, weights_a)


def test_head_count_must_divide_model_width():
    with pytest.raises(AssertionError, match="not divisible"):
        MultiHeadAttention(d_model=10, n_heads=3)
