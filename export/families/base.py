"""What every family module is made of: the `Family` row and its `HeadLayout`, and the helpers several
families share (config_value, activations, RoPE bases, local/global layers, a decoder's padding id).
Names with an underscore are shared inside export/families/ only; export/families/__init__.py is the API.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from export.errors import CheckpointError

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu"}

# a fused query/key/value projection (ModernBERT's Wqkv, GTE's qkv_proj, nomic's Wqkv): three equal parts
_FUSED_QKV = (r"layers.\1.attention.w_q.", r"layers.\1.attention.w_k.", r"layers.\1.attention.w_v.")

# Checkpoint tensors each family knows and deliberately does not use, with the reason (patterns
# match names after the family's prefix is removed; the export lists every tensor so skipped).
_INDEX_BUFFERS = {
    re.compile(r"^embeddings\.(position_ids|token_type_ids)$"): "a constant index buffer, rebuilt by the encoder",
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


def _rope_theta(raw: dict, config_path: Path, default: float = 10000.0) -> float:
    """The rotary base, from rope_parameters (transformers 5) or rope_theta (older configs); a scaled
    RoPE (YaRN, linear, dynamic, NTK) is refused by name rather than computed wrong."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind != "default":
        raise CheckpointError(f"{config_path}: rope_type {kind!r} is not supported (default RoPE only)")
    return float(params.get("rope_theta") or config_value(raw, "rope_theta", default))


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


def _pad_id(raw: dict) -> int:
    """A decoder's padding id: its pad_token_id, else its (first) EOS; the mask hides padding anyway."""
    pad = config_value(raw, "pad_token_id", config_value(raw, "eos_token_id", 0))
    return int(pad[0] if isinstance(pad, list) else pad)


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


@dataclass(frozen=True)
class MaskedLMLayout:
    """Where a family's *ForMaskedLM keeps its masked-LM head and what the head computes (transformers'
    modeling_<family>.py): logits = decoder(norm(activation(dense(h)))) per token, the decoder's weight
    the word embeddings while config.json's tie_word_embeddings (default true) says so. Full checkpoint
    names, each a prefix of a layer's tensors. A SPLADE model's vocabulary vector is these logits pooled."""

    dense: str  # hidden -> hidden, before the activation
    norm: str  # LayerNorm after the activation
    decoder: str  # hidden -> vocab_size
    embeddings: str  # the word embeddings the decoder's weight is tied to
    activation: str  # the activation when no config key names it (RoBERTa's is always exact GELU)
    activation_key: str | None = None  # config.json's key for the activation (BERT: hidden_act)
    # BERT's and RoBERTa's decoder bias is tied to a bias of the head's own (cls.predictions.bias, lm_head.bias)
    # while the embeddings are tied; untied, the decoder's own bias is read and that one is unused
    tied_bias: str | None = None
    dense_bias_key: str | None = None  # config.json's key for the dense layer's bias (default: it has one)
    decoder_bias_key: str | None = None  # config.json's key for the decoder's bias (default: it has one)

    def activation_of(self, raw: dict, config_path: Path) -> str:
        """The head's activation (export.config.Activation): config.json's, where the family reads one."""
        return _activation(raw, self.activation_key, config_path) if self.activation_key else self.activation

    def layers(self) -> tuple[tuple[str, str], ...]:
        """(checkpoint prefix, our prefix) of each of its tensors; the tied bias lands on `mlm_head.tied_bias`,
        which the loader moves onto the decoder or leaves out (export/checkpoint.py _tie_masked_lm)."""
        ours = ((self.dense, "mlm_head.dense."), (self.norm, "mlm_head.norm."), (self.decoder, "mlm_head.decoder."),
                (self.tied_bias, "mlm_head.tied_bias"))
        return tuple((source, target) for source, target in ours if source)


@dataclass(frozen=True)
class Family:
    """One checkpoint family: its model_type(s), its weight names, and what it leaves out on purpose."""

    name: str
    model_types: tuple[str, ...]
    # the base model's attribute in task checkpoints ("roberta." in RobertaForMaskedLM); several where the
    # original layout differs ("new." in GTE's remote code)
    prefix: str | tuple[str, ...]
    # checkpoint names (after the prefix) -> ours. Anything that matches no rename of its family and is not
    # ignored is an error naming the tensor. A tuple of replacements is a fused projection: the tensor is cut
    # into that many equal parts along its output rows (weights and biases alike), in order, as
    # transformers' own code splits it.
    renames: tuple[tuple[str, str | tuple[str, ...]], ...]
    ignored: dict[re.Pattern, str] = field(hash=False)
    head: HeadLayout | None  # its *ForSequenceClassification head (None: not loaded yet)
    # config.json (raw, model_type, its path) -> EncoderConfig's fields: the choices this family makes
    fields: Callable[[dict, str, Path], dict] = field(hash=False, default=lambda raw, model_type, path: {})
    masked_lm: MaskedLMLayout | None = None  # its *ForMaskedLM head, for SPLADE (None: SPLADE refused)
