"""make profile: where the service's CPU time goes, per process, under single-text load.

    python -m benchmarks.profile [--ingress proxy|haproxy] [--precision fp32|int8] [--seconds 15] [--tracing]
                                 [--standin 0|h100|MS] [--per-request N] [--concurrency C] [--loadgen httpx|wrk]

Starts the service on loopback (its own Ray), drives single-text requests at concurrency 32, and
records each Serve process (the replica, and Ray's proxy actor) with py-spy: a flame graph per process
(results/profile/*.svg) and the functions with the most samples, printed. This is how the request
path was profiled before and after each change of the performance work (see docs/performance.md).
--standin replaces the model with benchmarks/standin.py's stand-in runtime (bound into the replica as
make bench-request-path does), so that the request path's own CPU cost is what is sampled; --per-request
sends client batches of that many texts instead of single texts (to /v1/embeddings, as that benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.corpus import sentences
from benchmarks.service_phase import INGRESS_ENV, load
from service.config import DEFAULT_INGRESS
from service.hosting.processes import free_port, local_cluster_ports

PROCESSES = {"Encoder": "replica", "ProxyActor": "proxy"}  # HAProxy is not Python: /proc CPU columns cover it


def serve_pids() -> dict[str, int]:
    """pid of each Serve process, from the process titles Ray gives its workers."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for fragment, name in PROCESSES.items():
            if title.startswith("ray::") and fragment in title:
                found[name] = int(entry.name)
    return found


