"""The embedding job's texts/s against the online service and the engine alone, in one run (make bench-jobs).

    python -m benchmarks.jobs [--bundle DIR] [--texts N] [--seconds S] [--service-texts M] [--clients 1,2,4]
                              [--nodes N [--node-cpus C]] [--json FILE]

Three phases on the same short texts of the benchmark corpus (benchmarks/corpus.py, 4-20 words), one after
the other, never two at once:

1. the online service, started as `make bench` starts its default configuration (bench.service_phase: Ray
   Serve in a process of its own, on the last ingress of make bench, HAProxy), client batches of 32 texts
   over HTTP on /v1/embeddings at each client count of --clients, the first M texts; its best rate is the
   one the job is held to. The process (its Ray and Serve) has exited before phase 2 starts.
2. the job, `python -m jobs embed` on N texts written to a Parquet file (jobs.embed.run: planning, Ray
   Data, one actor per CPU, shards written), on a local Ray with every CPU, or with --nodes on a
   LoopbackCluster of tests/cluster.py (imported from there: a real Ray cluster on loopback started with
   `ray start`, as the multinode test's) of a 0-CPU head and N-1 workers of C CPUs, reached through the
   job's --address; it prints the rows each node computed (from the shards' _progress records) and
   whether every worker node did some. The cluster (or local Ray) is gone before phase 3.
3. the engine alone (benchmarks/engine_alone.py: client batches straight into the same engine at the same
   precision setting, in this process; no Ray, no HTTP, no files): the bound on one node.

It prints the three rates and the job's ratios (issue 50's targets: the job at least 1.3x the online
service and at least 0.9x the engine alone). The job's rate counts everything from its start (Ray's
start-up and the actors' engine loading included, so a small N understates it); its rate between its
first and last shard is printed beside it. With --nodes the cluster's workers share this machine's
CPUs, so the ratios say what the cluster's overhead costs here, not what more machines give. Rows for
make bench with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

PER_REQUEST = 32  # the online service's client batch, as make bench's rows


def short_texts(n: int) -> list[str]:
    """The benchmark's short texts; the first k of n are the same for any n (one seed)."""
    from benchmarks.corpus import sentences

    return sentences(n, min_words=4, max_words=20)


def online_rate(bundle: Path, precision: str, texts: list[str], clients: list[int]) -> list[dict]:
    """The service's rows: client batches of 32 on /v1/embeddings at each client count, in a process of its own."""
    from benchmarks.bench import service_phase

    settings = {"bundle": str(bundle), **({"precision": precision} if precision != "auto" else {})}
    return service_phase({
        "label": "default config, haproxy", "ingress": "haproxy", "settings": settings, "texts": texts,
        "route": "openai", "encoding_format": "base64",
        "scenarios": [{"label": f"client batches of {PER_REQUEST} (httpx, /v1/embeddings)", "per_request": PER_REQUEST,
                       "concurrency": c, "loadgen": "httpx"} for c in clients]})


@contextmanager
def job_cluster(nodes: int, node_cpus: int):
    """None (a local Ray started for the job), or the address of a loopback cluster of a 0-CPU head and
    nodes-1 workers, torn down (every process of it) on the way out."""
    if nodes <= 1:
        yield None
        return
    from tests.cluster import LoopbackCluster

    cluster = LoopbackCluster()
    # this driver joins with the cluster's token, and on loopback as its nodes do: with Ray's multi-node switch
    # off (read when ray is imported), 127.0.0.1 is not rewritten into the machine's network address
    joining = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    saved = {k: os.environ.get(k) for k in joining}
    if "ray" in sys.modules:
        raise RuntimeError("benchmarks.jobs: ray was imported before the loopback cluster's driver settings were set")
    try:
        cluster.start_node(0, head=True)
        for index in range(1, nodes):
            cluster.start_node(index, num_cpus=node_cpus)
        os.environ.update({k: cluster.env[k] for k in joining})
        yield f"127.0.0.1:{cluster.gcs_port}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        left = cluster.shutdown()
        if left:
            print(f"warning: processes of the loopback cluster still alive: {sorted(left)}", flush=True)


