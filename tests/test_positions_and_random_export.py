"""Sinusoidal positions, and randomly initialised encoders (sinusoidal, pre-norm, cls/max
pooling) that must export to ONNX with parity just as the real checkpoint does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL, GRAPH_FILE
from export import onnx_export, parity
from export.config import EncoderConfig
from export.encoder import Encoder, sinusoidal_positions


def test_sinusoidal_table_equals_the_formula():
    n, d = 50, 16
    table = sinusoidal_positions(n, d).double()
    for i in range(n):
        for j in range(d // 2):
            angle = i / 10000 ** (2 * j / d)
            assert table[i, 2 * j].item() == pytest.approx(np.sin(angle), abs=1e-6)
            assert table[i, 2 * j + 1].item() == pytest.approx(np.cos(angle), abs=1e-6)


@pytest.mark.parametrize("offset", [1, 3, 17])
def test_shifting_by_an_offset_is_one_rotation_for_every_position(offset):
    """P[i+k] = R_k P[i] for each (2j, 2j+1) pair, with R_k a rotation that does not depend on i.

    R_k is fitted from the table itself by least squares (not taken from the formula), then
    checked to be orthogonal with determinant 1 and to fit every position exactly.
    """
    n, d = 200, 32
    table = sinusoidal_positions(n, d).double().numpy()
    for j in range(d // 2):
        pairs = table[:, 2 * j : 2 * j + 2]  # (n, 2)
        src, dst = pairs[: n - offset], pairs[offset:]
        fitted, *_ = np.linalg.lstsq(src, dst, rcond=None)  # dst = src @ fitted
        rotation = fitted.T
        assert np.abs(src @ rotation.T - dst).max() < 1e-5, f"pair {j}: one matrix does not fit all positions"
        assert np.allclose(rotation @ rotation.T, np.eye(2), atol=1e-5), f"pair {j}: not orthogonal"
        assert np.linalg.det(rotation) == pytest.approx(1.0, abs=1e-5)
        theta = offset / 10000 ** (2 * j / d)
        expected = np.array([[np.cos(theta), np.sin(theta)], [-np.sin(theta), np.cos(theta)]])
        assert np.allclose(rotation, expected, atol=1e-5)


SMALL = dict(vocab_size=1200, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_positions=64, dropout=0.1)


@pytest.mark.parametrize(
    "variant",
    [
        dict(position_kind="sinusoidal", pooling="mean", normalize=True),
        dict(position_kind="sinusoidal", pooling="cls", norm_first=True),
        dict(position_kind="learned", pooling="max", activation="gelu_tanh", type_vocab_size=0),
    ],
    ids=["sinusoidal-mean-postnorm", "sinusoidal-cls-prenorm", "learned-max-nosegments"],
)
def test_random_encoder_exports_with_parity(tmp_path, variant):
    torch.manual_seed(0)
    config = EncoderConfig(**SMALL, **variant)
    encoder = Encoder(config).eval()
    written = onnx_export.export_onnx(encoder, tmp_path, DEFAULT_OPSET, config.max_positions)
    assert GRAPH_FILE in written
    probes = parity.make_probes(max_tokens=config.max_positions, vocab_size=config.vocab_size)
    report = parity.check_parity(encoder, tmp_path / GRAPH_FILE, probes, DEFAULT_ATOL, DEFAULT_RTOL)
    assert report.passed, "\n".join(o.model_dump_json() for o in report.outputs)
    assert {o.output for o in report.outputs} == {"last_hidden_state", "sentence_embedding", "attentions"}
    assert all(o.values > 0 for o in report.outputs)
    shapes = [p for p in report.probe_shapes]
    assert (1, 1) in shapes and any(b > 1 for b, _ in shapes) and max(s for _, s in shapes) == config.max_positions


def test_sinusoidal_encoder_outputs_do_not_depend_on_padding():
    torch.manual_seed(0)
    encoder = Encoder(EncoderConfig(**SMALL, position_kind="sinusoidal")).eval()
    ids = torch.randint(1000, 1200, (1, 9))
    with torch.no_grad():
        h, e, a = encoder(ids, torch.ones_like(ids))
        padded = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
        mask = torch.cat([torch.ones(1, 9, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long)], dim=1)
        hp, ep, ap = encoder(padded, mask)
    torch.testing.assert_close(hp[:, :9], h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ep, e, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ap[..., :9, :9], a, atol=1e-6, rtol=1e-5)


def test_a_large_models_mixed_length_probe_is_cut_to_bound_its_attention_output():
    """The mixed-length probe (8 rows padded to max_tokens) is cut into probes of rows_per_probe rows, each
    with the longest row so that it still pads, covering every length once: a Qwen3-0.6B-sized model (28
    layers, 16 heads, 512 tokens) was killed for memory by one probe's 3.8 GB of attention weights a copy."""
    assert parity.rows_per_probe(512, 28, 16) == 2 and parity.rows_per_probe(64, 2, 4) >= 8
    whole = parity.make_probes(512, 30522)
    cut = parity.make_probes(512, 30522, max_rows=parity.rows_per_probe(512, 28, 16))
    assert [p.shape for p in whole][3:] == [(8, 512)]
    mixed = cut[3:]
    assert all(p.shape == (2, 512) for p in mixed) and len(mixed) == 7
    lengths = sorted(n for p in mixed for n in p.attention_mask.sum(1).tolist() if n != 512)
    assert lengths == sorted(n for n in whole[3].attention_mask.sum(1).tolist() if n != 512)
    assert all(28 * p.shape[0] * 16 * 512 * 512 <= 2 * parity.ATTENTION_VALUES_PER_PROBE for p in mixed)


