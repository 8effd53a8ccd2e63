"""make gpu-check: what the day a GPU is there must prove, in one command.

1. One line per CUDA step (build, libraries, driver, device; service/runtimes/cuda.py). Without a usable GPU
   it stops there, non-zero, naming what is missing.
2. Parity of every CUDA graph of the bundle against the same graph on CPU: the full graph and the
   fp32 encodings graph within 1e-4 (TF32 off, as the service runs them), the fp16 encodings graph
   by cosine against CPU fp32, held to the floor of its own export gate.
3. Throughput of batches of 1, 8, 32 and 128 texts on CUDA, per encodings graph.
4. The service end to end: `python -m service --provider cuda`, /v1/embeddings against in-process
   CPU fp32, /info naming CUDA and the device, SIGTERM, exit 0.
5. The service's rate on the device (issue 56), before that SIGTERM: /v1/embeddings in client batches of
   32 and in single texts at 64 connections (wrk where it is on the PATH, else httpx clients in this
   process), each beside step 3's engine at batches of 128 on the graph the service serves (in a dry run,
   fp32 on every CPU).

`--service-replicas 1,8` runs steps 4 and 5 once per replica count, each count sharing the one GPU in
equal parts (`--replica-num-gpus 1/N`): how many replicas it takes to keep a GPU busy (docs/gpu.md).

`--dry-run-on-cpu` runs steps 2-4 with the CPU standing in for the GPU, so that the suite proves this
script's own code on a machine without one; its figures say nothing about a GPU and are labelled so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.corpus import sentences
from benchmarks.local_service import LocalService
from bundle.contract import ENCODINGS_OUTPUT_NAMES, OUTPUT_NAMES
from bundle.manifest import Bundle, load_bundle
from service.engine.runner import pad
from service.runtimes.cuda import CUDA, CudaOptions, check_cuda
from service.runtimes.onnxruntime import CPU, OrtGraph, _session_options, with_options
from service.engine.tokenization import TextTokenizer

ROOT = Path(__file__).resolve().parents[1]
FP32_ATOL = 1e-4
BATCH_SIZES = (1, 8, 32, 128)
RATE_CONNECTIONS = 64  # issue 56: the service on a GPU at 64 connections


def say(line: str) -> None:
    print(line, flush=True)


def graphs(bundle: Bundle) -> list[tuple[str, Path, tuple[str, ...]]]:
    """(label, file, outputs) of every graph meant for CUDA: the full graph and the CUDA variants."""
    found = [("full", bundle.graph_path, OUTPUT_NAMES)]
    for precision, variant in bundle.manifest.variants.items():
        if CUDA in variant.providers:
            found.append((f"encodings-{precision}", bundle.variant_path(precision), ENCODINGS_OUTPUT_NAMES))
    return found


def padded(bundle: Bundle, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The texts as the service feeds them to a graph: tokenized, truncated, right-padded (ids, mask)."""
    tokenizer = TextTokenizer(bundle.tokenizer_path, bundle.manifest.model.max_tokens)
    return pad([t.ids for t in tokenizer.encode(texts, truncate=True)], bundle.manifest.model.pad_token_id)


