"""ELECTRA (model_type electra: the discriminator, ElectraModel and ElectraForSequenceClassification):
BERT's names and config keys (bert.py; embedding_size is read there) plus the projection of smaller
embeddings up to the hidden size, as transformers' modeling_electra.py has it.
"""

from __future__ import annotations

import re

from export.families.base import _CLASSIFIER_DROPOUT, _INDEX_BUFFERS, Family, HeadLayout
from export.families.bert import _BERT_RENAMES, _bert_like_fields

_ELECTRA_RENAMES = (*_BERT_RENAMES, (r"^embeddings_project\.", "embeddings.project."))
_ELECTRA_IGNORED = {
    re.compile(r"^discriminator_predictions\."): "the discriminator's replaced-token head, not part of the encoder",
    re.compile(r"^generator_(predictions|lm_head)\."): "a generator's masked-LM head, not part of the encoder",
    **_INDEX_BUFFERS,
}
# ElectraClassificationHead calls get_activation("gelu"), whatever the config's hidden_act says
_ELECTRA_HEAD = HeadLayout("classifier.dense.", "classifier.out_proj.", "gelu", True, _CLASSIFIER_DROPOUT)

ROWS = (
    Family("ELECTRA", ("electra",), "electra.", _ELECTRA_RENAMES, _ELECTRA_IGNORED, _ELECTRA_HEAD, _bert_like_fields),
)
