"""Packed runs: several texts in one row of the bundle's packed graph, with no padding.

The feed packing builds, the planner's rows, and the engine on the real default bundle: packed and
padded runs give the same embeddings (and both match sentence-transformers), pairs keep their token
types, normalize=false and attention requests still run padded, and `packed_tokens: 0` turns it off.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bundle.manifest import load_bundle
from service.config import BundleRef, ServiceSettings
from service.engine.engine import EngineTable, load_engine
from service.engine.runner import EncodeJob
from service.engine.encoder_service import EncoderService
from service.runtimes.packing import pack, plan_packs

TEXTS = ["yes", "A much longer sentence about the weather in Paris, which was grey and wet all week.",
         "two words", "Der Hund schläft unter dem Tisch.", "short one here",
         " ".join(["token"] * 200)]  # past a 128-token row: a row alone


def test_pack_lays_texts_one_after_another_with_their_own_positions_segments_and_pooling():
    ids = [np.array([5, 6, 7]), np.array([8, 9])]
    types = [None, np.array([0, 1])]
    feed = pack(ids, types, position_offset=2, pooling="mean", multiple=8)
    assert feed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert feed["token_type_ids"].tolist() == [[0, 0, 0, 0, 1, 0, 0, 0]]
    assert feed["position_ids"].tolist() == [[2, 3, 4, 2, 3, 2, 2, 2]]  # each text counts from the offset
    assert feed["segment_ids"].tolist() == [[0, 0, 0, 1, 1, -1, -1, -1]]  # padding: a segment of its own
    np.testing.assert_allclose(feed["pool_weights"], [[1 / 3] * 3 + [0] * 5, [0] * 3 + [0.5, 0.5] + [0] * 3])
    cls = pack(ids, None, 0, "cls")["pool_weights"]
    assert cls.tolist() == [[1, 0, 0, 0, 0], [0, 0, 0, 1, 0]]
    with pytest.raises(ValueError, match="not 'max'"):
        pack(ids, None, 0, "max")


def test_pool_weights_of_every_packed_pooling_and_a_skipped_prompt():
    """sentence-transformers' Pooling of each text alone, as one weight per token of the row; a prompt's
    tokens (include_prompt false) get none, and weightedmean keeps numbering from the text's first token."""
    from service.runtimes.packing import pool_weights

    lengths = np.array([3, 2])
    expect = {
        "mean_sqrt_len_tokens": [[3 ** -0.5] * 3 + [0, 0, 0], [0, 0, 0] + [2 ** -0.5] * 2 + [0]],
        "weightedmean": [[1 / 6, 2 / 6, 3 / 6, 0, 0, 0], [0, 0, 0, 1 / 3, 2 / 3, 0]],
        "lasttoken": [[0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0]],
    }
    for pooling, weights in expect.items():
        np.testing.assert_allclose(pool_weights(lengths, pooling, 6), weights, rtol=1e-6, err_msg=pooling)
    np.testing.assert_allclose(pool_weights(lengths, "mean", 6, [1, 1]), [[0, .5, .5, 0, 0, 0], [0, 0, 0, 0, 1, 0]])
    np.testing.assert_allclose(pool_weights(lengths, "weightedmean", 6, [1, 0]),
                               [[0, 2 / 5, 3 / 5, 0, 0, 0], [0, 0, 0, 1 / 3, 2 / 3, 0]], rtol=1e-6)
    np.testing.assert_allclose(pool_weights(lengths, "cls", 6, [1, 0]), [[0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]])


def test_plan_packs_fills_rows_up_to_the_cap_and_puts_a_longer_text_alone():
    lengths = [100, 30, 200, 60, 300, 20]
    rows = plan_packs(lengths, 256)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # every text once
    assert [4] in rows  # 300 tokens: alone
    for row in rows:
        assert len(row) == 1 or sum(lengths[i] for i in row) <= 256
    assert len(rows) == 3  # 300 | 200 + 30 + 20 | 100 + 60


@pytest.fixture(scope="module")
def services(default_bundle):
    """The default bundle served packed (the default) and padded (packed_tokens 0), onnxruntime fp32."""
    made = {}
    for name, packed_tokens in (("packed", 128), ("padded", 0)):
        settings = ServiceSettings.model_validate({"bundle": str(default_bundle), "runtime": "onnxruntime",
                                                   "precision": "fp32", "batching": {"packed_tokens": packed_tokens}})
        made[name] = EncoderService(settings, EngineTable([load_engine(BundleRef(path=default_bundle), settings)]))
    return made


