"""Why a classifier scored a text (or a query-document pair) as it did, word by word: occlusion (the
score again with each word removed) and attention rollout from the first token, whose encoding the
classification head reads. Plain numpy and tokenizer data; the inferences are the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from service.engine.analysis import Units, rollout, word_units
from service.engine.tokenization import TokenizedText


@dataclass(frozen=True)
class Occlusions:
    """One text's words and the inputs with each removed (token ids and types, special tokens kept)."""

    units: Units
    words: list[int]  # indexes of the units that are words (not special tokens)
    ids: list[np.ndarray]
    type_ids: list[np.ndarray]


def occlusions(tokenized: TokenizedText, text: str | tuple[str, str]) -> Occlusions:
    """Every word of a text (both texts of a pair) and the input without it."""
    units = word_units(tokenized.encoding, text)
    words = [u for u, unit in enumerate(units.units) if not unit["special"]]
    types = tokenized.type_ids
    ids, type_ids = [], []
    for u in words:
        keep = np.ones(tokenized.n_tokens, dtype=bool)
        keep[units.groups[u]] = False
        ids.append(tokenized.ids[keep])
        type_ids.append(types[keep])
    return Occlusions(units, words, ids, type_ids)


def explanation(occluded: Occlusions, score: float, without: np.ndarray, attention: np.ndarray) -> list[dict]:
    """Per word: `occlusion`, the score minus the score without it (what the word adds), and `rollout`,
    the share of the first token's rolled-out attention that lands on the word's tokens."""
    flow = rollout(attention)[0]  # (n_tokens,): from the first token, the one the head reads
    out = []
    for k, u in enumerate(occluded.words):
        unit = {key: value for key, value in occluded.units.units[u].items() if key not in ("special", "tokens")}
        unit["occlusion"] = float(score - without[k])
        unit["rollout"] = float(flow[occluded.units.groups[u]].sum())
        out.append(unit)
    return out
