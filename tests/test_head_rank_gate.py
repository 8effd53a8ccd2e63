"""The heads' lossy gate (export/quality.py's check_heads) can fail on a changed ranking (issue 55): the tests'
tiny random rankers score every document of a query within about 0.005 of the others, inside the gate's tie
band (HEAD_RANK_TIE), so a candidate that swapped two documents still "kept every ranking". Here a ranker
whose documents' scores spread units apart, as a trained cross-encoder's do (the same tiny checkpoint, its
classifier's weights scaled and its bias centring the logits near 0), is gated on its real fp32 ONNX graph
(every ranking kept) and on a variant of that graph that swaps two of a query's documents (the gate fails,
naming the changed order); the unscaled ranker shows the blindness the scale removes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
from export import quality
from export.checkpoint import load_checkpoint
from export.sessions import ort_session
from tests.families import make_classifier

SCALE = 1000.0  # the tiny ranker's spread of about 0.005 becomes units, a trained cross-encoder's


def spread_ranker(out: Path) -> Path:
    """The session's tiny BERT cross-encoder with its classifier's weights times SCALE and its bias set so that
    the logits centre near 0: documents units apart, logits of a few units, as a trained ranker's."""
    make_classifier("bert", out, 1)
    weights = load_file(out / "model.safetensors")
    ckpt = load_checkpoint(out)
    reference = torch.from_numpy(pair_logits(ckpt))
    mean_before_bias = float(reference.mean()) - float(weights["classifier.bias"][0])
    weights["classifier.weight"] = weights["classifier.weight"] * SCALE
    weights["classifier.bias"] = torch.tensor([-mean_before_bias * SCALE], dtype=weights["classifier.bias"].dtype)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def pair_logits(ckpt) -> np.ndarray:
    """PyTorch's logits of every QUERIES x DOCUMENTS pair, as (queries, documents)."""
    tokenizer = Tokenizer.from_file(str(ckpt.tokenizer_path))
    pairs = [(q, d) for q, _ in quality.QUERIES for d in quality.DOCUMENTS]
    out = []
    for p in quality._batches(tokenizer, pairs, ckpt.max_tokens, ckpt.config.pad_token_id, segments=True):
        with torch.no_grad():
            out.append(ckpt.encoder(torch.from_numpy(p.input_ids), torch.from_numpy(p.attention_mask),
                                    torch.from_numpy(p.token_type_ids))[1].numpy())
    return np.concatenate(out)[:, 0].reshape(len(quality.QUERIES), -1)


class Swapped:
    """A candidate graph that answers as `session` does but with two documents of query 0 swapped."""

    def __init__(self, session, documents: tuple[int, int]) -> None:
        self.session, self.swap, self.row = session, documents, 0

    def get_providers(self):
        return self.session.get_providers()

    def run(self, names, feed):
        logits = self.session.run(names, feed)[0].copy()
        rows = range(self.row, self.row + len(logits))
        a, b = self.swap  # query 0's pairs are rows 0 .. len(DOCUMENTS) - 1
        if a in rows and b in rows:
            logits[[a - self.row, b - self.row]] = logits[[b - self.row, a - self.row]]
        else:
            assert a not in rows and b not in rows, "the two swapped pairs are in one batch"
        self.row += len(logits)
        return [logits]


def gate(ckpt, session) -> object:
    tokenizer = Tokenizer.from_file(str(ckpt.tokenizer_path))
    return quality.check_heads(ckpt.encoder, tokenizer, session, ckpt.max_tokens, ckpt.config.pad_token_id, 1,
                               segments=ckpt.config.type_vocab_size > 1)


@pytest.fixture(scope="module")
def rankers(tmp_path_factory) -> dict:
    """name -> (checkpoint, its fp32 ONNX graph): the tiny ranker and the spread one."""
    from export.pipeline import ExportOptions, build_bundle

    root = tmp_path_factory.mktemp("rankers")
    made = {}
    for name, make, scale in (("tiny", lambda out: make_classifier("bert", out, 1), 1.0),
                              ("spread", spread_ranker, SCALE)):
        checkpoint = make(root / f"{name}-ckpt")
        # the parity gate's absolute tolerance grows with the head's scale (fp32's rounding, times SCALE)
        build_bundle(ExportOptions(str(checkpoint), root / name, DEFAULT_OPSET, DEFAULT_ATOL * scale, DEFAULT_RTOL,
                                   name=name, lossy=()), progress=lambda _: None)
        made[name] = (load_checkpoint(checkpoint), root / name / "model.onnx")
    return made


def test_the_spread_rankers_documents_are_units_apart_and_the_tiny_ones_are_inside_the_tie_band(rankers):
    tiny, spread = (pair_logits(rankers[name][0]) for name in ("tiny", "spread"))
    assert np.ptp(tiny, axis=1).max() < quality.HEAD_RANK_TIE  # every document tied: no order to keep
    assert np.ptp(spread, axis=1).min() > 1.0 and np.abs(spread).max() < 20  # units apart, logits of a few units
    np.testing.assert_array_equal(np.argsort(spread, axis=1), np.argsort(tiny, axis=1))  # the same model's order


def test_the_head_gate_keeps_every_ranking_of_the_fp32_graph_and_fails_on_two_swapped_documents(rankers):
    ckpt, graph = rankers["spread"]
    kept = gate(ckpt, ort_session(graph))
    assert kept.passed and kept.rankings_kept == kept.queries == len(quality.QUERIES), kept.problems
    scores = pair_logits(ckpt)[0]
    best, worst = int(scores.argmax()), int(scores.argmin())
    swapped = gate(ckpt, Swapped(ort_session(graph), (best, worst)))
    assert not swapped.passed and swapped.rankings_kept == len(quality.QUERIES) - 1
    assert "the order of the documents changed for 1 of 10 queries" in swapped.problems, swapped.problems


def test_the_tiny_ranker_could_not_fail_on_the_same_swap(rankers):
    """Why the spread ranker is needed: the same swap on the tiny ranker keeps 'every ranking' (its documents
    are tied), and only the logits' tolerance could ever notice."""
    ckpt, graph = rankers["tiny"]
    scores = pair_logits(ckpt)[0]
    swapped = gate(ckpt, Swapped(ort_session(graph), (int(scores.argmax()), int(scores.argmin()))))
    assert swapped.rankings_kept == swapped.queries == len(quality.QUERIES) and swapped.passed, swapped.problems