JOB_COMPONENTS = (  # process title fragment -> what it is, first match wins (a Ray worker's title is its task)
    ("MapBatches(Embedder)", "embedding actors"),
    ("ray::", "read tasks and idle Ray workers"),
)


class CpuSampler:
    """CPU seconds by component of the job's processes, from /proc every half second while it runs: Ray Data's
    actors and workers exit with the dataset, so the last sample of each process is what it used."""

    def __init__(self) -> None:
        from benchmarks.service_phase import descendants_cpu

        self.read = descendants_cpu
        self.before = {pid: cpu for pid, (_, cpu) in self.read().items()}
        self.last: dict[int, tuple[str, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.last.update(self.read())
            if self.stop.wait(0.5):
                self.last.update(self.read())
                return

    def __enter__(self) -> CpuSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def by_component(self) -> dict[str, float]:
        me, totals = os.getpid(), {}
        for pid, (cmdline, cpu) in self.last.items():
            if pid == me:
                component = "driver (this process: Ray Data's executor)"
            else:
                component = next((c for fragment, c in JOB_COMPONENTS if fragment in cmdline),
                                 "ray system (GCS, raylet, agents)")
            totals[component] = totals.get(component, 0.0) + cpu - self.before.get(pid, 0.0)
        return totals


def job_rate(bundle: Path, texts: list[str], precision: str, work: Path, address: str | None) -> dict:
    """The job on the texts: its summary's texts/s (from its start), its rate between its first and last
    shard, and the rows each node computed with the CPUs Ray saw on it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from jobs.embed import run
    from jobs.shards import read_records, record_path

    n = len(texts)
    pq.write_table(pa.table({"text": texts}), work / "in.parquet")
    if address is None:
        ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        started = time.perf_counter()
        # this process and its descendants: a local Ray's, not a --nodes cluster's (`ray start` daemonizes them)
        with CpuSampler() as sampler:
            summary = run({"bundle": bundle, "inputs": [work / "in.parquet"], "output": work / "out",
                           "address": address, "precision": precision, "batch_size": max(256, min(4096, n // 16))})
        wall = time.perf_counter() - started
        node_cpus = {node["NodeID"]: node["Resources"].get("CPU", 0) for node in ray.nodes() if node["Alive"]}
    finally:
        ray.shutdown()
    records = read_records(work / "out")
    times = sorted(record_path(work / "out", r.first, r.last).stat().st_mtime for r in records)
    first_shard_rows = records[0].last + 1 if records else 0
    steady = (n - first_shard_rows) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return {"texts_s": n / wall, "steady_texts_s": steady, "precision": summary["precision"],
            "failures": summary["failures"], "rows_by_node": summary["rows_by_node"], "node_cpus": node_cpus,
            "cpu_ms_per_text": {k: round(v * 1000 / n, 3) for k, v in sampler.by_component().items()},
            "actor_cpu_ms_per_text": {k: round(v * 1000 / n, 3) for k, v in summary["actor_cpu_s"].items()}}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.jobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    p.add_argument("--texts", type=int, default=100_000, help="short texts the job embeds (issue 50: 100k)")
    p.add_argument("--seconds", type=float, default=8, help="the engine alone's seconds of load")
    p.add_argument("--service-texts", type=int, default=2048,
                   help="texts the online service embeds at each client count (the first of the job's)")
    p.add_argument("--clients", default="1,2,4", help="the online service's client counts; its best rate counts")
    p.add_argument("--nodes", type=int, default=1,
                   help="1: the job on a local Ray; N > 1: on a loopback Ray cluster of a 0-CPU head and N-1 workers")
    p.add_argument("--node-cpus", type=int, default=2, help="CPUs each worker node declares (with --nodes)")
    p.add_argument("--precision", default="auto", help="the service's precision setting, for all three")
    p.add_argument("--json", type=Path, help="also write the rows there, as JSON")
    args = p.parse_args()
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    if not clients or min(clients) < 1:
        p.error("--clients: client counts of at least 1, comma-separated")
    if args.nodes < 1 or args.node_cpus < 1:
        p.error("--nodes and --node-cpus: at least 1")

    bundle = args.bundle.resolve()
    texts = short_texts(args.texts)
    service_rows = online_rate(bundle, args.precision, texts[: args.service_texts], clients)
    online = max(service_rows, key=lambda r: r["texts_s"])
    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as work, job_cluster(args.nodes, args.node_cpus) as address:
        job = job_rate(bundle, texts, args.precision, Path(work), address)
    from benchmarks.engine_alone import measure  # imports ray: after the job's cluster (job_cluster)
    from service.config import ServiceSettings
    from service.engine.encoder_service import EncoderService
    from service.engine.engine import EngineTable, load_engine

    settings = ServiceSettings(bundle=str(bundle), precision=args.precision)
    engine = load_engine(settings.bundles[0], settings)
    svc = EncoderService(settings, EngineTable([engine]))
    svc.warm_up()
    alone = asyncio.run(measure(svc, engine, short_texts(512), args.seconds))

    where = (f"a loopback cluster of a 0-CPU head and {args.nodes - 1} workers of {args.node_cpus} CPUs"
             if args.nodes > 1 else "a local Ray")
    ratio, steady = job["texts_s"] / alone["texts_s"], job["steady_texts_s"] / alone["texts_s"]
    vs_online, steady_vs_online = job["texts_s"] / online["texts_s"], job["steady_texts_s"] / online["texts_s"]
    print(f"embedding job ({job['precision']}, {args.texts} texts, {where}, {os.cpu_count()} CPUs here): "
          f"{job['texts_s']:.0f} texts/s from its start = {ratio:.2f}x the engine alone, {vs_online:.2f}x the online "
          f"service; {job['steady_texts_s']:.0f} texts/s between its first and last shard = {steady:.2f}x, "
          f"{steady_vs_online:.2f}x (targets: >= 0.9x the engine alone, >= 1.3x the online service)", flush=True)
    workers = [node for node, cpus in job["node_cpus"].items() if cpus > 0]
    every_worker = bool(workers) and all(job["rows_by_node"].get(node, 0) > 0 for node in workers)
    for node, rows in job["rows_by_node"].items():
        print(f"  rows by node: {node[:12]} ({job['node_cpus'].get(node, '?')} CPUs): {rows}", flush=True)
    print(f"  rows done on every worker node: {'yes' if every_worker else 'no'} ({len(workers)} with CPUs)", flush=True)
    print("  CPU ms per text by process: " + ", ".join(f"{k} {v:.2f}" for k, v in job["cpu_ms_per_text"].items())
          + "; in the actors, by stage: " + ", ".join(f"{k} {v:.2f}" for k, v in job["actor_cpu_ms_per_text"].items()),
          flush=True)
    by_clients = ", ".join(f"{r['concurrency']} clients {r['texts_s']:.0f}" for r in service_rows)
    print(f"online service ({online['runtime']} {online['precision']}, client batches of {PER_REQUEST} on /v1/embeddings, "
          f"same run): best {online['texts_s']:.0f} texts/s at {online['concurrency']} clients ({by_clients})", flush=True)
    print(f"engine alone ({engine.runtime.runtime} {engine.runtime.precision}, same run): {alone['texts_s']:.0f} texts/s, "
          f"{alone['cpu_ms_per_text']:.2f} ms of CPU per text", flush=True)
    if args.json:
        args.json.write_text(json.dumps([
            {"engine": f"the embedding job ({job['precision']}): python -m jobs embed, {args.texts} texts, {where}",
             "job": True, "texts_s": job["texts_s"], "steady_texts_s": job["steady_texts_s"], "vs_engine_alone": ratio,
             "vs_online_service": vs_online, "steady_vs_online_service": steady_vs_online, "nodes": args.nodes,
             "rows_by_node": job["rows_by_node"], "every_worker_node": every_worker,
             "cpu_ms_per_text": job["cpu_ms_per_text"], "actor_cpu_ms_per_text": job["actor_cpu_ms_per_text"]},
            *({**row, "online_service": True, "best": row is online} for row in service_rows),
            {"engine": f"the engine alone ({engine.runtime.runtime} {engine.runtime.precision}), same run",
             "engine_alone": True, "bound": True, "texts_s": alone["texts_s"],
             "cpu_ms_per_text": alone["cpu_ms_per_text"]}]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
