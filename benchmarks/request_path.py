"""make bench-request-path: the CPU side of the request path, measured as a GPU host sees it (issue 56).

    python -m benchmarks.request_path [--seconds 12] [--warmup 2] [--models 0,h100] [--replicas 1,2]
                                      [--no-echo] [--no-real] [--no-engine-alone] [--peers infinity] [--smoke]

One run, on loopback, `/v1/embeddings` (floats, the OpenAI default), short multilingual texts
(benchmarks/corpus.py `short_texts`), wrk as the load generator for every row (benchmarks/wrk_load.py: a
Python client would take the cores the server needs):

- single texts at 32 connections, and client batches of 32 texts at 8 connections;
- the service with the model replaced by the stand-in runtime (benchmarks/standin.py) at 0 ms and at
  the H100 latency model, with 1 and 2 replicas;
- beside it, Ray Serve's echo ceiling (benchmarks/service_phase.py `echo_app`: a trivial deployment that
  answers the same request with a fixed JSON body), the real model through the service (onnxruntime
  fp32 on this CPU), and the engine alone with no HTTP and no Ray (benchmarks/engine_alone.py, client
  batches of 32 at 4 clients) on the real model and on the stand-in;
- with --peers infinity (`make bench-request-path PEERS=infinity`), the peer's request path: infinity-emb
  (its own virtual environment, benchmarks/peers.py) serving a model of near-zero cost (one BERT layer of
  width 32, MiniLM's tokenizer, random weights) under the same wrk load, its process group's CPU per text.

Each service configuration runs in a process of its own with its own Ray (service_phase's `ray_service`;
this module with --phase). Rows give texts/s, texts/s per core (the machine's CPUs), p50/p99 and CPU
milliseconds per text by process (load generator, proxy, replica, the rest of Ray). Before measuring, each
service configuration is asked once per kind of request and must answer every text with a vector of the
model's width. The table goes into docs/performance.md between the request-path markers, every row into
results/request_path.json. --smoke: the shortest run that goes through every step (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from benchmarks.corpus import short_texts
from service.hosting.processes import local_cluster_ports
from service.runtimes.onnxruntime import available_cpus

PAGE_START = "<!-- request-path:start -->"
PAGE_END = "<!-- request-path:end -->"
PATH = "/v1/embeddings"
BATCH = 32
SCENARIOS = (  # (key, texts per request, connections)
    ("single", 1, 32),
    ("batches", BATCH, 8),
)


REAL_SECONDS = 40.0  # the real model's rows: at least this long (main)


# ---- one service configuration, in a process of its own (--phase SPEC) ----

def check_answers(url: str, texts: list[str], dim: int | None, path: str = PATH, model: str | None = None) -> None:
    """One request of each kind: 200, one item per text, each a vector of the model's width (dim None: the echo).
    `model`: the body's model field (the peer serves its model by name)."""
    import httpx

    for text_or_texts in (texts[0], texts[:BATCH]):
        body = {"input": text_or_texts, **({"model": model} if model else {})}
        r = httpx.post(url + path, json=body, timeout=60)
        if r.status_code != 200:
            raise SystemExit(f"{url}{path} answered {r.status_code}: {r.text[:200]}")
        if dim is None:
            continue
        data = r.json()["data"]
        n = 1 if isinstance(text_or_texts, str) else len(text_or_texts)
        widths = {len(d["embedding"]) for d in data}
        if len(data) != n or widths != {dim}:
            raise SystemExit(f"{url}{path}: {len(data)} items of widths {sorted(widths)} for {n} texts; "
                             f"expected width {dim}")


def scenario_row(label: str, kind: str, scenario: tuple[str, int, int], measured: dict,
                 cpu_ms: dict[str, float], **more) -> dict:
    """One row of the page, from a scenario (key, texts per request, connections), wrk's figures and the
    CPU per text by process; printed as it is made. `more`: the configuration's own fields."""
    key, per_request, connections = scenario
    texts_s = measured["texts_s"] * per_request
    row = {"label": label, "kind": kind, "scenario": key, "per_request": per_request, "connections": connections,
           "texts_s": texts_s, "texts_s_per_core": texts_s / available_cpus(), "p50": measured["p50"],
           "p99": measured["p99"], "failures": measured["failures"], "requests": measured["requests"],
           "seconds": measured["duration_s"], "cpu_ms_per_text": cpu_ms, **more}
    batching = (f"; {row['texts_per_batch']:.1f} texts per batch, {row['texts_per_run']:.1f} per run"
                if "texts_per_batch" in row else "")
    print(f"  {label}, {key} ({per_request} per request, {connections} connections): {texts_s:,.0f} texts/s, "
          f"p50 {row['p50']:.1f} ms, p99 {row['p99']:.1f} ms, failures {row['failures']}{batching}; CPU ms per text: "
          + ", ".join(f"{c} {v:.2f}" for c, v in cpu_ms.items()), flush=True)
    return row


