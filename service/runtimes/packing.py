"""Packing: several texts in one row of the packed graph (bundle.contract.PACKED_INPUT_NAMES).

On a CPU every padded token costs what a real one does, and every run has a fixed cost. A batch of
single texts of 8-40 words, cut into sub-batches whose padding stays under 10 %, ran as runs of 2-3
texts; packed, the same texts are one run with no padding at all: each token attends only its own
text's tokens (a block-diagonal mask), and each text is pooled by one row of `pool_weights`. Measured
in-process on this repo's 2-core AMD EPYC (all-MiniLM-L6-v2, random batches of 8 texts, two
1-thread runs at once): onnxruntime fp32 467 -> 529 texts/s, OpenVINO bf16 662 -> 861. Attention still
computes every token pair of the row, so rows are capped (`packed_tokens`): past about 256 tokens
the wasted pairs cost more than the runs saved.

The export's gates (export/sessions.py) pack with this module too, so what is gated is what is served.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bundle.contract import PACKED_POOLINGS


def pack(ids: Sequence[np.ndarray], types: Sequence[np.ndarray | None] | None, position_offset: int, pooling: str,
         multiple: int = 1, skip: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """The packed graph's feed for these texts (token ids each, token types each or None for all 0).

    `multiple`: the row is padded to a multiple of this many tokens (OpenVINO keeps a compiled kernel
    per shape); padding tokens form a segment of their own (-1) that no text's pooling reads.
    `skip`: per text, leading tokens its pooling leaves out (pool_weights).
    """
    lengths = np.fromiter((a.shape[0] for a in ids), dtype=np.int64, count=len(ids))
    real = int(lengths.sum())
    total = real + (-real % multiple)
    input_ids = np.zeros((1, total), dtype=np.int64)
    input_ids[0, :real] = np.concatenate(ids)
    token_types = np.zeros((1, total), dtype=np.int64)
    if types is not None and any(t is not None for t in types):
        token_types[0, :real] = np.concatenate([t if t is not None else np.zeros(n, np.int64)
                                                for t, n in zip(types, lengths, strict=True)])
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    segment = np.repeat(np.arange(len(ids), dtype=np.int64), lengths)
    positions = np.full((1, total), position_offset, dtype=np.int64)
    positions[0, :real] = np.arange(real) - starts[segment] + position_offset
    segment_ids = np.full((1, total), -1, dtype=np.int64)
    segment_ids[0, :real] = segment
    return {"input_ids": input_ids, "token_type_ids": token_types, "position_ids": positions,
            "segment_ids": segment_ids, "pool_weights": pool_weights(lengths, pooling, total, skip)}


def pool_weights(lengths: np.ndarray, pooling: str, total: int, skip: Sequence[int] | None = None) -> np.ndarray:
    """(texts, total) weights that pool each text of a packed row as sentence-transformers' Pooling
    pools it alone: mean 1/n on each of its n tokens, mean_sqrt_len_tokens 1/sqrt(n), weightedmean
    (i + 1) / sum, cls 1 on its first token, lasttoken 1 on its last. `skip`: per text, how many of
    its first tokens pooling leaves out (a prompt, with the model's include_prompt false); a
    weightedmean still numbers tokens from the text's first, as sentence-transformers does."""
    weights = np.zeros((len(lengths), total), dtype=np.float32)
    if skip is None and pooling in ("mean", "cls"):  # the common case, without a loop over texts
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        if pooling == "cls":
            weights[np.arange(len(lengths)), starts] = 1.0
        else:
            segment = np.repeat(np.arange(len(lengths)), lengths)
            weights[segment, np.arange(int(lengths.sum()))] = (1.0 / lengths.astype(np.float32))[segment]
        return weights
    start = 0
    for i, n in enumerate(int(x) for x in lengths):
        first = min(int(skip[i]), n) if skip is not None else 0  # tokens [first, n) of the text are pooled
        row = weights[i, start + first:start + n]
        if pooling in ("mean", "mean_sqrt_len_tokens") and n > first:
            row[:] = 1.0 / (n - first if pooling == "mean" else np.sqrt(n - first))
        elif pooling == "weightedmean" and n > first:
            rank = np.arange(first + 1, n + 1, dtype=np.float64)
            row[:] = rank / rank.sum()
        elif pooling == "cls":
            weights[i, start + (first if first < n else 0)] = 1.0
        elif pooling == "lasttoken":
            weights[i, start + n - 1] = 1.0
        elif pooling not in PACKED_POOLINGS:
            raise ValueError(f"packing pools by {', '.join(PACKED_POOLINGS)}, not {pooling!r}")
        start += n
    return weights


def plan_packs(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Text indexes grouped into rows of at most max_tokens tokens (a longer text is a row alone),
    longest first, each text into the first row it fits (first-fit decreasing: few rows, full ones)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):
        n = lengths[index]
        for r, left in enumerate(room):
            if n <= left:
                rows[r].append(index)
                room[r] -= n
                break
        else:
            rows.append([index])
            room.append(max_tokens - n)
    return rows
