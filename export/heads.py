"""The heads on our encoder: transformers' *ForSequenceClassification heads, and the *ForMaskedLM head a
SPLADE model pools (MaskedLMHead, SpladeEncoder, at the end).

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

from bundle.manifest import SPLADE_POOLINGS
from export.config import ClassifierConfig, EncoderConfig, MaskedLMConfig
from export.encoder import Encoder, make_norm

HEAD_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}
# a masked-LM head's activation: the encoder's kinds (export.config.Activation), as FeedForward maps them
FEED_FORWARD_ACTIVATIONS = {"gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU,
                            "silu": nn.SiLU}


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


class MaskedLMHead(nn.Module):
    """A *ForMaskedLM head, as each family's transformers code computes it: (B, T, d_model) encodings ->
    (B, T, vocab_size) logits, decoder(norm(activation(dense(h)))). BERT calls it cls.predictions, RoBERTa and
    XLM-R lm_head (always exact GELU), DistilBERT vocab_transform/vocab_layer_norm/vocab_projector, ModernBERT
    head + decoder; export/families/ names each family's tensors (MaskedLMLayout)."""

    def __init__(self, config: EncoderConfig, head: MaskedLMConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model, bias=head.dense_bias)
        self.activation = FEED_FORWARD_ACTIVATIONS[head.activation]()
        self.norm = make_norm(config, config.d_model)
        self.decoder = nn.Linear(config.d_model, config.vocab_size, bias=head.decoder_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.activation(self.dense(hidden))))


def splade_pool(logits: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """(B, T, vocab) logits -> (B, vocab): log(1 + relu(logit)) per token, padding zeroed, then the max or the sum
    over tokens (sentence-transformers' SpladePooling, activation relu). For max, log1p and relu are monotonic,
    so they are applied once to the maximum (B, vocab) rather than to every token's logits (B, T, vocab): the
    same values, one (B, T, vocab) pass less."""
    masked = logits * mask.unsqueeze(-1).to(logits.dtype)  # padding's logits -> 0, as SpladePooling does
    if how == "splade_max":
        return torch.log1p(torch.relu(masked.max(dim=1).values))
    if how == "splade_sum":
        return torch.log1p(torch.relu(masked)).sum(dim=1)
    raise ValueError(f"unknown SPLADE pooling {how!r}: expected one of {', '.join(SPLADE_POOLINGS)}")


class SpladeEncoder(Encoder):
    """The encoder with its family's masked-LM head: the pooled output is a SPLADE vector, one weight per
    vocabulary entry, (B, vocab_size), where an embedding model returns its sentence embedding (the contract's
    `sentence_embedding`; the manifest says pooling splade_max or splade_sum, dense false).

    Cost: the head's logits are a (batch, seq, vocab_size) float32 intermediate, 4 * B * T * V bytes (BERT's
    30,522 entries: 125 KB per token, 1 GB for 32 texts of 256 tokens), and its decoder a d_model x vocab
    matrix product per token (23 M multiply-adds at d_model 768, about a quarter of a base encoder's). Only a
    SPLADE model's graphs contain it: every other Encoder pools its encodings directly.
    """

    def __init__(self, config: EncoderConfig, head: MaskedLMConfig) -> None:
        if config.pooling not in SPLADE_POOLINGS or config.normalize or config.dense:
            raise ValueError(f"a SPLADE model pools by {' or '.join(SPLADE_POOLINGS)} with no Dense layers and no "
                             "normalisation")
        super().__init__(config)
        self.head_config = head
        self.mlm_head = MaskedLMHead(config, head)
        if head.tied:  # one tensor, so the graphs hold the vocabulary matrix once
            self.mlm_head.decoder.weight = self.embeddings.token.weight

    def pooled(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return splade_pool(self.mlm_head(x), attention_mask, self.config.pooling)

    def packed(self, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError("SPLADE pooling is a max or sum over tokens, which packed rows' pooling "
                                  "weights cannot say (bundle.contract.PACKED_POOLINGS)")
