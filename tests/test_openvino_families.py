"""Every family's bundle served by OpenVINO, held against sentence-transformers (pooled outputs) and
onnxruntime fp32 (token encodings): at f32 on every machine, and at bf16 where the CPU has bf16 units
(OpenVINO's loading and I/O code is the same at both). The bundles are the ones tests/test_families.py
exports anyway (its parity test calls `check_served_on_openvino`); here, MPNet, Qwen3 and XLM-R exported
with the bf16 variant (the families whose graphs OpenVINO names by a Cast's output: issue 46, item 5),
served in-process through the engine (tokenizer, batch runner, packing, pooling) and, once, over HTTP.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL, encodings_file
from bundle.manifest import load_bundle
from export.pipeline import ExportOptions, build_bundle
from service.config import BundleRef, ServiceSettings
from service.engine.engine import EngineTable, load_engine
from service.engine.runner import EncodeJob
from service.engine.encoder_service import EncoderService
from service.runtimes.openvino import check_openvino
from tests.families import make_checkpoint

BF16 = check_openvino().bf16_units
NO_BF16 = f"the bf16 path is not run on this machine: {check_openvino().reason}"
F32_TOLERANCE = 1e-4  # OpenVINO f32 against sentence-transformers and onnxruntime fp32, as the parity gate
BF16_MIN_COSINE = 0.999  # OpenVINO bf16 against sentence-transformers (the export's gate floor is 0.95)

TEXTS = [
    "Hello, world!",
    "Der Zug nach München fährt um acht Uhr ab.",
    "東京は日本の首都です。",
    "a",
    " ".join(["a long support ticket that keeps going and going"] * 20),  # cut at the model's limit
]

# the families of item 5: (pooling, L2-normalised), as the real models are (all-mpnet-base-v2: mean and
# Normalize; a Qwen3 embedder: its last token; BGE-M3-shaped XLM-R: Normalize)
BF16_FAMILIES = {"mpnet": ("mean", True), "qwen3": ("lasttoken", False), "xlm-roberta": ("mean", True)}


def precisions(bundle_dir: Path) -> list[str]:
    """f32 everywhere; bf16 too where this CPU runs it and the bundle has a gated bf16 variant."""
    variants = load_bundle(bundle_dir).manifest.variants
    return ["fp32"] + (["bf16"] if BF16 and "bf16" in variants else [])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def assert_bf16_close(got: np.ndarray, reference: np.ndarray, min_cosine: float) -> None:
    """Rows by cosine; a zero row of the reference (Qwen3's empty text: its EOS is its pad id, and
    sentence-transformers' last-token pooling gives zeros) must be zero here too."""
    zero = np.linalg.norm(reference, axis=1) == 0
    assert np.abs(got[zero]).max(initial=0) <= 1e-3, got[zero]
    assert cosines(got[~zero], reference[~zero]).min(initial=1) >= min_cosine, cosines(got[~zero], reference[~zero])


def served(bundle_dir: Path, precision: str) -> EncoderService:
    """The bundle loaded as a replica loads it, asked to run on OpenVINO at `precision`."""
    settings = ServiceSettings.model_validate({
        "bundle": str(bundle_dir), "runtime": "openvino", "precision": precision, "intra_op_threads": 1,
        "openvino_cache_dir": None, "batching": {"max_concurrent_batches": 1}})
    return EncoderService(settings, EngineTable([load_engine(BundleRef(path=bundle_dir), settings)]))


async def encode(svc: EncoderService, texts: list[str], hidden: bool) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """The embeddings route's steps: tokenize, queue, batch, run, pool (with hidden states: padded runs)."""
    engine = svc.engines.get(None)
    tokenized = await svc.tokenize(engine, svc.texts(texts), True, "/v1/embeddings")
    job = EncodeJob(route="/v1/embeddings", ids=[t.ids for t in tokenized], normalize=engine.model.normalize,
                    want_hidden=hidden)
    result = await svc.infer(engine, job, 60.0)
    return result.embeddings, result.hidden


def ort_hidden(bundle_dir: Path, ids: list[np.ndarray]) -> list[np.ndarray]:
    """Each text's token encodings from onnxruntime fp32 on the bundle's fp32 encodings graph, one text a run."""
    session = ort.InferenceSession(str(bundle_dir / encodings_file("fp32")), providers=["CPUExecutionProvider"])
    out = []
    for row in ids:
        feed = {"input_ids": row[None], "attention_mask": np.ones_like(row)[None], "token_type_ids": np.zeros_like(row)[None]}
        out.append(session.run(["last_hidden_state"], feed)[0][0])
    return out


def check_served_on_openvino(bundle_dir: Path, checkpoint: Path, texts: list[str] = TEXTS) -> list[str]:
    """`bundle_dir` served with runtime openvino at each precision this machine runs: OpenVINO really
    served it (the runtime, its precision, every encodings run counted on an OpenVINO graph), its
    embeddings are sentence-transformers' (both the packed and the padded path) and its token
    encodings onnxruntime fp32's. Returns the precisions checked."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(checkpoint), device="cpu").encode(texts, convert_to_numpy=True)
    checked = precisions(bundle_dir)
    for precision in checked:
        svc = served(bundle_dir, precision)
        engine = svc.engines.default
        runtime = engine.runtime
        label = f"{precision}-openvino"
        assert (runtime.runtime, runtime.precision, runtime.fast.label) == ("openvino", precision, f"encodings-{label}")
        assert runtime.fast.provider == "OpenVINO CPU"
        embeddings, _ = asyncio.run(encode(svc, texts, hidden=False))  # packed where the bundle can
        padded, hidden = asyncio.run(encode(svc, texts, hidden=True))  # the padded encodings graph
        runs = {k: v for k, v in engine.runner.runs_by_graph.items() if v}
        assert runs and all(k.endswith("-openvino") for k in runs), runs  # nothing ran on onnxruntime
        assert runs.get(f"encodings-{label}", 0) >= 1, runs
        if runtime.packed is not None:
            assert runs.get(f"packed-{label}", 0) >= 1, runs
        for got in (embeddings, padded):
            assert got.shape == reference.shape
            if precision == "fp32":
                assert np.abs(got - reference).max() <= F32_TOLERANCE, (precision, np.abs(got - reference).max())
            else:
                assert_bf16_close(got, reference, BF16_MIN_COSINE)
        ids = [t.ids for t in asyncio.run(svc.tokenize(engine, texts, True, "/v1/embeddings"))]
        expected = ort_hidden(bundle_dir, ids)
        for got_h, ref_h in zip(hidden, expected, strict=True):
            assert got_h.shape == ref_h.shape
            if precision == "fp32":
                assert np.abs(got_h - ref_h).max() <= F32_TOLERANCE, np.abs(got_h - ref_h).max()
            else:
                assert_bf16_close(got_h, ref_h, BF16_MIN_COSINE - 0.009)
    return checked


@pytest.fixture(scope="module")
def bf16_bundles(tmp_path_factory) -> dict[str, tuple[Path, Path, list[str]]]:
    """MPNet, Qwen3 and XLM-R exported with the bf16 variant: family -> (checkpoint, bundle, export log)."""
    root = tmp_path_factory.mktemp("openvino-families")
    out = {}
    for family, (pooling, normalize) in BF16_FAMILIES.items():
        # the weights at transformers' own 0.02: at the families' larger INIT_STD a random XLM-R's retrieval
        # probe has near ties (cosines 0.99999, one top-1 flipped) and the gate rejects bf16 for that alone;
        # what this file checks, the graph's names and OpenVINO's answers, does not depend on their size
        checkpoint = make_checkpoint(family, root / family, pooling=pooling, normalize=normalize, init_std=0.02)
        log: list[str] = []
        build_bundle(ExportOptions(str(checkpoint), root / f"{family}-bundle", DEFAULT_OPSET, DEFAULT_ATOL,
                                   DEFAULT_RTOL, lossy=("bf16",)), progress=log.append)
        out[family] = (checkpoint, root / f"{family}-bundle", log)
    return out


@pytest.mark.parametrize("family", list(BF16_FAMILIES))
def test_the_bf16_export_gates_and_publishes_a_graph_openvino_names_by_a_cast(family, bf16_bundles):
    """Issue 46, item 5: the export stopped at the bf16 gate (`graph I/O ['input_ids',
    '/encoder/embeddings/Cast_output_0', ...] does not match the manifest`) for these three."""
    _, bundle_dir, log = bf16_bundles[family]
    variants = load_bundle(bundle_dir).manifest.variants
    if not BF16:
        assert set(variants) == {"fp32"} and any("bf16 not gated, not published" in line for line in log), log
        pytest.skip(NO_BF16)
    bf16 = variants.get("bf16")
    assert bf16 is not None, "\n".join(log)  # gated and published
    assert bf16.runtime == "openvino" and bf16.quality.passed and bf16.quality.min_cosine >= BF16_MIN_COSINE, bf16.quality
    assert bf16.attention_gate is not None and bf16.attention_gate.outputs[0].values > 0


@pytest.mark.parametrize("family", list(BF16_FAMILIES))
def test_each_bf16_family_is_served_by_openvino_like_sentence_transformers(family, bf16_bundles):
    checkpoint, bundle_dir, _ = bf16_bundles[family]
    checked = check_served_on_openvino(bundle_dir, checkpoint)
    if not BF16:
        pytest.skip(f"served at f32 only: {NO_BF16}")
    assert checked == ["fp32", "bf16"]


def test_mpnet_is_served_by_openvino_over_http(bf16_bundles, ray_serve):
    """One family end to end: `runtime: openvino` through Serve and HTTP, /info saying what served it
    (bf16 where this CPU has bf16 units, else f32), embeddings as sentence-transformers'."""
    import httpx
    from ray import serve
    from sentence_transformers import SentenceTransformer

    from tests.conftest import deploy

    checkpoint, bundle_dir, _ = bf16_bundles["mpnet"]
    precision = precisions(bundle_dir)[-1]
    name = "ov-mpnet"
    deploy({"runtime": "openvino", "num_cpus": 0.5, "openvino_cache_dir": None}, name, f"/{name}", bundle_dir)
    try:
        with httpx.Client(base_url=f"{ray_serve.url}/{name}", timeout=60) as client:
            info = client.get("/info").json()
            got = client.post("/v1/embeddings", json={"input": TEXTS}).json()
    finally:
        serve.delete(name)
    assert (info["runtime"], info["precision"], info["graphs"]["encodings"]) == (
        "openvino", precision, f"encodings-{precision}-openvino"), info
    assert info["graph_providers"]["encodings"] == "OpenVINO CPU", info["graph_providers"]
    embeddings = np.array([d["embedding"] for d in got["data"]])
    reference = SentenceTransformer(str(checkpoint), device="cpu").encode(TEXTS, convert_to_numpy=True)
    if precision == "fp32":
        assert np.abs(embeddings - reference).max() <= F32_TOLERANCE
    else:
        assert_bf16_close(embeddings, reference, BF16_MIN_COSINE)
