"""BERT (model_type bert: BertModel, BertForMaskedLM, BertForSequenceClassification, and the many
sentence-transformers models built on it), as transformers' modeling_bert.py names it. Its renames and
config keys are the block RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA and MPNet build on.
"""

from __future__ import annotations

import re
from pathlib import Path

from export.errors import CheckpointError
from export.families.base import (_CLASSIFIER_DROPOUT, _INDEX_BUFFERS, Family, HeadLayout, MaskedLMLayout, _activation,
                                  config_value)

# BERT's parameter names -> ours; RoBERTa, XLM-RoBERTa, CamemBERT and ELECTRA share them.
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
_BERT_IGNORED = {
    re.compile(r"^pooler\."): "BERT's tanh pooler; sentence embeddings come from the pooling config",
    re.compile(r"^cls\."): "pre-training heads (masked LM / next sentence), not part of the encoder",
    **_INDEX_BUFFERS,
}
# the model_types of roberta.py's rows, whose positions _bert_like_fields counts as fairseq does
_ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")


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


# BertForSequenceClassification: the pooler (dense + tanh on [CLS]), then dropout and `classifier`
_BERT_HEAD = HeadLayout("bert.pooler.dense.", "classifier.", "tanh", False, _CLASSIFIER_DROPOUT)

# BertForMaskedLM: cls.predictions.transform (dense, hidden_act, LayerNorm), then the decoder
_BERT_MASKED_LM = MaskedLMLayout("cls.predictions.transform.dense.", "cls.predictions.transform.LayerNorm.",
                                 "cls.predictions.decoder.", "bert.embeddings.word_embeddings.", "gelu",
                                 activation_key="hidden_act", tied_bias="cls.predictions.bias")

ROWS = (
    Family("BERT", ("bert",), "bert.", _BERT_RENAMES, _BERT_IGNORED, _BERT_HEAD, _bert_like_fields,
           masked_lm=_BERT_MASKED_LM),
)
