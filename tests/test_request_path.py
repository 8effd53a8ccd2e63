"""make bench-request-path (benchmarks/request_path.py) and its stand-in runtime (benchmarks/standin.py):
the stand-in's outputs have the contract's shapes and dtype for every output the engine asks for; the
harness, smoked at tiny durations against the real service on loopback with the stand-in bound into
its replica, checks every answer's width and writes its rows (page and JSON); and no production
config can select the stand-in. No figure is asserted: targets live in the benchmark."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from benchmarks.request_path import PAGE_END, PAGE_START
from benchmarks.standin import H100, ZERO, StandInLoader, StandInRuntime, latency_model
from bundle.contract import ENCODINGS_OUTPUT_NAMES, OUTPUT_NAMES

ROOT = Path(__file__).resolve().parent.parent


def test_the_stand_in_returns_every_output_in_the_contracts_shapes(default_bundle):
    from bundle.manifest import load_bundle
    from service.config import ServiceSettings
    from service.engine.engine import load_engine
    from service.engine.runner import EncodeJob

    bundle = load_bundle(default_bundle)
    model = bundle.manifest.model
    runtime = StandInLoader(ZERO)(bundle, None, 1, None, 2)
    assert runtime.packed is None and runtime.runtime == "stand-in"  # padded runs, as on CUDA
    assert runtime.sizing == "device"  # sized for a device, as on CUDA (tests/test_device_sizing.py)
    assert runtime.graph_for(["sentence_embedding"]) is runtime.fast
    assert runtime.graph_for(["sentence_embedding", "attentions"]) is runtime.full
    assert runtime.resized(4, 4) is runtime and runtime.describe_cuda()["usable"] is False
    runtime.smoke_test()
    ids = np.arange(3 * 7, dtype=np.int64).reshape(3, 7) % model.vocab_size
    mask = np.ones_like(ids)
    mask[2, 4:] = 0
    out = runtime.run(ids, mask, list(OUTPUT_NAMES))
    assert set(out) == set(OUTPUT_NAMES) and all(a.dtype == np.float32 for a in out.values())
    assert out["last_hidden_state"].shape == (3, 7, model.hidden_size)
    assert out["sentence_embedding"].shape == (3, model.sentence_dim)
    assert out["attentions"].shape == (model.num_layers, 3, model.num_heads, 7, 7)
    assert np.allclose(np.linalg.norm(out["sentence_embedding"], axis=1), 1.0, atol=1e-5)
    assert np.allclose(out["attentions"].sum(-1), 1.0, atol=1e-5) and not out["attentions"][:, 2, :, :, 4:].any()
    assert set(runtime.run(ids, mask, list(ENCODINGS_OUTPUT_NAMES[1:]))) == {"sentence_embedding"}
    with pytest.raises(ValueError, match="no output 'attentions'"):
        runtime.fast.run(ids, mask, ["attentions"])
    # a classifier's logits, one column per label
    classifier = SimpleNamespace(model=model.model_copy(update={"task": "classification", "labels": ["a", "b", "c"]}))
    logits = StandInRuntime(classifier, ZERO).run(ids, mask, ["logits"])["logits"]
    assert logits.shape == (3, 3) and logits.dtype == np.float32

    # through the engine, as a replica computes a batch: the runner scatters each text's outputs
    settings = ServiceSettings(bundle=str(default_bundle))
    engine = load_engine(settings.bundles[0], settings, runtime_loader=StandInLoader(ZERO))
    texts = [np.array([101, 7592, 102]), np.array([101, 7592, 2088, 2003, 102])]
    [result] = engine.runner.compute([EncodeJob(route="test", ids=texts, normalize=True, want_hidden=True)])
    assert result.embeddings.shape == (2, model.sentence_dim) and result.embeddings.dtype == np.float32
    assert [h.shape for h in result.hidden] == [(3, model.hidden_size), (5, model.hidden_size)]
    assert engine.runtime.fast.runs >= 1


def test_latency_models():
    assert ZERO.seconds(128, 49) == 0
    assert H100.seconds(1, 19) < H100.seconds(32, 47) < H100.seconds(128, 49)  # fixed cost plus a term per token
    assert latency_model("1.6").seconds(8, 8) == pytest.approx(0.0016)
    for bad in ("fast", "-1"):
        with pytest.raises(ValueError):
            latency_model(bad)


@pytest.mark.serial  # a Ray cluster of its own: Serve's proxy start timed out at load 15-17 beside the workers
def test_the_harness_smoked_against_the_service_writes_its_rows(default_bundle, tmp_path):
    page, out = tmp_path / "performance.md", tmp_path / "request_path.json"
    page.write_text(f"# page\n\n{PAGE_START}\nold\n{PAGE_END}\nafter\n")
    run = subprocess.run([sys.executable, "-m", "benchmarks.request_path", "--bundle", str(default_bundle), "--smoke",
                          "--no-echo", "--texts", "64", "--page", str(page), "--json", str(out)],
                         cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert run.returncode == 0, f"the harness exited {run.returncode}:\n" + "\n".join(
        (run.stdout + run.stderr).splitlines()[-40:])
    result = json.loads(out.read_text())
    service = [r for r in result["rows"] if r["kind"] == "service"]
    # the phase checked one answer of each kind (every text a vector of the model's width) before measuring
    assert {r["scenario"] for r in service} == {"single", "batches"}
    assert all(r["runtime"] == "stand-in" and r["model"] == "0" and r["replicas"] == 1 for r in service)
    assert all(r["requests"] > 0 and r["failures"] == 0 and r["texts_s"] > 0 for r in service)
    alone = [r for r in result["rows"] if r["kind"] == "engine alone"]
    assert [r["runtime"] for r in alone] == ["stand-in"] and alone[0]["texts_s"] > 0
    text = page.read_text()
    section = text[text.index(PAGE_START):text.index(PAGE_END)]
    assert "old" not in section and text.endswith("after\n")
    assert "service, stand-in, 0 ms | 1 |" in section and "the engine alone, stand-in" in section


# ---- the stand-in can be selected by no production config ----

def test_no_setting_or_config_file_selects_the_stand_in(default_bundle):
    from service.app import build_app
    from service.config import RuntimePreference, ServiceSettings

    assert set(RuntimePreference.__args__) == {"auto", "onnxruntime", "openvino"}
    for values in ({"runtime": "stand-in"}, {"runtime": "standin"}, {"runtime_loader": "benchmarks.standin:StandInLoader"},
                   {"runtime_loader": None}):
        with pytest.raises(ValidationError):
            ServiceSettings.model_validate({"bundle": str(default_bundle), **values})
    # every shipped Serve config goes through build_app, which binds the settings alone
    for config in sorted((ROOT / "deploy").glob("serve_config*.yaml")):
        for application in yaml.safe_load(config.read_text())["applications"]:
            assert application["import_path"] == "service.app:build_app", config
    bound = build_app({"bundle": str(default_bundle)})._bound_deployment
    assert len(bound.init_args) == 1 and isinstance(bound.init_args[0], ServiceSettings) and bound.init_kwargs == {}


def test_service_code_never_reaches_the_stand_in():
    """service/ imports nothing of benchmarks/ (nor loads it by name); only a caller's runtime_loader argument
    changes what load_engine calls, and service/config.py (the settings) has no such field."""
    for path in sorted((ROOT / "service").rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import)\s+benchmarks\b", text, re.M), path
        assert not re.search(r"import_module\(\s*[\"']benchmarks|[\"']benchmarks\.standin", text), path
    assert "runtime_loader" not in (ROOT / "service" / "config.py").read_text()


def test_the_peers_rows_sit_beside_ours_and_its_model_costs_next_to_nothing(tmp_path):
    """--peers infinity: the peer serves NEAR_ZERO (one BERT layer of width 32, MiniLM's tokenizer) as a
    sentence-transformers model (what infinity-emb loads), and its rows render beside the service's with the
    ratios. The peer itself is not started here: it installs into a virtual environment of its own
    (benchmarks/peers.py), which make test never builds."""
    from sentence_transformers import SentenceTransformer

    from benchmarks.families import make_checkpoint
    from benchmarks.request_path import NEAR_ZERO, ratios, table

    model = make_checkpoint("near-zero", tmp_path / "near-zero", shape=NEAR_ZERO)
    encoder = SentenceTransformer(str(model), device="cpu")
    vectors = encoder.encode(["a short text", "ein kurzer Text, etwas länger"])
    assert vectors.shape == (2, 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert sum(p.numel() for n, p in encoder.named_parameters() if "embeddings" not in n) < 20_000  # one tiny layer

    def row(kind, scenario, texts_s, label):
        return {"label": label, "kind": kind, "model": "0" if kind == "service" else None, "replicas": 1,
                "scenario": scenario, "per_request": 1 if scenario == "single" else 32, "texts_s": texts_s,
                "texts_s_per_core": texts_s / 2, "p50": 5.0, "p99": 9.0, "failures": 0,
                "cpu_ms_per_text": {"peer server" if kind == "peer" else "encoder": 1.0}}

    rows = [row("service", "single", 300, "stand-in 0"), row("service", "batches", 4000, "stand-in 0"),
            row("peer", "single", 600, "infinity-emb 0.0.77"), row("peer", "batches", 2000, "infinity-emb 0.0.77")]
    text = table(rows, "header")
    assert "| infinity-emb 0.0.77 (torch), one BERT layer of width 32: the peer's request path | 1 | 600 (300/core)" in text
    said = ratios(rows)
    assert "single texts: the service at 0 ms / infinity-emb on a near-zero model, 1 replica each: 0.50x" in said
    assert "client batches: the service at 0 ms / infinity-emb on a near-zero model, 1 replica each: 2.00x" in said


def test_a_phase_never_chooses_a_port_its_parent_gave_the_cluster(monkeypatch):
    """A phase process inherits the cluster's ports from run_phase (local_cluster_ports, chosen in the parent) and
    chooses its own HTTP port with free_port: that port was once HAProxy's stats port ('cannot bind socket
    (Address already in use)' for the http frontend, 2026-11-29). In a range of 100 ports, 96 choices never
    take one of the 4 the environment names."""
    from service.hosting import processes

    low = 31000
    monkeypatch.setattr(processes, "FREE_PORT_LOW", low)
    monkeypatch.setattr(processes, "_ephemeral_low", lambda: low + 100)
    monkeypatch.setattr(processes, "_taken", set())
    reserved = dict(zip(processes.CLUSTER_PORT_ENV, (low + 3, low + 40, low + 77, low + 99), strict=True))
    for key, port in reserved.items():
        monkeypatch.setenv(key, str(port))
    chosen = {processes.free_port() for _ in range(96)}
    assert not chosen & set(reserved.values())
