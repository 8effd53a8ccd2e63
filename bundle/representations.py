"""Sparse and multi-vector representations from a graph's outputs: the math written once, in numpy.

The service applies it to what a runtime returned (any precision, any runtime), and the export's gates
apply it to onnxruntime's outputs before they compare them with PyTorch. A model's manifest says which
representations it has (bundle/manifest.py: SparseInfo, MultiVectorInfo); the token-level heads'
weights are in the bundle's HEADS_FILE:

- `sparse.weight` (1, hidden) and `sparse.bias` (1,): BGE-M3's sparse_linear;
- `multivector.weight` (dim, hidden) and, where it has one, `multivector.bias` (dim,): BGE-M3's
  colbert_linear, or a PyLate ColBERT's Dense projection.

What each function computes is what the reference library computes (named in each docstring); the
tests hold them against the libraries themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bundle.manifest import MultiVectorInfo, SparseInfo

SPARSE_WEIGHT, SPARSE_BIAS = "sparse.weight", "sparse.bias"
MULTIVECTOR_WEIGHT, MULTIVECTOR_BIAS = "multivector.weight", "multivector.bias"
HEAD_ARRAYS = (SPARSE_WEIGHT, SPARSE_BIAS, MULTIVECTOR_WEIGHT, MULTIVECTOR_BIAS)


class HeadsError(ValueError):
    """A heads file that does not fit its manifest."""


@dataclass(frozen=True)
class Heads:
    """The token-level heads a model's sparse and multi-vector outputs apply to last_hidden_state."""

    sparse_weight: np.ndarray | None = None  # (1, hidden)
    sparse_bias: np.ndarray | None = None  # (1,)
    multivector_weight: np.ndarray | None = None  # (dim, hidden)
    multivector_bias: np.ndarray | None = None  # (dim,)

    def save(self, path: Path) -> None:
        """Write the heads as an .npz of float32 arrays (no pickles)."""
        arrays = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in self.arrays().items()}
        with path.open("wb") as fh:
            np.savez(fh, **arrays)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: value for name, value in zip(HEAD_ARRAYS, (self.sparse_weight, self.sparse_bias,
                                                                  self.multivector_weight, self.multivector_bias),
                                                   strict=True) if value is not None}


def load_heads(path: Path, hidden: int, sparse: SparseInfo | None, multivector: MultiVectorInfo | None) -> Heads:
    """Read a heads file and check every array's shape against the manifest: a head that does not fit is
    refused when the bundle loads, never met by a request."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: np.asarray(data[name], dtype=np.float32) for name in data.files}
    except (OSError, ValueError) as exc:
        raise HeadsError(f"{path}: not a heads file ({exc})") from None
    unknown = sorted(set(arrays) - set(HEAD_ARRAYS))
    if unknown:
        raise HeadsError(f"{path}: unknown arrays {unknown} (known: {', '.join(HEAD_ARRAYS)})")
    expected: dict[str, tuple[int, ...]] = {}
    if sparse is not None and sparse.kind == "bge-m3":
        expected |= {SPARSE_WEIGHT: (1, hidden), SPARSE_BIAS: (1,)}
    if multivector is not None:
        expected[MULTIVECTOR_WEIGHT] = (multivector.dim, hidden)
        if MULTIVECTOR_BIAS in arrays:
            expected[MULTIVECTOR_BIAS] = (multivector.dim,)
    for name, shape in expected.items():
        if name not in arrays:
            raise HeadsError(f"{path}: {name} is missing")
        if arrays[name].shape != shape:
            raise HeadsError(f"{path}: {name} has shape {arrays[name].shape}, the manifest says {shape}")
    if extra := sorted(set(arrays) - set(expected)):
        raise HeadsError(f"{path}: arrays {extra} belong to no representation of the manifest")
    return Heads(arrays.get(SPARSE_WEIGHT), arrays.get(SPARSE_BIAS), arrays.get(MULTIVECTOR_WEIGHT),
                 arrays.get(MULTIVECTOR_BIAS))


# ---- sparse -------------------------------------------------------------------------------------------------

def splade_terms(vector: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A SPLADE model's pooled vocabulary vector as (indices, values): its non-zero entries in index order
    (SparseEncoder.encode's sparse tensor, coalesced)."""
    indices = np.flatnonzero(vector).astype(np.int64)
    return indices, np.asarray(vector[indices], dtype=np.float32)


def bge_m3_terms(encodings: np.ndarray, ids: np.ndarray, heads: Heads, skip_ids: list[int]) -> tuple[np.ndarray,
                                                                                                   np.ndarray]:
    """BGE-M3's lexical weights: relu(sparse_linear) per token, the largest per token id, its special tokens
    and zero weights left out (FlagEmbedding's BGEM3 `_process_token_weights`), in index order.
    `encodings` (tokens, hidden) and `ids` (tokens,) are one text's real tokens."""
    weights = np.maximum(encodings.astype(np.float32) @ heads.sparse_weight[0] + heads.sparse_bias[0], 0.0)
    keep = (weights > 0) & ~np.isin(ids, np.asarray(skip_ids, dtype=np.int64))
    if not keep.any():
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    unique, inverse = np.unique(ids[keep], return_inverse=True)
    best = np.zeros(len(unique), dtype=np.float32)
    np.maximum.at(best, inverse, weights[keep])
    return unique.astype(np.int64), best


