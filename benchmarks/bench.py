"""make bench: the performance targets, measured side by side in one run on the same texts.

In-process references first (sentence-transformers, and onnxruntime on each of the bundle's
graphs), then the service over HTTP on loopback, one process per configuration (precision,
ingress), see benchmarks/service_phase.py. Prints every row (texts/s, p50/p95/p99, CPU per text
by component), then the targets table with the measured ratios, and writes that table, with the
machine it ran on, into docs/performance.md between the bench markers, and the headline figures
into README.md between the summary markers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.corpus import sentences
from benchmarks.engine_alone import model_cost, physical_bound
from bundle.contract import ENCODINGS_OUTPUT_NAMES, INPUT_NAMES
from benchmarks.peers import ensure_infinity, measure_infinity, parse_peers
from benchmarks.service_phase import ROUTES
from benchmarks.wrk_load import ensure_wrk, wrk_version

# Ray Serve's per-request options, measured against its defaults with --variants (each an environment
# of the Ray processes); what is kept is what the service sets itself.
VARIANTS = {
    "main-loop": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"},  # user code on the replica's main event loop
    "throughput-optimized": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},  # Ray's bundle of per-request shortcuts
    "no-gc-freeze": {"RAY_SERVE_FREEZE_GC_ON_STARTUP": "0"},  # Ray's default freezes start-up objects out of the GC
}
README_START = "<!-- bench:start -->"
README_END = "<!-- bench:end -->"
SUMMARY_START = "<!-- summary:start -->"  # the README's headline figures (summary())
SUMMARY_END = "<!-- summary:end -->"
SHORT_TEXT = "A short text."


def bench_sentence_transformers(texts: list[str], batch: int, precision: str = "fp32",
                                checkpoint: Path | None = None) -> tuple[float, np.ndarray, object]:
    """texts/s of SentenceTransformer.encode in batches of `batch` on every core, its embeddings (at fp32:
    the reference every served precision's cosine is taken against) and the model. precision bf16 loads
    the weights in bf16, as a user does with one flag (`model_kwargs={"dtype": torch.bfloat16}`;
    sentence-transformers 6.2 reads `dtype` or the older `torch_dtype`, which transformers 5 deprecates)."""
    import torch
    from sentence_transformers import SentenceTransformer

    from export.checkpoint import resolve_checkpoint

    torch.set_num_threads(os.cpu_count() or 1)
    kwargs = {"model_kwargs": {"dtype": torch.bfloat16}} if precision == "bf16" else {}
    model = SentenceTransformer(str(checkpoint or resolve_checkpoint("default")[0]), device="cpu", **kwargs)
    model.encode(texts[:64], batch_size=batch)
    started = time.perf_counter()
    embeddings = model.encode(texts, batch_size=batch)
    return len(texts) / (time.perf_counter() - started), np.asarray(embeddings, dtype=np.float32), model


def bf16_units() -> bool:
    """Whether this CPU has bf16 matrix units (OpenVINO's CPU plugin says so): where peers run bf16 too."""
    from service.runtimes.openvino import check_openvino

    return check_openvino().bf16_units


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def batch_rate(run, ids: list[list[int]], order: list[int], batch: int, outputs: list[str]) -> float:
    """texts/s of `run` (a graph's run(ids, mask, outputs)) over the texts in `order`, in batches of
    `batch`, after two batches of warm-up."""
    from service.engine.runner import pad

    for i in range(0, 2 * batch, batch):  # warm-up
        run(*pad([ids[j] for j in order[i : i + batch]], 0), outputs)
    started = time.perf_counter()
    for i in range(0, len(order), batch):
        run(*pad([ids[j] for j in order[i : i + batch]], 0), outputs)
    return len(order) / (time.perf_counter() - started)


class ReferenceSamples:
    """In-process onnxruntime fp32 on the fused encodings graph, length-sorted batches: what every
    target ratio divides by. One reading moved by a quarter between runs (605, 485, 408 texts/s), and the
    first of a run, in the process that has just run sentence-transformers and OpenVINO, tends to
    read low (504 and 545 in two runs, against 550-627 after), so the benchmark samples it again after each service phase,
    while nothing else runs, and the ratios divide by the median of all samples."""

    def __init__(self, bundle, texts: list[str], batch: int, threads: int):
        from service.engine.tokenization import TextTokenizer

        self.bundle, self.batch, self.threads = bundle, batch, threads
        self.tokenizer = TextTokenizer(bundle.tokenizer_path, bundle.manifest.model.max_tokens)
        self.ids = [t.ids for t in self.tokenizer.encode(texts, True)]
        self.by_length = sorted(range(len(texts)), key=lambda i: len(self.ids[i]))
        self.samples: list[float] = []

    def add(self, rate: float) -> float:
        self.samples.append(rate)
        return rate

    def sample(self, after: str) -> float:
        """One more sample, in a fresh session that is closed after it (its threads then stop spinning)."""
        from service.runtimes.onnxruntime import OrtEncoder

        encoder = OrtEncoder(self.bundle, "auto", intra_op_threads=self.threads, precision="fp32")
        rate = self.add(batch_rate(encoder.fast.run, self.ids, self.by_length, self.batch, ["sentence_embedding"]))
        del encoder
        print(f"  in-process onnxruntime fp32 after {after}: {rate:.0f} texts/s (median of {len(self.samples)} "
              f"samples {self.median():.0f})", flush=True)
        return rate

    def median(self) -> float:
        return statistics.median(self.samples)


def bench_onnxruntime(texts: list[str], batch: int, bundle_dir: Path, threads: int,
                      reference: np.ndarray) -> tuple[dict, ReferenceSamples]:
    """texts/s of each graph on length-sorted batches (full graph also in arrival order), the time
    of one call on a short text through the fp32 encodings graph (ms), OpenVINO's f32 and bf16 on
    the fp32 encodings graph, and each one's min cosine against sentence-transformers; and the
    fp32 encodings graph's first reference sample."""
    from bundle.manifest import load_bundle
    from service.engine.runner import pad
    from service.runtimes.onnxruntime import OrtEncoder

    samples = ReferenceSamples(load_bundle(bundle_dir), texts, batch, threads)
    bundle, tokenizer, ids, by_length = samples.bundle, samples.tokenizer, samples.ids, samples.by_length

    def speed(run, order: list[int], outputs: list[str]) -> float:
        return batch_rate(run, ids, order, batch, outputs)

    def fidelity(run) -> float:
        got = np.zeros_like(reference, dtype=np.float64)
        for i in range(0, len(by_length), batch):
            chunk = by_length[i : i + batch]
            got[chunk] = run(*pad([ids[j] for j in chunk], 0), ["sentence_embedding"])["sentence_embedding"]
        return min_cosine(got, reference)

    out = {"provider": None, "threads": None}
    for precision in ("fp32", "int8"):
        if precision not in bundle.manifest.variants:
            continue
        encoder = OrtEncoder(bundle, "auto", intra_op_threads=threads, precision=precision)
        out["provider"], out["threads"] = encoder.provider, encoder.threads
        if precision == "fp32":
            out["full_unsorted"] = speed(encoder.full.run, list(range(len(texts))), ["sentence_embedding"])
            out["full_sorted"] = speed(encoder.full.run, by_length, ["sentence_embedding"])
            one = [t.ids for t in tokenizer.encode([SHORT_TEXT], True)]
            calls = []
            for _ in range(100):
                started = time.perf_counter()
                encoder.fast.run(*pad(one, 0), ["sentence_embedding"])
                calls.append(time.perf_counter() - started)
            out["one_call_ms"] = statistics.median(calls[10:]) * 1000
        out[f"{precision}_sorted"] = speed(encoder.fast.run, by_length, ["sentence_embedding"])
        if precision == "fp32":
            samples.add(out["fp32_sorted"])
        out[f"{precision}_cosine"] = fidelity(encoder.fast.run)
    from service.runtimes.openvino import OvGraph, check_openvino

    check = check_openvino()
    out["bf16_units"], out["cpu"] = check.bf16_units, check.reason or check.cpu
    for precision in ("fp32", "bf16") if check.installed else ():
        if precision == "bf16" and not check.bf16_units:
            continue
        graph = OvGraph(bundle.variant_path("fp32"), INPUT_NAMES, ENCODINGS_OUTPUT_NAMES, f"openvino-{precision}",
                        precision, threads, streams=1)
        out[f"openvino_{precision}_sorted"] = speed(graph.run, by_length, ["sentence_embedding"])
        out[f"openvino_{precision}_cosine"] = fidelity(graph.run)
    return out, samples


def protocol_phase(ingress: str, common: dict, settings: dict, batch: int) -> dict:
    """KServe v2 over gRPC and over HTTP on one service: client batches of `batch` at 4 clients and
    single texts at 32, each protocol in turn on the same replica."""
    scenarios = []
    for per_request, concurrency, kind in ((batch, 4, f"client batches of {batch}"), (1, 32, "single texts")):
        scenarios += [
            {"label": f"{kind} (grpc.aio, KServe v2 ModelInfer over gRPC)", "per_request": per_request,
             "concurrency": concurrency, "loadgen": "grpc.aio", "protocol": "grpc"},
            {"label": f"{kind} (httpx, KServe v2 over HTTP, binary outputs)", "per_request": per_request,
             "concurrency": concurrency, "loadgen": "httpx", "protocol": "v2"},
        ]
    return {"label": f"KServe v2, default config, {ingress}", "ingress": ingress, **common, "settings": settings,
            "scenarios": scenarios}


def tracing_phase(ingress: str, common: dict, settings: dict, batch: int, traced: bool, loadgen: str) -> dict:
    """The default config with OpenTelemetry tracing off, or on at full sampling: single texts at 32
    clients (where a span costs the most per text) and client batches, with the load generators of
    the other rows of each kind (wrk for single texts unless --loadgen says otherwise)."""
    on = "on" if traced else "off"
    return {"label": f"default config, tracing {'on (100% sampled)' if traced else 'off'}, {ingress}", "ingress": ingress,
            **common, "settings": settings, "tracing": traced,
            "scenarios": [{"label": f"single texts ({loadgen}, tracing {on})", "per_request": 1,
                           "concurrency": 32, "loadgen": loadgen, "tracing_row": True},
                          {"label": f"client batches of {batch} (httpx, tracing {on})",
                           "per_request": batch, "concurrency": 4, "loadgen": "httpx", "tracing_row": True}]}


def service_phase(spec: dict) -> list[dict]:
    """Run one service configuration in its own process (see service_phase.py); its rows."""
    with tempfile.TemporaryDirectory() as scratch:
        spec_path, out = Path(scratch) / "spec.json", Path(scratch) / "rows.json"
        spec_path.write_text(json.dumps({**spec, "out": str(out)}))
        result = subprocess.run([sys.executable, "-m", "benchmarks.service_phase", str(spec_path)], timeout=1200)
        if result.returncode != 0 or not out.exists():
            raise SystemExit(f"service phase {spec['label']} failed (exit {result.returncode})")
        return json.loads(out.read_text())


def machine() -> str:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")), platform.processor() or "unknown CPU",
    ) if Path("/proc/cpuinfo").exists() else platform.processor()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = [name for name, flag in (("AVX-512", "avx512f"), ("VNNI", "avx512_vnni"), ("AMX", "amx_tile")) if flag in flags]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} CPUs ({model}{', ' + '/'.join(isa) if isa else ''}), {mem:.0f} GiB, {platform.machine()}"


