"""Token-level heads: BGE-M3's sparse and multi-vector heads and a PyLate ColBERT's projection, read from the
layouts their libraries save, and the PyTorch reference of what they compute (the export's gates).

- BGE-M3 (FlagEmbedding's BGEM3FlagModel): a sentence-transformers directory (Transformer, Pooling cls,
  Normalize: the dense output, unchanged) with `colbert_linear.pt` and `sparse_linear.pt` beside it,
  torch state dicts of an nn.Linear (`weight`, `bias`) as FlagEmbedding's `save` writes them.
- ColBERT (PyLate's ColBERT.save): modules.json with a Transformer and PyLate's Dense (no Pooling);
  config_sentence_transformers.json carries the markers, lengths, query expansion and skiplist; the
  markers are tokens PyLate added to the saved tokenizer.

The numpy math the service applies is bundle/representations.py; the reference here is written with
torch ops on the PyTorch encoder's hidden states, so that a gate compares two separate computations.
"""

from __future__ import annotations

import json
import string
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from bundle.manifest import MultiVectorInfo, SparseInfo
from bundle.representations import Heads, colbert_cut, colbert_ids, kept_tokens
from export.config import EncoderConfig
from export.errors import CheckpointError

COLBERT_LINEAR, SPARSE_LINEAR = "colbert_linear.pt", "sparse_linear.pt"
# the type modules.json gives PyLate's Dense: its module path as sentence-transformers <= 5.3 writes it
# (`type(module).__module__`), and module + class as 5.4 and later write it
PYLATE_DENSE_TYPES = ("pylate.models.Dense", "pylate.models.Dense.Dense")
_TRANSFORMER_TYPES = ("sentence_transformers.models.Transformer", "sentence_transformers.base.modules.transformer.Transformer")
_IDENTITY = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")
# PyLate's ColBERT defaults where its config_sentence_transformers.json says nothing (pylate/models/colbert.py)
PYLATE_DEFAULTS = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 32, "document_length": 180,
                   "do_query_expansion": True, "attend_to_expansion_tokens": False,
                   "skiplist_words": list(string.punctuation)}


