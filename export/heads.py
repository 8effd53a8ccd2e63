"""Sequence classification on our encoder: transformers' *ForSequenceClassification heads.

Every family we load classifies the same way: the first token's final encoding ([CLS], or <s>)
through a hidden-to-hidden dense layer and an activation, then a linear map to one logit per
label. BERT calls the first half its pooler (tanh), RoBERTa, XLM-R and CamemBERT call it
classifier.dense (tanh), DistilBERT pre_classifier (ReLU), ELECTRA classifier.dense (exact GELU).
ModernBERT's prediction head adds a norm after its activation and may pool by the mean instead.
The loader (export/checkpoint.py) maps each family's names onto `head.dense`, `head.norm` and
`head.out_proj`.
"""

from __future__ import annotations

import torch
from torch import nn

from export.config import ClassifierConfig, EncoderConfig
from export.encoder import Encoder, make_norm

HEAD_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


class ClassificationHead(nn.Module):
    """(B, d_model) pooled encodings (the first token's, or their mean) -> (B, num_labels) logits."""

    def __init__(self, config: EncoderConfig, head: ClassifierConfig) -> None:
        super().__init__()
        d_model = config.d_model
        self.dense = nn.Linear(d_model, d_model, bias=head.dense_bias)
        self.activation = HEAD_ACTIVATIONS[head.activation]()
        self.norm = make_norm(config, d_model) if head.norm else nn.Identity()
        self.out_proj = nn.Linear(d_model, head.num_labels)
        self.dropout = nn.Dropout(head.dropout)
        self.input_dropout = head.input_dropout

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        x = self.dropout(first) if self.input_dropout else first
        x = self.norm(self.activation(self.dense(x)))
        return self.out_proj(self.dropout(x))


class SequenceClassifier(Encoder):
    """The encoder with a classification head in place of the sentence embedding.

    forward(input_ids, attention_mask, token_type_ids) returns
    (last_hidden_state (B, T, d), logits (B, num_labels), attentions (layers, B, heads, T, T)):
    the embedding graph's contract with logits as the second output, so the exporter, the parity
    gate and the optimizer treat both alike. The encoder pools by "cls" (or "mean", as ModernBERT's
    classifier_pooling may say) with nothing after it, which is exactly what the head reads.
    """

    task = "classification"

    def __init__(self, config: EncoderConfig, head: ClassifierConfig) -> None:
        if config.pooling not in ("cls", "mean") or config.normalize or config.dense:
            raise ValueError("a classifier reads the first token or the mean: pooling 'cls' or 'mean', no "
                             "normalisation, no Dense layers")
        super().__init__(config)
        self.head_config = head
        self.head = ClassificationHead(config, head)

    def finish(self, pooled: torch.Tensor) -> torch.Tensor:
        """The pooled encoding -> logits, in forward() and packed() alike (the encoder's
        finish step: a classifier has no Dense layers and no normalisation)."""
        return self.head(pooled)
