"""The checkpoint families the encoder loads: one `Family` row each, saying how its config.json
maps onto EncoderConfig (`fields`), its weight names (native and original layouts) onto our modules,
what it leaves out on purpose, and its sequence-classification head. export/checkpoint.py reads a
checkpoint; this table says what each family means (../shared/DESIGN.md, "Families as blocks").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from export.errors import CheckpointError

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu"}

# BERT's parameter names -> ours; RoBERTa, XLM-RoBERTa, CamemBERT and ELECTRA share them.
# Anything that matches no rename of its family and is not ignored is an error naming the tensor.
# A tuple of replacements is a fused projection: the tensor is cut into that many equal parts along
# its output rows (weights and biases alike), in order, as transformers' own code splits it.
_BERT_RENAMES = (
    (r"^embeddings\.word_embeddings\.", "embeddings.token."),
    (r"^embeddings\.position_embeddings\.", "embeddings.position."),
    (r"^embeddings\.token_type_embeddings\.", "embeddings.segment."),
    (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.attention.w_q."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.attention.w_k."),
    (r"^encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.attention.w_v."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attention.w_o."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.norm1."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn.linear1."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn.linear2."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.norm2."),
)
_ELECTRA_RENAMES = (*_BERT_RENAMES, (r"^embeddings_project\.", "embeddings.project."))
_DISTILBERT_RENAMES = (
    (r"^embeddings\.word_embeddings\.", "embeddings.token."),
    (r"^embeddings\.position_embeddings\.", "embeddings.position."),
    (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"^transformer\.layer\.(\d+)\.attention\.q_lin\.", r"layers.\1.attention.w_q."),
    (r"^transformer\.layer\.(\d+)\.attention\.k_lin\.", r"layers.\1.attention.w_k."),
    (r"^transformer\.layer\.(\d+)\.attention\.v_lin\.", r"layers.\1.attention.w_v."),
    (r"^transformer\.layer\.(\d+)\.attention\.out_lin\.", r"layers.\1.attention.w_o."),
    (r"^transformer\.layer\.(\d+)\.sa_layer_norm\.", r"layers.\1.norm1."),
    (r"^transformer\.layer\.(\d+)\.ffn\.lin1\.", r"layers.\1.ffn.linear1."),
    (r"^transformer\.layer\.(\d+)\.ffn\.lin2\.", r"layers.\1.ffn.linear2."),
    (r"^transformer\.layer\.(\d+)\.output_layer_norm\.", r"layers.\1.norm2."),
)

# MPNet (transformers' modeling_mpnet.py): BERT's embeddings without token types, attention under
# `attention.attn.{q,k,v,o}` with its LayerNorm one level up, and one relative-position table
_MPNET_RENAMES = (
    (r"^embeddings\.word_embeddings\.", "embeddings.token."),
    (r"^embeddings\.position_embeddings\.", "embeddings.position."),
    (r"^embeddings\.LayerNorm\.", "embeddings.norm."),
    (r"^encoder\.relative_attention_bias\.", "relative.table."),
    (r"^encoder\.layer\.(\d+)\.attention\.attn\.q\.", r"layers.\1.attention.w_q."),
    (r"^encoder\.layer\.(\d+)\.attention\.attn\.k\.", r"layers.\1.attention.w_k."),
    (r"^encoder\.layer\.(\d+)\.attention\.attn\.v\.", r"layers.\1.attention.w_v."),
    (r"^encoder\.layer\.(\d+)\.attention\.attn\.o\.", r"layers.\1.attention.w_o."),
    (r"^encoder\.layer\.(\d+)\.attention\.LayerNorm\.", r"layers.\1.norm1."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.ffn.linear1."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.ffn.linear2."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.norm2."),
)

# Qwen3 (modeling_qwen3.py): a decoder, pre-RMSNorm, grouped-query attention with RMSNorm on each
# head's queries and keys, RoPE, SwiGLU, no biases; Qwen3ForCausalLM keeps it under `model.`
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
# a fused query/key/value projection (ModernBERT's Wqkv, GTE's qkv_proj, nomic's Wqkv): three equal parts
_FUSED_QKV = (r"layers.\1.attention.w_q.", r"layers.\1.attention.w_k.", r"layers.\1.attention.w_v.")

# ModernBERT (modeling_modernbert.py): pre-norm, fused Wqkv, GeGLU in one Wi (input, then gate), no
# position table; ModernBertForMaskedLM and the classifier keep it under `model.`
_MODERNBERT_RENAMES = (
    (r"^embeddings\.tok_embeddings\.", "embeddings.token."),
    (r"^embeddings\.norm\.", "embeddings.norm."),
    (r"^layers\.(\d+)\.attn_norm\.", r"layers.\1.norm1."),
    (r"^layers\.(\d+)\.attn\.Wqkv\.", _FUSED_QKV),
    (r"^layers\.(\d+)\.attn\.Wo\.", r"layers.\1.attention.w_o."),
    (r"^layers\.(\d+)\.mlp_norm\.", r"layers.\1.norm2."),
    (r"^layers\.(\d+)\.mlp\.Wi\.", (r"layers.\1.ffn.linear1.", r"layers.\1.ffn.up.")),
    (r"^layers\.(\d+)\.mlp\.Wo\.", r"layers.\1.ffn.linear2."),
    (r"^final_norm\.", "final_norm."),
)
# GTE (modeling_gte.py) and NomicBert (modeling_nomic_bert.py): BERT's embeddings without a position
# table, post-norm layers with RoPE and a gated MLP, named alike in transformers 5. The original layouts
# (GTE's "new" remote code, nomic's own) are mapped here as transformers' conversion_mapping.py maps them.
_ROTARY_BERT_EMBEDDINGS = (
    (r"^embeddings\.word_embeddings\.", "embeddings.token."),
    (r"^embeddings\.token_type_embeddings\.", "embeddings.segment."),
    (r"^(embeddings\.LayerNorm|emb_ln)\.", "embeddings.norm."),
)
_ROTARY_BERT_RENAMES = (
    *_ROTARY_BERT_EMBEDDINGS,
    (r"^layers\.(\d+)\.self_attn\.q_proj\.", r"layers.\1.attention.w_q."),
    (r"^layers\.(\d+)\.self_attn\.k_proj\.", r"layers.\1.attention.w_k."),
    (r"^layers\.(\d+)\.self_attn\.v_proj\.", r"layers.\1.attention.w_v."),
    (r"^layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.attention.w_o."),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.norm1."),
    (r"^layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.ffn.linear1."),
    (r"^layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.ffn.up."),
    (r"^layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.ffn.linear2."),
    (r"^layers\.(\d+)\.post_mlp_layernorm\.", r"layers.\1.norm2."),
)
_GTE_RENAMES = (
    *_ROTARY_BERT_RENAMES,
    (r"^encoder\.layer\.(\d+)\.attention\.qkv_proj\.", _FUSED_QKV),
    (r"^encoder\.layer\.(\d+)\.attention\.o_proj\.", r"layers.\1.attention.w_o."),
    (r"^encoder\.layer\.(\d+)\.attn_ln\.", r"layers.\1.norm1."),
    (r"^encoder\.layer\.(\d+)\.mlp\.up_gate_proj\.", (r"layers.\1.ffn.up.", r"layers.\1.ffn.linear1.")),
    (r"^encoder\.layer\.(\d+)\.mlp\.down_proj\.", r"layers.\1.ffn.linear2."),
    (r"^encoder\.layer\.(\d+)\.mlp_ln\.", r"layers.\1.norm2."),
)
_NOMIC_RENAMES = (
    *_ROTARY_BERT_RENAMES,
    (r"^encoder\.layers\.(\d+)\.attn\.Wqkv\.", _FUSED_QKV),
    (r"^encoder\.layers\.(\d+)\.attn\.out_proj\.", r"layers.\1.attention.w_o."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc11\.", r"layers.\1.ffn.up."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc12\.", r"layers.\1.ffn.linear1."),
    (r"^encoder\.layers\.(\d+)\.mlp\.fc2\.", r"layers.\1.ffn.linear2."),
    (r"^encoder\.layers\.(\d+)\.norm1\.", r"layers.\1.norm1."),
    (r"^encoder\.layers\.(\d+)\.norm2\.", r"layers.\1.norm2."),
)
_MODERNBERT_IGNORED = {
    re.compile(r"^head\."): "the masked-LM prediction head, not part of the encoder",
    re.compile(r"^decoder\."): "the masked-LM decoder, not part of the encoder",
}
# Gemma 3 (modeling_gemma3.py), as EmbeddingGemma uses it: Qwen3's names, and a norm after each sub-layer too
_GEMMA3_RENAMES = (
    *(rename for rename in _QWEN3_RENAMES if "post_attention_layernorm" not in rename[0]),
    (r"^layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.post_norm1."),
    (r"^layers\.(\d+)\.pre_feedforward_layernorm\.", r"layers.\1.norm2."),
    (r"^layers\.(\d+)\.post_feedforward_layernorm\.", r"layers.\1.post_norm2."),
)
_QWEN3_IGNORED = {
    re.compile(r"^lm_head\."): "the language-model head (next-token logits), not part of the embedder",
    re.compile(r"^rotary_emb\."): "RoPE's frequencies, rebuilt from rope_theta by the encoder",
}

# Checkpoint tensors each family knows and deliberately does not use, with the reason (patterns
# match names after the family's prefix is removed; the export lists every tensor so skipped).
_INDEX_BUFFERS = {
    re.compile(r"^embeddings\.(position_ids|token_type_ids)$"): "a constant index buffer, rebuilt by the encoder",
}
_BERT_IGNORED = {
    re.compile(r"^pooler\."): "BERT's tanh pooler; sentence embeddings come from the pooling config",
    re.compile(r"^cls\."): "pre-training heads (masked LM / next sentence), not part of the encoder",
    **_INDEX_BUFFERS,
}
_ROBERTA_IGNORED = {
    re.compile(r"^pooler\."): "the tanh pooler; sentence embeddings come from the pooling config",
    re.compile(r"^lm_head\."): "the masked-LM head, not part of the encoder",
    **_INDEX_BUFFERS,
}
_DISTILBERT_IGNORED = {
    re.compile(r"^vocab_(transform|layer_norm|projector)\."): "the masked-LM head, not part of the encoder",
    **_INDEX_BUFFERS,
}
_ELECTRA_IGNORED = {
    re.compile(r"^discriminator_predictions\."): "the discriminator's replaced-token head, not part of the encoder",
    re.compile(r"^generator_(predictions|lm_head)\."): "a generator's masked-LM head, not part of the encoder",
    **_INDEX_BUFFERS,
}
_ROTARY_BERT_IGNORED = {
    re.compile(r"^pooler\."): "the tanh pooler; sentence embeddings come from the pooling config",
    re.compile(r"^(lm_head|cls)\."): "the masked-LM head, not part of the encoder",
    re.compile(r"(^|\.)rotary_emb\."): "RoPE's frequencies, rebuilt from the rotary base by the encoder",
    **_INDEX_BUFFERS,
}


def config_value(raw: dict, key: str, default):
    """raw[key], with `default` when the key is absent or null (transformers' config default)."""
    value = raw.get(key)
    return default if value is None else value


def _positive_int(raw: dict, key: str, default: int, config_path: Path) -> int:
    """A layer pattern's period (every n-th layer global): a whole number of 1 or more, refused by name otherwise
    (a 0 would divide by zero, a fraction name no layer)."""
    value = config_value(raw, key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{config_path}: {key} {value!r} is not a whole number of layers of 1 or more")
    return value


def _activation(raw: dict, key: str, config_path: Path) -> str:
    act = config_value(raw, key, "gelu")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"{config_path}: {key} {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[act]


def _bert_like_fields(raw: dict, model_type: str, config_path: Path) -> dict:
    """BERT's config keys, as RoBERTa, XLM-RoBERTa, CamemBERT and ELECTRA also write them."""
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(
            f"{config_path}: position_embedding_type {raw['position_embedding_type']!r} is not supported (absolute)"
        )
    roberta = model_type in _ROBERTA_TYPES
    pad_token_id = config_value(raw, "pad_token_id", 1 if roberta else 0)
    fields = dict(
        vocab_size=raw["vocab_size"],
        d_model=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=raw["num_attention_heads"],
        d_ff=raw["intermediate_size"],
        max_positions=raw["max_position_embeddings"],
        type_vocab_size=config_value(raw, "type_vocab_size", 2),
        layer_norm_eps=config_value(raw, "layer_norm_eps", 1e-12),
        dropout=config_value(raw, "hidden_dropout_prob", 0.1),
        attention_dropout=config_value(raw, "attention_probs_dropout_prob", 0.1),
        activation=_activation(raw, "hidden_act", config_path),
        position_kind="learned",
        pad_token_id=pad_token_id,
    )
    if roberta:  # fairseq counts positions from padding_idx + 1 over real tokens
        fields["position_offset"] = pad_token_id + 1
    if model_type == "electra":  # ElectraConfig's default embedding_size is 128
        fields["embedding_size"] = config_value(raw, "embedding_size", 128)
    return fields


# MPNet counts positions from padding_idx + 1 over real tokens, with padding_idx fixed at 1 in its code
_MPNET_PADDING_IDX = 1


def _mpnet_fields(raw: dict, model_type: str, config_path: Path) -> dict:
    """BERT's config keys, with no token types, positions as RoBERTa counts them (from 2) and the
    relative-position table (relative_attention_num_buckets rows)."""
    return _bert_like_fields(raw, model_type, config_path) | dict(
        type_vocab_size=0,
        pad_token_id=config_value(raw, "pad_token_id", _MPNET_PADDING_IDX),
        position_offset=_MPNET_PADDING_IDX + 1,
        relative_buckets=config_value(raw, "relative_attention_num_buckets", 32),
    )


def _rope_theta(raw: dict, config_path: Path, default: float = 10000.0) -> float:
    """The rotary base, from rope_parameters (transformers 5) or rope_theta (older configs); a scaled
    RoPE (YaRN, linear, dynamic, NTK) is refused by name rather than computed wrong."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise CheckpointError(f"{config_path}: rope_type {kind!r} is not supported (default RoPE only)")
    return float(params.get("rope_theta") or config_value(raw, "rope_theta", default))


# nomic's original config.json (its remote code, as nomic-embed-text and arctic-embed-m-long ship it)
_NOMIC_ORIGINAL_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
                        "n_inner": "intermediate_size", "n_positions": "max_position_embeddings",
                        "layer_norm_epsilon": "layer_norm_eps", "rotary_emb_base": "rope_theta"}
_NOMIC_ORIGINAL_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}
# what the original layouts can say that the encoder does not compute: key -> the value it must have
_NOMIC_ORIGINAL_REFUSED = {"rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "prenorm": False,
                           "use_rms_norm": False, "parallel_block": False, "rotary_scaling_factor": None,
                           "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False}
_GTE_ORIGINAL_REFUSED = {"logn_attention_scale": False, "layer_norm_type": "layer_norm",
                         "position_embedding_type": "rope"}


def _rotary_bert_fields(raw: dict, model_type: str, config_path: Path) -> dict:
    """GTE's and NomicBert's config keys: BERT's, with RoPE in place of the position table, post-norm
    and a gated MLP (GeGLU for GTE, SwiGLU for nomic). GTE biases every projection but the gate and
    up ones; nomic has no linear biases. nomic's original keys (n_embd, rotary_emb_base, ...) are read
    too, and what its or GTE's remote code can switch on that the encoder lacks is refused by name."""
    nomic = model_type == "nomic_bert"
    if nomic and "n_embd" in raw:
        raw = {_NOMIC_ORIGINAL_KEYS.get(k, k): v for k, v in raw.items()}
        activation = raw.get("activation_function", "swiglu")
        if activation not in _NOMIC_ORIGINAL_ACTIVATIONS:
            raise CheckpointError(f"{config_path}: activation_function {activation!r} is not supported "
                                  f"({', '.join(_NOMIC_ORIGINAL_ACTIVATIONS)})")
        raw["hidden_act"] = _NOMIC_ORIGINAL_ACTIVATIONS[activation]
    for key, expected in (_NOMIC_ORIGINAL_REFUSED if nomic else _GTE_ORIGINAL_REFUSED).items():
        if key in raw and raw[key] != expected and not (expected is None and raw[key] in (None, 1.0)):
            raise CheckpointError(f"{config_path}: {key} {raw[key]!r} is not supported for {model_type} ({expected!r})")
    return dict(
        vocab_size=raw["vocab_size"],
        d_model=raw["hidden_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=raw["num_attention_heads"],
        # transformers 5 saves nomic's head_dim even where it is hidden / heads
        head_dim=raw.get("head_dim") if raw.get("head_dim") != raw["hidden_size"] // raw["num_attention_heads"] else None,
        d_ff=raw["intermediate_size"],
        max_positions=raw["max_position_embeddings"],
        type_vocab_size=config_value(raw, "type_vocab_size", 2 if nomic else 1),
        layer_norm_eps=config_value(raw, "layer_norm_eps", 1e-12),
        dropout=config_value(raw, "hidden_dropout_prob", 0.0 if nomic else 0.1),
        attention_dropout=config_value(raw, "attention_probs_dropout_prob", 0.0),
        activation=_activation(raw, "hidden_act", config_path),
        position_kind="rotary",
        rope_theta=_rope_theta(raw, config_path, 1000.0 if nomic else 160_000.0),
        gated_mlp=True,
        bias=not nomic,
        gate_bias=False,
        pad_token_id=config_value(raw, "pad_token_id", 0 if nomic else 1),
    )


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


_MODERNBERT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}  # ModernBertConfig.default_theta


def _modernbert_fields(raw: dict, model_type: str, config_path: Path) -> dict:
    """ModernBERT's config keys, in the layout transformers 5 saves (layer_types, rope_parameters per
    layer type) and the original one (global_attn_every_n_layers, global/local_rope_theta): pre-norm
    without biases, a sliding window of local_attention // 2 each way on the local layers, GeGLU."""
    n_layers = raw["num_hidden_layers"]
    every = _positive_int(raw, "global_attn_every_n_layers", 3, config_path)
    local = _local_attention(raw, config_path, [bool(i % every) for i in range(n_layers)], _MODERNBERT_THETA,
                             {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"})
    if bool(raw.get("attention_bias", False)) != bool(raw.get("mlp_bias", False)):
        raise CheckpointError(f"{config_path}: attention_bias and mlp_bias must agree (the encoder has one bias switch)")
    return dict(
        vocab_size=raw["vocab_size"],
        d_model=raw["hidden_size"],
        n_layers=n_layers,
        n_heads=raw["num_attention_heads"],
        d_ff=raw["intermediate_size"],
        max_positions=config_value(raw, "max_position_embeddings", 8192),
        type_vocab_size=0,
        layer_norm_eps=config_value(raw, "norm_eps", 1e-5),
        dropout=0.0,
        attention_dropout=config_value(raw, "attention_dropout", 0.0),
        activation=_activation(raw, "hidden_activation", config_path),
        position_kind="rotary",
        **local,
        sliding_window=config_value(raw, "local_attention", 128) // 2,
        norm_bias=bool(raw.get("norm_bias", False)),
        bias=bool(raw.get("attention_bias", False)),
        gated_mlp=True,
        norm_first=True,
        first_attention_norm=False,
        pad_token_id=config_value(raw, "pad_token_id", 50283),
    )


_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta


def _local_attention(raw: dict, config_path: Path, sliding_by_pattern: list[bool], defaults: dict[str, float],
                     old_keys: dict[str, str]) -> dict:
    """EncoderConfig's rope_theta, local_rope_theta and sliding_layers of a family with global and local
    layers: the layers from layer_types (transformers 5), else from the family's older pattern (true where
    a layer is local); each type's rotary base from _layer_thetas."""
    n_layers = len(sliding_by_pattern)
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if local else "full_attention" for local in sliding_by_pattern]
    if len(layer_types) != n_layers or not set(layer_types) <= set(defaults):
        raise CheckpointError(f"{config_path}: layer_types {layer_types} is not one of {'/'.join(defaults)} per layer")
    theta = _layer_thetas(raw, config_path, defaults, old_keys)
    return dict(rope_theta=theta["full_attention"], local_rope_theta=theta["sliding_attention"],
                sliding_layers=tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention"))


def _layer_thetas(raw: dict, config_path: Path, defaults: dict[str, float],
                  old_keys: dict[str, str]) -> dict[str, float]:
    """The rotary base of each layer type, from rope_parameters keyed by layer type (transformers 5) or the
    family's older keys; a scaled RoPE on either is refused by name."""
    params = raw.get("rope_parameters") or {}
    theta = {}
    for kind, default in defaults.items():
        kind_params = params.get(kind) or {}
        if (kind_params.get("rope_type") or "default") != "default" or raw.get("rope_scaling"):
            raise CheckpointError(f"{config_path}: a scaled RoPE on {kind} layers is not supported (default RoPE only)")
        theta[kind] = float(kind_params.get("rope_theta") or config_value(raw, old_keys[kind], default))
    return theta


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


def _pad_id(raw: dict) -> int:
    """A decoder's padding id: its pad_token_id, else its (first) EOS; the mask hides padding anyway."""
    pad = config_value(raw, "pad_token_id", config_value(raw, "eos_token_id", 0))
    return int(pad[0] if isinstance(pad, list) else pad)


def _distilbert_fields(raw: dict, model_type: str, config_path: Path) -> dict:
    """DistilBERT's own config keys; no token types, LayerNorm eps fixed at 1e-12 in its code."""
    return dict(
        vocab_size=raw["vocab_size"],
        d_model=raw["dim"],
        n_layers=raw["n_layers"],
        n_heads=raw["n_heads"],
        d_ff=raw["hidden_dim"],
        max_positions=raw["max_position_embeddings"],
        type_vocab_size=0,
        layer_norm_eps=1e-12,
        dropout=config_value(raw, "dropout", 0.1),
        attention_dropout=config_value(raw, "attention_dropout", 0.1),
        activation=_activation(raw, "activation", config_path),
        # the fixed table is added to unscaled token embeddings, as a learned one would be
        position_kind="sinusoidal" if raw.get("sinusoidal_pos_embds") else "learned",
        embedding_scale=1.0,
        pad_token_id=config_value(raw, "pad_token_id", 0),
    )


@dataclass(frozen=True)
class HeadLayout:
    """Where a family's *ForSequenceClassification keeps its head, and what the head computes
    (transformers' modeling_<family>.py): full checkpoint names of the two linear layers."""

    dense: str  # hidden -> hidden, before the activation
    out_proj: str  # hidden -> num_labels
    activation: str  # ClassifierConfig.activation
    input_dropout: bool  # dropout on the first token's encoding before dense, too
    dropout_keys: tuple[str, ...]  # config.json keys of the head's dropout rate, the first set one wins
    norm: str | None = None  # a norm after the activation (ModernBERT's prediction head)
    activation_key: str | None = None  # config.json's key for the activation, when the family has one
    pooling_key: str | None = None  # config.json's key for what the head reads ("cls" or "mean")
    dense_bias_key: str | None = None  # config.json's key for the dense layer's bias (default: it has one)

    def tensors(self, dense_bias: bool = True) -> tuple[str, ...]:
        """The tensors such a head has (a norm's bias, which the encoder's norm_bias decides, is checked on load)."""
        weights = tuple(f"{layer}weight" for layer in (self.dense, self.norm, self.out_proj) if layer)
        return (*weights, *((f"{self.dense}bias",) if dense_bias else ()), f"{self.out_proj}bias")

    def layers(self) -> tuple[tuple[str, str], ...]:
        """(checkpoint prefix, our prefix) of each of its layers."""
        ours = ((self.dense, "head.dense."), (self.norm, "head.norm."), (self.out_proj, "head.out_proj."))
        return tuple((source, target) for source, target in ours if source)


_CLASSIFIER_DROPOUT = ("classifier_dropout", "hidden_dropout_prob")
# BertForSequenceClassification: the pooler (dense + tanh on [CLS]), then dropout and `classifier`
_BERT_HEAD = HeadLayout("bert.pooler.dense.", "classifier.", "tanh", False, _CLASSIFIER_DROPOUT)
# RobertaClassificationHead, and its copies in XLM-RoBERTa and CamemBERT
_ROBERTA_HEAD = HeadLayout("classifier.dense.", "classifier.out_proj.", "tanh", True, _CLASSIFIER_DROPOUT)
_DISTILBERT_HEAD = HeadLayout("pre_classifier.", "classifier.", "relu", False, ("seq_classif_dropout",))
# ElectraClassificationHead calls get_activation("gelu"), whatever the config's hidden_act says
_ELECTRA_HEAD = HeadLayout("classifier.dense.", "classifier.out_proj.", "gelu", True, _CLASSIFIER_DROPOUT)
# ModernBertForSequenceClassification: pooled (classifier_pooling), then ModernBertPredictionHead
# (dense, classifier_activation, norm), dropout and `classifier`
# GteForSequenceClassification and NomicBertForSequenceClassification: BERT's (the tanh pooler, `classifier`)
_GTE_HEAD = HeadLayout("gte.pooler.dense.", "classifier.", "tanh", False, _CLASSIFIER_DROPOUT)
_NOMIC_HEAD = HeadLayout("nomic_bert.pooler.dense.", "classifier.", "tanh", False, _CLASSIFIER_DROPOUT)
_MODERNBERT_HEAD = HeadLayout("head.dense.", "classifier.", "gelu", False, ("classifier_dropout",), norm="head.norm.",
                              activation_key="classifier_activation", pooling_key="classifier_pooling",
                              dense_bias_key="classifier_bias")


@dataclass(frozen=True)
class Family:
    """One checkpoint family: its model_type(s), its weight names, and what it leaves out on purpose."""

    name: str
    model_types: tuple[str, ...]
    # the base model's attribute in task checkpoints ("roberta." in RobertaForMaskedLM); several where the
    # original layout differs ("new." in GTE's remote code)
    prefix: str | tuple[str, ...]
    renames: tuple[tuple[str, str | tuple[str, ...]], ...]
    ignored: dict[re.Pattern, str] = field(hash=False)
    head: HeadLayout | None  # its *ForSequenceClassification head (None: not loaded yet)
    # config.json (raw, model_type, its path) -> EncoderConfig's fields: the choices this family makes
    fields: Callable[[dict, str, Path], dict] = field(hash=False, default=lambda raw, model_type, path: {})


FAMILIES = (
    Family("BERT", ("bert",), "bert.", _BERT_RENAMES, _BERT_IGNORED, _BERT_HEAD, _bert_like_fields),
    Family("RoBERTa", ("roberta",), "roberta.", _BERT_RENAMES, _ROBERTA_IGNORED, _ROBERTA_HEAD, _bert_like_fields),
    Family("XLM-RoBERTa", ("xlm-roberta",), "roberta.", _BERT_RENAMES, _ROBERTA_IGNORED, _ROBERTA_HEAD, _bert_like_fields),
    Family("CamemBERT", ("camembert",), "roberta.", _BERT_RENAMES, _ROBERTA_IGNORED, _ROBERTA_HEAD, _bert_like_fields),
    Family("DistilBERT", ("distilbert",), "distilbert.", _DISTILBERT_RENAMES, _DISTILBERT_IGNORED, _DISTILBERT_HEAD, _distilbert_fields),
    Family("ELECTRA", ("electra",), "electra.", _ELECTRA_RENAMES, _ELECTRA_IGNORED, _ELECTRA_HEAD, _bert_like_fields),
    # MPNetClassificationHead is RoBERTa's: dense, tanh, out_proj on the first token, dropout before each
    Family("MPNet", ("mpnet",), "mpnet.", _MPNET_RENAMES, _ROBERTA_IGNORED, _ROBERTA_HEAD, _mpnet_fields),
    Family("ModernBERT", ("modernbert",), "model.", _MODERNBERT_RENAMES, _MODERNBERT_IGNORED, _MODERNBERT_HEAD,
           _modernbert_fields),
    # EmbeddingGemma: Gemma 3 with bidirectional attention, pooled by the mean, Dense modules after
    Family("Gemma3", ("gemma3_text",), "model.", _GEMMA3_RENAMES, _QWEN3_IGNORED, None, _gemma3_fields),
    Family("GTE", ("gte", "new"), ("gte.", "new."), _GTE_RENAMES, _ROTARY_BERT_IGNORED, _GTE_HEAD, _rotary_bert_fields),
    Family("NomicBert", ("nomic_bert",), ("nomic_bert.", "bert."), _NOMIC_RENAMES, _ROTARY_BERT_IGNORED, _NOMIC_HEAD,
           _rotary_bert_fields),
    # a decoder embedder (Qwen3-Embedding): pooled by its last token, the EOS its tokenizer appends
    Family("Qwen3", ("qwen3",), "model.", _QWEN3_RENAMES, _QWEN3_IGNORED, None, _qwen3_fields),
)
SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)
_ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")


def family_of(model_type: str | None, config_path: Path) -> Family:
    """The family of a model_type, or one CheckpointError that lists every family we load."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)
    raise CheckpointError(
        f"{config_path}: model_type {model_type!r} is not supported; the encoder loads these families "
        f"(model_type): {supported}"
    )


