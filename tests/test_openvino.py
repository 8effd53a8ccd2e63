"""bf16 on OpenVINO: gated at export like every lossy variant, chosen per replica by measuring, served
through the same routes, and every way it cannot start falls back with one line.

On a CPU with bf16 units (this machine's AMD EPYC has AVX512_BF16, recent Xeons AMX) the bf16 path
itself runs; on one without, the tests that need it are skipped, saying why, and OpenVINO runs at f32
(the same loading and I/O code). Where the hardware's answer has to be the other one (a CPU without
bf16 units, OpenVINO missing), `check_openvino`'s answer is replaced: the rest (bundles, sessions,
compiles, HTTP) is real. Every figure is held against an independent reference: onnxruntime fp32 or
sentence-transformers.
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import httpx
import numpy as np
import pytest

from bundle.manifest import BundleError, file_entry, load_bundle
from export.sessions import OpenVinoSession
from service.config import ServiceSettings
from service.runtimes import choice, load_runtime
from service.runtimes.cuda import GpuAssignment
from service.runtimes.openvino import OpenVinoCheck, check_openvino, usable_cache_dir
from tests.conftest import deploy
from tests.metrics_scrape import poll, settled, total

BF16 = check_openvino().bf16_units
NO_BF16 = f"the bf16 path is not run on this machine: {check_openvino().reason}"
needs_bf16 = pytest.mark.skipif(not BF16, reason=NO_BF16)
TEXTS = ["How do I reset my password?", "Die Lieferung kam zwei Tage zu spät.", "ok", "敏捷的棕色狐狸跳过了懒狗。",
         "The committee will vote on the proposal next Thursday after a public consultation, as it does every year."]


def runtime_for(bundle_dir, tmp_path, **settings):
    values = {"bundle": str(bundle_dir), "openvino_cache_dir": str(tmp_path / "ov-cache"), **settings}
    return load_runtime(load_bundle(bundle_dir), ServiceSettings.model_validate(values), 1, GpuAssignment(), 2)


def encode(runtime, tokenizer_path, texts=TEXTS):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    rows = []
    for e in tok.encode_batch(texts):
        ids = np.array([e.ids], dtype=np.int64)
        rows.append(runtime.run(ids, np.ones_like(ids), ["sentence_embedding"])["sentence_embedding"][0])
    return np.array(rows)


def cosines(a, b):
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def without_bf16(monkeypatch):
    """This process's CPU as one without bf16 units (OpenVINO's answer replaced, nothing else)."""
    monkeypatch.setattr(choice, "check_openvino", lambda: OpenVinoCheck(
        True, False, "2026.4.1", "a CPU", "this CPU (a CPU) has no bf16 units (OpenVINO reports FP32, INT8)"))


def reference_embeddings(bundle_dir, tmp_path):
    """onnxruntime fp32 on the bundle's own graphs: the independent reference of OpenVINO's answers."""
    return encode(runtime_for(bundle_dir, tmp_path, runtime="onnxruntime", precision="fp32"),
                  load_bundle(bundle_dir).tokenizer_path)


@pytest.mark.skipif(BF16, reason="this CPU has bf16 units: its export gates bf16 (the next test)")
def test_an_export_on_a_cpu_without_bf16_units_publishes_no_bf16_variant(default_bundle):
    assert "bf16" not in load_bundle(default_bundle).manifest.variants  # not gated here, so never served


@needs_bf16
def test_export_gates_bf16_on_openvino_and_keeps_attention_in_fp32_unless_its_gate_passes(default_bundle):
    manifest = load_bundle(default_bundle).manifest
    bf16 = manifest.variants["bf16"]
    assert bf16.runtime == "openvino" and bf16.file == manifest.variants["fp32"].file  # the fp32 file, compiled bf16
    assert bf16.quality.passed and bf16.quality.min_cosine >= 0.9999, bf16.quality
    assert bf16.quality.min_cosine < 1.0  # bf16 really ran: OpenVINO on bf16 units rounds
    gate = bf16.attention_gate
    assert gate is not None and [o.output for o in gate.outputs] == ["attentions"] and gate.outputs[0].atol == 1e-3
    assert gate.passed == (gate.outputs[0].max_abs_diff <= 1e-3)


@needs_bf16
def test_bf16_answers_within_its_gate_of_fp32(default_bundle, tmp_path):
    bundle = load_bundle(default_bundle)
    fp32 = runtime_for(default_bundle, tmp_path, runtime="onnxruntime")
    bf16 = runtime_for(default_bundle, tmp_path, precision="bf16")
    assert (bf16.runtime, bf16.precision, bf16.fast.label) == ("openvino", "bf16", "encodings-bf16-openvino")
    got, ref = encode(bf16, bundle.tokenizer_path), encode(fp32, bundle.tokenizer_path)
    assert cosines(got, ref).min() >= bundle.manifest.variants["bf16"].quality.min_cosine_floor
    assert cosines(got, ref).min() >= 0.9999, cosines(got, ref)
    # attention weights come from the fp32 graph when the bf16 attention gate failed
    if not bundle.manifest.variants["bf16"].attention_gate.passed:
        assert bf16.full.label == "full" and bf16.graph_for(["attentions"]) is bf16.full


def test_auto_serves_whichever_measured_faster_and_says_both_figures(default_bundle, tmp_path, monkeypatch):
    reference = reference_embeddings(default_bundle, tmp_path)
    with monkeypatch.context() as patched:  # without bf16 units: onnxruntime fp32, saying why
        without_bf16(patched)
        fallback = runtime_for(default_bundle, tmp_path)
    assert (fallback.runtime, fallback.precision) == ("onnxruntime", "fp32")
    # the reason, whatever follows it (a bundle exported where bf16 units are missing says it has no bf16 graph too)
    assert "not OpenVINO bf16: this CPU (a CPU) has no bf16 units (OpenVINO reports FP32, INT8)" in fallback.precision_note
    np.testing.assert_allclose(encode(fallback, load_bundle(default_bundle).tokenizer_path), reference, atol=1e-5)
    if not BF16:
        pytest.skip(f"the faster-of-two choice is not run: {NO_BF16}")
    runtime = runtime_for(default_bundle, tmp_path)
    found = re.search(r"in ([\d.]+) ms on OpenVINO bf16 and ([\d.]+) ms on onnxruntime fp32", runtime.precision_note)
    assert found, runtime.precision_note
    ov_ms, ort_ms = map(float, found.groups())
    assert (runtime.runtime, runtime.precision) == (("openvino", "bf16") if ov_ms < ort_ms else ("onnxruntime", "fp32"))
    assert cosines(encode(runtime, load_bundle(default_bundle).tokenizer_path), reference).min() >= 0.9999


def test_without_bf16_units_runtime_openvino_serves_f32_and_bf16_asked_for_falls_back_with_one_line(
        default_bundle, tmp_path, monkeypatch, caplog):
    without_bf16(monkeypatch)
    caplog.set_level(logging.WARNING)
    # runtime openvino keeps OpenVINO, in f32, on every machine: fp32 parity with onnxruntime
    on_ov = runtime_for(default_bundle, tmp_path, runtime="openvino")
    assert (on_ov.runtime, on_ov.precision, on_ov.fast.label) == ("openvino", "fp32", "encodings-fp32-openvino")
    np.testing.assert_allclose(encode(on_ov, load_bundle(default_bundle).tokenizer_path),
                               reference_embeddings(default_bundle, tmp_path), atol=1e-4)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    if not BF16:  # exported on this CPU, the bundle has no bf16 graph to fall back from
        pytest.skip(f"no bf16 variant to ask for: {NO_BF16}")
    runtime = runtime_for(default_bundle, tmp_path, precision="bf16")
    assert (runtime.runtime, runtime.precision) == ("onnxruntime", "fp32")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["precision bf16: this CPU (a CPU) has no bf16 units (OpenVINO reports FP32, INT8); serving fp32"]


def test_runtime_openvino_asked_for_by_name_serves_or_refuses_the_start_in_one_line(default_bundle, tmp_path,
                                                                                     monkeypatch, caplog):
    """Only `auto` falls back: `runtime: openvino` that cannot start is refused, in one line, before any
    replica starts (check_bundles, which `python -m service` and build_app run) and in the replica
    itself; never onnxruntime in its place."""
    from service.runtimes import openvino
    from service.runtimes.onnxruntime import check_bundles

    missing = OpenVinoCheck(False, False, reason="openvino is not installed (No module named 'openvino')")
    monkeypatch.setattr(choice, "check_openvino", lambda: missing)
    monkeypatch.setattr(openvino, "check_openvino", lambda: missing)
    caplog.set_level(logging.WARNING)
    settings = ServiceSettings.model_validate({"bundle": str(default_bundle), "runtime": "openvino"})
    expected = "runtime 'openvino' was asked for, but OpenVINO cannot serve: openvino is not installed (No module named 'openvino')"
    with pytest.raises(RuntimeError) as refused:
        check_bundles(settings)
    assert str(refused.value) == expected
    with pytest.raises(RuntimeError) as refused:
        runtime_for(default_bundle, tmp_path, runtime="openvino")
    assert str(refused.value) == expected
    assert not caplog.records  # no fallback said: none happened
    # auto: onnxruntime fp32, and the same numbers as ever
    auto = runtime_for(default_bundle, tmp_path)
    assert (auto.runtime, auto.precision) == ("onnxruntime", "fp32") and "openvino is not installed" in auto.precision_note
    np.testing.assert_allclose(encode(auto, load_bundle(default_bundle).tokenizer_path),
                               reference_embeddings(default_bundle, tmp_path), atol=1e-6)


def break_for_openvino(graph_path) -> None:
    """The graph's sentence_embedding multiplied by Inverse([[1]]): the same numbers on onnxruntime (a
    contrib op it runs), an operation OpenVINO's ONNX reader has no conversion for."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph_path))
    graph = model.graph
    for node in graph.node:
        node.output[:] = ["sentence_embedding_before" if o == "sentence_embedding" else o for o in node.output]
    graph.initializer.append(numpy_helper.from_array(np.ones((1, 1), dtype=np.float32), "one_by_one"))
    graph.node.extend([
        helper.make_node("Inverse", ["one_by_one"], ["one_inverted"], domain="com.microsoft"),
        helper.make_node("Mul", ["sentence_embedding_before", "one_inverted"], ["sentence_embedding"]),
    ])
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(graph_path))


