"""Issue 49's fidelity gates: a classifier's and a cross-encoder's bf16 variant gated on their logits (the head
gate), `auto` serving a lossy variant only where its gate holds the model's fidelity (min cosine >= 0.999 for an
embedding model), and /info saying what precision serves pooled outputs, token encodings and attention.

The classifiers are the session's tiny ones (tests/families.py, the same seeds as conftest's CLASSIFIERS),
exported here with a bf16 variant; the floor is proved on a copy of the default bundle whose bf16 and fp16
figures were written to miss it (0.998: above the export gate's 0.95, below auto's 0.999)."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
from bundle.manifest import AUTO_MIN_COSINE, load_bundle
from export.quality import DOCUMENTS, HEAD_LOGITS_ATOL, QUERIES, TOKEN_MIN_COSINE
from service.config import ServiceSettings
from service.runtimes import load_runtime
from service.runtimes.cuda import GpuAssignment
from service.runtimes.onnxruntime import CPU, CUDA, resolve_precision
from service.runtimes.openvino import check_openvino
from tests.conftest import deploy
from tests.families import classifier_labels, make_classifier

BF16 = check_openvino().bf16_units
# bf16 is gated (and so exported) only on a CPU with bf16 units; the fp16 head gate and CUDA's floor run everywhere
needs_bf16 = pytest.mark.skipif(not BF16, reason="bf16 is gated (and so exported) only on a CPU with bf16 units")
PREFIX = "/fidelity"
MISSES = 0.998  # a figure that passes the export gate (0.95) and misses auto's floor


@pytest.fixture(scope="module")
def heads_bf16(tmp_path_factory) -> dict:
    """name -> (checkpoint, bundle) of a cross-encoder (BERT, one label) and a classifier (RoBERTa, three),
    exported with a bf16 variant."""
    from export.pipeline import ExportOptions, build_bundle

    root = tmp_path_factory.mktemp("fidelity")
    made = {}
    for name, family, labels in (("ranker", "bert", 1), ("sentiment", "roberta", 3)):
        checkpoint = make_classifier(family, root / f"{name}-ckpt", labels)
        build_bundle(ExportOptions(str(checkpoint), root / name, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, name=name,
                                   lossy=("bf16",)), progress=lambda _: None)
        made[name] = (checkpoint, root / name)
    return made


@pytest.fixture(scope="module")
def misses_the_floor(default_bundle, tmp_path_factory):
    """The default bundle, its bf16 (where this CPU made one) and fp16 gates' min cosine written as MISSES (the gate
    still passed)."""
    copy = tmp_path_factory.mktemp("floor") / "misses"
    shutil.copytree(default_bundle, copy)
    manifest = json.loads((copy / "bundle.json").read_text())
    for precision in ("bf16", "fp16") if BF16 else ("fp16",):
        assert manifest["variants"][precision]["quality"]["passed"]
        manifest["variants"][precision]["quality"]["min_cosine"] = MISSES
    (copy / "bundle.json").write_text(json.dumps(manifest))
    return copy


def runtime_for(bundle_dir, tmp_path, **settings):
    values = {"bundle": str(bundle_dir), "openvino_cache_dir": str(tmp_path / "ov-cache"), **settings}
    return load_runtime(load_bundle(bundle_dir), ServiceSettings.model_validate(values), 1, GpuAssignment(), 1)


@needs_bf16
def test_head_gates_are_in_the_manifest(heads_bf16):
    ranker, sentiment = (load_bundle(heads_bf16[n][1]).manifest.variants["bf16"] for n in ("ranker", "sentiment"))
    for variant in (ranker, sentiment):
        gate = variant.head_gate
        assert gate is not None and gate.passed and variant.quality is None and variant.runtime == "openvino"
        assert gate.atol == HEAD_LOGITS_ATOL and 0 < gate.max_abs_diff <= HEAD_LOGITS_ATOL
        assert variant.attention_gate is not None and variant.auto_verdict[0]
        assert tuple(variant.outputs) == ("last_hidden_state", "logits")
    pairs = len(QUERIES) * len(DOCUMENTS)
    assert (ranker.head_gate.inputs, ranker.head_gate.count) == ("pairs", pairs)
    assert ranker.head_gate.rankings_kept == ranker.head_gate.queries == len(QUERIES)
    assert sentiment.head_gate.inputs == "texts" and sentiment.head_gate.labels == sentiment.head_gate.count > 0


@needs_bf16
def test_embedding_gates_record_the_floor_and_the_token_gate(default_bundle):
    for precision in ("bf16", "fp16"):
        gate = load_bundle(default_bundle).manifest.variants[precision].quality
        assert gate.auto_min_cosine == AUTO_MIN_COSINE == 0.999
        assert gate.tokens is not None and gate.tokens.min_cosine_required == TOKEN_MIN_COSINE
        assert gate.tokens.tokens > 0 and gate.tokens.passed == (gate.tokens.min_cosine >= TOKEN_MIN_COSINE)


@needs_bf16
def test_auto_serves_a_head_at_bf16_where_its_gate_passed(heads_bf16, tmp_path):
    for name in ("ranker", "sentiment"):
        runtime = runtime_for(heads_bf16[name][1], tmp_path, runtime="openvino")
        assert (runtime.runtime, runtime.precision) == ("openvino", "bf16"), runtime.precision_note
        assert "its head gate: logits within" in runtime.precision_note
        assert runtime.choice["found"]["bf16_holds_auto_floor"] is True
        auto = runtime_for(heads_bf16[name][1], tmp_path)  # runtime auto: bf16 is a candidate, the faster serves
        assert "OpenVINO bf16 can run -> the faster" in auto.choice["matched"], auto.choice


@needs_bf16
def test_a_variant_below_the_floor_is_served_by_name_never_by_auto(misses_the_floor, tmp_path):
    auto = runtime_for(misses_the_floor, tmp_path)
    assert (auto.runtime, auto.precision) == ("onnxruntime", "fp32")
    assert "its gate misses auto's fidelity floor" in auto.choice["matched"]
    assert f"min cosine {MISSES:.5f}" in auto.precision_note and "below the 0.999" in auto.precision_note
    on_ov = runtime_for(misses_the_floor, tmp_path, runtime="openvino")
    assert (on_ov.runtime, on_ov.precision) == ("openvino", "fp32") and "below the 0.999" in on_ov.precision_note
    named = runtime_for(misses_the_floor, tmp_path, precision="bf16")
    assert (named.runtime, named.precision) == ("openvino", "bf16") and "below the 0.999" in named.precision_note


def test_cudas_fp16_below_the_floor_is_served_by_name_never_by_auto(misses_the_floor, default_bundle):
    """onnxruntime's resolve_precision holds CUDA's fp16 to the floor as the table holds bf16 (on any CPU: the
    fp16 variant is gated on onnxruntime's CPU provider)."""
    assert resolve_precision(load_bundle(default_bundle), "auto", CUDA)[0] == "fp16"  # its gate holds the floor
    bundle = load_bundle(misses_the_floor)
    precision, note = resolve_precision(bundle, "auto", CUDA)
    assert precision == "fp32" and f"min cosine {MISSES:.5f}" in note
    assert resolve_precision(bundle, "fp16", CUDA) == ("fp16", "fp16 as configured")
    assert resolve_precision(bundle, "auto", CPU)[0] == "fp32"


def test_a_cross_encoders_fp16_variant_has_a_head_gate_on_any_cpu(tmp_path):
    """The head gate runs on onnxruntime (fp16) where no bf16 can be made: logits, rankings, verdict recorded."""
    from export.pipeline import ExportOptions, build_bundle

    checkpoint = make_classifier("bert", tmp_path / "ranker-ckpt", 1)
    build_bundle(ExportOptions(str(checkpoint), tmp_path / "ranker", DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL,
                               name="ranker", lossy=("fp16",)), progress=lambda _: None)
    variant = load_bundle(tmp_path / "ranker").manifest.variants["fp16"]
    gate = variant.head_gate
    assert gate is not None and gate.passed and variant.quality is None and variant.auto_verdict[0]
    assert (gate.inputs, gate.count) == ("pairs", len(QUERIES) * len(DOCUMENTS)) and gate.atol == HEAD_LOGITS_ATOL
    assert 0 < gate.max_abs_diff <= HEAD_LOGITS_ATOL and gate.rankings_kept == gate.queries == len(QUERIES)


@pytest.fixture(scope="module")
def fidelity_app(ray_serve, heads_bf16, misses_the_floor):
    deploy({"bundles": [{"path": str(heads_bf16["ranker"][1]), "name": "ranker"},
                        {"path": str(heads_bf16["sentiment"][1]), "name": "sentiment"},
                        {"path": str(misses_the_floor), "name": "misses"}],
            "runtime": "openvino", "num_cpus": 0.5, "openvino_cache_dir": None}, "fidelity", PREFIX,
           heads_bf16["ranker"][1])
    try:
        with httpx.Client(base_url=ray_serve.url + PREFIX, timeout=60) as client:
            yield client
    finally:
        from ray import serve

        serve.delete("fidelity")


@needs_bf16
def test_info_says_what_serves_each_output_and_why(fidelity_app):
    models = {m["model"]: m for m in fidelity_app.get("/info").json()["models"]}
    for name in ("ranker", "sentiment"):
        m = models[name]
        assert (m["runtime"], m["precision"]) == ("openvino", "bf16")
        assert m["precisions"]["pooled"] == m["precisions"]["token_encodings"] == "bf16"
        assert m["precisions"]["attention"] in ("bf16", "fp32")
        assert m["variants"]["bf16"]["served_by_auto"] and m["variants"]["bf16"]["gate"]["atol"] == HEAD_LOGITS_ATOL
    misses = models["misses"]
    assert (misses["runtime"], misses["precision"]) == ("openvino", "fp32")
    assert "below the 0.999" in misses["precision_note"] and f"{MISSES:.5f}" in misses["precision_note"]
    assert misses["precisions"] == {"pooled": "fp32", "token_encodings": "fp32", "token_encodings_gate": None,
                                    "attention": "fp32", "attention_gate": None}
    assert misses["variants"]["bf16"]["served_by_auto"] is False
    assert misses["runtime_choice"]["found"]["bf16_holds_auto_floor"] is False


@needs_bf16
def test_bf16_rerank_and_classify_are_the_references_within_the_head_gate(fidelity_app, heads_bf16):
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    query, documents = QUERIES[0][0], list(DOCUMENTS)
    expected = CrossEncoder(str(heads_bf16["ranker"][0]), device="cpu").predict([(query, d) for d in documents])
    r = fidelity_app.post("/v1/rerank", json={"model": "ranker", "query": query, "documents": documents})
    assert r.status_code == 200, r.text
    got = np.array([x["relevance_score"] for x in sorted(r.json()["results"], key=lambda x: x["index"])])
    # the scores are the sigmoid of the logits (no activation saved): its slope is at most 1/4
    np.testing.assert_allclose(got, expected, atol=HEAD_LOGITS_ATOL / 4)
    texts = ["I loved it", "it broke after a day and nobody answered", "fine"]
    path = str(heads_bf16["sentiment"][0])
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(**AutoTokenizer.from_pretrained(path)(texts, padding=True, return_tensors="pt")).logits.numpy()
    body = fidelity_app.post("/v1/classify", json={"model": "sentiment", "input": texts}).json()
    labels = classifier_labels(3)
    for row, item in zip(logits, body["data"], strict=True):
        assert item["labels"][0]["label"] == labels[int(row.argmax())]  # the label is unchanged
        got = {x["label"]: x["score"] for x in item["labels"]}
        # softmax moves by at most half the largest change of a logit difference
        np.testing.assert_allclose([got[label] for label in labels], torch.softmax(torch.from_numpy(row), -1).numpy(),
                                   atol=HEAD_LOGITS_ATOL)