@dataclass(frozen=True)
class TokenHeads:
    """A checkpoint's sparse and multi-vector representations: what the manifest says and the heads' arrays."""

    dense: bool  # its pooled output is an embedding to serve (BGE-M3: yes; ColBERT: no)
    sparse: SparseInfo | None
    multivector: MultiVectorInfo | None
    heads: Heads

    @property
    def longest(self) -> int | None:
        """The longest ColBERT input in tokens, marker and expansion included (None: not a ColBERT)."""
        mv = self.multivector
        return max(mv.query_length, mv.document_length) if mv is not None and mv.kind == "colbert" else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def _token_name(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_token_ids(directory: Path, tokenizer: Tokenizer) -> dict[str, int | None]:
    """The ids of the tokenizer's cls, eos, pad, unk and mask tokens as transformers' tokenizer names them
    (tokenizer_config.json, else special_tokens_map.json); None where it has no such token."""
    found: dict[str, str | None] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = directory / name
        raw = _read_json(path) if path.is_file() else {}
        for role in ("cls", "eos", "pad", "unk", "mask"):
            if found.get(role) is None:
                found[role] = _token_name(raw.get(f"{role}_token"))
    return {role: (tokenizer.token_to_id(token) if token is not None else None) for role, token in found.items()}


# ---- BGE-M3 ---------------------------------------------------------------------------------------------------

def _linear_state(path: Path, hidden: int, rows: int | None) -> tuple[np.ndarray, np.ndarray]:
    """An nn.Linear's state dict saved with torch.save (weights_only: no pickled code runs)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot be read as a torch state dict ({exc})") from None
    if not isinstance(state, dict) or set(state) != {"weight", "bias"}:
        raise CheckpointError(f"{path}: expected an nn.Linear's state dict (weight, bias), got "
                              f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
    weight, bias = state["weight"], state["bias"]
    if weight.dim() != 2 or weight.shape[1] != hidden or (rows is not None and weight.shape[0] != rows) \
            or tuple(bias.shape) != (weight.shape[0],):
        raise CheckpointError(f"{path}: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} do not map the "
                              f"model's hidden size {hidden} to {rows or 'any'} output(s)")
    return weight.float().numpy(), bias.float().numpy()


def read_bge_m3(directory: Path, tokenizer_path: Path, config: EncoderConfig) -> TokenHeads | None:
    """BGE-M3's heads where `colbert_linear.pt` or `sparse_linear.pt` lies beside the checkpoint; else None.
    sparse: skip_ids are FlagEmbedding's BGEM3 `unused_tokens` (cls, eos, pad, unk); multi-vector: every
    token after the CLS, colbert_linear then L2-normalised (BGEM3's encode, normalize_embeddings)."""
    colbert, sparse = directory / COLBERT_LINEAR, directory / SPARSE_LINEAR
    if not colbert.is_file() and not sparse.is_file():
        return None
    sparse_info = multivector_info = None
    sparse_weight = sparse_bias = mv_weight = mv_bias = None
    if sparse.is_file():
        sparse_weight, sparse_bias = _linear_state(sparse, config.d_model, 1)
        ids = special_token_ids(directory, Tokenizer.from_file(str(tokenizer_path)))
        skip = sorted({ids[role] for role in ("cls", "eos", "pad", "unk") if ids[role] is not None})
        sparse_info = SparseInfo(kind="bge-m3", skip_ids=skip)
    if colbert.is_file():
        mv_weight, mv_bias = _linear_state(colbert, config.d_model, None)
        multivector_info = MultiVectorInfo(kind="bge-m3", dim=mv_weight.shape[0], skip_leading=1, normalize=True)
    return TokenHeads(True, sparse_info, multivector_info, Heads(sparse_weight, sparse_bias, mv_weight, mv_bias))


# ---- PyLate ColBERT -------------------------------------------------------------------------------------------

def pylate_dense(directory: Path, modules: list[dict]) -> Path | None:
    """The folder of a PyLate ColBERT's Dense module, where modules.json is a PyLate ColBERT's (PyLate's Dense and
    no Pooling); None for any other layout. A module beside the Transformer and the Dense is refused by name."""
    dense = [m for m in modules if m.get("type") in PYLATE_DENSE_TYPES]
    if not dense or any(str(m.get("type", "")).endswith("Pooling") for m in modules):
        return None  # a pooled embedder: its modules are judged as such (checkpoint._sentence_modules)
    others = [m.get("type") for m in modules if m.get("type") not in (*PYLATE_DENSE_TYPES, *_TRANSFORMER_TYPES)]
    if others or len(dense) != 1 or len(modules) != 2:
        raise CheckpointError(f"{directory / 'modules.json'}: a PyLate ColBERT is served as a Transformer and one "
                              f"pylate.models.Dense; this one has {[m.get('type') for m in modules]}")
    return directory / dense[0].get("path", "")


def _pylate_projection(folder: Path, hidden: int) -> tuple[np.ndarray, np.ndarray | None]:
    """PyLate's Dense: linear (no activation, no residual: the heads apply one linear map) to the token vectors."""
    from export.checkpoint import read_weights

    config_path = folder / "config.json"
    raw = _read_json(config_path) if config_path.is_file() else None
    if raw is None:
        raise CheckpointError(f"{config_path}: missing")
    if raw.get("activation_function", _IDENTITY[0]) not in _IDENTITY or raw.get("use_residual", False):
        raise CheckpointError(f"{config_path}: activation_function {raw.get('activation_function')!r} and use_residual "
                              f"{raw.get('use_residual', False)}: a ColBERT projection is served as one linear map "
                              "(Identity, no residual)")
    weights, weights_path = read_weights(folder)
    bias = bool(raw.get("bias", True))
    expected = {"linear.weight"} | ({"linear.bias"} if bias else set())
    if set(weights) != expected:
        raise CheckpointError(f"{weights_path}: tensors {sorted(weights)}, expected {sorted(expected)}")
    weight = weights["linear.weight"].float()
    if weight.dim() != 2 or weight.shape[1] != hidden or weight.shape[0] != raw.get("out_features", weight.shape[0]):
        raise CheckpointError(f"{weights_path}: linear.weight {tuple(weight.shape)} does not map the model's hidden "
                              f"size {hidden} to out_features {raw.get('out_features')}")
    return weight.numpy(), (weights["linear.bias"].float().numpy() if bias else None)


def read_pylate(directory: Path, dense_folder: Path, tokenizer_path: Path, config: EncoderConfig) -> TokenHeads:
    """A PyLate ColBERT's multi-vector representation, every value read as PyLate reads it (its saved
    config_sentence_transformers.json, else PyLate's defaults) and every token resolved by the saved tokenizer
    as PyLate's `convert_tokens_to_ids` does (an unknown word: the unk id)."""
    st_path = directory / "config_sentence_transformers.json"
    saved = _read_json(st_path) if st_path.is_file() else {}
    value = {key: saved[key] if saved.get(key) is not None else default for key, default in PYLATE_DEFAULTS.items()}
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    special = special_token_ids(directory, tokenizer)

    def token_id(token: str) -> int:
        found = tokenizer.token_to_id(token)
        if found is None and special["unk"] is None:
            raise CheckpointError(f"{tokenizer_path}: {token!r} ({st_path.name}) is not a token and the tokenizer has "
                                  "no unknown token to stand for it")
        return special["unk"] if found is None else found

    def marker(key: str) -> int | None:
        token = value[key]
        if token == "":
            return None
        if tokenizer.token_to_id(token) is None:
            raise CheckpointError(f"{tokenizer_path}: the {key} {token!r} is not a token of the saved tokenizer "
                                  "(PyLate adds it when it builds the model; save the model with PyLate)")
        return tokenizer.token_to_id(token)

    # PyLate pads queries with the mask token, else the eos token, else the pad token (ColBERT.__init__)
    expansion = next((special[r] for r in ("mask", "eos", "pad") if special[r] is not None), None)
    expand = bool(value["do_query_expansion"])
    if expand and expansion is None:
        raise CheckpointError(f"{tokenizer_path}: query expansion needs a mask, eos or pad token; the tokenizer has none")
    for key in ("query_length", "document_length"):
        if not isinstance(value[key], int) or not 1 < value[key] <= config.max_sequence_length:
            raise CheckpointError(f"{st_path}: {key} {value[key]!r} is not a length from 2 to the "
                                  f"{config.max_sequence_length} tokens the model's positions cover")
    attend = bool(value["attend_to_expansion_tokens"]) and expand  # PyLate: no expansion, nothing to attend
    if expand and not attend and config.position_offset:
        raise CheckpointError(
            f"{st_path}: query expansion with attend_to_expansion_tokens false on a model whose positions count the "
            f"attention mask (position_offset {config.position_offset}: RoBERTa, XLM-R, CamemBERT, MPNet) is not "
            "supported: transformers counts the expansion tokens' positions by their ids, the exported graph by the "
            "attention mask, so their vectors would differ from PyLate's")
    if not isinstance(value["skiplist_words"], list) or not all(isinstance(w, str) for w in value["skiplist_words"]):
        raise CheckpointError(f"{st_path}: skiplist_words must be a list of strings")
    weight, bias = _pylate_projection(dense_folder, config.d_model)
    info = MultiVectorInfo(
        kind="colbert", dim=weight.shape[0], normalize=True, query_prefix_id=marker("query_prefix"),
        document_prefix_id=marker("document_prefix"), query_length=value["query_length"],
        document_length=value["document_length"], do_query_expansion=expand,
        expansion_token_id=expansion if expand else None, attend_to_expansion_tokens=attend,
        skip_ids=sorted({token_id(word) for word in value["skiplist_words"]}),
    )
    return TokenHeads(False, None, info, Heads(multivector_weight=weight, multivector_bias=bias))


# ---- rows of token ids, as the service makes them ---------------------------------------------------------------

@dataclass(frozen=True)
class TokenRow:
    """One text's token ids as the graph gets them, how many lead attended, and whether it is a query."""

    ids: np.ndarray
    attended: int
    is_query: bool


def token_rows(tokenizer: Tokenizer, texts: list[str], info: MultiVectorInfo | None, is_query: bool,
               max_tokens: int) -> list[TokenRow]:
    """Each text tokenized (special tokens included) and, for a ColBERT, cut, marked and expanded as PyLate's
    ColBERT.tokenize does (bundle.representations.colbert_ids)."""
    tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: settings made here must not leak
    tokenizer.no_padding()
    colbert = info is not None and info.kind == "colbert"
    tokenizer.enable_truncation((colbert_cut(info, is_query) if colbert else None) or max_tokens)
    rows = []
    for encoding in tokenizer.encode_batch(list(texts)):
        ids = np.asarray(encoding.ids, dtype=np.int64)
        if colbert:
            ids, attended = colbert_ids(ids, info, is_query)
        else:
            attended = len(ids)
        rows.append(TokenRow(ids, attended, is_query))
    return rows


def pad_rows(rows: list[TokenRow], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """input_ids, attention_mask (1 on each row's attended tokens) and token_type_ids, right-padded."""
    width = max(len(r.ids) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row.ids)] = row.ids
        mask[i, :row.attended] = 1
    return ids, mask, np.zeros_like(ids)


# ---- the PyTorch reference ------------------------------------------------------------------------------------

def reference_vectors(hidden: torch.Tensor, row: TokenRow, heads: Heads, info: MultiVectorInfo) -> torch.Tensor:
    """One text's token vectors from its hidden states (tokens, d) with torch ops: the kept tokens through
    the projection (nn.functional.linear), L2-normalised (BGEM3's colbert_linear, PyLate's Dense + normalize)."""
    keep = torch.from_numpy(kept_tokens(row.ids, info, row.is_query))
    weight = torch.from_numpy(heads.multivector_weight)
    bias = torch.from_numpy(heads.multivector_bias) if heads.multivector_bias is not None else None
    vectors = F.linear(hidden[:len(row.ids)][keep], weight, bias)
    return F.normalize(vectors, p=2.0, dim=-1) if info.normalize else vectors


def reference_sparse(hidden: torch.Tensor, row: TokenRow, heads: Heads, info: SparseInfo, vocab: int) -> torch.Tensor:
    """One text's BGE-M3 lexical weights as a (vocab,) vector with torch ops: relu(sparse_linear) per token,
    the largest per token id, its skip ids zero (BGEM3's sparse_embedding and _process_token_weights)."""
    ids = torch.from_numpy(row.ids)
    weights = torch.relu(F.linear(hidden[:len(row.ids)], torch.from_numpy(heads.sparse_weight),
                                  torch.from_numpy(heads.sparse_bias)))[:, 0]
    vector = torch.zeros(vocab, dtype=weights.dtype).scatter_reduce(0, ids, weights, reduce="amax", include_self=True)
    vector[torch.tensor(info.skip_ids, dtype=torch.long)] = 0.0
    return vector


def sparse_vector(indices: np.ndarray, values: np.ndarray, vocab: int) -> np.ndarray:
    """(indices, values) as a dense (vocab,) vector."""
    vector = np.zeros(vocab, dtype=np.float64)
    vector[indices] = values
    return vector