def texts_answered(measured: dict, per_request: int) -> int:
    """The texts of the measured window's 2xx answers (at least 1: CPU per text divides by it)."""
    return max(1, (measured["requests"] - measured["non2xx"]) * per_request)


def phase(spec: dict) -> list[dict]:
    """The spec's service on loopback under each scenario: its rows."""
    from benchmarks.service_phase import cpu_seconds, encoder_counters, ray_service
    from benchmarks.wrk_load import run_wrk
    from service.config import ServiceSettings

    settings = ServiceSettings.model_validate(spec["settings"])
    texts = spec["texts"]
    rng = random.Random(0)
    with ray_service(spec, settings) as (url, _, _):
        import httpx

        info = {} if spec.get("echo") else httpx.get(f"{url}/info", timeout=30).json()
        check_answers(url, texts, None if spec.get("echo") else spec["dim"])
        rows = []
        for key, per_request, connections in SCENARIOS:
            if per_request == 1:
                bodies = [json.dumps({"input": t}) for t in texts]
            else:
                bodies = [json.dumps({"input": rng.sample(texts, per_request)}) for _ in range(64)]
            if spec["warmup_s"]:
                run_wrk(url, PATH, bodies, connections, spec["warmup_s"])
            counters_before = encoder_counters(url, spec)
            cpu_before = cpu_seconds()
            measured = run_wrk(url, PATH, bodies, connections, spec["seconds"])
            cpu_after = cpu_seconds()
            cpu_after["load generator"] = cpu_after.get("load generator", 0.0) + measured["load_cpu_s"]
            counters = {k: v - counters_before[k] for k, v in encoder_counters(url, spec).items()}
            n_texts = texts_answered(measured, per_request)
            rows.append(scenario_row(
                spec["label"], spec["kind"], (key, per_request, connections), measured,
                {c: round((cpu_after.get(c, 0.0) - cpu_before.get(c, 0.0)) * 1000 / n_texts, 3) for c in sorted(cpu_after)},
                model=spec.get("model"), replicas=spec["replicas"],
                runtime=info.get("runtime", ""), precision=info.get("precision", ""),
                # the answering replica's counters (/info): with 2 replicas, one of them
                texts_per_batch=counters["texts"] / max(counters["batches"], 1),
                texts_per_run=counters["texts"] / max(counters["ort_runs"], 1)))
    return rows