BEFORE_ENGINE_P50_MS = 4.8  # p50 of one short text at 1 client, the last make bench before engine/batcher.py
PEER_HINT = "not measured (make bench PEERS=infinity)"


def targets(rows: list[dict], ort: dict, peer_missing: str = PEER_HINT) -> list[dict]:
    """The issue's targets table, every ratio taken side by side in this run: the service (default
    settings; the best ingress where there are two, named) against in-process onnxruntime on the
    same graph (length-sorted batches) and against the peer server (infinity-emb), when measured."""

    def pick(precision: str, per_request: int, concurrency: int, short: bool = False, mixed: bool = False,
             peer: bool = False) -> list[dict]:
        return [r for r in rows if r.get("precision") == precision and r.get("per_request") == per_request
                and r.get("concurrency") == concurrency and r.get("short", False) == short
                and r.get("mixed", False) == mixed and r.get("batching", True) and bool(r.get("peer")) == peer
                and not r.get("bound") and not r.get("protocol") and not r.get("tracing_row")]

    def best(found: list[dict]) -> dict | None:
        return max(found, key=lambda r: r["texts_s"]) if found else None

    def verdict(checks: list[tuple[str, float | None, float]]) -> tuple[bool | None, str]:
        """checks: (what, measured ratio or None when not measured, goal) -> (met, the met column)."""
        failing = [(what, ratio, goal) for what, ratio, goal in checks if ratio is not None and ratio < goal]
        missing = [what for what, ratio, _ in checks if ratio is None]
        if failing:
            gaps = "; ".join(f"{ratio / goal:.0%} of the {what} target" for what, ratio, goal in failing)
            return False, f"no ({gaps}{'; ' + ', '.join(missing) + ' not measured' if missing else ''})"
        if missing:
            done = [what for what, ratio, _ in checks if ratio is not None]
            return None, f"yes against {', '.join(done)}; {', '.join(missing)} not measured" if done else "not measured"
        return True, "yes"

    peer_name = next((r["peer_name"] for r in rows if r.get("peer_name")), "infinity-emb")
    out = []
    # fp32: the engine issue's goals (0.8x in-process onnxruntime for single texts); int8: the earlier ones
    goals = {"fp32": (0.8, 0.9), "int8": (0.45, 0.9)}
    for precision in ("fp32", "int8"):  # the order: fp32 single texts, fp32 client batches, then int8
        single_goal, batch_goal = goals[precision]
        for kind, per_request, concurrency, ort_goal in (("single texts at 32 clients", 1, 32, single_goal),
                                                          ("client batches of 32 at 4 clients", 32, 4, batch_goal)):
            peer = best(pick("fp32", per_request, concurrency, peer=True))  # the peer runs torch fp32
            r, reference = best(pick(precision, per_request, concurrency)), ort.get(f"{precision}_sorted")
            if r is None or reference is None:
                continue
            on_ort = r["texts_s"] / reference
            on_peer = r["texts_s"] / peer["texts_s"] if peer and peer["texts_s"] else None
            how = f"{r['ingress']}, {r.get('loadgen', 'httpx')}"
            if per_request == 1:
                how += f"; {r['texts_per_batch']:.1f} texts per batch"
            peer_text = (f"{on_peer:.2f}x {peer_name} ({peer['texts_s']:.0f} texts/s)" if on_peer is not None
                         else f"{peer_name} {peer_missing}") + without_ray(rows, precision, per_request, concurrency, reference)
            checks = [("infinity-emb", on_peer, 2.0), (f"in-process onnxruntime {precision}", on_ort, ort_goal)]
            extra_goal = ""
            if per_request == 1 and precision == "fp32":
                batches = best(pick(precision, 32, 4))
                on_batches = r["texts_s"] / batches["texts_s"] if batches else None
                checks += [("own client-batch rate", on_batches, 0.85), ("texts per batch", r["texts_per_batch"] / 8, 1.0)]
                extra_goal = ", >= 0.85x the service's own client-batch rate, >= 8 texts per batch"
                if on_batches is not None:
                    how += f"; {on_batches:.2f}x its client batches"
            met, column = verdict(checks)
            on_peer_goal = f">= 2.0x {peer_name} in the same run"
            on_ort_goal = f">= {ort_goal}x in-process onnxruntime {precision} (sorted batches of 32){extra_goal}"
            out.append({
                "measure": f"{kind}, {precision}, default config",
                # in the order: the peer first for single texts, onnxruntime first for client batches
                "target": f"{on_peer_goal}, and {on_ort_goal}" if per_request == 1 else f"{on_ort_goal}, and {on_peer_goal}",
                "measured": f"{r['texts_s']:.0f} texts/s ({how}) = {on_ort:.2f}x in-process onnxruntime {precision} "
                            f"({reference:.0f} texts/s); {peer_text}",
                "met": met, "column": column,
            })
    found = pick("fp32", 1, 1, short=True)
    if found and "one_call_ms" in ort:
        r = min(found, key=lambda r: r["p50"])
        limit = min(ort["one_call_ms"] + 3, BEFORE_ENGINE_P50_MS)
        peer = pick("fp32", 1, 1, short=True, peer=True)
        peer_text = f"{peer_name} {peer[0]['p50']:.1f} ms" if peer else f"{peer_name} {peer_missing}"
        out.append({"measure": "p50 of one short text at 1 client, default config",
                    "target": f"<= one in-process onnxruntime call ({ort['one_call_ms']:.1f} ms) + 3 ms, and <= "
                              f"{BEFORE_ENGINE_P50_MS} ms (the last run before the engine's own batch queue): {limit:.1f} ms",
                    "measured": f"{r['p50']:.1f} ms ({r['ingress']}, {r.get('loadgen', 'httpx')}); {peer_text}",
                    "met": r["p50"] <= limit,
                    "column": "yes" if r["p50"] <= limit else f"no ({r['p50'] - limit:+.1f} ms)"})
    found = [(c, best(pick("fp32", 1, c, short=(c == 1)))) for c in (1, 8, 32)]
    found = [(c, r) for c, r in found if r]
    if found:
        out.append({"measure": "texts per batch at 1, 8 and 32 single-text clients, fp32", "target": "reported",
                    "measured": ", ".join(f"{c} clients: {r['texts_per_batch']:.1f}" for c, r in found)
                                + f" ({found[-1][1]['ingress']})",
                    "met": None, "column": "reported"})
    out += bf16_targets(rows, ort, peer_name, peer_missing, best, verdict)
    out += equal_precision_targets(rows, ort, peer_name, peer_missing, best, verdict)
    out += protocol_targets(rows)
    out += tracing_targets(rows)
    out += rerank_targets(rows, verdict)
    found = [r for r in rows if r.get("mixed") and r.get("batching", True)]
    if found:
        r = min(found, key=lambda r: r["padding_waste"])
        out.append({"measure": "padding waste, mixed-length client batches (ray_encoder_padded_tokens_total)",
                    "target": "<= 10 % of tokens",
                    "measured": f"{r['padding_waste']:.1%} ({r['ingress']}, client batches of {r['per_request']} "
                                f"texts of 1-200 words, concurrency {r['concurrency']})",
                    "met": r["padding_waste"] <= 0.10,
                    "column": "yes" if r["padding_waste"] <= 0.10 else f"no ({(r['padding_waste'] - 0.10) * 100:+.1f} points)"})
    return out