def test_a_graph_openvino_cannot_load_refuses_runtime_openvino_in_one_line(default_bundle, tmp_path):
    """A real failure, not a replaced answer: an encodings graph OpenVINO cannot read (a bundle whose
    hashes are updated, so only the runtime can find out) refuses `runtime: openvino` at the preflight."""
    from service.runtimes.onnxruntime import check_bundles

    copy = tmp_path / "bad-for-openvino"
    shutil.copytree(default_bundle, copy)
    settings = ServiceSettings.model_validate({"bundle": str(copy), "runtime": "openvino"})
    check_bundles(settings)  # the bundle as exported: OpenVINO serves it
    graph = copy / "encodings-fp32.onnx"
    break_for_openvino(graph)
    manifest = json.loads((copy / "bundle.json").read_text())
    manifest["files"][graph.name] = file_entry(graph).model_dump()
    (copy / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(RuntimeError) as refused:
        check_bundles(settings)
    assert str(refused.value) == ("runtime 'openvino' was asked for, but OpenVINO cannot serve: "
                                  f"{graph}: OpenVINO cannot compile the graph: "
                                  "No conversion rule found for operations: com.microsoft.Inverse")
    # onnxruntime serves the same bundle, with the same numbers: only OpenVINO cannot
    np.testing.assert_allclose(encode(runtime_for(copy, tmp_path, runtime="onnxruntime"), load_bundle(copy).tokenizer_path),
                               reference_embeddings(default_bundle, tmp_path), atol=1e-6)


def test_a_broken_cache_dir_costs_a_compile_not_the_replica(default_bundle, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    assert usable_cache_dir(blocker)[0] is None
    caplog.set_level(logging.WARNING)
    runtime = runtime_for(default_bundle, tmp_path, runtime="openvino", precision="fp32",
                          openvino_cache_dir=str(blocker / "ov"))
    assert (runtime.runtime, runtime.precision) == ("openvino", "fp32")
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"OpenVINO: cache directory {blocker / 'ov'} is not usable ("), warnings
    np.testing.assert_allclose(encode(runtime, load_bundle(default_bundle).tokenizer_path),
                               reference_embeddings(default_bundle, tmp_path), atol=1e-4)


def test_compiled_models_are_cached_so_a_restart_does_not_compile_again(default_bundle, tmp_path):
    cache = tmp_path / "ov-cache"
    runtime_for(default_bundle, tmp_path, runtime="openvino")
    blobs = sorted(p.name for p in cache.iterdir() if p.suffix == ".blob")
    assert blobs, list(cache.iterdir())
    stamps = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    runtime_for(default_bundle, tmp_path, runtime="openvino")  # a restarted replica: loads, writes nothing
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps


def test_stream_threads_are_not_pinned_to_cores_when_compiled_loaded_from_the_cache_or_resized(default_bundle,
                                                                                                 tmp_path):
    """OpenVINO pins a THROUGHPUT model's stream threads by default; on cores the replica shares, a pinned stream
    waits for its busy core (compile_options). Each compiled model of the runtime reports pinning off: compiled,
    loaded from the cache by a restarted replica, and recompiled for new streams."""
    def pinned(runtime) -> set:
        graphs = [g for g in (runtime.fast, runtime.full, runtime.packed) if hasattr(g, "compiled")]
        assert graphs
        return {g.compiled.get_property("ENABLE_CPU_PINNING") for g in graphs}

    first = runtime_for(default_bundle, tmp_path, runtime="openvino")  # 2 streams: THROUGHPUT, pinned by default
    assert first.fast.streams == 2 and pinned(first) == {False}
    assert pinned(runtime_for(default_bundle, tmp_path, runtime="openvino")) == {False}  # from the cache
    assert pinned(first.resized(2, 1)) == {False}


def test_a_resized_openvino_runtime_is_compiled_for_the_new_streams_and_threads(default_bundle, tmp_path):
    """A live max_concurrent_batches recompiles OpenVINO's graphs for that many streams (threads x streams
    in all), as the compiled models themselves report, and the onnxruntime full graph beside them gets the
    new thread count; the old runtime keeps its compiled models for the batches still running on it."""
    import os

    cpus = len(os.sched_getaffinity(0))
    old = runtime_for(default_bundle, tmp_path, runtime="openvino")  # 1 thread per run, 2 streams
    new = old.resized(2, 1)
    assert old.runtime == new.runtime == "openvino" and new is not old and new.fast is not old.fast
    compiled = lambda graph: (graph.compiled.get_property("NUM_STREAMS"), graph.compiled.get_property("INFERENCE_NUM_THREADS"))  # noqa: E731
    assert compiled(old.fast) == (2, min(2, cpus)) and (old.fast.streams, old.threads) == (2, 1)
    assert compiled(new.fast) == (1, min(2, cpus)) and (new.fast.streams, new.threads) == (1, min(2, cpus))
    if new.packed is not None:
        assert compiled(new.packed) == (1, min(2, cpus))
    if new.full.label == "full":  # attention weights on onnxruntime: its session resized too
        assert (old.full.threads, new.full.threads) == (1, 2)
    bundle = load_bundle(default_bundle)
    np.testing.assert_allclose(encode(new, bundle.tokenizer_path), encode(old, bundle.tokenizer_path), atol=1e-4)
    assert new.resized(2, 1) is new


def test_a_bundle_without_a_gated_bf16_graph_never_serves_bf16(default_bundle, tmp_path):
    copy = tmp_path / "no-bf16"
    shutil.copytree(default_bundle, copy)
    manifest = json.loads((copy / "bundle.json").read_text())
    manifest["variants"].pop("bf16", None)
    (copy / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="no gated bf16 graph in this bundle"):
        runtime_for(copy, tmp_path, precision="bf16")
    auto = runtime_for(copy, tmp_path)
    assert (auto.runtime, auto.precision) == ("onnxruntime", "fp32") and "not OpenVINO bf16" in auto.precision_note
    on_ov = runtime_for(copy, tmp_path, runtime="openvino")
    assert (on_ov.runtime, on_ov.precision) == ("openvino", "fp32") and "no gated bf16 graph" in on_ov.precision_note


@pytest.mark.parametrize("values, message", [
    ({"runtime": "onnxruntime", "precision": "bf16"}, "precision bf16 runs on OpenVINO"),
    ({"runtime": "openvino", "precision": "int8"}, "runtime openvino runs fp32 or bf16"),
    ({"runtime": "openvino", "provider": "cuda"}, "runtime openvino runs on CPU"),
])
def test_settings_refuse_a_runtime_that_cannot_run_the_precision(values, message):
    with pytest.raises(ValueError, match=message):
        ServiceSettings.model_validate({"bundle": "x", **values})


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_export_gate_session_answers_like_onnxruntime(default_bundle, precision):
    """export.sessions.OpenVinoSession is what the bf16 gate ran on: the graph's names and shapes, and the
    values of onnxruntime fp32 on the same graph (f32: within the parity gate's 1e-4; bf16: its rounding)."""
    from export.sessions import ort_session

    if precision == "bf16" and not BF16:
        pytest.skip(NO_BF16)
    outputs = ["last_hidden_state", "sentence_embedding"]
    session = OpenVinoSession(default_bundle / "encodings-fp32.onnx", outputs, precision)
    assert session.get_providers() == [f"OpenVINO CPU ({precision})"]
    assert [p.name for p in session.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [(p.name, p.shape[-1]) for p in session.get_outputs()] == [("last_hidden_state", 384), ("sentence_embedding", 384)]
    ids = np.array([[101, 7592, 2088, 1010, 2129, 2024, 2017, 102], [101, 7592, 102, 0, 0, 0, 0, 0]], dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64)}
    hidden, pooled = session.run(outputs, feed)
    ref_hidden, ref_pooled = ort_session(default_bundle / "encodings-fp32.onnx").run(
        outputs, {**feed, "token_type_ids": np.zeros_like(ids)})
    assert hidden.shape == ref_hidden.shape == (2, 8, 384) and pooled.shape == ref_pooled.shape == (2, 384)
    real = feed["attention_mask"].astype(bool)
    if precision == "fp32":
        np.testing.assert_allclose(hidden[real], ref_hidden[real], atol=1e-4)
        np.testing.assert_allclose(pooled, ref_pooled, atol=1e-4)
    else:
        assert cosines(pooled, ref_pooled).min() >= 0.9999, cosines(pooled, ref_pooled)
        assert cosines(hidden[real], ref_hidden[real]).min() >= 0.999, cosines(hidden[real], ref_hidden[real]).min()
        assert np.abs(pooled - ref_pooled).max() > 0  # bf16 really ran: OpenVINO on bf16 units rounds


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_each_runtime_serves_the_routes_with_reference_embeddings(runtime, ray_serve, service_url, metrics_url,
                                                                  default_bundle, checkpoint):
    """Parity and routing for each runtime, through Serve and HTTP: embeddings against
    sentence-transformers, attention requests on the full graph, everything else on the encodings
    graph of the runtime, and /info and the model-info metric say which."""
    from sentence_transformers import SentenceTransformer

    name = f"rt-{runtime}"
    deploy({"runtime": runtime, "num_cpus": 0.5}, name, f"/{name}", default_bundle)
    try:
        app = {"application": name}
        with httpx.Client(base_url=f"{ray_serve.url}/{name}", timeout=60) as client:
            info = client.get("/info").json()
            precision = "bf16" if runtime == "openvino" and BF16 else "fp32"
            encodings = f"encodings-{precision}" + ("-openvino" if runtime == "openvino" else "")
            assert (info["runtime"], info["precision"], info["graphs"]["encodings"]) == (runtime, precision, encodings), info
            assert info["graph_providers"]["encodings"] == ("OpenVINO CPU" if runtime == "openvino" else "CPUExecutionProvider")
            # texts that need only their embedding run on the packed graph of the same runtime and precision
            packed = f"packed-{precision}" + ("-openvino" if runtime == "openvino" else "")
            assert info["graphs"]["packed"] == packed, info["graphs"]

            def runs(f):
                return (total(f, "ray_encoder_inference_runs_total", **app, graph=info["graphs"]["attentions"]),
                        total(f, "ray_encoder_inference_runs_total", **app, graph=packed))

            before = runs(settled(metrics_url, runs))
            got = client.post("/v1/embeddings", json={"input": TEXTS}).json()
            attention = client.post("/v1/encode", json={"inputs": TEXTS[:1], "attention": {"layers": [5], "heads": [0]}}).json()
        after = runs(poll(metrics_url, lambda f: runs(f)[0] > before[0] and runs(f)[1] > before[1],
                          "runs on both graphs to be counted"))
        assert after[0] - before[0] == 1 and after[1] - before[1] >= 1
        reference = SentenceTransformer(str(checkpoint.path), device="cpu").encode(TEXTS)
        embeddings = np.array([d["embedding"] for d in got["data"]])
        assert cosines(embeddings, reference).min() >= (0.9999 if precision == "bf16" else 0.99999)
        assert np.isfinite(np.array(attention["data"][0]["attention"]["data"])).all()
        info_series = poll(metrics_url, lambda f: total(f, "ray_encoder_model_info", **app, runtime=runtime, precision=precision) >= 1,
                           "the model-info gauge to name the runtime")
        assert total(info_series, "ray_encoder_model_info", **app, runtime=runtime, precision=precision) == 1
    finally:
        from ray import serve

        serve.delete(name)
