"""The parity gate: onnxruntime must reproduce PyTorch on real positions of every output.

Validation is a verb of its own (as in optimum's exporters): compare names, then shapes,
then values; collect every failure and report them all, one line per output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from bundle.contract import INPUT_NAMES, output_names
from bundle.manifest import OutputParity, ParityReport
from export.encoder import Encoder
from export.sessions import ort_session

# Varied scripts, lengths and punctuation: the tokenizer paths that matter (accents,
# CJK split per character, emoji to [UNK]) all reach the graph.
PROBE_TEXTS = (
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux, n'est-ce pas ?",
    "敏捷的棕色狐狸跳过了懒狗。",
    "Быстрая коричневая лиса перепрыгивает через ленивую собаку.",
    "🙂 ok",
    "a",
)


@dataclass
class Probe:
    """One batch fed to both engines: int64 arrays of shape (batch, seq)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]


def _pad(rows: Sequence[Sequence[int]], type_rows: Sequence[Sequence[int]] | None, pad_id: int) -> Probe:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    types = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
        if type_rows is not None:
            types[i, : len(row)] = type_rows[i]
    return Probe(ids, mask, types)


# What one probe's attention output may hold, in float32 values: PyTorch's and onnxruntime's copies of
# (layers, batch, heads, T, T) and their comparison must fit beside the model on a 24 GiB machine (a
# Qwen3-0.6B's 8 rows of 512 tokens were 3.8 GB a copy and the export was killed for memory)
ATTENTION_VALUES_PER_PROBE = 2 ** 28  # 1 GiB


