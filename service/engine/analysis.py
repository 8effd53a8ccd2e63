"""Attention made useful: units (tokens or words), attention rollout, per-head entropy, top-k, and
the exact token-by-token split of a cosine similarity.

Plain numpy on one text's real tokens, run in the replica that ran the model, so that the
`layers x heads x n x n` probabilities never leave it unless a client asks for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Encoding


@dataclass(frozen=True)
class Units:
    """The units a text is analysed in, and which token positions make up each."""

    units: list[dict]  # {"text", "start", "end", "special", "tokens"}
    groups: list[list[int]]  # token positions per unit, in order

    def __len__(self) -> int:
        return len(self.groups)

    def assignment(self, n_tokens: int) -> np.ndarray:
        """(n_tokens, n_units) one-hot: token i belongs to unit u."""
        s = np.zeros((n_tokens, len(self.groups)), dtype=np.float64)
        for u, group in enumerate(self.groups):
            s[group, u] = 1.0
        return s


def token_units(encoding: Encoding) -> Units:
    """One unit per token, with its character offsets."""
    units = [
        {"text": token, "start": start, "end": end, "special": bool(special), "tokens": [i]}
        for i, (token, (start, end), special) in enumerate(
            zip(encoding.tokens, encoding.offsets, encoding.special_tokens_mask, strict=True)
        )
    ]
    return Units(units, [[i] for i in range(len(units))])


def word_units(encoding: Encoding, text: str | tuple[str, str]) -> Units:
    """One unit per word (the pieces that share a tokenizer word id); special tokens stand alone.
    For a text pair, `text` is both texts: offsets count in each one's own, and each unit says which
    (`sequence`: 0 the first, 1 the second)."""
    groups: list[list[int]] = []
    keys: list[object] = []
    for i, (word, special) in enumerate(zip(encoding.word_ids, encoding.special_tokens_mask, strict=True)):
        # a special token, or a piece without a word id, is a unit of its own
        key = ("token", i) if special or word is None else ("word", encoding.sequence_ids[i], word)
        if keys and keys[-1] == key:
            groups[-1].append(i)
        else:
            groups.append([i])
            keys.append(key)
    units = []
    for group in groups:
        first, last = group[0], group[-1]
        special = bool(encoding.special_tokens_mask[first])
        start, end = encoding.offsets[first][0], encoding.offsets[last][1]
        sequence = encoding.sequence_ids[first]
        source = text if isinstance(text, str) else text[sequence or 0]
        unit = {"text": encoding.tokens[first] if special else source[start:end],
                "start": start, "end": end, "special": special, "tokens": group}
        if not isinstance(text, str):
            unit["sequence"] = sequence
        units.append(unit)
    return Units(units, groups)


def to_units(attention: np.ndarray, units: Units) -> np.ndarray:
    """(..., n, n) token attention to (..., m, m) unit attention: attention *to* a unit is the sum over
    its pieces, attention *from* a unit the mean over its pieces, so rows still sum to 1."""
    n = attention.shape[-1]
    if len(units) == n:
        return attention.astype(np.float64)
    s = units.assignment(n)
    counts = s.sum(axis=0)
    return np.einsum("iu,...ij,jv->...uv", s / counts, attention.astype(np.float64), s)


def rollout(attention: np.ndarray) -> np.ndarray:
    """Attention rollout (Abnar & Zuidema 2020) of (layers, heads, m, m), layers in model order:
    per layer the heads' mean, `0.5 A + 0.5 I`, rows renormalised, then `R = A_last @ ... @ A_first`."""
    m = attention.shape[-1]
    eye = np.eye(m)
    result = eye
    for layer in attention.astype(np.float64):
        a = 0.5 * layer.mean(axis=0) + 0.5 * eye
        a /= a.sum(axis=-1, keepdims=True)
        result = a @ result
    return result


def entropy(attention: np.ndarray) -> np.ndarray:
    """(layers, heads): the mean over query units of `-sum_j p_ij ln p_ij` (0 ln 0 = 0), in nats."""
    p = attention.astype(np.float64)
    logs = np.log(np.where(p > 0, p, 1.0))
    return -(p * logs).sum(axis=-1).mean(axis=-1)


def top_k(matrix: np.ndarray, k: int) -> list[list[list[float]]]:
    """Per row, the k largest entries as [column, weight], largest first (ties: lower column first)."""
    k = min(k, matrix.shape[-1])
    order = np.argsort(-matrix, axis=-1, kind="stable")[:, :k]
    return [[[int(j), float(row[j])] for j in cols] for row, cols in zip(matrix, order, strict=True)]


class NoExactSplit(ValueError):
    """Raised for pooling whose cosine has no exact per-token split."""


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def contributions(h: np.ndarray, g: np.ndarray, pooling: str) -> tuple[float, np.ndarray, np.ndarray]:
    """The cosine of two texts' pooled token encodings h (n_a, d) and g (n_b, d), and each token's
    share of it: for mean pooling token i of the first text gives `(h_i . b) / (n_a |a| |b|)`, so
    each text's shares sum exactly to the score; cls puts all of it on the first token."""
    h = h.astype(np.float64)
    g = g.astype(np.float64)
    if pooling == "mean":
        a, b = h.mean(axis=0), g.mean(axis=0)
        norms = max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12)
        return cosine(a, b), h @ b / (len(h) * norms), g @ a / (len(g) * norms)
    if pooling == "cls":
        score = cosine(h[0], g[0])
        first_a, first_b = np.zeros(len(h)), np.zeros(len(g))
        first_a[0] = first_b[0] = score
        return score, first_a, first_b
    check_explainable(pooling)
    raise AssertionError("unreachable")


def check_explainable(pooling: str, dense_layers: int = 0) -> None:
    """Raise NoExactSplit, saying why, for a pooling whose cosine cannot be split per token."""
    if dense_layers:
        raise NoExactSplit(
            "the model projects its pooled embedding with a Dense layer (a non-linear map of all tokens at once), "
            "so its cosine has no exact per-token split; ask without explain for the score"
        )
    if pooling not in ("mean", "cls"):
        raise NoExactSplit(
            f"the model pools with {pooling!r}: a {pooling} pool takes each dimension from one token, so its "
            "cosine has no exact per-token split; ask without explain for the score"
        )
