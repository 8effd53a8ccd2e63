"""MPNet (model_type mpnet: all-mpnet-base-v2 and its kin), as transformers' modeling_mpnet.py names it:
BERT's config keys (bert.py) without token types, RoBERTa's positions and heads (roberta.py), and one
relative-position table added to every layer's scores.
"""

from __future__ import annotations

from pathlib import Path

from export.families.base import Family, MaskedLMLayout, config_value
from export.families.bert import _bert_like_fields
from export.families.roberta import _ROBERTA_HEAD, _ROBERTA_IGNORED

# BERT's embeddings without token types, attention under `attention.attn.{q,k,v,o}` with its LayerNorm
# one level up, and one relative-position table
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


# MPNetLMHead is RoBERTa's under its own base model's embeddings
_MPNET_MASKED_LM = MaskedLMLayout("lm_head.dense.", "lm_head.layer_norm.", "lm_head.decoder.",
                                  "mpnet.embeddings.word_embeddings.", "gelu", tied_bias="lm_head.bias")

ROWS = (
    # MPNetClassificationHead is RoBERTa's: dense, tanh, out_proj on the first token, dropout before each
    Family("MPNet", ("mpnet",), "mpnet.", _MPNET_RENAMES, _ROBERTA_IGNORED, _ROBERTA_HEAD, _mpnet_fields,
           masked_lm=_MPNET_MASKED_LM),
)