def batches(bundle: Bundle, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The texts tokenized and padded in batches of mixed length (1, 3 and 8 texts)."""
    out, start = [], 0
    for size in (1, 3, 8, 8):
        if start < len(texts):
            out.append(padded(bundle, texts[start:start + size]))
            start += size
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def parity(bundle: Bundle, device: str, providers: list) -> bool:
    """Each CUDA graph on `providers` against the fp32 graphs on CPU; a line per graph."""
    options = _session_options(os.cpu_count() or 1, 1, False)
    probe = batches(bundle, [*sentences(12, 1, 60, seed=3), "OK", " ".join(["a long text"] * 200)])
    cpu_full = OrtGraph(bundle.graph_path, OUTPUT_NAMES, "full", [CPU], options)
    cpu_fp32 = OrtGraph(bundle.variant_path("fp32"), ENCODINGS_OUTPUT_NAMES, "encodings-fp32", [CPU], options)
    ok = True
    for label, path, outputs in graphs(bundle):
        graph = OrtGraph(path, outputs, label, providers, options)
        if graph.provider != providers_first(providers):
            say(f"parity     FAILED      {label}: the session runs on {graph.provider}, not {providers_first(providers)}")
            ok = False
            continue
        reference = cpu_full if label == "full" else cpu_fp32
        if label.endswith("fp16"):
            gate = bundle.manifest.variants["fp16"].quality
            floor = gate.min_cosine_floor if gate else 0.99
            worst = min(float(cosine(graph.run(i, m, ["sentence_embedding"])["sentence_embedding"],
                                     reference.run(i, m, ["sentence_embedding"])["sentence_embedding"]).min())
                        for i, m in probe)
            passed = worst >= floor
            say(f"parity     {'ok' if passed else 'FAILED':<11} {label} on {device} vs fp32 on CPU: "
                f"min cosine {worst:.6f} (floor {floor:g}, the export gate's)")
        else:
            worst_by_output = {name: 0.0 for name in outputs}
            for i, m in probe:
                got, want = graph.run(i, m, outputs), reference.run(i, m, outputs)
                real = m.astype(bool)
                for name in outputs:
                    diff = np.abs(got[name] - want[name])
                    if name == "last_hidden_state":
                        diff = diff[real]
                    elif name == "attentions":  # [layers, batch, heads, q, k]: real queries and keys
                        diff = diff * (real[None, :, None, :, None] & real[None, :, None, None, :])
                    worst_by_output[name] = max(worst_by_output[name], float(diff.max()))
            passed = max(worst_by_output.values()) <= FP32_ATOL
            figures = ", ".join(f"{n} {v:.2e}" for n, v in worst_by_output.items())
            say(f"parity     {'ok' if passed else 'FAILED':<11} {label} on {device} vs CPU: max abs diff {figures} "
                f"(<= {FP32_ATOL:g}, TF32 off)")
        ok &= passed
    return ok


def providers_first(providers: list) -> str:
    first = providers[0]
    return first[0] if isinstance(first, tuple) else first


def throughput(bundle: Bundle, device: str, providers: list, repeats: int) -> dict[str, dict[int, float]]:
    """texts/s and ms per batch of each encodings graph, batches of 1/8/32/128 texts of 8-40 words;
    returns texts/s by graph label ("encodings-fp16") and batch size."""
    options = _session_options(os.cpu_count() or 1, 1, False)
    rates: dict[str, dict[int, float]] = {}
    for label, path, outputs in graphs(bundle):
        if label == "full":
            continue
        graph = OrtGraph(path, outputs, label, providers, options)
        row = []
        for size in BATCH_SIZES:
            ids, mask = padded(bundle, sentences(size, seed=size))
            graph.run(ids, mask, ["sentence_embedding"])  # warm-up: kernels chosen, arena grown
            started = time.perf_counter()
            for _ in range(repeats):
                graph.run(ids, mask, ["sentence_embedding"])
            seconds = (time.perf_counter() - started) / repeats
            rates.setdefault(label, {})[size] = size / seconds
            row.append(f"{size}: {size / seconds:.0f} texts/s ({seconds * 1000:.1f} ms)")
        say(f"throughput {label} on {device}: " + ", ".join(row))
    return rates


@dataclass
class RateLoad:
    """Step 5's load: seconds per scenario (after a warm-up of a fifth of it) and connections."""
    seconds: float = 15.0
    connections: int = RATE_CONNECTIONS


def service_rates(url: str, precision: str, engine: dict[str, dict[int, float]], rate_load: RateLoad) -> bool:
    """The service's /v1/embeddings rate in client batches of 32 and in single texts, each beside the
    engine's rate at batches of 128 on the graph the service serves (step 3): issue 56's 'at least 50% of
    the engine alone at batches of 128'. True when requests were answered and none failed."""
    import asyncio
    import shutil

    from benchmarks.service_phase import load
    from benchmarks.wrk_load import run_wrk

    texts = sentences(512, seed=56)
    best = engine.get(f"encodings-{precision}", {}).get(max(BATCH_SIZES))
    ok = True
    for label, per_request in (("client batches of 32", 32), ("single texts", 1)):
        bodies = ([{"input": t} for t in texts] if per_request == 1 else
                  [{"input": [texts[(i * 32 + k) % len(texts)] for k in range(32)]} for i in range(64)])
        if shutil.which("wrk"):
            lines = [json.dumps(b) for b in bodies]
            run_wrk(url, "/v1/embeddings", lines, rate_load.connections, rate_load.seconds / 5)  # warm-up
            m = run_wrk(url, "/v1/embeddings", lines, rate_load.connections, rate_load.seconds)
            rate, p50, p99, failures, loader = m["texts_s"] * per_request, m["p50"], m["p99"], m["failures"], "wrk"
        else:
            asyncio.run(load(url, bodies, rate_load.connections, "/v1/embeddings", rate_load.seconds / 5))
            wall, latencies, failures = asyncio.run(load(url, bodies, rate_load.connections, "/v1/embeddings", rate_load.seconds))
            rate = (len(latencies) - failures) * per_request / wall
            p50, p99 = (float(np.percentile(latencies, q)) * 1000 for q in (50, 99))
            loader = "httpx clients in this process: on single texts the loader may be the bound"
        versus = f" = {rate / best:.2f}x the engine's encodings-{precision} at batches of 128 ({best:,.0f})" if best else ""
        passed = failures == 0 and rate > 0  # no answer in the whole window is a failure too
        ok &= passed
        say(f"rate       {'ok' if passed else 'FAILED':<11} {label}, {rate_load.connections} connections "
            f"({loader}): {rate:,.0f} texts/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms, failures {failures}{versus}")
    return ok


def service_end_to_end(bundle_dir: Path, bundle: Bundle, provider: str, timeout_s: float,
                       engine: dict[str, dict[int, float]] | None = None, rate_load: RateLoad | None = None,
                       replicas: int = 1) -> bool:
    """`python -m service --provider PROVIDER` as a user starts it: ready, embeddings equal to CPU fp32
    in-process (to the fp16 floor when it serves fp16), /info names the provider, then (with `rate_load`)
    its rate beside the engine's (step 5); SIGTERM exits 0. More than one replica share the GPU equally."""
    # in a dry run the CPU serves the fp32 graph step 3 measured in CUDA's place: under `auto` a CPU with bf16
    # units would serve bf16, which step 3 does not measure, and step 5 would have no engine rate beside it
    pinned = ("--precision", "fp32") if provider == "cpu" else ()
    shared = ("--replica-num-gpus", f"{1 / replicas:.4f}") if provider == "cuda" and replicas > 1 else ()
    say(f"service    {replicas} replica{'s' if replicas > 1 else ''}{' sharing the GPU' if shared else ''}")
    service = LocalService(bundle_dir, "--provider", provider, *pinned, "--replicas", str(replicas), *shared)
    try:
        info = _check_service(service, bundle, provider, timeout_s)
        passed = info is not None
        if passed and rate_load is not None:
            passed = service_rates(service.url, info["precision"], engine or {}, rate_load)
    finally:
        code = service.stop()
        say(f"service    {'ok' if code == 0 else 'FAILED':<11} SIGTERM: exit {code}")
    return passed and code == 0


def _check_service(service: LocalService, bundle: Bundle, provider: str, timeout_s: float) -> dict | None:
    """The service's /info when every check passed, else None."""
    if not service.ready(timeout_s):
        say(f"service    FAILED      python -m service --provider {provider} did not start: "
            + " | ".join(line.strip() for line in service.lines[-5:]))
        return None
    url = service.url
    texts = sentences(5, seed=11)
    got = np.array([d["embedding"] for d in post(f"{url}/v1/embeddings", {"input": texts})["data"]])
    info = json.loads(urllib.request.urlopen(f"{url}/info", timeout=30).read())
    cpu = OrtGraph(bundle.variant_path("fp32"), ENCODINGS_OUTPUT_NAMES, "encodings-fp32", [CPU],
                   _session_options(1, 1, False))
    ids, mask = padded(bundle, texts)
    want = cpu.run(ids, mask, ["sentence_embedding"])["sentence_embedding"]
    worst = float(cosine(got, want).min())
    gate = bundle.manifest.variants["fp16"].quality if info["precision"] == "fp16" else None
    floor = gate.min_cosine_floor if gate else 0.9999
    expected = CUDA if provider == "cuda" else CPU
    gpu = info["replica"]["gpu"]
    passed = worst >= floor and info["provider"] == expected
    say(f"service    {'ok' if passed else 'FAILED':<11} --provider {provider}: {info['provider']}, "
        f"{info['precision']} ({info['precision_note']}), device {gpu['device_id']} "
        f"(Ray GPU ids {gpu['ray_gpu_ids']}), /v1/embeddings min cosine vs CPU fp32 {worst:.6f} (>= {floor:g})")
    if info["cuda"]["provider_options"]:
        say(f"           provider options {info['cuda']['provider_options']}")
    return info if passed else None


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=ROOT / "bundles/all-MiniLM-L6-v2")
    p.add_argument("--repeats", type=int, default=20, help="runs per throughput figure")
    p.add_argument("--no-service", action="store_true", help="skip the end-to-end service step")
    p.add_argument("--dry-run-on-cpu", action="store_true",
                   help="after the CUDA steps, run the rest on CPU (proves this script, measures no GPU)")
    p.add_argument("--service-timeout-s", type=float, default=300)
    p.add_argument("--no-rates", action="store_true", help="skip step 5, the service's rate under load")
    p.add_argument("--rate-seconds", type=float, default=15, help="step 5: seconds of load per scenario")
    p.add_argument("--rate-connections", type=int, default=RATE_CONNECTIONS, help="step 5: connections")
    p.add_argument("--service-replicas", default="1",
                   help="steps 4 and 5 once per replica count, comma-separated (e.g. 1,8); they share the GPU")
    a = p.parse_args(argv)

    check = check_cuda(0)
    for line in check.lines():
        say(line)
    if not check.usable and not a.dry_run_on_cpu:
        say(f"gpu-check: CUDA cannot be used here: {check.reason}")
        return 1
    bundle = load_bundle(a.bundle)
    if check.usable:
        device, provider = f"CUDA ({check.device.name})" if check.device else "CUDA", "cuda"
        providers = with_options([CUDA, CPU], CudaOptions(device_id=0, use_tf32=False))
    else:
        say("gpu-check: no usable GPU; the steps below run on CPU in its place (a dry run of this script, "
            "not a GPU measurement)")
        device, provider, providers = "CPU (dry run)", "cpu", [CPU]
    ok = parity(bundle, device, providers)
    engine = throughput(bundle, device, providers, a.repeats)
    if not a.no_service:
        rate_load = None if a.no_rates else RateLoad(a.rate_seconds, a.rate_connections)
        for replicas in (int(n) for n in a.service_replicas.split(",")):
            ok &= service_end_to_end(a.bundle, bundle, provider, a.service_timeout_s, engine, rate_load, replicas)
    say(f"gpu-check: {'PASSED' if ok else 'FAILED'}{' (dry run on CPU)' if not check.usable else ''}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