def top_frames(raw: Path, n: int = 12) -> list[tuple[float, str]]:
    """The functions with the most samples (self time) in a py-spy raw (collapsed stacks) file."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        counts[stack.split(";")[-1]] += int(count)
    return [(100 * c / max(total, 1), frame) for frame, c in counts.most_common(n)]


# Frames where a sampled thread waits rather than works (py-spy counts some waits as active)
WAITING = ("Condition.wait", "Thread.run (threading", "_run_user_code_event_loop", "Worker.main_loop",
           "_worker (concurrent", "Event.wait", "select (selectors", "_get_loop")
# Where a sample of the replica's stack is, by the innermost frame that says (checked in this order)
STAGES = [
    ("metrics", ("ray/util/metrics.py", "service/observability/metrics.py")),
    ("model", ("onnxruntime_inference_collection", "runtimes/onnxruntime.py", "benchmarks/standin.py")),
    ("tokenize", ("engine/tokenization.py", "tokenizers")),
    ("serialise", ("front/responses.py", "orjson", "responses.py")),
    ("batch and pool", ("engine/batcher.py", "engine/runner.py", "batching.py", "numpy")),
    ("parse and validate", ("fastapi/", "pydantic", "starlette/", "apis/", "json/", "schemas.py")),
    ("routes and engine steps", ("service/",)),
    ("Ray Serve, uvicorn, event loop", ("ray/", "uvicorn", "h11", "asyncio", "anyio", "concurrent/")),
]
SAMPLE_MS = 10  # py-spy at 100 samples per second


def stage_of(stack: str) -> str:
    frames = stack.split(";")
    if any(mark in frames[-1] for mark in WAITING):
        return "waiting"
    for frame in reversed(frames):
        for stage, marks in STAGES:
            if any(mark in frame for mark in marks):
                return stage
    return "other"


def stage_ms(raw: Path, requests: int) -> dict[str, float]:
    """CPU milliseconds per request by stage: py-spy samples of non-idle threads, 10 ms each."""
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            counts[stage_of(stack)] += int(count)
    return {stage: n * SAMPLE_MS / max(requests, 1) for stage, n in counts.most_common()}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    p.add_argument("--ingress", choices=["proxy", "haproxy"], default=DEFAULT_INGRESS)
    p.add_argument("--precision", choices=["fp32", "int8"], default="fp32")
    p.add_argument("--seconds", type=int, default=15)
    p.add_argument("--out", type=Path, default=Path("results/profile"))
    p.add_argument("--standin", help="the model replaced by the stand-in runtime at this latency model "
                                     "(benchmarks/standin.py: 0, h100, or ms per run)")
    p.add_argument("--per-request", type=int, default=1, help="texts per request (more than 1: /v1/embeddings client batches)")
    p.add_argument("--concurrency", type=int, default=32, help="clients at once")
    p.add_argument("--loadgen", choices=["httpx", "wrk"], default="httpx",
                   help="the load generator: Python's httpx, or wrk (benchmarks/wrk_load.py: leaves the cores to the server)")
    p.add_argument("--tracing", action="store_true",
                   help="OpenTelemetry tracing on, every request sampled, spans sent to an OTLP receiver on loopback")
    args = p.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("py-spy not found: pip install py-spy (it is in the test extra)", file=sys.stderr)
        return 2

    os.environ.update(INGRESS_ENV[args.ingress])
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for key, value in local_cluster_ports().items():  # never another cluster's ports (service/hosting/processes.py)
        os.environ.setdefault(key, value)
    import ray
    from ray import serve

    from service.app import build_app
    from service.config import ServiceSettings

    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR")
    receiver = None
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False})
        if args.tracing:
            from benchmarks.otlp_receiver import ReceiverProcess  # as the bench's: not in the load generator

            receiver = ReceiverProcess().start()
        settings = ServiceSettings.model_validate({"bundle": str(args.bundle.resolve()), "precision": args.precision,
                                                   "replicas": 1,
                                                   **({"tracing": {"endpoint": receiver.endpoint}} if receiver else {})})
        if args.standin is not None:  # bound here only, as make bench-request-path does (benchmarks/standin.py)
            from benchmarks.standin import StandInLoader, latency_model
            from service.app import compose

            app = compose(settings, runtime_loader=StandInLoader(latency_model(args.standin)))
        else:
            app = build_app(settings)
        serve.run(app, name="bench", route_prefix="/", logging_config={"enable_access_log": False})
        url = f"http://127.0.0.1:{port}"
        texts = sentences(4096)
        n = args.per_request
        if n > 1:
            path, payloads = "/v1/embeddings", [{"input": texts[i:i + n]} for i in range(0, len(texts), n)] * 64
        else:
            path, payloads = "/v1/encode", [{"inputs": t} for t in texts]
        asyncio.run(load(url, payloads[:64], 8, path=path))  # warm-up
        pids = serve_pids()
        handled_before = replica_requests(url)
        print(f"profiling {', '.join(f'{name} (pid {pid})' for name, pid in pids.items())} for {args.seconds}s "
              f"under {'single-text load' if n == 1 else f'client batches of {n}'} at concurrency {args.concurrency}"
              + (f", the model a stand-in ({args.standin})" if args.standin is not None else ""), flush=True)
        recorders = {
            name: [subprocess.Popen([py_spy, "record", "-p", str(pid), "-d", str(args.seconds), "-r", "100",
                                     "--nonblocking", "-f", fmt, "-o", str(args.out / f"{name}.{ext}")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for fmt, ext in (("flamegraph", "svg"), ("raw", "txt"))]
            for name, pid in pids.items()
        }

        async def drive() -> None:
            loop = asyncio.get_running_loop()
            task = asyncio.ensure_future(load(url, payloads, args.concurrency, path=path))
            await loop.run_in_executor(None, lambda: [r.wait() for rs in recorders.values() for r in rs])
            task.cancel()

        if args.loadgen == "wrk":  # wrk runs past the recording; the requests are counted when it ends
            import threading

            from benchmarks.wrk_load import run_wrk

            bodies = [json.dumps(p) for p in payloads[:512]]
            wrk = threading.Thread(target=run_wrk, args=(url, path, bodies, args.concurrency, args.seconds + 3), daemon=True)
            wrk.start()
            for rs in recorders.values():
                for r in rs:
                    r.wait()
            handled = replica_requests(url) - handled_before
            wrk.join()
        else:
            try:
                asyncio.run(drive())
            except asyncio.CancelledError:
                pass
            handled = replica_requests(url) - handled_before
        if receiver is not None:
            print(f"the receiver got {receiver.count()} spans", flush=True)
    finally:
        if receiver is not None:
            receiver.stop()
        serve.shutdown()
        ray.shutdown()
    for name in recorders:
        raw = args.out / f"{name}.txt"
        if raw.exists():
            print(f"\n{name}: most samples (flame graph: {args.out / (name + '.svg')})")
            for share, frame in top_frames(raw):
                print(f"  {share:5.1f}%  {frame[:120]}")
    raw = args.out / "replica.txt"
    if raw.exists():
        stages = stage_ms(raw, handled)
        outside = sum(v for k, v in stages.items() if k not in ("model", "waiting"))
        kind = "single-text request" if n == 1 else f"request of {n} texts"
        print(f"\nreplica CPU per {kind} ({handled} requests): " +
              ", ".join(f"{k} {v:.2f} ms" for k, v in stages.items()) + f"; outside the model {outside:.2f} ms"
              + (f" ({outside / n:.3f} ms per text)" if n > 1 else ""))
        (args.out / "stages.json").write_text(json.dumps({"requests": handled, "texts_per_request": n,
                                                           "ms_per_request": stages, "outside_model_ms": outside}))
    return 0


def replica_requests(url: str) -> int:
    """Requests the (one) replica has put through its runner, from /info."""
    import httpx

    return int(httpx.get(f"{url}/info", timeout=30).json()["encoder_counters"]["requests"])


if __name__ == "__main__":
    raise SystemExit(main())
