"""One service configuration under load, in a process of its own: python -m benchmarks.service_phase SPEC_JSON.

Ray Serve reads its ingress switches (HAProxy, direct ingress) from the environment when it is
imported, in every Ray process; a fresh process per configuration is the only clean way to
compare them in one `make bench` run. The spec names the bundle, the settings, the ingress and
the scenarios; the rows are written as JSON to the spec's `out` path.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

from benchmarks.wrk_load import run_wrk
from service.config import INGRESS_ENV as SERVICE_INGRESS_ENV
from service.hosting.processes import free_port, local_cluster_ports

# Ray Serve switches per ingress choice (environment of the Ray processes, set before ray starts):
# the service's own choices, and Ray's throughput-optimized mode (ingress replicas listen
# themselves, gRPC between deployments), measured here but not offered by python -m service.
INGRESS_ENV = {**SERVICE_INGRESS_ENV, "direct": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}}

# the service's routes the load can go to: (path, the request's texts field)
ROUTES = {"native": ("/v1/encode", "inputs"), "openai": ("/v1/embeddings", "input")}
V2_PATH = "/v2/models/all-MiniLM-L6-v2/infer"  # the protocol rows: KServe v2 over HTTP, beside gRPC


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


async def load(url: str, payloads: list[dict], concurrency: int, path: str = "/v1/encode",
               seconds: float | None = None) -> tuple[float, list[float], int]:
    """POST payloads to `path` with `concurrency` httpx clients; return wall time, latencies, and
    failures (answers other than 200). Each payload once, or with `seconds`, the payloads over and over
    until that time has passed (no request starts after it)."""
    latencies: list[float] = []
    failures = 0
    queue: asyncio.Queue = asyncio.Queue()
    for p in payloads:
        queue.put_nowait(p)
    sent = itertools.count()
    deadline = None if seconds is None else time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        def next_payload() -> dict | None:
            if deadline is not None:
                return payloads[next(sent) % len(payloads)] if time.perf_counter() < deadline else None
            return None if queue.empty() else queue.get_nowait()

        async def worker() -> None:
            nonlocal failures
            while (payload := next_payload()) is not None:
                started = time.perf_counter()
                r = await client.post(path, json=payload)
                latencies.append(time.perf_counter() - started)
                failures += r.status_code != 200

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, latencies, failures


def v2_body(texts: list[str]) -> dict:
    """KServe v2 over HTTP as tritonclient sends it by default: binary outputs (here: the pooled embedding)."""
    return {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
            "outputs": [{"name": "sentence_embedding"}], "parameters": {"binary_data_output": True}}


async def load_grpc(target: str, batches: list[list[str]], concurrency: int,
                    model: str = "all-MiniLM-L6-v2") -> tuple[float, list[float], int]:
    """KServe v2 ModelInfer over gRPC (grpc.aio, one HTTP/2 channel per client, raw input contents as
    tritonclient sends them) with `concurrency` clients: wall time, latencies, failures (non-OK calls)."""
    import struct

    import grpc

    from service.apis.kserve_v2.messages import messages, method_path

    m = messages()

    def request(texts: list[str]):
        r = m.ModelInferRequest(model_name=model)
        r.inputs.add(name="text", datatype="BYTES", shape=[len(texts)])
        r.outputs.add(name="sentence_embedding")
        r.raw_input_contents.append(b"".join(struct.pack("<I", len(b)) + b for b in (t.encode() for t in texts)))
        return r.SerializeToString()

    queue: asyncio.Queue = asyncio.Queue()
    for texts in batches:
        queue.put_nowait(request(texts))
    latencies: list[float] = []
    failures = 0

    async def worker() -> None:
        nonlocal failures
        async with grpc.aio.insecure_channel(target) as channel:
            call = channel.unary_unary(method_path("ModelInfer"))  # bytes in, bytes out
            while not queue.empty():
                body = queue.get_nowait()
                started = time.perf_counter()
                try:
                    await call(body, timeout=120)
                except grpc.aio.AioRpcError:
                    failures += 1
                latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies, failures


COMPONENTS = (  # process title fragment -> component, first match wins
    ("ServeReplica:bench:Encoder", "encoder"),
    ("ServeReplica:bench:Ingress", "ingress"),
    ("ServeReplica:bench:Echo", "echo replica"),
    ("ServeReplica:bench:", "replica"),  # any other deployment of the app
    ("ProxyActor", "proxy"),
    ("haproxy", "proxy"),
    ("benchmarks.plain_server", "uvicorn server"),  # the no-Ray bound (benchmarks/plain_server.py)
    ("benchmarks.otlp_receiver", "trace receiver"),  # the tracing rows' collector (benchmarks/otlp_receiver.py)
    ("service.observability.span_export", "span exporter"),  # a tracing replica's exporter process (service/observability/span_export.py)
)


def descendants_cpu(root: int | None = None) -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds, user + system) of this process (or `root`) and its live descendants, from
    /proc: another Ray cluster on the same machine (a test suite running beside a benchmark) is not ours."""
    tick = os.sysconf("SC_CLK_TCK")
    me = os.getpid() if root is None else root
    procs: dict[int, tuple[int, str, float]] = {}  # pid -> (parent, command line, CPU seconds)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        procs[int(entry.name)] = (int(fields[1]), cmdline, (int(fields[11]) + int(fields[12])) / tick)

    def ours(pid: int) -> bool:
        seen = set()
        while pid > 1 and pid not in seen:
            if pid == me:
                return True
            seen.add(pid)
            pid = procs[pid][0] if pid in procs else 0
        return False

    return {pid: (cmdline, cpu) for pid, (_, cmdline, cpu) in procs.items() if ours(pid)}