def protocol_targets(rows: list[dict]) -> list[dict]:
    """KServe v2 over gRPC against the same over HTTP, same run, same replica settings: client batches
    at least as fast (the target); single texts reported."""
    def rate(protocol: str, per_request: int, concurrency: int) -> dict | None:
        return next((r for r in rows if r.get("protocol") == protocol and r["per_request"] == per_request
                     and r["concurrency"] == concurrency), None)

    out = []
    for kind, per_request, concurrency, goal in (("client batches of 32 at 4 clients", 32, 4, 1.0),
                                                  ("single texts at 32 clients", 1, 32, None)):
        grpc_row, http_row = rate("grpc", per_request, concurrency), rate("v2", per_request, concurrency)
        if grpc_row is None or http_row is None:
            continue
        ratio = grpc_row["texts_s"] / http_row["texts_s"]
        met = None if goal is None else ratio >= goal
        out.append({"measure": f"KServe v2 over gRPC vs over HTTP, {kind}, default config",
                    "target": ">= 1.0x v2 over HTTP (binary outputs) in the same run" if goal else "reported",
                    "measured": f"gRPC {grpc_row['texts_s']:.0f} texts/s (p50 {grpc_row['p50']:.1f} ms) = {ratio:.2f}x "
                                f"HTTP v2 {http_row['texts_s']:.0f} texts/s (p50 {http_row['p50']:.1f} ms); {grpc_row['ingress']}",
                    "met": met, "column": "reported" if goal is None else ("yes" if met else f"no ({ratio:.0%})")})
    return out


TRACING_ROUNDS = 3  # rounds of tracing off and on: the phases' own spread is a few percent here, and one
# disturbed phase must not decide the median


def tracing_targets(rows: list[dict]) -> list[dict]:
    """Tracing on at full sampling against off: the median of each over their interleaved phases."""
    out = []
    for kind, per_request, concurrency, goal in (("single texts at 32 clients", 1, 32, 0.95),
                                                  ("client batches of 32 at 4 clients", 32, 4, None)):
        found: dict[bool, list[dict]] = {False: [], True: []}
        for r in rows:
            if r.get("tracing_row") and r["per_request"] == per_request and r["concurrency"] == concurrency:
                found[r["tracing"]].append(r)
        if not (found[False] and found[True]):
            continue
        on, off = (statistics.median(r["texts_s"] for r in found[flag]) for flag in (True, False))
        ratio = on / off
        met = None if goal is None else ratio >= goal
        spread = lambda flag: "/".join(f"{r['texts_s']:.0f}" for r in found[flag])  # noqa: E731
        out.append({"measure": f"OpenTelemetry tracing on (100% sampled, OTLP to a receiver on loopback) vs off, {kind}",
                    "target": f">= {goal}x tracing off (at most 5% of throughput)" if goal else "reported",
                    "measured": f"{on:.0f} texts/s on = {ratio:.2f}x {off:.0f} off (medians of {len(found[True])} "
                                f"interleaved phases each: on {spread(True)}, off {spread(False)})",
                    "met": met, "column": "reported" if goal is None else ("yes" if met else f"no ({ratio:.0%})")})
    return out


