"""ModernBERT (model_type modernbert: ModernBertModel, ModernBertForMaskedLM and its classifier), as
transformers' modeling_modernbert.py names it, in the layout transformers 5 saves and the original one.
"""

from __future__ import annotations

import re
from pathlib import Path

from export.errors import CheckpointError
from export.families.base import (_FUSED_QKV, Family, HeadLayout, MaskedLMLayout, _activation, _local_attention,
                                  _positive_int, config_value)

# pre-norm, fused Wqkv, GeGLU in one Wi (input, then gate), no position table; ModernBertForMaskedLM and
# the classifier keep it under `model.`
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
_MODERNBERT_IGNORED = {
    re.compile(r"^head\."): "the masked-LM prediction head, not part of the encoder",
    re.compile(r"^decoder\."): "the masked-LM decoder, not part of the encoder",
}

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


# ModernBertForSequenceClassification: pooled (classifier_pooling), then ModernBertPredictionHead
# (dense, classifier_activation, norm), dropout and `classifier`
_MODERNBERT_HEAD = HeadLayout("head.dense.", "classifier.", "gelu", False, ("classifier_dropout",), norm="head.norm.",
                              activation_key="classifier_activation", pooling_key="classifier_pooling",
                              dense_bias_key="classifier_bias")

# ModernBertForMaskedLM: ModernBertPredictionHead (dense without a bias unless classifier_bias,
# classifier_activation, norm), then the decoder (a bias unless decoder_bias is false)
_MODERNBERT_MASKED_LM = MaskedLMLayout("head.dense.", "head.norm.", "decoder.", "model.embeddings.tok_embeddings.",
                                       "gelu", activation_key="classifier_activation", dense_bias_key="classifier_bias",
                                       decoder_bias_key="decoder_bias")

ROWS = (
    Family("ModernBERT", ("modernbert",), "model.", _MODERNBERT_RENAMES, _MODERNBERT_IGNORED, _MODERNBERT_HEAD,
           _modernbert_fields, masked_lm=_MODERNBERT_MASKED_LM),
)
