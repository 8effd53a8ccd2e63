"""Qwen3 (model_type qwen3: Qwen3-Embedding), a decoder used as an embedder, as transformers'
modeling_qwen3.py names it; pooled by its last token, the EOS its tokenizer appends. Its names are the
block gemma3.py builds on.
"""

from __future__ import annotations

import re
from pathlib import Path

from export.errors import CheckpointError
from export.families.base import Family, _pad_id, _rope_theta, config_value

# a decoder, pre-RMSNorm, grouped-query attention with RMSNorm on each head's queries and keys, RoPE,
# SwiGLU, no biases; Qwen3ForCausalLM keeps it under `model.`
_QWEN3_RENAMES = (
    (r"^embed_tokens\.", "embeddings.token."),
    (r"^layers\.(\d+)\.self_attn\.q_proj\.", r"layers.\1.attention.w_q."),
    (r"^layers\.(\d+)\.self_attn\.k_proj\.", r"layers.\1.attention.w_k."),
    (r"^layers\.(\d+)\.self_attn\.v_proj\.", r"layers.\1.attention.w_v."),
    (r"^layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.attention.w_o."),
    (r"^layers\.(\d+)\.self_attn\.q_norm\.", r"layers.\1.attention.q_norm."),
    (r"^layers\.(\d+)\.self_attn\.k_norm\.", r"layers.\1.attention.k_norm."),
    (r"^layers\.(\d+)\.input_layernorm\.", r"layers.\1.norm1."),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.norm2."),
    (r"^layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.ffn.linear1."),
    (r"^layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.ffn.up."),
    (r"^layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.ffn.linear2."),
    (r"^norm\.", "final_norm."),
)
_QWEN3_IGNORED = {
    re.compile(r"^lm_head\."): "the language-model head (next-token logits), not part of the embedder",
    re.compile(r"^rotary_emb\."): "RoPE's frequencies, rebuilt from rope_theta by the encoder",
}


def _qwen3_fields(raw: dict, model_type: str, config_path: Path) -> dict:
    """Qwen3's config keys: a causal pre-RMSNorm decoder with GQA, QK-norm, RoPE and SwiGLU, no biases.
    Sliding-window layers are refused (Qwen3-Embedding has none)."""
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in raw.get("layer_types") or []):
        raise CheckpointError(f"{config_path}: sliding-window attention layers are not supported for qwen3")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{config_path}: hidden_act {raw['hidden_act']!r} is not supported for qwen3 (silu)")
    return dict(
        vocab_size=raw["vocab_size"],
        d_model=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=raw["num_attention_heads"],
        n_kv_heads=config_value(raw, "num_key_value_heads", raw["num_attention_heads"]),
        head_dim=config_value(raw, "head_dim", raw["hidden_size"] // raw["num_attention_heads"]),
        d_ff=raw["intermediate_size"],
        max_positions=raw["max_position_embeddings"],
        type_vocab_size=0,
        layer_norm_eps=config_value(raw, "rms_norm_eps", 1e-6),
        dropout=0.0,
        attention_dropout=config_value(raw, "attention_dropout", 0.0),
        activation="silu",
        position_kind="rotary",
        rope_theta=_rope_theta(raw, config_path),
        norm="rmsnorm",
        qk_norm=True,
        bias=bool(raw.get("attention_bias", False)),
        gated_mlp=True,
        causal=True,
        norm_first=True,
        embedding_norm=False,
        pad_token_id=_pad_id(raw),
    )


ROWS = (
    # a decoder embedder (Qwen3-Embedding): pooled by its last token, the EOS its tokenizer appends
    Family("Qwen3", ("qwen3",), "model.", _QWEN3_RENAMES, _QWEN3_IGNORED, None, _qwen3_fields),
)