def test_a_model_too_large_for_one_file_publishes_every_graph_with_its_weights_beside_it(tmp_path, monkeypatch):
    """Past protobuf's 2 GB (a real Qwen3-0.6B), every graph keeps its weights in one `<graph>.data` file: the
    full, encodings (and its lossy variants) and packed graphs are exported, gated, hashed in the manifest,
    and served. Forced here on a small Qwen3 by lowering the single-file limit."""
    import asyncio

    from sentence_transformers import SentenceTransformer

    from bundle.contract import DEFAULT_ATOL, DEFAULT_RTOL
    from bundle.manifest import load_bundle
    from export.pipeline import ExportOptions, build_bundle
    from service.config import BundleRef, ServiceSettings
    from service.engine.engine import EngineTable, load_engine
    from service.engine.runner import EncodeJob
    from service.engine.encoder_service import EncoderService
    from tests.families import CORPUS, make_checkpoint

    monkeypatch.setattr(onnx_export, "_SINGLE_FILE_LIMIT", 0)
    checkpoint = make_checkpoint("qwen3", tmp_path / "qwen3", pooling="lasttoken", normalize=True)
    out = tmp_path / "bundle"
    build_bundle(ExportOptions(str(checkpoint), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, lossy=("int8",)),
                 progress=lambda _: None)
    manifest = load_bundle(out).manifest  # every file, data files included, checked against its hash
    graphs = [GRAPH_FILE, *(v.file for v in manifest.variants.values()), manifest.packed.file]
    for graph in graphs:
        assert f"{graph}.data" in manifest.files and (out / f"{graph}.data").stat().st_size > 10_000, graph
        assert (out / graph).stat().st_size < 1_000_000, graph  # the graph itself holds no weights
    assert sorted(p.name for p in out.glob("*.data")) == sorted(f"{g}.data" for g in graphs)  # nothing stray

    texts = list(CORPUS[:6])
    expected = SentenceTransformer(str(checkpoint), device="cpu").encode(texts)
    for packed_tokens in (256, 0):
        settings = ServiceSettings.model_validate({"bundle": str(out), "precision": "fp32", "runtime": "onnxruntime",
                                                   "batching": {"packed_tokens": packed_tokens}})
        svc = EncoderService(settings, EngineTable([load_engine(BundleRef(path=out), settings)]))

        async def run():
            engine = svc.engines.default
            tokenized = await svc.tokenize(engine, texts, True, "test")
            return await svc.infer(engine, EncodeJob(route="test", ids=[t.ids for t in tokenized], normalize=True), 60)

        np.testing.assert_allclose(asyncio.run(run()).embeddings, expected, atol=1e-4, rtol=0)