def rerank_rows(args, ingress: str, settings: dict) -> list[dict]:
    """CrossEncoder in-process, then the service with the cross-encoder beside the default model: 1 query x
    32 documents of 20-60 words per request, at 1 and 4 clients; and explain on 4 documents, for its cost."""
    from benchmarks.rerank import DOCUMENTS, EXPLAIN_DOCUMENTS, QUERIES, cross_encoder_rate, make_cross_encoder, workload
    from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
    from bundle.manifest import SCHEMA_VERSION, BundleError, load_bundle
    from export.pipeline import ExportOptions, build_bundle

    root = Path("results/bench")
    checkpoint = make_cross_encoder(root / "minilm-l6-cross-encoder")
    bundle = root / "minilm-l6-cross-encoder-bundle"
    try:  # one exported before the bundle's schema changed lacks what came since (a classifier's bf16 variant)
        if load_bundle(bundle).manifest.schema_version < SCHEMA_VERSION:
            raise BundleError(f"{bundle}: an older schema")
    except BundleError:
        print(f"  exporting the cross-encoder to {bundle}", flush=True)
        build_bundle(ExportOptions(str(checkpoint), bundle, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, name="ranker",
                                   force=True), progress=lambda _: None)
    queries, documents = workload()
    rows = []
    fp32_scores = None
    for precision in ("fp32", "bf16") if bf16_units() else ("fp32",):
        reference = cross_encoder_rate(checkpoint, queries, documents, precision, fp32_scores)
        fp32_scores = fp32_scores if fp32_scores is not None else reference["scores"]
        cosine = reference.get("cosine")
        print(f"  CrossEncoder in-process {precision}: {reference['requests_s']:.1f} requests/s ({reference['pairs_s']:.0f} "
              f"pairs/s), p50 {reference['p50']:.0f} ms" + (f", min cosine vs fp32 {cosine:.5f}" if cosine else ""), flush=True)
        rows.append({"engine": f"in-process sentence-transformers CrossEncoder {precision}, 1 query x {DOCUMENTS} documents",
                     "rerank": True, "reference": True, "peer_precision": precision, "texts_s": reference["pairs_s"],
                     "requests_s": reference["requests_s"], "p50": reference["p50"],
                     **({"cosine": cosine} if cosine is not None else {})})
    bundles = [{"path": settings["bundle"]}, {"path": str(bundle.resolve()), "name": "ranker"}]
    spec_settings = {**{k: v for k, v in settings.items() if k != "bundle"}, "bundles": bundles}
    scenarios = [{"label": f"rerank 1 query x {DOCUMENTS} documents (httpx, /v1/rerank)", "rerank": True,
                  "documents": DOCUMENTS, "concurrency": c} for c in (1, 4)]
    scenarios += [{"label": f"rerank 1 query x {EXPLAIN_DOCUMENTS} documents{', explain' if e else ''} (httpx, /v1/rerank)",
                   "rerank": True, "documents": EXPLAIN_DOCUMENTS, "concurrency": 1, "explain": e} for e in (False, True)]
    rows += service_phase({"label": f"cross-encoder, {ingress}", "ingress": ingress, "settings": spec_settings,
                           "texts": [], "rerank": {"model": "ranker", "queries": queries[:QUERIES], "documents": documents},
                           "scenarios": scenarios})
    return rows


RERANK_GOALS = {"fp32": 1.5, "bf16": 1.1}  # 1 x 32 documents at 1 client against CrossEncoder (issue 49)


def rerank_targets(rows: list[dict], verdict=None) -> list[dict]:
    """The heads issue's measures: rerank against CrossEncoder in-process (fp32, and bf16 where the CPU has
    bf16 units; at 1 client issue 49's targets), and what explain costs per document."""
    references = {r.get("peer_precision", "fp32"): r for r in rows if r.get("rerank") and r.get("reference")}
    served = [r for r in rows if r.get("rerank") and not r.get("reference")]
    if "fp32" not in references or not served:
        return []
    out = []
    for r in (r for r in served if r["documents"] == 32):
        checks = [(f"CrossEncoder {p}", r["texts_s"] / ref["texts_s"], RERANK_GOALS[p]) for p, ref in references.items()]
        measured = "; ".join(f"{ratio:.2f}x {what} ({references[what.split()[-1]]['requests_s']:.1f} requests/s, p50 "
                             f"{references[what.split()[-1]]['p50']:.0f} ms)" for what, ratio, _ in checks)
        met, column = verdict(checks) if verdict and r["concurrency"] == 1 else (None, "reported")
        out.append({"measure": f"rerank, 1 query x 32 documents of 20-60 words, {r['concurrency']} client(s) "
                               f"({r.get('runtime', '')} {r.get('precision', 'fp32')})".replace("( ", "("),
                    "target": (" and ".join(f">= {RERANK_GOALS[p]}x CrossEncoder {p}" for p in references)
                               if r["concurrency"] == 1 else "reported, against CrossEncoder in-process on the same pairs"),
                    "measured": f"{r['requests_s']:.1f} requests/s, p50 {r['p50']:.0f} ms = {measured}",
                    "met": met, "column": column, "headline": r["concurrency"] == 1})
    plain = next((r for r in served if r["documents"] != 32 and not r["explain"]), None)
    explained = next((r for r in served if r["explain"]), None)
    if plain and explained:
        per_document = (explained["p50"] - plain["p50"]) / plain["documents"]
        out.append({"measure": f"explain on rerank, per document (1 query x {plain['documents']} documents of 20-60 words)",
                    "target": "reported", "measured": f"+{per_document:.0f} ms per document at the median "
                    f"({explained['p50']:.0f} ms against {plain['p50']:.0f} ms without explain)", "met": None,
                    "column": "reported"})
    return out


def without_ray(rows: list[dict], precision: str, per_request: int, concurrency: int, reference: float) -> str:
    """What the same app and engine do under plain uvicorn with no Ray (benchmarks/plain_server.py), and
    for client batches what the engine alone does with no HTTP either (benchmarks/engine_alone.py), for a
    target's row: the bounds on what any tuning of the Ray Serve side, then of the HTTP side, could reach."""
    out = ""
    for alone, what in ((False, "the same app without Ray (plain uvicorn)"), (True, "the engine alone (no HTTP, no Ray)")):
        found = [r for r in rows if r.get("bound") and bool(r.get("engine_alone")) == alone and r.get("precision") == precision
                 and r.get("per_request") == per_request and r.get("concurrency") == concurrency and not r.get("short")]
        if found:
            r = max(found, key=lambda r: r["texts_s"])
            out += f"; {what}: {r['texts_s']:.0f} texts/s = {r['texts_s'] / reference:.2f}x"
    return out


