"""RoBERTa, XLM-RoBERTa and CamemBERT (model_types roberta, xlm-roberta, camembert): BERT's weight names
and config keys (bert.py), positions counted from padding_idx + 1 as fairseq does, and their own
masked-LM head and classification head (transformers' modeling_roberta.py and its copies).
"""

from __future__ import annotations

import re

from export.families.base import _CLASSIFIER_DROPOUT, _INDEX_BUFFERS, Family, HeadLayout, MaskedLMLayout
from export.families.bert import _BERT_RENAMES, _bert_like_fields

_ROBERTA_IGNORED = {
    re.compile(r"^pooler\."): "the tanh pooler; sentence embeddings come from the pooling config",
    re.compile(r"^lm_head\."): "the masked-LM head, not part of the encoder",
    **_INDEX_BUFFERS,
}
# RobertaClassificationHead, and its copies in XLM-RoBERTa and CamemBERT
_ROBERTA_HEAD = HeadLayout("classifier.dense.", "classifier.out_proj.", "tanh", True, _CLASSIFIER_DROPOUT)

# RobertaLMHead (and its copies): dense, exact GELU whatever hidden_act says, layer_norm, decoder
_ROBERTA_MASKED_LM = MaskedLMLayout("lm_head.dense.", "lm_head.layer_norm.", "lm_head.decoder.",
                                    "roberta.embeddings.word_embeddings.", "gelu", tied_bias="lm_head.bias")

ROWS = (
    Family("RoBERTa", ("roberta",), "roberta.", _BERT_RENAMES, _ROBERTA_IGNORED, _ROBERTA_HEAD, _bert_like_fields,
           masked_lm=_ROBERTA_MASKED_LM),
    Family("XLM-RoBERTa", ("xlm-roberta",), "roberta.", _BERT_RENAMES, _ROBERTA_IGNORED, _ROBERTA_HEAD, _bert_like_fields,
           masked_lm=_ROBERTA_MASKED_LM),
    Family("CamemBERT", ("camembert",), "roberta.", _BERT_RENAMES, _ROBERTA_IGNORED, _ROBERTA_HEAD, _bert_like_fields,
           masked_lm=_ROBERTA_MASKED_LM),
)