def top_terms(indices: np.ndarray, values: np.ndarray, k: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The `k` largest weights (all when k is None), still in index order; ties broken by the lower index."""
    if k is None or k >= len(values):
        return indices, values
    chosen = np.sort(np.argsort(-values, kind="stable")[:k])
    return indices[chosen], values[chosen]


def sparse_dot(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """The dot product of two sparse vectors given as (indices, values) in index order (FlagEmbedding's
    lexical matching score: the sum over shared terms of the product of their weights)."""
    shared, ia, ib = np.intersect1d(a[0], b[0], assume_unique=True, return_indices=True)
    return float(np.dot(a[1][ia].astype(np.float64), b[1][ib].astype(np.float64))) if len(shared) else 0.0


# ---- multi-vector -------------------------------------------------------------------------------------------

def colbert_ids(ids: np.ndarray, info: MultiVectorInfo, is_query: bool) -> tuple[np.ndarray, int]:
    """A ColBERT text's token ids as PyLate's ColBERT.tokenize makes them from the tokenizer's ids (special
    tokens included, already cut to query_length - 1 or document_length - 1 where the marker is used): the
    marker put after the first token, a query padded with expansion tokens to query_length. Returns the ids
    and how many leading tokens are attended to (the rest: expansion tokens, computed but not attended)."""
    prefix = info.query_prefix_id if is_query else info.document_prefix_id
    out = ids if prefix is None else np.concatenate([ids[:1], np.array([prefix], dtype=ids.dtype), ids[1:]])
    attended = len(out)
    if is_query and info.do_query_expansion and info.query_length and len(out) < info.query_length:
        pad = np.full(info.query_length - len(out), info.expansion_token_id, dtype=ids.dtype)
        out = np.concatenate([out, pad])
        if info.attend_to_expansion_tokens:
            attended = len(out)
    return out, attended


def colbert_cut(info: MultiVectorInfo, is_query: bool) -> int | None:
    """The most tokens the tokenizer may give a ColBERT text before its marker goes in (PyLate sets the
    transformer's max_seq_length to the length less one where a marker is used)."""
    length = info.query_length if is_query else info.document_length
    if length is None:
        return None
    prefix = info.query_prefix_id if is_query else info.document_prefix_id
    return length - 1 if prefix is not None else length


def kept_tokens(ids: np.ndarray, info: MultiVectorInfo, is_query: bool) -> np.ndarray:
    """Which of a text's tokens give a vector: bge-m3 leaves its first `skip_leading` out; a ColBERT document
    its skiplist's ids (PyLate's skiplist_mask); a ColBERT query keeps every token, expansion ones too."""
    keep = np.ones(len(ids), dtype=bool)
    keep[:info.skip_leading] = False
    if info.kind == "colbert" and not is_query and info.skip_ids:
        keep &= ~np.isin(ids, np.asarray(info.skip_ids, dtype=np.int64))
    return keep


def token_vectors(encodings: np.ndarray, heads: Heads, info: MultiVectorInfo, keep: np.ndarray) -> np.ndarray:
    """The kept tokens' vectors: encodings @ weight.T (+ bias), L2-normalised when the model normalises
    (BGE-M3's colbert_linear then normalize; PyLate's Dense then normalize_embeddings)."""
    vectors = encodings[keep].astype(np.float32) @ heads.multivector_weight.T
    if heads.multivector_bias is not None:
        vectors += heads.multivector_bias
    if info.normalize:
        vectors /= np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
    return np.ascontiguousarray(vectors, dtype=np.float32)


@dataclass(frozen=True)
class MaxSim:
    """A late-interaction score and how it was made: for each query token, the document token it matched
    best and that match's similarity (the score is their sum, or their mean for BGE-M3)."""

    score: float
    best: np.ndarray  # (query tokens,) the index of each query token's best document token
    similarity: np.ndarray  # (query tokens,) that match's dot product


def maxsim(query: np.ndarray, document: np.ndarray, mean: bool = False) -> MaxSim:
    """Late interaction: the sum over query tokens of the best dot product with any document token
    (PyLate's colbert_scores, used by rank.rerank), or its mean over the query's tokens (FlagEmbedding's
    BGEM3 colbert_score). An empty side scores 0."""
    if len(query) == 0 or len(document) == 0:
        return MaxSim(0.0, np.zeros(len(query), dtype=np.int64), np.zeros(len(query), dtype=np.float32))
    similarity = query.astype(np.float32) @ document.astype(np.float32).T
    best = similarity.argmax(axis=1)
    values = similarity[np.arange(len(query)), best]
    total = float(values.astype(np.float64).sum())
    return MaxSim(total / len(query) if mean else total, best, values)


# BGE-M3's compute_score "colbert+sparse+dense": the weighted mean of its three scores with FlagEmbedding's
# default weights_for_different_modes (dense, sparse, colbert) = [1, 1, 1], so their plain mean
BGE_M3_WEIGHTS = (1.0, 1.0, 1.0)
