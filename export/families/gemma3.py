"""Gemma 3 (model_type gemma3_text) as EmbeddingGemma uses it: bidirectional attention, pooled by the mean,
Dense modules after; transformers' modeling_gemma3.py names it as Qwen3 does (qwen3.py), with a norm after
each sub-layer too. A causal Gemma 3 (a language model) is refused.
"""

from __future__ import annotations

from pathlib import Path

from export.errors import CheckpointError
from export.families.base import Family, _activation, _local_attention, _pad_id, _positive_int, config_value
from export.families.qwen3 import _QWEN3_IGNORED, _QWEN3_RENAMES

# Qwen3's names, and a norm after each sub-layer too
_GEMMA3_RENAMES = (
    *(rename for rename in _QWEN3_RENAMES if "post_attention_layernorm" not in rename[0]),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.post_norm1."),
    (r"^layers\.(\d+)\.pre_feedforward_layernorm\.", r"layers.\1.norm2."),
    (r"^layers\.(\d+)\.post_feedforward_layernorm\.", r"layers.\1.post_norm2."),
)

_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


def _gemma3_fields(raw: dict, model_type: str, config_path: Path) -> dict:
    """Gemma 3's config keys with use_bidirectional_attention (EmbeddingGemma): GQA with QK-norm, RMSNorm
    scaled by 1 + w before and after each sub-layer, GeGLU (tanh), token embeddings times sqrt(hidden), and
    local layers that see sliding_window // 2 positions each way (transformers' exclusive bound of
    sliding_window // 2 + 1) with their own rotary base. A causal Gemma (a language model), logit soft-capping
    or a query scale other than the head width is refused by name."""
    if not raw.get("use_bidirectional_attention"):
        raise CheckpointError(f"{config_path}: a causal gemma3_text is a language model; the encoder loads Gemma 3 "
                              "as EmbeddingGemma uses it (use_bidirectional_attention true)")
    n_layers = raw["num_hidden_layers"]
    head_dim = config_value(raw, "head_dim", 256)
    for key in ("attn_logit_softcapping", "attention_bias"):
        if raw.get(key):
            raise CheckpointError(f"{config_path}: {key} {raw[key]!r} is not supported for gemma3_text")
    if config_value(raw, "query_pre_attn_scalar", 256) != head_dim:
        raise CheckpointError(f"{config_path}: query_pre_attn_scalar {raw['query_pre_attn_scalar']} is not supported "
                              f"(scores are scaled by the head width, {head_dim})")
    pattern = _positive_int(raw, "sliding_window_pattern", 6, config_path)
    local = _local_attention(raw, config_path, [bool((i + 1) % pattern) for i in range(n_layers)], _GEMMA3_THETA,
                             {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"})
    return dict(
        vocab_size=raw["vocab_size"],
        d_model=raw["hidden_size"],
        n_layers=n_layers,
        n_heads=raw["num_attention_heads"],
        n_kv_heads=config_value(raw, "num_key_value_heads", raw["num_attention_heads"]),
        head_dim=head_dim,
        d_ff=raw["intermediate_size"],
        max_positions=raw["max_position_embeddings"],
        type_vocab_size=0,
        layer_norm_eps=config_value(raw, "rms_norm_eps", 1e-6),
        dropout=0.0,
        attention_dropout=config_value(raw, "attention_dropout", 0.0),
        activation=_activation(raw, "hidden_activation", config_path),
        position_kind="rotary",
        **local,
        sliding_window=config_value(raw, "sliding_window", 4096) // 2,
        embedding_scale=raw["hidden_size"] ** 0.5,
        norm="rmsnorm",
        norm_weight_offset=1.0,
        post_sublayer_norm=True,
        qk_norm=True,
        bias=False,
        gated_mlp=True,
        norm_first=True,
        embedding_norm=False,
        pad_token_id=_pad_id(raw),
    )


ROWS = (
    # EmbeddingGemma: Gemma 3 with bidirectional attention, pooled by the mean, Dense modules after
    Family("Gemma3", ("gemma3_text",), "model.", _GEMMA3_RENAMES, _QWEN3_IGNORED, None, _gemma3_fields),
)
