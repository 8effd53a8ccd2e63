"""make bench: in-process references and the service over HTTP, on the same texts, in one run.

Rows: sentence-transformers (torch), onnxruntime in-process (our bundle's graph, length-sorted
batches of 32), and the service on loopback with client batches of 32 and with single-text
requests at several concurrencies, dynamic batching on and off (a batch of one). Prints texts/s,
tokens/s and p50/p95/p99 latency; figures move +-10 % between runs on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.corpus import sentences


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def bench_sentence_transformers(texts: list[str], batch: int) -> float:
    import torch
    from sentence_transformers import SentenceTransformer

    from export.checkpoint import resolve_checkpoint

    torch.set_num_threads(os.cpu_count() or 1)
    model = SentenceTransformer(str(resolve_checkpoint("default")[0]), device="cpu")
    model.encode(texts[:64], batch_size=batch)
    started = time.perf_counter()
    model.encode(texts, batch_size=batch)
    return len(texts) / (time.perf_counter() - started)


def bench_onnxruntime(texts: list[str], batch: int, bundle_dir: Path, threads: int) -> tuple[float, float]:
    """texts/s in arrival order and length-sorted; plus the time of one short-text call (ms)."""
    from bundle.manifest import load_bundle
    from service.batching import pad
    from service.runtime import OrtEncoder
    from service.tokenization import TextTokenizer

    bundle = load_bundle(bundle_dir)
    encoder = OrtEncoder(bundle, "auto", intra_op_threads=threads)
    tokenizer = TextTokenizer(bundle.tokenizer_path, bundle.manifest.model.max_tokens)

    def run(order: list[int]) -> float:
        started = time.perf_counter()
        for i in range(0, len(order), batch):
            chunk = [texts[j] for j in order[i : i + batch]]
            ids, mask = pad([t.ids for t in tokenizer.encode(chunk, True)], 0)
            encoder.run(ids, mask, ["sentence_embedding"])
        return len(texts) / (time.perf_counter() - started)

    run(list(range(64)))
    lengths = [len(t.split()) for t in texts]
    unsorted = run(list(range(len(texts))))
    by_length = run(sorted(range(len(texts)), key=lengths.__getitem__))
    one = [t.ids for t in tokenizer.encode(["A short text."], True)]
    calls = []
    for _ in range(50):
        started = time.perf_counter()
        ids, mask = pad(one, 0)
        encoder.run(ids, mask, ["sentence_embedding"])
        calls.append(time.perf_counter() - started)
    return unsorted, by_length, statistics.median(calls) * 1000


async def load(url: str, payloads: list[dict], concurrency: int) -> tuple[float, list[float], int]:
    """Send payloads with `concurrency` clients; return wall time, latencies, and failures."""
    latencies: list[float] = []
    failures = 0
    queue: asyncio.Queue = asyncio.Queue()
    for p in payloads:
        queue.put_nowait(p)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            nonlocal failures
            while not queue.empty():
                payload = queue.get_nowait()
                started = time.perf_counter()
                r = await client.post("/v1/encode", json=payload)
                latencies.append(time.perf_counter() - started)
                failures += r.status_code != 200

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, latencies, failures


def bench_service(texts: list[str], bundle_dir: Path, scenarios: list[tuple[str, int, int]], batching: bool, threads: int) -> list[dict]:
    import ray
    from ray import serve

    from service.app import build_app
    from service.config import ServiceSettings

    port = 18000 + os.getpid() % 1000
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR")
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"enable_access_log": False, "log_level": "WARNING"})
        settings = ServiceSettings.model_validate(
            {"bundle": str(bundle_dir), "intra_op_threads": threads, "batching": {"enabled": batching}}
        )
        serve.run(build_app(settings), name="bench", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        asyncio.run(load(url, [{"inputs": t} for t in texts[:64]], 8))  # warm-up
        for label, per_request, concurrency in scenarios:
            payloads = [{"inputs": texts[i : i + per_request]} for i in range(0, len(texts), per_request)]
            wall, latencies, failures = asyncio.run(load(url, payloads, concurrency))
            rows.append({
                "engine": f"service, {label}, batching {'on' if batching else 'off'}",
                "concurrency": concurrency,
                "texts_s": len(texts) / wall,
                "p50": percentile(latencies, 50) * 1000,
                "p95": percentile(latencies, 95) * 1000,
                "p99": percentile(latencies, 99) * 1000,
                "failures": failures,
            })
            print(f"  {rows[-1]['engine']}, concurrency {concurrency}: {rows[-1]['texts_s']:.0f} texts/s", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__)
    p.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="onnxruntime intra-op threads")
    p.add_argument("--json", type=Path, default=Path("results/bench.json"), help="where to write the rows")
    p.add_argument("--sweep", action="store_true",
                   help="also single-text requests at concurrency 2, 4 and 16 (for the plot)")
    args = p.parse_args()

    texts = sentences(args.texts)
    print(f"benchmark: {len(texts)} texts of 8-40 words, batch {args.batch}, {args.threads} ORT threads, "
          f"{os.cpu_count()} CPUs, {platform.machine()}, {platform.processor() or platform.platform()}", flush=True)
    st = bench_sentence_transformers(texts, args.batch)
    print(f"  sentence-transformers: {st:.0f} texts/s", flush=True)
    ort_unsorted, ort_sorted, one_call_ms = bench_onnxruntime(texts, args.batch, args.bundle, args.threads)
    print(f"  onnxruntime: {ort_unsorted:.0f} texts/s unsorted, {ort_sorted:.0f} sorted; one short text {one_call_ms:.1f} ms", flush=True)
    single = [1, 2, 4, 8, 16, 32] if args.sweep else [1, 8, 32]
    scenarios = [
        (f"client batches of {args.batch}", args.batch, 1),
        (f"client batches of {args.batch}", args.batch, 4),
        *(("single texts", 1, c) for c in single),
    ]
    rows = [
        {"engine": "in-process sentence-transformers (torch fp32)", "concurrency": 1, "texts_s": st},
        {"engine": "in-process onnxruntime fp32, batches in arrival order", "concurrency": 1, "texts_s": ort_unsorted},
        {"engine": "in-process onnxruntime fp32, length-sorted batches", "concurrency": 1, "texts_s": ort_sorted},
    ]
    rows += bench_service(texts, args.bundle, scenarios, batching=True, threads=args.threads)
    rows += bench_service(texts, args.bundle, scenarios, batching=False, threads=args.threads)

    print()
    print("| engine | concurrency | texts/s | vs sentence-transformers | p50 ms | p95 ms | p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        lat = " | ".join(f"{r[k]:.1f}" if k in r else "" for k in ("p50", "p95", "p99"))
        print(f"| {r['engine']} | {r['concurrency']} | {r['texts_s']:.0f} | {r['texts_s'] / st:.2f}x | {lat} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
        "threads": args.threads, "one_call_ms": one_call_ms, "rows": rows,
    }, indent=2))
    failed = sum(r.get("failures", 0) for r in rows)
    print(f"\none in-process onnxruntime call on a short text: {one_call_ms:.1f} ms; failed requests: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