def run(svc: EncoderService, texts, normalize=True, pairs=False, attention=None):
    engine = svc.engines.default

    async def go():
        if pairs:
            tokenized = await svc.tokenize_pairs(engine, texts, True, "test")
        else:
            tokenized = await svc.tokenize(engine, texts, True, "test")
        job = EncodeJob(route="test", ids=[t.ids for t in tokenized], normalize=normalize, attention=attention,
                        type_ids=[t.type_ids for t in tokenized] if pairs else None)
        return await svc.infer(engine, job, 60)

    before = dict(engine.runner.runs_by_graph)
    result = asyncio.run(go())
    return result, {k: v - before.get(k, 0) for k, v in engine.runner.runs_by_graph.items() if v - before.get(k, 0)}


def test_the_default_bundle_has_a_gated_packed_graph(default_bundle):
    m = load_bundle(default_bundle).manifest
    assert m.packed is not None and m.packed.parity.passed and m.packed.position_offset == 0
    assert all(o.max_abs_diff <= 1e-4 and o.values > 0 for o in m.packed.parity.outputs)


def test_packed_runs_give_the_padded_runs_embeddings_and_sentence_transformers(services, checkpoint):
    from sentence_transformers import SentenceTransformer

    packed, runs = run(services["packed"], TEXTS)
    assert runs == {"packed-fp32": 2}, runs  # 5 short texts in one row of 128 tokens, the long one alone
    assert packed.stats["padding_ratio"] == 0.0
    padded, runs = run(services["padded"], TEXTS)
    assert set(runs) == {"encodings-fp32"}
    np.testing.assert_allclose(packed.embeddings, padded.embeddings, atol=1e-5)
    reference = SentenceTransformer(str(checkpoint.path), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(packed.embeddings, reference, atol=1e-4)


def test_pairs_keep_their_token_types_when_packed(services):
    pairs = [("What is the capital of France?", "Paris is the capital of France."), ("a", "b c d")]
    packed, runs = run(services["packed"], pairs, pairs=True)
    assert runs == {"packed-fp32": 1}
    padded, _ = run(services["padded"], pairs, pairs=True)
    np.testing.assert_allclose(packed.embeddings, padded.embeddings, atol=1e-5)


def test_requests_for_more_than_the_pooled_output_run_padded(services):
    # normalize=false on a normalising model needs the hidden states; attention needs the full graph
    raw, runs = run(services["packed"], TEXTS[:3], normalize=False)
    assert set(runs) == {"encodings-fp32"}
    assert not np.allclose(np.linalg.norm(raw.embeddings, axis=1), 1.0)
    _, runs = run(services["packed"], TEXTS[:2], attention=((0,), (0,)))
    assert set(runs) == {"full"}


def test_packed_tokens_is_live_and_zero_turns_packing_off(services):
    svc = services["packed"]
    settings = svc.batching
    try:
        svc.reconfigure(settings.model_copy(update={"packed_tokens": 0}))
        _, runs = run(svc, TEXTS[:3])
        assert set(runs) == {"encodings-fp32"}
    finally:
        svc.reconfigure(settings)
    _, runs = run(svc, TEXTS[:3])
    assert runs == {"packed-fp32": 1}


def test_a_packed_row_is_bounded_because_its_attention_grows_with_its_square():
    from pydantic import ValidationError

    from service.config import BatchingSettings

    with pytest.raises(ValidationError, match="less than or equal to 2048"):
        BatchingSettings(packed_tokens=4096)


def test_info_says_how_each_model_is_batched_and_why_a_model_runs_padded_only(services, tmp_path):
    """Packed rows hold every family (each text keeps its own positions, window and causal mask); /info
    says so, and names the reason where a model runs padded only: a pooling with no per-token weights,
    or packing turned off."""
    from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
    from export.pipeline import ExportOptions, build_bundle
    from tests.families import make_checkpoint

    packed, padded = (services[k].describe(services[k].engines.default)["batches"] for k in ("packed", "padded"))
    assert packed.startswith("packed: ") and "128 tokens" in packed, packed
    assert padded == "padded only: batching.packed_tokens is 0"
    bundle = tmp_path / "max"
    build_bundle(ExportOptions(str(make_checkpoint("bert", tmp_path / "ckpt", pooling="max")), bundle, DEFAULT_OPSET,
                               DEFAULT_ATOL, DEFAULT_RTOL, lossy=()), progress=lambda _: None)
    settings = ServiceSettings.model_validate({"bundle": str(bundle), "runtime": "onnxruntime", "precision": "fp32"})
    svc = EncoderService(settings, EngineTable([load_engine(BundleRef(path=bundle), settings)]))
    assert svc.describe(svc.engines.default)["batches"] == \
        "padded only: max pooling has no per-token weights to pool a packed row by"