def run_phase(spec: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as scratch:
        spec_path, out = Path(scratch) / "spec.json", Path(scratch) / "rows.json"
        spec_path.write_text(json.dumps({**spec, "out": str(out)}))
        # Ray Serve's fixed ports made free ones for each phase, never inherited: a test session's cluster (whose
        # ports its environment holds) or the last phase's HAProxy, which can outlive its Ray, keeps them bound
        result = subprocess.run([sys.executable, "-m", "benchmarks.request_path", "--phase", str(spec_path)],
                                timeout=900, env={**os.environ, **local_cluster_ports()})
        if result.returncode != 0 or not out.exists():
            raise SystemExit(f"request-path phase {spec['label']} failed (exit {result.returncode})")
        return json.loads(out.read_text())


def engine_alone(bundle: Path, seconds: float, standin: str | None) -> list[dict]:
    """benchmarks/engine_alone.py in a process of its own: fp32 on the real model, or the stand-in."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "rows.json"
        cmd = [sys.executable, "-m", "benchmarks.engine_alone", "--bundle", str(bundle), "--seconds", str(seconds),
               "--precision", "fp32", "--no-reference", "--corpus", "short", "--json", str(out)]
        if standin is not None:
            cmd += ["--standin", standin]
        result = subprocess.run(cmd, timeout=600)
        if result.returncode != 0 or not out.exists():
            raise SystemExit(f"the engine-alone phase failed (exit {result.returncode})")
        rows = json.loads(out.read_text())
    for r in rows:
        r.update({"kind": "engine alone", "model": standin, "replicas": None, "scenario": "batches",
                  "texts_s_per_core": r["texts_s"] / available_cpus(), "connections": r["concurrency"]})
    return rows


# ---- the peer's request path (--peers infinity) ----

# the peer's model: near-zero cost, so that its rows are its request path (HTTP, JSON, tokenizer, batching), not a model
NEAR_ZERO = ("BertConfig", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                            "max_position_embeddings": 512}, "BertModel", "mean", "one BERT layer of width 32")
PEER_ROOT = Path("results/request_path")


def infinity_phase(texts: list[str], seconds: float, warmup_s: float) -> list[dict]:
    """infinity-emb serving NEAR_ZERO (a sentence-transformers checkpoint made once under PEER_ROOT) under each
    scenario, with the same bodies and wrk load as the service's rows: its rows."""
    from benchmarks.families import make_checkpoint
    from benchmarks.peers import SERVED_NAME, InfinityServer, ensure_infinity
    from benchmarks.service_phase import process_group_cpu
    from benchmarks.wrk_load import run_wrk

    model = make_checkpoint("near-zero", (PEER_ROOT / "near-zero-model").resolve(), shape=NEAR_ZERO)
    install = ensure_infinity()
    version = install["versions"]["infinity_emb"]
    rng = random.Random(0)
    rows = []
    with InfinityServer(install, PEER_ROOT / "infinity.log", model=str(model)) as server:
        check_answers(server.url, texts, NEAR_ZERO[1]["hidden_size"], "/embeddings", SERVED_NAME)
        for key, per_request, connections in SCENARIOS:
            if per_request == 1:
                bodies = [json.dumps({"model": SERVED_NAME, "input": t}) for t in texts]
            else:
                bodies = [json.dumps({"model": SERVED_NAME, "input": rng.sample(texts, per_request)}) for _ in range(64)]
            if warmup_s:
                run_wrk(server.url, "/embeddings", bodies, connections, warmup_s)
            cpu_before = process_group_cpu(server.proc.pid)
            measured = run_wrk(server.url, "/embeddings", bodies, connections, seconds)
            cpu = process_group_cpu(server.proc.pid) - cpu_before
            n_texts = texts_answered(measured, per_request)
            rows.append(scenario_row(
                f"infinity-emb {version}", "peer", (key, per_request, connections), measured,
                {"peer server": round(cpu * 1000 / n_texts, 3),
                 "load generator": round(measured["load_cpu_s"] * 1000 / n_texts, 3)},
                model=None, replicas=1, runtime="torch", precision="fp32", peer_version=version))
    return rows


# ---- the whole run ----

def model_label(name: str | None) -> str:
    from benchmarks.standin import latency_model

    if name is None:
        return "real model"
    m = latency_model(name)
    return f"stand-in, {m.name}" + (f" ({m.fixed_ms:g} ms + {m.per_token_us:g} us/token)" if m.per_token_us else "")


def table(rows: list[dict], header: str) -> str:
    """The page's section: one line per configuration, the two scenarios side by side."""
    def cells(r: dict | None) -> list[str]:
        if r is None:
            return ["", ""]
        rate = f"{r['texts_s']:,.0f} ({r['texts_s_per_core']:,.0f}/core)"
        if r.get("failures"):
            rate += f", {r['failures']} failed"
        return [rate, f"{r['p50']:.1f} / {r['p99']:.1f}"]

    def cpu(r: dict | None) -> str:
        if r is None:
            return ""
        c = r["cpu_ms_per_text"]
        parts = [f"{k} {v:.2f}" for k, v in c.items() if v >= 0.005]
        return f"{sum(c.values()):.2f} ({', '.join(parts)})"

    lines = [header, "",
             "| configuration | replicas | single texts, 32 connections: texts/s | p50 / p99 ms "
             "| client batches of 32, 8 connections: texts/s | p50 / p99 ms | CPU ms per text: single texts "
             "| CPU ms per text: client batches |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = []
    for r in rows:
        k = (r["kind"], r.get("model"), r.get("replicas"))
        if k not in keys:
            keys.append(k)
    for kind, model, replicas in keys:
        found = {r["scenario"]: r for r in rows if (r["kind"], r.get("model"), r.get("replicas")) == (kind, model, replicas)}
        single, batches = found.get("single"), found.get("batches")
        if kind == "engine alone":
            what = (f"the engine alone, {model_label(model)} (no HTTP, no Ray; "
                    f"{batches['concurrency']} clients x {batches['per_request']} texts)")
            lines.append(f"| {what} | | | | {batches['texts_s']:,.0f} ({batches['texts_s_per_core']:,.0f}/core) | "
                         f"| | engine {batches['cpu_ms_per_text']['engine']:.2f} |")
            continue
        if kind == "peer":
            what = f"{single['label'] if single else batches['label']} (torch), {NEAR_ZERO[4]}: the peer's request path"
        else:
            what = "Ray Serve echo (fixed JSON body, no model)" if kind == "echo" else f"service, {model_label(model)}"
        lines.append("| " + " | ".join([what, str(replicas), *cells(single), *cells(batches), cpu(single), cpu(batches)]) + " |")
    return "\n".join(lines)


def write_page(page: Path, text: str) -> None:
    from benchmarks.bench import write_readme

    write_readme(page, text, PAGE_START, PAGE_END)


def ratios(rows: list[dict]) -> list[str]:
    """The issue's ratios in this run, one line each."""
    def rate(kind, model, replicas, scenario):
        return next((r["texts_s"] for r in rows if r["kind"] == kind and r.get("model") == model
                     and r.get("replicas") == replicas and r["scenario"] == scenario), None)

    out = []
    zero, h100 = rate("service", "0", 1, "batches"), rate("service", "h100", 1, "batches")
    if zero and h100:
        out.append(f"stand-in at the H100 model / at 0 ms, client batches, 1 replica: {h100 / zero:.2f}x (issue 56's target: >= 0.9x)")
    single, echo = rate("service", "0", 1, "single"), rate("echo", None, 1, "single")
    if single and echo:
        out.append(f"single texts at 0 ms / Ray Serve's echo, 1 replica: {single / echo:.2f}x")
    two = rate("service", "0", 2, "batches")
    if zero and two:
        out.append(f"2 replicas / 1 at 0 ms, client batches: {two / zero:.2f}x")
    for scenario in ("single", "batches"):
        ours, peer = rate("service", "0", 1, scenario), rate("peer", None, 1, scenario)
        if ours and peer:
            what = "single texts" if scenario == "single" else "client batches"
            out.append(f"{what}: the service at 0 ms / infinity-emb on a near-zero model, 1 replica each: {ours / peer:.2f}x")
    real, alone = rate("service", None, 1, "batches"), rate("engine alone", None, None, "batches")
    if real and alone:
        out.append(f"the real model through the service / the engine alone, client batches: {real / alone:.2f}x (target: >= 0.95x)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.request_path", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", type=Path, help=argparse.SUPPRESS)  # one configuration (a spec file): internal
    p.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    p.add_argument("--seconds", type=float, default=12, help="seconds of wrk load per row, after --warmup")
    p.add_argument("--warmup", type=float, default=2, help="seconds of load before each row, not counted")
    p.add_argument("--models", default="0,h100", help="stand-in latency models: 0, h100, or ms per run (1.6)")
    p.add_argument("--replicas", default="1,2", help="replica counts of the stand-in rows")
    p.add_argument("--texts", type=int, default=512, help="short multilingual texts (benchmarks/corpus.py short_texts)")
    p.add_argument("--echo", action=argparse.BooleanOptionalAction, default=True, help="Ray Serve's echo ceiling")
    p.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                   help="the real model (onnxruntime fp32) through the service, 1 replica")
    p.add_argument("--engine-alone", action=argparse.BooleanOptionalAction, default=True,
                   help="the engine alone (no HTTP, no Ray) on the real model and on each stand-in model")
    p.add_argument("--peers", default="", help="infinity: the peer's request path beside ours (its own venv, "
                   "installed on first use)")
    p.add_argument("--smoke", action="store_true", help="1 s per row, no warm-up, 1 replica, 0 ms only, no real model")
    p.add_argument("--page", type=Path, default=Path("docs/performance.md"))
    p.add_argument("--no-page", dest="write", action="store_false", help="do not write the page")
    p.add_argument("--json", type=Path, default=Path("results/request_path.json"))
    args = p.parse_args(argv)

    if args.phase is not None:
        spec = json.loads(args.phase.read_text())
        rows = phase(spec)
        Path(spec["out"]).write_text(json.dumps(rows))
        return 0

    from benchmarks.bench import machine
    from benchmarks.peers import parse_peers
    from benchmarks.wrk_load import ensure_wrk, wrk_version
    from bundle.manifest import load_bundle
    from service.config import DEFAULT_INGRESS

    if args.smoke:
        args.seconds, args.warmup, args.models, args.replicas, args.real = 1, 0, "0", "1", False
    peers = parse_peers(args.peers)  # an unknown peer is refused now, not after the service's rows
    ensure_wrk()
    bundle = args.bundle.resolve()
    dim = load_bundle(bundle).manifest.model.sentence_dim
    texts = short_texts(args.texts)
    started = time.perf_counter()
    load_before = os.getloadavg()
    # the replicas' output (the service's access log, on as by default) stays in Ray's log files: forwarded to
    # this process, it would cost the machine CPU that a deployment does not spend
    common = {"texts": texts, "dim": dim, "ingress": DEFAULT_INGRESS, "seconds": args.seconds, "warmup_s": args.warmup,
              "log_to_driver": False}
    specs = []
    if args.echo:
        specs.append({"label": "echo", "kind": "echo", "echo": True, "model": None, "replicas": 1,
                      "settings": {"bundle": str(bundle)}})
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        for replicas in [int(n) for n in args.replicas.split(",") if n.strip()]:
            specs.append({"label": f"stand-in {model}, {replicas} replica(s)", "kind": "service", "model": model,
                          "standin": model, "replicas": replicas,
                          "settings": {"bundle": str(bundle), "replicas": replicas, "warmup": True}})
    if args.real:
        # a longer window: on a CPU a round of 8 client batches of 32 takes seconds and its answers come back
        # together, so 12 s held 1 to 3 rounds (two runs of the same code: 40 and 69 texts/s); 40 s holds ten
        specs.append({"label": "real model fp32, 1 replica", "kind": "service", "model": None, "replicas": 1,
                      "seconds": max(args.seconds, REAL_SECONDS), "warmup_s": max(args.warmup, REAL_SECONDS / 4),
                      "settings": {"bundle": str(bundle), "replicas": 1, "precision": "fp32"}})
    rows: list[dict] = []
    for spec in specs:
        print(f"{spec['label']} ...", flush=True)
        rows += run_phase({**common, **spec})
    if args.engine_alone:
        for standin in [None, *[m.strip() for m in args.models.split(",") if m.strip()]]:
            if standin is None and not args.real:
                continue
            print(f"the engine alone, {model_label(standin)} ...", flush=True)
            rows += engine_alone(bundle, args.seconds, standin)
    if "infinity" in peers:
        print("the peer infinity-emb on a near-zero model ...", flush=True)
        rows += infinity_phase(texts, args.seconds, args.warmup)
    load_after = os.getloadavg()
    header = (f"Measured {date.today().isoformat()} by `make bench-request-path` on {machine()}; 1-minute load "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; {len(texts)} short multilingual texts "
              f"(`benchmarks/corpus.py` short_texts), `{PATH}` returning floats, {DEFAULT_INGRESS} ingress; wrk "
              f"{wrk_version()} (2 threads) for {args.seconds:g} s per row after {args.warmup:g} s of warm-up"
              + (f" (the real model's rows {max(args.seconds, REAL_SECONDS):g} s after "
                 f"{max(args.warmup, REAL_SECONDS / 4):g} s)" if args.real else "")
              + "; texts/s "
              f"per core divides by the machine's {available_cpus()} CPUs; CPU ms per text by process, read from /proc."
              + (" A smoke run: its figures mean nothing." if args.smoke else ""))
    text = table(rows, header)
    lines = ratios(rows)
    if lines:
        text += "\n\n" + "\n".join(f"- {line}" for line in lines)
    print("\n" + text, flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "header": header, "ratios": lines,
                                     "seconds": time.perf_counter() - started}, indent=1))
    if args.write:
        write_page(args.page, text)
        print(f"\nwrote {args.page} and {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