def engine_alone(bundle: Path, precisions: list[str], seconds: float, flags: tuple[str, ...] = ()) -> list[dict]:
    """The engine with client batches, no HTTP and no Ray, in a process of its own (benchmarks/engine_alone.py);
    flags: more of its arguments (--texts, --seed, --no-reference)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rows.json"
        result = subprocess.run([sys.executable, "-m", "benchmarks.engine_alone", "--bundle", str(bundle), "--seconds",
                                 str(seconds), "--precision", ",".join(precisions), "--json", str(out), *flags], timeout=1200)
        if result.returncode != 0 or not out.exists():
            raise SystemExit(f"the engine-alone phase failed (exit {result.returncode})")
        return json.loads(out.read_text())


def bf16_targets(rows: list[dict], ort: dict, peer_name: str, peer_missing: str, best, verdict) -> list[dict]:
    """The bf16 issue's targets: the default configuration (OpenVINO bf16 where the CPU has bf16 units)
    against in-process onnxruntime fp32 and the peer, and every served precision's fidelity."""
    # the default configuration's /v1/embeddings rows: not the KServe v2 or tracing rows, which run the
    # same configuration through other protocols or with tracing on (their own targets read them)
    default = [r for r in rows if r.get("default_config") and not r.get("protocol") and not r.get("tracing_row")]
    if not default:
        return []
    served = f"{default[0]['runtime']} {default[0]['precision']}"
    reference = ort["fp32_sorted"]

    def one(per_request: int, concurrency: int, short: bool = False, peer: bool = False) -> dict | None:
        pool = [r for r in (rows if peer else default) if r.get("per_request") == per_request and
                r.get("concurrency") == concurrency and r.get("short", False) == short and bool(r.get("peer")) == peer
                and (not peer or r.get("precision") == "fp32")]  # the peer at fp32: the bf16 issue's goal
        return best(pool)

    out = []
    if default[0]["precision"] != "bf16":
        why = ort["cpu"] if not ort["bf16_units"] else "auto measured onnxruntime fp32 faster on its probe batch"
        out.append({"measure": "bf16 targets, default config", "target": "on a CPU with bf16 units",
                    "measured": f"the default serves {served} here: {why}", "met": None, "column": "not applicable"})
    else:
        single, batches, short = one(1, 32), one(32, 4), one(1, 1, short=True)
        peer = one(1, 32, peer=True)
        if single:
            on_ort = single["texts_s"] / reference
            on_peer = single["texts_s"] / peer["texts_s"] if peer else None
            met, column = verdict([("in-process onnxruntime fp32", on_ort, 1.2), (peer_name, on_peer, 3.0)])
            out.append({"measure": f"single texts at 32 clients, default config ({served})",
                        "target": f">= 1.2x in-process onnxruntime fp32 (sorted batches of 32), >= 3.0x {peer_name}",
                        "measured": f"{single['texts_s']:.0f} texts/s ({single['ingress']}, {single['loadgen']}; "
                                    f"{single['texts_per_batch']:.1f} texts per batch) = {on_ort:.2f}x in-process "
                                    f"onnxruntime fp32 ({reference:.0f} texts/s); "
                                    + (f"{on_peer:.2f}x {peer_name} ({peer['texts_s']:.0f} texts/s)" if peer
                                       else f"{peer_name} {peer_missing}") + without_ray(rows, "bf16", 1, 32, reference),
                        "met": met, "column": column})
        if batches:
            on_ort = batches["texts_s"] / reference
            met, column = verdict([("in-process onnxruntime fp32", on_ort, 1.6)])
            out.append({"measure": f"client batches of 32 at 4 clients, default config ({served})",
                        "target": ">= 1.6x in-process onnxruntime fp32 (sorted batches of 32)",
                        "measured": f"{batches['texts_s']:.0f} texts/s ({batches['ingress']}, httpx) = {on_ort:.2f}x "
                                    f"in-process onnxruntime fp32 ({reference:.0f} texts/s)" + without_ray(rows, "bf16", 32, 4, reference),
                        "met": met, "column": column})
        if short:
            out.append({"measure": f"p50 of one short text at 1 client, default config ({served})", "target": "<= 4 ms",
                        "measured": f"{short['p50']:.1f} ms ({short['ingress']}, {short['loadgen']})",
                        "met": short["p50"] <= 4.0,
                        "column": "yes" if short["p50"] <= 4.0 else f"no ({short['p50'] - 4.0:+.1f} ms)"})
    served_cosines = {}
    for r in rows:
        if "cosine" in r and r.get("ingress") and not r.get("peer") and (r.get("default_config") or r.get("precision") == "fp32"):
            served_cosines[f"{r.get('runtime')} {r['precision']}"] = r["cosine"]
    if served_cosines:
        low = min(served_cosines.values())
        int8 = next((r["cosine"] for r in rows if r.get("precision") == "int8" and "cosine" in r), None)
        out.append({"measure": "min cosine vs sentence-transformers of every precision the default and fp32 "
                               "configurations serve, on the benchmark texts",
                    "target": ">= 0.9999",
                    "measured": ", ".join(f"{k} {v:.5f}" for k, v in served_cosines.items())
                                + (f" (int8, opt-in and never chosen by auto: {int8:.5f})" if int8 is not None else ""),
                    "met": low >= 0.9999, "column": "yes" if low >= 0.9999 else "no"})
    return out


EQUAL_PRECISION_GOAL = 1.3  # the default against each peer at its best precision (issue 49)
FP32_PEER_GOAL = 2.0  # the default against each peer at fp32


def peer_rates(rows: list[dict], per_request: int = 32, concurrency: int = 4) -> dict[tuple[str, str], dict]:
    """(peer, precision) -> its row: sentence-transformers in-process, and the peer server's client batches."""
    found: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r.get("inprocess_peer"):
            key = (r["inprocess_peer"], r["peer_precision"])
        elif r.get("peer") and r.get("per_request") == per_request and r.get("concurrency") == concurrency:
            key = (r["peer_name"].split(" ")[0], r["precision"])
        else:
            continue
        if key not in found or r["texts_s"] > found[key]["texts_s"]:
            found[key] = r
    return found


def equal_precision_targets(rows: list[dict], ort: dict, peer_name: str, peer_missing: str, best, verdict) -> list[dict]:
    """Issue 49's targets on client batches of 32 at 4 clients: the default configuration against the best peer
    at its precision (sentence-transformers and infinity-emb in bf16 where the default serves bf16), against the
    peers at fp32, and the fp32 configuration against the fp32 peers; then the engine alone and the physical
    bound beside the service."""
    def served(default: bool) -> dict | None:
        return best([r for r in rows if r.get("per_request") == 32 and r.get("concurrency") == 4 and r.get("ingress")
                     and not r.get("peer") and not r.get("protocol") and not r.get("tracing_row") and not r.get("bound")
                     and not r.get("mixed") and r.get("batching", True)
                     and (r.get("default_config") if default else r.get("precision") == "fp32" and not r.get("default_config"))])

    peers = peer_rates(rows)
    server = peer_name.split(" ")[0]
    out = []
    for default in (True, False):
        r = served(default)
        if r is None:
            continue
        precision = r["precision"]
        equal = {name: p for (name, prec), p in peers.items() if prec == precision}
        fp32 = {name: p for (name, prec), p in peers.items() if prec == "fp32"}
        wanted = [(name, precision, equal.get(name), EQUAL_PRECISION_GOAL) for name in ("sentence-transformers", server)]
        if precision != "fp32":
            wanted += [(name, "fp32", fp32.get(name), FP32_PEER_GOAL) for name in ("sentence-transformers", server)]
        top = max(equal.values(), key=lambda p: p["texts_s"]) if equal else None
        parts, checks = [], []
        for name, at, peer, goal in wanted:
            ratio = r["texts_s"] / peer["texts_s"] if peer else None
            checks.append((f"{name} {at}", ratio, goal))
            if peer is None:
                if name == server:
                    parts.append(f"{server} {at} {peer_missing}")
                continue
            cosine = f", min cosine {peer['cosine']:.5f}" if "cosine" in peer else ""
            if peer is top:  # first: the ratio the headline states
                parts.insert(0, f"{ratio:.2f}x the best peer at {at}, {name} {at} ({peer['texts_s']:.0f} texts/s{cosine})")
            else:
                parts.append(f"{ratio:.2f}x {name} {at} ({peer['texts_s']:.0f} texts/s{cosine})")
        label = f"{r['runtime']} {precision}"
        if default and precision == "bf16":
            met, column = verdict(checks)
            target = (f">= {EQUAL_PRECISION_GOAL}x sentence-transformers bf16 and {server} bf16, >= {FP32_PEER_GOAL}x "
                      f"their fp32")
        elif default:
            met, column = None, "not applicable (no bf16 units: the peers at fp32 only)"
            target = f">= {EQUAL_PRECISION_GOAL}x the peers at their best precision, on a CPU with bf16 units"
        else:
            met, column, target = None, "reported", "reported: the ratio to the best fp32 peer"
        out.append({"measure": f"client batches of 32 at 4 clients, {'default config' if default else 'fp32'} ({label}) "
                               f"vs the peers at equal precision", "target": target, "headline": True,
                    "measured": f"{r['texts_s']:.0f} texts/s ({r['ingress']}, httpx, min cosine "
                                f"{r.get('cosine', float('nan')):.5f}) = " + "; ".join(parts),
                    "met": met, "column": column})
    bounds = ort.get("bounds")
    alone = {r["setting"]: r for r in rows if r.get("engine_alone")}
    for default in (True, False) if bounds else ():
        r = served(default)
        if r is None:
            continue
        bound = bounds["bf16" if r["precision"] == "bf16" else "fp32"]
        engine = alone.get("auto" if default else "fp32")
        engine_text = (f"engine alone {engine['texts_s']:.0f} = {engine['texts_s'] / bound['texts_s']:.1%} of peak"
                       if engine else "engine alone not measured (--bounds)")
        out.append({"measure": f"client batches of 32 at 4 clients, {'default config' if default else 'fp32'} "
                               f"({r['runtime']} {r['precision']}): the service, the engine alone and the physical bound",
                    "target": "reported: the distance to the limit", "headline": default,
                    "measured": f"service {r['texts_s']:.0f} texts/s = {r['texts_s'] / bound['texts_s']:.1%} of peak, "
                                f"{engine_text}, bound {bound['texts_s']:.0f} texts/s at the {bound['precision']} peak "
                                f"({bound['peak_flops'] / 1e9:.0f} GFLOP/s: {bound['how']}; {bound['gflops_per_text']:.3f} "
                                f"GFLOPs per text of {bound['mean_tokens']:.1f} tokens)",
                    "met": None, "column": "reported"})
    return out


