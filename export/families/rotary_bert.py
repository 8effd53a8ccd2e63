"""GTE (model_types gte, and new: GTE's original remote code) and NomicBert (nomic_bert: nomic-embed-text,
arctic-embed-m-long): BERT with RoPE in place of the position table, post-norm and a gated MLP, one block
with one config mapping, as transformers 5's modeling_gte.py and modeling_nomic_bert.py name them.
"""

from __future__ import annotations

import re
from pathlib import Path

from export.errors import CheckpointError
from export.families.base import (_CLASSIFIER_DROPOUT, _FUSED_QKV, _INDEX_BUFFERS, Family, HeadLayout, _activation,
                                  _rope_theta, config_value)

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
_ROTARY_BERT_IGNORED = {
    re.compile(r"^pooler\."): "the tanh pooler; sentence embeddings come from the pooling config",
    re.compile(r"^(lm_head|cls)\."): "the masked-LM head, not part of the encoder",
    re.compile(r"(^|\.)rotary_emb\."): "RoPE's frequencies, rebuilt from the rotary base by the encoder",
    **_INDEX_BUFFERS,
}

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


# GteForSequenceClassification and NomicBertForSequenceClassification: BERT's (the tanh pooler, `classifier`)
_GTE_HEAD = HeadLayout("gte.pooler.dense.", "classifier.", "tanh", False, _CLASSIFIER_DROPOUT)
_NOMIC_HEAD = HeadLayout("nomic_bert.pooler.dense.", "classifier.", "tanh", False, _CLASSIFIER_DROPOUT)

ROWS = (
    Family("GTE", ("gte", "new"), ("gte.", "new."), _GTE_RENAMES, _ROTARY_BERT_IGNORED, _GTE_HEAD, _rotary_bert_fields),
    Family("NomicBert", ("nomic_bert",), ("nomic_bert.", "bert."), _NOMIC_RENAMES, _ROTARY_BERT_IGNORED, _NOMIC_HEAD,
           _rotary_bert_fields),
)
