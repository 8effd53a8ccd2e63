"""DistilBERT (model_type distilbert, learned or sinusoidal positions): its own weight and config names,
as transformers' modeling_distilbert.py writes them; no token types, no pooler.
"""

from __future__ import annotations

import re
from pathlib import Path

from export.families.base import _INDEX_BUFFERS, Family, HeadLayout, MaskedLMLayout, _activation, config_value

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
_DISTILBERT_IGNORED = {
    re.compile(r"^vocab_(transform|layer_norm|projector)\."): "the masked-LM head, not part of the encoder",
    **_INDEX_BUFFERS,
}


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


_DISTILBERT_HEAD = HeadLayout("pre_classifier.", "classifier.", "relu", False, ("seq_classif_dropout",))

# DistilBertForMaskedLM: vocab_transform, `activation`, vocab_layer_norm, vocab_projector (its own bias)
_DISTILBERT_MASKED_LM = MaskedLMLayout("vocab_transform.", "vocab_layer_norm.", "vocab_projector.",
                                       "distilbert.embeddings.word_embeddings.", "gelu", activation_key="activation")

ROWS = (
    Family("DistilBERT", ("distilbert",), "distilbert.", _DISTILBERT_RENAMES, _DISTILBERT_IGNORED, _DISTILBERT_HEAD,
           _distilbert_fields, masked_lm=_DISTILBERT_MASKED_LM),
)