def cpu_seconds() -> dict[str, float]:
    """CPU time (user + system) used so far by this phase's processes, by component.

    Read from /proc (descendants_cpu): the load generator (this process), the Serve proxy, the ingress and
    encoder replicas, and everything else Ray runs (GCS, raylet, controller, agents).
    """
    me = os.getpid()
    totals: dict[str, float] = {}
    for pid, (cmdline, cpu) in descendants_cpu().items():
        if pid == me:
            component = "load generator"
        elif "ray" not in cmdline and not any(f in cmdline for f, _ in COMPONENTS):
            continue
        else:
            component = next((c for fragment, c in COMPONENTS if fragment in cmdline), "ray system")
        totals[component] = totals.get(component, 0.0) + cpu
    return totals


def process_group_cpu(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of one process group."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def padding_counters(metrics_url: str) -> tuple[float, float]:
    """(real tokens, padded tokens) from the service's own Prometheus counters."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10).text
    sums = {"ray_encoder_tokens": 0.0, "ray_encoder_padded_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in sums:
            sums[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return sums["ray_encoder_tokens"], sums["ray_encoder_padded_tokens"]


def settled_counters(metrics_url: str, at_least: float = 0.0, timeout: float = 30.0) -> tuple[float, float]:
    """Counters once Ray's metrics export has caught up: past `at_least` and equal on two reads."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        now = padding_counters(metrics_url)
        if now == last and now[0] >= at_least:
            return now
        last = now
        time.sleep(1.5)
    return last or (0.0, 0.0)


def echo_app():
    """The ceiling of the HTTP path: a Ray Serve deployment that answers at once, no model."""
    from ray import serve

    @serve.deployment(name="Echo", max_ongoing_requests=256)
    class Echo:
        async def __call__(self, request) -> dict:
            await request.body()
            return {"data": [{"embedding": []}]}

    return Echo.bind()


def encoder_counters(url: str, spec: dict) -> dict:
    """The answering encoder replica's counters (/info); zeros for the echo deployment."""
    if spec.get("echo"):
        return {"batches": 0, "texts": 0, "ort_runs": 0, "compute_ms": 0.0}
    return httpx.get(f"{url}/info", timeout=30).json()["encoder_counters"]


@contextmanager
def ray_service(spec: dict, settings):
    """The service under Ray Serve on loopback, as `python -m service` runs it: (url, metrics url)."""
    for key, value in {**INGRESS_ENV[spec["ingress"]], **spec.get("env", {})}.items():
        os.environ[key] = value
    # Ray Serve's own fixed ports made free ones, as python -m service does: another cluster on this
    # machine must neither fail this one's start nor receive its traffic
    for key, value in local_cluster_ports().items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep the local cluster on loopback
    import ray
    from ray import serve

    from service.app import build_app

    from service.grpc.protocol import SERVICER_FUNCTION

    port, metrics_port, grpc_port = free_port(), free_port(), free_port()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR",
             log_to_driver=spec.get("log_to_driver", True),  # False: the replicas' output stays in Ray's log files
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    grpc_options={"port": grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]},
                    logging_config={"enable_access_log": False, "log_level": "WARNING"})
        if spec.get("echo"):
            app = echo_app()
        elif spec.get("standin") is not None:  # the model replaced by benchmarks/standin.py, bound here only
            from benchmarks.standin import StandInLoader, latency_model
            from service.app import compose

            app = compose(settings, runtime_loader=StandInLoader(latency_model(spec["standin"])))
        else:
            app = build_app(settings)
        serve.run(app, name="bench", route_prefix="/", logging_config={"enable_access_log": False, "log_level": "WARNING"})
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", f"127.0.0.1:{grpc_port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def plain_service(spec: dict, settings):
    """The same app and engines under plain uvicorn, no Ray (benchmarks/plain_server.py): (url, None)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.plain_server", json.dumps(spec["settings"]), str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the plain uvicorn server exited ({server.returncode}) before it served")
            try:
                if httpx.get(f"{url}/info", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the plain uvicorn server did not answer /info within 180 s")
            time.sleep(0.5)
        yield url, None, None
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def run(spec: dict) -> list[dict]:
    rows: list[dict] = []
    receiver = None
    if spec.get("tracing"):  # every request's spans to an OTLP receiver on loopback, in a process of its own
        from benchmarks.otlp_receiver import ReceiverProcess

        receiver = ReceiverProcess().start()
        spec = {**spec, "settings": {**spec["settings"], "tracing": {"endpoint": receiver.endpoint, "sample_ratio": 1.0}}}
    try:
        return _measure(spec, rows)
    finally:
        if receiver is not None:
            print(f"  {spec['label']}: {receiver.count()} spans received", flush=True)
            receiver.stop()


def _measure(spec: dict, rows: list[dict]) -> list[dict]:
    from service.config import ServiceSettings

    settings = ServiceSettings.model_validate(spec["settings"])
    with (plain_service if spec.get("no_ray") else ray_service)(spec, settings) as (url, metrics_url, grpc_target):
        texts = spec["texts"]
        info = {} if spec.get("echo") else httpx.get(f"{url}/info", timeout=30).json()
        fmt = {"encoding_format": spec["encoding_format"]} if spec.get("encoding_format") else {}
        path, field = ROUTES[spec.get("route", "native")]
        asyncio.run(load(url, [{field: [t], **fmt} for t in texts[:64]], 8, path=path))  # warm-up
        for scenario in spec["scenarios"]:
            if scenario.get("rerank"):
                rows.append(rerank_row(url, spec, scenario))
                continue
            if scenario.get("bodies"):
                rows.append(bodies_row(url, spec, scenario, info))
                continue
            if scenario.get("short"):
                pool = [spec["short_text"]] * 200
            else:
                pool = spec["mixed_texts"] if scenario.get("mixed") else texts
            per_request, concurrency = scenario["per_request"], scenario["concurrency"]
            protocol = scenario.get("protocol")  # None: the spec's route; "v2" or "grpc": KServe v2 over HTTP or gRPC
            use_wrk = scenario.get("loadgen") == "wrk"
            if use_wrk:  # one text per request, the body as a string: {"input": "..."}
                if per_request != 1:
                    raise ValueError("wrk scenarios send single texts")
                wrk, bodies = spec["wrk"], [json.dumps({field: t, **fmt}) for t in dict.fromkeys(pool)]
                if wrk.get("warmup_s"):
                    run_wrk(url, path, bodies, concurrency, wrk["warmup_s"], threads=wrk.get("threads"))
            else:
                payloads = [{field: pool[i : i + per_request], **fmt} for i in range(0, len(pool), per_request)]
            if protocol == "grpc":  # the channels' first calls, before anything is counted
                asyncio.run(load_grpc(grpc_target, [pool[:per_request]] * 16, concurrency))
            if scenario.get("mixed"):
                before = settled_counters(metrics_url)
            counters_before = encoder_counters(url, spec)
            cpu_before = cpu_seconds()
            if use_wrk:
                measured = run_wrk(url, path, bodies, concurrency, wrk["duration_s"], threads=wrk.get("threads"))
                n_texts, failures, texts_s = max(measured["requests"], 1), measured["failures"], measured["texts_s"]
                p50, p95, p99 = measured["p50"], measured["p95"], measured["p99"]
            elif protocol == "grpc":
                batches = [pool[i : i + per_request] for i in range(0, len(pool), per_request)]
                wall, latencies, failures = asyncio.run(load_grpc(grpc_target, batches, concurrency))
                n_texts, texts_s = len(pool), len(pool) / wall
            elif protocol == "v2":
                v2 = [v2_body(pool[i : i + per_request]) for i in range(0, len(pool), per_request)]
                wall, latencies, failures = asyncio.run(load(url, v2, concurrency, path=V2_PATH))
                n_texts, texts_s = len(pool), len(pool) / wall
            else:
                wall, latencies, failures = asyncio.run(load(url, payloads, concurrency, path=path))
                n_texts, texts_s = len(pool), len(pool) / wall
            if not use_wrk:
                p50, p95, p99 = (percentile(latencies, q) * 1000 for q in (50, 95, 99))
            cpu_after = cpu_seconds()
            if use_wrk:  # wrk is a child process: its CPU is the load generator's too
                cpu_after["load generator"] = cpu_after.get("load generator", 0.0) + measured["load_cpu_s"]
            counters_after = encoder_counters(url, spec)
            counters = {k: v - counters_before[k] for k, v in counters_after.items()}
            row = {
                "engine": f"service {spec['label']}, {scenario['label']}",
                # what the replica serves (auto resolves to fp32 or bf16), and on which runtime
                "precision": "none (echo)" if spec.get("echo") else info.get("precision", settings.precision),
                "runtime": info.get("runtime", ""),
                "default_config": "precision" not in spec["settings"] and not spec.get("echo") and not spec.get("no_ray"),
                "ingress": spec["ingress"],
                "bound": bool(spec.get("no_ray")),  # a bound to compare with, not the service: no target picks it
                "batching": settings.batching.enabled,
                "per_request": per_request,
                "concurrency": concurrency,
                "short": bool(scenario.get("short")),
                "mixed": bool(scenario.get("mixed")),
                "loadgen": "wrk" if use_wrk else ("grpc.aio" if protocol == "grpc" else "httpx"),
                "route": {"grpc": "ModelInfer (gRPC)", "v2": V2_PATH}.get(protocol, path),
                "protocol": protocol,
                "tracing": bool(spec.get("tracing")),
                "tracing_row": bool(scenario.get("tracing_row")),
                "texts_s": texts_s,
                "p50": p50,
                "p95": p95,
                "p99": p99,
                "failures": failures,
                **({"intra_op_threads": info["intra_op_threads"],
                    "concurrent_batches": info["batching"]["max_concurrent_batches"]} if info else {}),
                # one encoder replica: its counters say how well requests were batched
                "texts_per_batch": counters["texts"] / max(counters["batches"], 1),
                "texts_per_ort_run": counters["texts"] / max(counters["ort_runs"], 1),
                "compute_ms_per_text": counters["compute_ms"] / max(counters["texts"], 1),
                # CPU milliseconds per text, by component: where the machine's time went
                "cpu_ms_per_text": {
                    c: round((cpu_after.get(c, 0.0) - cpu_before.get(c, 0.0)) * 1000 / n_texts, 2)
                    for c in sorted(cpu_after)
                },
            }
            if scenario.get("mixed"):
                after = settled_counters(metrics_url, at_least=before[0] + 1)
                real, padded = after[0] - before[0], after[1] - before[1]
                row["padding_waste"] = 1 - real / padded if padded else float("nan")
            rows.append(row)
            extra = f", padding waste {row['padding_waste']:.1%}" if "padding_waste" in row else ""
            cpu = ", ".join(f"{c} {v:.1f}" for c, v in row["cpu_ms_per_text"].items())
            print(f"  {row['engine']}, concurrency {concurrency}: {row['texts_s']:.0f} texts/s, "
                  f"failures {failures}, p50 {row['p50']:.1f} ms{extra}; {row['texts_per_batch']:.1f} texts per batch, "
                  f"{row['texts_per_ort_run']:.1f} per ORT run, compute {row['compute_ms_per_text']:.1f} ms per text; CPU ms per text: {cpu}", flush=True)
        if spec.get("reference"):  # the served embeddings of the texts, against sentence-transformers'
            cosine = served_min_cosine(url, texts, np.array(spec["reference"]))
            print(f"  {spec['label']}: min cosine vs sentence-transformers {cosine:.5f} over {len(texts)} texts", flush=True)
            for row in rows:
                row["cosine"] = cosine
    return rows


def rerank_row(url: str, spec: dict, scenario: dict) -> dict:
    """/v1/rerank with one query and `documents` documents per request (explain as the scenario says)."""
    work, n = spec["rerank"], scenario["documents"]
    payloads = [{"model": work["model"], "query": q, "documents": docs[:n], "explain": scenario.get("explain", False)}
                for q, docs in zip(work["queries"], work["documents"], strict=True)]
    asyncio.run(load(url, payloads[:2], 1, path="/v1/rerank"))  # warm-up
    wall, latencies, failures = asyncio.run(load(url, payloads, scenario["concurrency"], path="/v1/rerank"))
    row = {"engine": f"service {spec['label']}, {scenario['label']}", "rerank": True, "explain": scenario.get("explain", False),
           "documents": n, "concurrency": scenario["concurrency"], "ingress": spec["ingress"], "precision": "fp32",
           "requests_s": len(payloads) / wall, "texts_s": len(payloads) * n / wall, "failures": failures,
           **{f"p{q}": percentile(latencies, q) * 1000 for q in (50, 95, 99)}}
    print(f"  {row['engine']}, concurrency {row['concurrency']}: {row['requests_s']:.1f} requests/s "
          f"({row['texts_s']:.0f} pairs/s), p50 {row['p50']:.1f} ms, failures {failures}", flush=True)
    return row


def bodies_row(url: str, spec: dict, scenario: dict, info: dict) -> dict:
    """/v1/encode with the scenario's own request bodies (several per client batch where it asks for one
    representation each): texts/s counts each of the scenario's `texts` once, however many requests it took.
    Each kind of body is sent once first, and its answer must hold every output it asked for."""
    bodies = scenario["bodies"]
    with httpx.Client(base_url=url, timeout=300) as client:
        for body in {json.dumps({k: v for k, v in b.items() if k != "inputs"}): b for b in bodies}.values():
            r = client.post("/v1/encode", json=body)
            r.raise_for_status()
            item = r.json()["data"][0]
            missing = [k for k in ("embedding", "sparse", "multivector") if body.get(k) and item.get(k) is None]
            if missing:
                raise SystemExit(f"{spec['label']}: /v1/encode answered without {missing} for {sorted(body)}")
    asyncio.run(load(url, bodies[:8], scenario["concurrency"], path="/v1/encode"))  # warm-up
    wall, latencies, failures = asyncio.run(load(url, bodies, scenario["concurrency"], path="/v1/encode"))
    row = {"engine": f"service {spec['label']}, {scenario['label']}", "representations": scenario["representations"],
           "passes": scenario["passes"], "concurrency": scenario["concurrency"], "ingress": spec["ingress"],
           "requests": len(bodies), "texts_s": scenario["texts"] / wall, "failures": failures,
           "precision": info.get("precision", ""), "runtime": info.get("runtime", ""),
           **{f"p{q}": percentile(latencies, q) * 1000 for q in (50, 95, 99)}}
    print(f"  {row['engine']}, concurrency {row['concurrency']}: {row['texts_s']:.1f} texts/s "
          f"({len(bodies)} requests), p50 {row['p50']:.0f} ms, failures {failures}", flush=True)
    return row


def served_min_cosine(url: str, texts: list[str], reference: np.ndarray, batch: int = 32) -> float:
    """The lowest cosine between an embedding the service returns (/v1/embeddings, floats) and the reference's."""
    got = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for i in range(0, len(texts), batch):
            r = client.post("/v1/embeddings", json={"input": texts[i : i + batch]})
            r.raise_for_status()
            got += [d["embedding"] for d in r.json()["data"]]
    a, b = np.array(got, dtype=np.float64), reference.astype(np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    rows = run(spec)
    Path(spec["out"]).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