def rows_per_probe(max_tokens: int, layers: int, heads: int) -> int:
    """How many rows of max_tokens one probe may batch under ATTENTION_VALUES_PER_PROBE (at least one)."""
    return max(1, ATTENTION_VALUES_PER_PROBE // (layers * heads * max_tokens * max_tokens))


def make_probes(
    max_tokens: int, vocab_size: int, pad_id: int = 0, tokenizer: Tokenizer | None = None,
    max_rows: int | None = None,
) -> list[Probe]:
    """Batch 1 and several; lengths from 1 token to max_tokens; mixed-length padded batches.

    With a tokenizer, real multilingual text and a sentence pair (segment B) join the
    random-id probes. max_rows (rows_per_probe): the mixed-length batch padded to max_tokens is cut
    into probes of that many rows, so that a large model's attention output stays within bounds.
    """
    rng = np.random.default_rng(0)
    cls_id, sep_id = (101, 102) if vocab_size > 1000 else (1, 2)
    if tokenizer is not None:
        tokenizer = Tokenizer.from_str(tokenizer.to_str())  # a copy: settings made here must not leak
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_tokens)
        # What the post-processor wraps every text in: [CLS] ... [SEP] for BERT, <s> ... </s> for
        # RoBERTa (whose id 1 is the padding a default would otherwise put first).
        wrapped = tokenizer.encode("").ids
        if len(wrapped) >= 2:
            cls_id, sep_id = wrapped[0], wrapped[-1]
    low = min(1000, vocab_size // 2)  # skip [PAD]/[unused]/special ids, as real text does

    def random_row(length: int) -> list[int]:
        body = rng.integers(low, vocab_size, size=max(length - 2, 0)).tolist()
        return ([cls_id] + body + [sep_id])[:length]

    mixed_lengths = sorted({1, 2, 3, 17, max_tokens // 4, max_tokens // 2, max_tokens - 1, max_tokens})
    probes = [
        _pad([random_row(1)], None, pad_id),  # batch 1, one token
        _pad([random_row(max_tokens)], None, pad_id),  # batch 1, exactly max_tokens
        _pad([random_row(1), random_row(1), random_row(1)], None, pad_id),  # batch 3, one token each
    ]
    *shorter, longest = (random_row(n) for n in mixed_lengths)  # 1..max tokens
    per = max((max_rows or len(mixed_lengths)) - 1, 1)  # every cut keeps the longest row: it pads to max
    for start in range(0, len(shorter), per):
        probes.append(_pad([*shorter[start : start + per], longest], None, pad_id))
    if tokenizer is not None:
        texts = [e.ids for e in tokenizer.encode_batch(list(PROBE_TEXTS))]
        long_text = tokenizer.encode(" ".join(PROBE_TEXTS * 40)).ids  # truncated to max_tokens
        pair = tokenizer.encode("What is the capital of France?", "Paris is the capital of France.")
        probes += [
            _pad([texts[1]], None, pad_id),  # batch 1, a real sentence
            _pad([long_text], None, pad_id),  # batch 1, real text cut at max_tokens
            _pad(texts, None, pad_id),  # mixed-length real texts, padded
            _pad([pair.ids, texts[0]], [pair.type_ids, [0] * len(texts[0])], pad_id),  # segment B ids
        ]
    return probes


def _real_values(name: str, array: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The values of `array` at real (unpadded) positions, flattened per output kind."""
    real = mask.astype(bool)
    if name == "last_hidden_state":  # (B, T, d)
        return array[real]
    if name == "attentions":  # (layers, B, heads, T, T): keep rows and columns of real tokens
        pairs = real[:, :, None] & real[:, None, :]  # (B, T, T)
        return array.transpose(1, 3, 4, 0, 2)[pairs]  # (n_pairs, layers, heads)
    return array  # sentence_embedding (B, d) or logits (B, labels): one row per input, all real


@dataclass
class _Tally:
    """One output's comparison over every probe, and its line of the parity report."""

    values: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    passed: bool = True
    problems: list[str] = field(default_factory=list)

    def compare(self, ref: np.ndarray, got: np.ndarray, atol: float, rtol: float, where: str) -> None:
        """Count `got` against `ref` (values already cut to the real ones) within atol + rtol * |ref|."""
        ref, got = ref.astype(np.float64), got.astype(np.float64)
        diff = np.abs(got - ref)
        self.values += diff.size
        self.max_abs = max(self.max_abs, float(np.nanmax(diff, initial=0.0)))
        self.max_rel = max(self.max_rel, float(np.nanmax(diff / np.maximum(np.abs(ref), atol), initial=0.0)))
        bad = ~(diff <= atol + rtol * np.abs(ref))
        if bad.any():
            self.passed = False
            self.problems.append(f"{where}: {int(bad.sum())} of {bad.size} values out of tolerance")

    def report(self, output: str, shape: str, probes: int, atol: float, rtol: float) -> OutputParity:
        """The output's line: it passes when every comparison did and at least one value was compared."""
        return OutputParity(output=output, shape=shape, probes=probes, values=self.values, max_abs_diff=self.max_abs,
                            max_rel_diff=self.max_rel, atol=atol, rtol=rtol, passed=self.passed and self.values > 0,
                            problems=self.problems if self.values > 0 else [*self.problems, "no values compared"])


def check_parity(
    encoder: Encoder,
    graph_path: Path,
    probes: Sequence[Probe],
    atol: float,
    rtol: float,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    outputs: Sequence[str] | None = None,
    session=None,
    compare: Sequence[str] | None = None,
) -> ParityReport:
    """Run every probe through PyTorch and onnxruntime and compare every output on real positions.

    A value passes when |ort - torch| <= atol + rtol * |torch| (numpy.isclose's rule); the
    reported relative difference is |ort - torch| / max(|torch|, atol), so near-zero values
    do not make it meaningless. outputs: the graph's, by default the full graph's of the encoder's task.
    """
    names = output_names(encoder.task)  # what the PyTorch module returns, in order
    outputs = tuple(outputs or names)
    if session is None:  # export.sessions.OpenVinoSession answers the same calls
        session = ort_session(graph_path, providers)
    compare = tuple(compare or outputs)  # the outputs judged (all the graph's by default)
    tallies = {name: _Tally() for name in compare}

    got_inputs = [i.name for i in session.get_inputs()]
    got_outputs = [o.name for o in session.get_outputs()]
    if got_inputs != list(INPUT_NAMES) or got_outputs != list(outputs):
        for tally in tallies.values():
            tally.passed = False
            tally.problems.append(f"graph I/O {got_inputs} -> {got_outputs}")
    shapes = {o.name: "(" + ", ".join(str(d) for d in o.shape) + ")" for o in session.get_outputs()}

    encoder.eval()
    for probe in probes if all(t.passed for t in tallies.values()) else ():
        feed = {"input_ids": probe.input_ids, "attention_mask": probe.attention_mask, "token_type_ids": probe.token_type_ids}
        with torch.no_grad():
            everything = encoder(*(torch.from_numpy(feed[n]) for n in INPUT_NAMES))
        reference = [t.numpy() for name, t in zip(names, everything, strict=True) if name in compare]
        candidate = session.run(list(compare), feed)
        for name, ref, got in zip(compare, reference, candidate, strict=True):
            tally = tallies[name]
            if ref.shape != got.shape:
                tally.passed = False
                tally.problems.append(f"probe {probe.shape}: shape {got.shape}, expected {ref.shape}")
                continue
            ref_real = _real_values(name, ref, probe.attention_mask)
            got_real = _real_values(name, got, probe.attention_mask)
            if not np.all(np.isfinite(got_real)):
                tally.passed = False
                tally.problems.append(f"probe {probe.shape}: non-finite values")
            tally.compare(ref_real, got_real, atol, rtol, f"probe {probe.shape}")

    outputs = [t.report(name, shapes.get(name, "?"), len(probes), atol, rtol) for name, t in tallies.items()]
    return ParityReport(
        passed=all(o.passed for o in outputs),
        provider=session.get_providers()[0],
        probe_shapes=[p.shape for p in probes],
        outputs=outputs,
    )


def check_representations(encoder: Encoder, session, token_heads, tokenizer: Tokenizer, max_tokens: int, pad_id: int,
                          vocab_size: int, atol: float, rtol: float) -> list[OutputParity]:
    """The sparse and multi-vector rows of the strict gate: bundle/representations applied to the graph's
    last_hidden_state vs the PyTorch reference (export/token_heads.py: the encoder's hidden states through the
    heads in torch ops), on real text cut, marked and expanded as the service does it (a ColBERT's queries
    and documents both, expansion tokens included), each batch padded and its longest row alone."""
    from bundle.representations import bge_m3_terms, kept_tokens, token_vectors
    from export.token_heads import pad_rows, reference_sparse, reference_vectors, sparse_vector, token_rows

    mv, sp, heads = token_heads.multivector, token_heads.sparse, token_heads.heads
    names = [name for name, info in (("sparse", sp if sp is not None and sp.kind == "bge-m3" else None),
                                     ("multivector", mv)) if info is not None]
    if not names:
        return []
    tallies = {name: _Tally() for name in names}
    texts = [*PROBE_TEXTS, " ".join(PROBE_TEXTS * 40)]  # the last one reaches the longest input
    groups = [token_rows(tokenizer, texts, mv, False, max_tokens)]
    if mv is not None and mv.kind == "colbert":
        groups.append(token_rows(tokenizer, texts, mv, True, max_tokens))
    batches = [batch for rows in groups for batch in (rows, rows[-1:])]

    def tally(name: str, ref: np.ndarray, got: np.ndarray, shape: tuple) -> None:
        t = tallies[name]
        if ref.shape != got.shape:
            t.passed = False
            t.problems.append(f"{shape}: shape {got.shape}, expected {ref.shape}")
            return
        t.compare(ref, got, atol, rtol, f"row {shape}")

    encoder.eval()
    for batch in batches:
        ids, mask, types = pad_rows(batch, pad_id)
        with torch.no_grad():
            hidden = encoder(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(types))[0]
        got = session.run(["last_hidden_state"], {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})[0]
        for i, row in enumerate(batch):
            encodings = got[i, :len(row.ids)]
            if mv is not None:
                reference = reference_vectors(hidden[i], row, heads, mv).numpy()
                candidate = token_vectors(encodings, heads, mv, kept_tokens(row.ids, mv, row.is_query))
                tally("multivector", reference, candidate, ids.shape)
            if "sparse" in tallies:
                reference = reference_sparse(hidden[i], row, heads, sp, vocab_size).numpy()
                candidate = sparse_vector(*bge_m3_terms(encodings, row.ids, heads, sp.skip_ids), vocab_size)
                either = (reference != 0) | (candidate != 0)  # the terms either side gives a weight
                tally("sparse", reference[either], candidate[either], ids.shape)
    shapes = {"sparse": "(vocab terms of a text)", "multivector": f"(kept tokens, {mv.dim if mv else 0})"}
    return [t.report(name, shapes[name], len(batches), atol, rtol) for name, t in tallies.items()]
