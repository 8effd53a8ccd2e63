"""make bench-models: a model repository under a Zipf rotation (issue 57), rows into docs/models.md.

`python -m service --models-dir` with one replica over a repository of the bundle under several names (each
its own sessions, as different models of that size would have) and a budget with room for `--room` of them,
as a user starts it. In one run:
  - one model alone: single-text requests at `--clients` clients for `--seconds`, its p50 and p99;
  - a Zipf rotation (exponent `--zipf`) over all of them, the same clients and time: the hot model's p99
    against the same traffic on one model, loads per 1,000 requests, failures;
  - a cold load's added latency: every model unloaded through the repository API, then one request (the load
    and its answer) against the next (an answer alone), `--cold` times, p50;
  - the replica's resident memory at its most during the rotation against its memory with only the default
    model loaded (the fixed overhead) plus the budget.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.bench import machine, write_readme
from benchmarks.corpus import short_texts
from benchmarks.service_phase import percentile
from service.hosting.processes import free_port, local_cluster_ports

ROOT = Path(__file__).resolve().parents[1]
PAGE_START, PAGE_END = "<!-- models-bench:start -->", "<!-- models-bench:end -->"
MiB = 2**20


def resident(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load(url: str, pick, texts: list[str], clients: int, seconds: float) -> list[tuple[str, float, int]]:
    """(model, seconds, status) of every request `clients` clients sent for `seconds`, each naming pick(rng)."""
    done: list[tuple[str, float, int]] = []
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        with httpx.Client(timeout=120) as c:
            while time.monotonic() < stop:
                model = pick(rng)
                started = time.perf_counter()
                r = c.post(f"{url}/v1/embeddings", json={"model": model, "input": texts[int(rng.integers(len(texts)))]})
                done.append((model, time.perf_counter() - started, r.status_code))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def loads_total(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ray_encoder_model_loads_total{") and 'outcome="loaded"' in line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.model_repository", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=ROOT / "bundles" / "all-MiniLM-L6-v2")
    p.add_argument("--models", type=int, default=8, help="models in the rotation")
    p.add_argument("--room", type=int, default=3, help="models the budget has room for")
    p.add_argument("--model-bytes", type=int, default=350 * MiB, help="what one model measures at its load")
    p.add_argument("--zipf", type=float, default=1.1, help="the rotation's Zipf exponent")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--cold", type=int, default=5, help="cold loads timed")
    p.add_argument("--page", type=Path, default=ROOT / "docs" / "models.md")
    p.add_argument("--no-page", action="store_true")
    args = p.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="bench-models-"))
    repo = workdir / "models"
    repo.mkdir()
    names = [f"m{i}" for i in range(1, args.models + 1)]
    for name in ["base", *names]:  # `base` first by name: the default, loaded at start, outside the budget
        (repo / name).symlink_to(args.bundle.resolve())
    budget = args.room * args.model_bytes + args.model_bytes // 2
    port, metrics_port = free_port(), free_port()
    url, metrics_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--models-dir", str(repo), "--default-model", "base", "--port", str(port),
         "--replicas", "1", "--metrics-port", str(metrics_port), "--grpc-port", "0",
         "--model-memory-bytes", str(budget)],
        cwd=ROOT, env={**os.environ, **local_cluster_ports()}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("serving ") for line in lines):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the service did not start:\n" + "".join(lines[-30:]))
            time.sleep(0.5)
        texts = short_texts(512)
        pid = httpx.get(f"{url}/info", timeout=30).json()["replica"]["pid"]
        fixed = resident(pid)
        hot = names[0]
        one = load(url, lambda rng: hot, texts, args.clients, 3)  # loads it, warms up
        one = load(url, lambda rng: hot, texts, args.clients, args.seconds)
        weights = 1.0 / np.arange(1, len(names) + 1) ** args.zipf
        weights /= weights.sum()
        peak = [resident(pid)]
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.is_set():
                peak.append(resident(pid))
                time.sleep(0.2)

        sampler = threading.Thread(target=sample)
        sampler.start()
        before = loads_total(metrics_url)
        rotation = load(url, lambda rng: names[int(rng.choice(len(names), p=weights))], texts, args.clients,
                        args.seconds)
        sampling.set()
        sampler.join()
        time.sleep(2.5)  # the loads counter recorded (each second) and exported
        loads = loads_total(metrics_url) - before
        added = []
        with httpx.Client(timeout=120) as c:
            for k in range(args.cold):
                name = names[-1 - (k % 2)]  # two cold models in turn
                for other in names:  # an empty budget: a cold model is never loaded in place of hotter ones
                    c.post(f"{url}/v2/repository/models/{other}/unload")
                time.sleep(0.3)
                started = time.perf_counter()
                assert c.post(f"{url}/v1/embeddings", json={"model": name, "input": texts[k]}).status_code == 200
                cold = time.perf_counter() - started
                started = time.perf_counter()
                assert c.post(f"{url}/v1/embeddings", json={"model": name, "input": texts[k]}).status_code == 200
                added.append(cold - (time.perf_counter() - started))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)

    def ms(values: list[float], q: float) -> float:
        return percentile(values, q) * 1000

    one_ok = [s for _, s, status in one if status == 200]
    hot_ok = [s for m, s, status in rotation if m == hot and status == 200]
    failed = sum(1 for _, _, status in rotation if status != 200)
    share = sum(1 for m, _, _ in rotation if m == hot) / max(1, len(rotation))
    p99_ratio = ms(hot_ok, 99) / ms(one_ok, 99)
    rows = [
        "| measure | figure |",
        "| --- | --- |",
        f"| one model alone, single texts at {args.clients} clients: p50 / p99 | {ms(one_ok, 50):.1f} / "
        f"{ms(one_ok, 99):.1f} ms ({len(one_ok) / args.seconds:.0f} requests/s) |",
        f"| Zipf ({args.zipf}) over {len(names)} models, room for {args.room}: the hot model ({share:.0%} of "
        f"requests) p50 / p99 | {ms(hot_ok, 50):.1f} / {ms(hot_ok, 99):.1f} ms: **p99 {p99_ratio:.2f}x** the one "
        "model's (target: at most 1.2x) |",
        f"| the rotation: requests, failures, loads per 1,000 requests | {len(rotation)}, {failed}, "
        f"**{1000 * loads / max(1, len(rotation)):.0f}** |",
        f"| a cold load's added latency, p50 of {len(added)} (an unloaded model's first request less its second) | "
        f"**{statistics.median(added):.2f} s** (target: at most 2 s) |",
        f"| the replica's resident memory: at most during the rotation / with the default model only + the budget "
        f"| {max(peak) / MiB:.0f} / {fixed / MiB:.0f} + {budget / MiB:.0f} = {(fixed + budget) / MiB:.0f} MiB |",
    ]
    when = time.strftime("%Y-%m-%d")
    text = (f"Measured {when} by `make bench-models` on {machine()}: `python -m service --models-dir` with one "
            f"replica, {len(names)} models (the bundle {args.bundle.name} under {len(names)} names: each its own "
            f"sessions), a budget of {budget / MiB:.0f} MiB (room for {args.room} at {args.model_bytes / MiB:.0f} "
            f"MiB), single short texts on /v1/embeddings, {args.seconds:.0f} s per phase.\n\n" + "\n".join(rows))
    print(text)
    if not args.no_page:
        write_readme(args.page, text, PAGE_START, PAGE_END)
        print(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