def render(rows: list[dict], goals: list[dict], header: str) -> str:
    lines = [header, "", "| measure | target | measured | met |", "| --- | --- | --- | --- |"]
    for g in goals:
        lines.append(f"| {g['measure']} | {g['target']} | {g['measured']} | {g['column']} |")
    lines += ["", "All rows of the same run (texts/s, latency in ms; CPU ms per text by component):", "",
              "| engine | conc. | texts/s | vs ST | min cosine vs ST | p50 | p95 | p99 | texts per batch | CPU ms per text |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    st = rows[0]["texts_s"]
    for r in rows:
        lat = " | ".join(f"{r[k]:.1f}" if k in r else "" for k in ("p50", "p95", "p99"))
        batch = f"{r['texts_per_batch']:.1f}" if "texts_per_batch" in r else ""
        cpu = ", ".join(f"{c} {v:.1f}" for c, v in r.get("cpu_ms_per_text", {}).items())
        cosine = f"{r['cosine']:.5f}" if "cosine" in r else ""
        lines.append(f"| {r['engine']} | {r.get('concurrency', 1)} | {r['texts_s']:.0f} | {r['texts_s'] / st:.2f}x | "
                     f"{cosine} | {lat} | {batch} | {cpu} |")
    return "\n".join(lines)


def write_readme(readme: Path, text: str, start: str = README_START, end: str = README_END) -> None:
    """Replace what lies between the `start` and `end` markers of a page."""
    content = readme.read_text()
    if start not in content or end not in content:
        raise SystemExit(f"{readme}: no {start} ... {end} section to replace")
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{text}\n{end}{tail}")


def headline(measured: str) -> str:
    """A measured figure without its parenthesised details, for the README's front page:
    '270 texts/s (haproxy, wrk; ...) = 0.54x in-process onnxruntime fp32 (501 texts/s)' ->
    '270 texts/s = 0.54x in-process onnxruntime fp32'."""
    while True:
        shorter = re.sub(r"\s*\([^()]*\)", "", measured)
        if shorter == measured:
            return measured.strip()
        measured = shorter


def summary(goals: list[dict], where: str, page: Path) -> str:
    """The headline figures for the README's front page: the rows with a target, and those marked
    `headline` (the ratios to the peers at equal precision, the distance to the physical bound); every
    row, with its target and what is in the way, stays on the page (`page`, linked from the README)."""
    lines = [f"The last `make bench` ({time.strftime('%Y-%m-%d')}, {where}); the targets, every row and what "
             f"is in the way: [{page}]({page}).", "",
             "| measure | measured | target met |", "| --- | --- | --- |"]
    shown = [g for g in goals if g.get("headline") or g["column"] != "reported"]
    lines += [f"| {g['measure']} | {headline(g['measured'])} | {g['column'].split(' (')[0]} |" for g in shown]
    if len(shown) < len(goals):
        lines += ["", f"{len(goals) - len(shown)} more rows, reported without a target, are on the page."]
    return "\n".join(lines)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__)
    p.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: the CPUs this process may use)")
    p.add_argument("--ingress", default="proxy,haproxy",
                   help="ingress configurations to measure, comma-separated: proxy, haproxy, direct")
    p.add_argument("--encoding-format", choices=["float", "base64"], default="base64",
                   help="how the service returns embeddings to the benchmark's clients")
    p.add_argument("--json", type=Path, default=Path("results/bench.json"), help="where to write the rows")
    p.add_argument("--page", "--readme", dest="readme", type=Path, default=Path("docs/performance.md"),
                   help="the page whose bench markers get the table (default docs/performance.md)")
    p.add_argument("--no-readme", "--no-page", dest="no_readme", action="store_true", help="print only")
    p.add_argument("--render", type=Path, default=None, metavar="BENCH_JSON",
                   help="measure nothing: the table and the README's headline again from a run's rows (results/bench.json), "
                        "with the targets as this code reads them")
    p.add_argument("--sweep", action="store_true",
                   help="also single-text requests at concurrency 2-16, and with batching off (for the plot)")
    p.add_argument("--peers", default="", help="peer servers to measure in the same run, comma-separated: infinity "
                   "(installed on first use into results/peers/infinity/venv)")
    p.add_argument("--route", choices=sorted(ROUTES), default="openai",
                   help="the service's route for the load: openai (/v1/embeddings, as the peer's /embeddings) or "
                   "native (/v1/encode)")
    p.add_argument("--loadgen", choices=["wrk", "httpx"], default="wrk",
                   help="load generator of the single-text rows (client batches always use httpx)")
    p.add_argument("--wrk-duration", type=float, default=15, help="seconds of each wrk measurement")
    p.add_argument("--wrk-warmup", type=float, default=3, help="seconds of wrk load before each measurement, dropped")
    p.add_argument("--wrk-threads", type=int, default=2, help="wrk threads (at most one per connection)")
    p.add_argument("--rerank", action=argparse.BooleanOptionalAction, default=True,
                   help="the rerank rows: a MiniLM-L6 cross-encoder built locally (benchmarks/rerank.py) served beside "
                   "the default model, against sentence-transformers' CrossEncoder in-process")
    p.add_argument("--bounds", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure the same app and engine under plain uvicorn without Ray (the bound of Ray Serve's "
                   "share), and the engine alone with client batches, no HTTP and no Ray (the bound of any server)")
    p.add_argument("--rerank-only", action="store_true", help="only the rerank rows (and the in-process references)")
    p.add_argument("--tracing-only", action="store_true",
                   help="only the tracing rows (and the in-process references); prints them, writes no page")
    p.add_argument("--tracing-rounds", type=int, default=TRACING_ROUNDS,
                   help="rounds of tracing off and on, in the order off, on, on, off, off, on, ... (a drift of the "
                   "machine within a run falls on both alike)")
    p.add_argument("--tracing", action=argparse.BooleanOptionalAction, default=True,
                   help="the tracing rows: single texts and client batches with OpenTelemetry tracing off, then on at "
                   "100%% sampling (every span exported with OTLP to a receiver on loopback)")
    p.add_argument("--protocols", action=argparse.BooleanOptionalAction, default=True,
                   help="the KServe v2 rows: the same requests over gRPC (grpc.aio) and over HTTP (httpx), default config")
    p.add_argument("--variants", default="",
                   help=f"Ray Serve per-request options to measure against the default, fp32 on the last ingress, "
                   f"comma-separated: {', '.join(VARIANTS)}")
    args = p.parse_args()
    if args.tracing_only:  # a partial run: its rows beside the last full run's, never over its page
        args.no_readme = True
        if args.json == Path("results/bench.json"):
            args.json = Path("results/bench-tracing.json")
    if args.render is not None:
        return render_again(args.render, args.readme)
    peers = parse_peers(args.peers)
    # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so that a peer server is stopped on the way out
    signal.signal(signal.SIGTERM, _interrupt)
    if args.loadgen == "wrk":
        ensure_wrk()  # fail before the long parts when it cannot be had
    peer_installs = {"infinity": ensure_infinity()} if "infinity" in peers else {}
    explicit_threads = args.threads != 0
    if args.threads == 0:
        from service.runtimes.onnxruntime import available_cpus

        args.threads = available_cpus()

    texts = sentences(args.texts)
    mixed = sentences(args.texts, min_words=1, max_words=200, seed=1)
    where = machine()
    print(f"benchmark: {len(texts)} texts of 8-40 words, batch {args.batch}, {args.threads} ORT threads, {where}", flush=True)
    st, reference, st_model = bench_sentence_transformers(texts, args.batch)
    cost = model_cost(st_model, texts)
    del st_model
    print(f"  sentence-transformers: {st:.0f} texts/s", flush=True)
    peers_bf16 = bf16_units()
    if peers_bf16:  # the peer at its best precision, beside fp32, on a CPU with bf16 units
        st_bf16, st_bf16_vectors, _ = bench_sentence_transformers(texts, args.batch, "bf16")
        st_bf16_cosine = min_cosine(st_bf16_vectors, reference)
        print(f"  sentence-transformers bf16: {st_bf16:.0f} texts/s, min cosine vs fp32 {st_bf16_cosine:.5f}", flush=True)
    ort, references = bench_onnxruntime(texts, args.batch, args.bundle, args.threads, reference)
    print(f"  onnxruntime ({ort['provider']}, {ort['threads']} threads): full graph {ort['full_unsorted']:.0f} texts/s "
          f"unsorted, {ort['full_sorted']:.0f} sorted; encodings fp32 {ort['fp32_sorted']:.0f}, "
          f"int8 {ort.get('int8_sorted', float('nan')):.0f}; one short text {ort['one_call_ms']:.1f} ms; OpenVINO f32 "
          f"{ort.get('openvino_fp32_sorted', float('nan')):.0f}, bf16 {ort.get('openvino_bf16_sorted', float('nan')):.0f}"
          + ("" if ort["bf16_units"] else f" ({ort['cpu']})"), flush=True)
    # its texts/s becomes the median of the samples taken between the service phases, at the end
    fp32_row = {"engine": "in-process onnxruntime, fused encodings graph fp32, length-sorted", "texts_s": ort["fp32_sorted"],
                "cosine": ort["fp32_cosine"]}
    ort["bounds"] = {precision: physical_bound(cost, precision, args.threads) for precision in ("fp32", "bf16")}
    rows = [
        {"engine": "in-process sentence-transformers (torch fp32)", "texts_s": st, "inprocess_peer": "sentence-transformers",
         "peer_precision": "fp32"},
        *([{"engine": "in-process sentence-transformers (torch bf16: model_kwargs={'dtype': torch.bfloat16})",
            "texts_s": st_bf16, "cosine": st_bf16_cosine, "inprocess_peer": "sentence-transformers",
            "peer_precision": "bf16"}] if peers_bf16 else []),
        {"engine": "in-process onnxruntime, full graph (attention weights), arrival order", "texts_s": ort["full_unsorted"]},
        {"engine": "in-process onnxruntime, full graph (attention weights), length-sorted", "texts_s": ort["full_sorted"]},
        fp32_row,
    ]
    if "int8_sorted" in ort:
        rows.append({"engine": "in-process onnxruntime, fused encodings graph int8, length-sorted", "texts_s": ort["int8_sorted"],
                     "cosine": ort["int8_cosine"]})
    for precision in ("fp32", "bf16"):
        if f"openvino_{precision}_sorted" in ort:
            rows.append({"engine": f"in-process OpenVINO {precision} (the fp32 encodings graph), length-sorted",
                         "texts_s": ort[f"openvino_{precision}_sorted"], "cosine": ort[f"openvino_{precision}_cosine"]})

    route = ROUTES[args.route][0]

    def phase(spec: dict) -> list[dict]:
        """One service phase, then one more sample of the in-process reference."""
        found = service_phase(spec)
        references.sample(after=spec["label"])
        return found

    def scenario(label, per_request, concurrency, **flags):
        loadgen = args.loadgen if per_request == 1 else "httpx"
        return {"label": f"{label} ({loadgen}, {route})", "per_request": per_request, "concurrency": concurrency,
                "loadgen": loadgen, **flags}

    fp32 = [
        scenario(f"client batches of {args.batch}", args.batch, 4),
        scenario("single texts", 1, 32),
        scenario("one short text", 1, 1, short=True),
        scenario(f"mixed-length client batches of {args.batch}", args.batch, 4, mixed=True),
    ]
    if args.sweep:
        fp32 += [scenario("single texts", 1, c) for c in (1, 2, 4, 8, 16)]
    else:  # texts per batch at 1 (the short-text row), 8 and 32 single-text clients
        fp32 += [scenario("single texts", 1, 8)]
    # the service's own thread default (CPUs / concurrent batches) unless --threads was given
    settings = {"bundle": str(args.bundle.resolve()), **({"intra_op_threads": args.threads} if explicit_threads else {})}
    wrk = {"duration_s": args.wrk_duration, "warmup_s": args.wrk_warmup, "threads": args.wrk_threads}
    common = {"texts": texts, "mixed_texts": mixed, "short_text": SHORT_TEXT, "encoding_format": args.encoding_format,
              "route": args.route, "wrk": wrk}
    ingresses = [i for i in args.ingress.replace(" ", "").split(",") if i]
    if (args.rerank or args.rerank_only) and not args.tracing_only:
        rows += rerank_rows(args, ingresses[-1], settings)
        references.sample(after="the cross-encoder phase")
    def tracing_phases() -> list[dict]:
        """The same rows with tracing off and on at full sampling, phases interleaved (TRACING_ROUNDS)."""
        order = [traced for i in range(args.tracing_rounds) for traced in ((False, True), (True, False))[i % 2]]
        return [row for traced in order
                for row in phase(tracing_phase(ingresses[-1], common, settings, args.batch, traced, args.loadgen))]

    if args.tracing_only:
        rows += tracing_phases()
    elif not args.rerank_only:
        # the default configuration (runtime and precision auto: OpenVINO bf16 where the CPU has bf16 units
        # and it measures faster), on the last ingress; its embeddings of the texts against sentence-transformers'
        rows += phase({"label": f"default config, {ingresses[-1]}", "ingress": ingresses[-1], **common,
                       "settings": settings, "reference": reference.tolist(),
                       "scenarios": [scenario(f"client batches of {args.batch}", args.batch, 4),
                                     scenario("single texts", 1, 32),
                                     scenario("one short text", 1, 1, short=True)]})
        for ingress in ingresses:
            rows += phase({"label": f"fp32, {ingress}", "ingress": ingress, **common, "reference": reference.tolist(),
                           "settings": {**settings, "precision": "fp32"}, "scenarios": fp32})
        best = ingresses[-1]
        rows += phase({"label": f"echo (no model), {best}", "ingress": best, **common, "settings": settings, "echo": True,
                       "scenarios": [scenario("single texts", 1, 32)]})
        if args.protocols:
            rows += phase(protocol_phase(best, common, settings, args.batch))
        if args.tracing:
            rows += tracing_phases()
        if args.bounds:  # the engine alone (no HTTP, no Ray), and the same app under plain uvicorn (no Ray)
            rows += engine_alone(args.bundle, ["auto", "fp32"], seconds=args.wrk_duration)
            references.sample(after="the engine alone")
            for label, extra in (("default config", {}), ("fp32", {"precision": "fp32"})):
                rows += phase({"label": f"{label}, plain uvicorn without Ray (a bound, not the service)",
                               "ingress": "uvicorn, no Ray", "no_ray": True, **common,
                               "settings": {**settings, **extra},
                               "scenarios": [scenario(f"client batches of {args.batch}", args.batch, 4),
                                             scenario("single texts", 1, 32),
                                             scenario("one short text", 1, 1, short=True)]})
        if "int8_sorted" in ort:
            rows += phase({"label": f"int8, {best}", "ingress": best, **common, "reference": reference.tolist(),
                           "settings": {**settings, "precision": "int8"},
                           "scenarios": [scenario(f"client batches of {args.batch}", args.batch, 4),
                                         scenario("single texts", 1, 32)]})
        for name in [v for v in args.variants.replace(" ", "").split(",") if v]:
            rows += phase({"label": f"fp32, {best}, {name}", "ingress": best, **common, "env": VARIANTS[name],
                           "settings": {**settings, "precision": "fp32"},
                           "scenarios": [scenario(f"client batches of {args.batch}", args.batch, 4),
                                         scenario("single texts", 1, 32)]})
        if args.sweep:
            rows += phase({"label": f"fp32, {ingresses[0]}, batching off", "ingress": ingresses[0], **common,
                           "settings": {**settings, "precision": "fp32", "batching": {"enabled": False}},
                           "scenarios": [scenario("single texts", 1, c) for c in (1, 2, 4, 8, 16, 32)]})

    peer_error = None
    if "infinity" in peers:
        try:
            rows += measure_infinity(texts, SHORT_TEXT, args.batch, wrk, args.encoding_format, install=peer_installs["infinity"],
                                     reference=reference)
            if peers_bf16:  # its best precision: client batches, the equal-precision target's row
                rows += measure_infinity(texts, SHORT_TEXT, args.batch, wrk, args.encoding_format,
                                         install=peer_installs["infinity"], reference=reference, precision="bf16",
                                         batches_only=True)
        except (Exception, SystemExit) as exc:  # the service's rows stand; the table says the peer failed
            peer_error = f"failed: {exc}".splitlines()[0][:200]
            print(f"  peer infinity-emb {peer_error}", flush=True)
        references.sample(after="infinity-emb")

    # every ratio divides by the median of the reference's samples (the first one and one after each phase)
    ort["fp32_sorted_samples"] = [round(r, 1) for r in references.samples]
    ort["fp32_sorted"] = fp32_row["texts_s"] = references.median()
    if len(references.samples) > 1:
        fp32_row["engine"] += (f" (median of {len(references.samples)} samples, one before the service and one after "
                               f"each phase: {min(references.samples):.0f}-{max(references.samples):.0f})")
    goals = targets(rows, ort, peer_missing=f"not measured ({peer_error})" if peer_error else PEER_HINT)
    single_gen = (f"wrk {wrk_version()} (Lua script POSTing JSON bodies, {args.wrk_threads} threads, "
                  f"{args.wrk_duration:.0f} s after {args.wrk_warmup:.0f} s of warm-up)" if args.loadgen == "wrk"
                  else "the Python httpx client (asyncio)")
    peer_text = ""
    if "infinity" in peers and not peer_error:
        v = peer_installs["infinity"]["versions"]
        peer_text = (f"; the peer infinity-emb {v['infinity_emb']} (torch engine, torch {v['torch']}, `--dtype float32`"
                     f"{' and `--dtype bfloat16` (client batches)' if peers_bf16 else ''}, its other defaults, "
                     f"`infinity_emb v2` on loopback, own venv) through its /embeddings")
    service_threads = sorted({r["intra_op_threads"] for r in rows if "intra_op_threads" in r})
    header = (f"Measured {time.strftime('%Y-%m-%d')} by `make bench` on {where}; {ort['provider']}; "
              f"onnxruntime in-process with {ort['threads']} threads, in the service "
              f"{'/'.join(map(str, service_threads))} thread(s) per session and "
              f"{'/'.join(map(str, sorted({r['concurrent_batches'] for r in rows if 'concurrent_batches' in r})))} "
              f"batches at once per replica; {len(texts)} texts of 8-40 words, embeddings returned as "
              f"{args.encoding_format}, the service's rows through {route}{peer_text}. Load generators, on the same "
              f"machine: {single_gen} for single-text rows; the Python httpx client (asyncio) for client-batch rows. "
              f"Target ratios are against in-process onnxruntime (fused encodings graph, length-sorted batches of "
              f"{args.batch}; the median of {len(references.samples)} samples taken between the phases, "
              f"{min(references.samples):.0f}-{max(references.samples):.0f} texts/s){' and the peer' if peers else ''} "
              f"in the same run; 'vs ST' is against in-process "
              f"sentence-transformers fp32 ({st:.0f} texts/s)"
              + (f", which runs bf16 too (`model_kwargs={{'dtype': torch.bfloat16}}`, {st_bf16:.0f} texts/s)" if peers_bf16 else "")
              + f". The physical bound: {ort['bounds']['fp32']['how']}, over {cost['flops_per_text'] / 1e9:.2f} GFLOPs "
              f"per text ({cost['mean_tokens']:.1f} tokens on average; 2 x {cost['matmul_parameters'] / 1e6:.1f}M matmul "
              f"parameters x tokens + 4 x {cost['layers']} layers x tokens^2 x {cost['attention_width']}).")
    table = render(rows, goals, header)
    print()
    print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": where, "threads": ort["threads"], "provider": ort["provider"],
        "one_call_ms": ort["one_call_ms"], "ort": ort, "peers": peers, "route": route, "loadgen": args.loadgen,
        "wrk": wrk, "rows": rows, "targets": goals, "header": header,
    }, indent=2))
    if not args.no_readme:
        write_readme(args.readme, table)
        write_readme(Path("README.md"), summary(goals, where, args.readme), SUMMARY_START, SUMMARY_END)
        print(f"\nwrote the table into {args.readme} and the headline figures into README.md")
    failed = sum(r.get("failures", 0) for r in rows)
    print(f"failed requests: {failed}")
    return 1 if failed or peer_error else 0


def render_again(saved: Path, page: Path) -> int:
    """The page's table and the README's headline from a run's saved rows, the targets read by this
    code: for a fix in how a target reads its rows, without measuring again."""
    run = json.loads(saved.read_text())
    if "header" not in run:
        raise SystemExit(f"{saved} has no header (written before --render existed): run make bench again")
    goals = targets(run["rows"], run["ort"])
    table = render(run["rows"], goals, run["header"])
    write_readme(page, table)
    write_readme(Path("README.md"), summary(goals, run["machine"], page), SUMMARY_START, SUMMARY_END)
    print(f"rendered {page} and README.md's headline again from {saved} ({run['date']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
