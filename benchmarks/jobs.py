"""The embedding job's texts/s against the engine alone, in one run (make bench-jobs).

    python -m benchmarks.jobs [--bundle DIR] [--texts N] [--seconds S] [--json FILE]

Writes N short texts of the benchmark corpus (benchmarks/corpus.py) to a Parquet file, runs `python -m jobs
embed` on them on a local Ray with every CPU (jobs.embed.run: planning, Ray Data, one actor per 2 CPUs,
shards written), then benchmarks/engine_alone.py's measurement of the same engine at the same precision
setting (client batches straight into the engine: no Ray, no files; the bound on one node), and prints the
two rates and their ratio (issue 50's target: the job at least 0.9x the engine alone). The job's rate
counts everything from its start: Ray's start-up and the actors' engine loading included, so a small N
understates it; the job's own rate without start-up is printed beside it (from its first shard's time to
its last). Rows for make bench with --json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path


def job_rate(bundle: Path, n: int, precision: str, work: Path) -> dict:
    """The job on n texts: its summary's texts/s (from its start) and its rate between its first and last shard."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from benchmarks.corpus import sentences
    from jobs.embed import run

    pq.write_table(pa.table({"text": sentences(n, min_words=4, max_words=20)}), work / "in.parquet")
    ray.init(address="local", include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        started = time.perf_counter()
        summary = run({"bundle": bundle, "inputs": [work / "in.parquet"], "output": work / "out",
                       "precision": precision, "batch_size": max(256, min(4096, n // 16))})
        wall = time.perf_counter() - started
    finally:
        ray.shutdown()
    times = sorted(p.stat().st_mtime for p in (work / "out" / "_progress").glob("part-*.json"))
    records = [json.loads(p.read_text()) for p in (work / "out" / "_progress").glob("part-*.json")]
    first_shard_rows = min(records, key=lambda r: r["first"])["last"] + 1 if records else 0
    steady = (n - first_shard_rows) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0
    return {"texts_s": n / wall, "steady_texts_s": steady, "precision": summary["precision"],
            "failures": summary["failures"]}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.jobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    p.add_argument("--texts", type=int, default=100_000, help="short texts the job embeds (issue 50: 100k)")
    p.add_argument("--seconds", type=float, default=8, help="the engine alone's seconds of load")
    p.add_argument("--precision", default="auto", help="the service's precision setting, for both")
    p.add_argument("--json", type=Path, help="also write the rows there, as JSON")
    args = p.parse_args()

    from benchmarks.corpus import sentences
    from benchmarks.engine_alone import measure
    from service.config import ServiceSettings
    from service.engine.encoder_service import EncoderService
    from service.engine.engine import EngineTable, load_engine

    bundle = args.bundle.resolve()
    with tempfile.TemporaryDirectory(prefix="bench-jobs-") as work:
        job = job_rate(bundle, args.texts, args.precision, Path(work))
    settings = ServiceSettings(bundle=str(bundle), precision=args.precision)
    engine = load_engine(settings.bundles[0], settings)
    svc = EncoderService(settings, EngineTable([engine]))
    svc.warm_up()
    alone = asyncio.run(measure(svc, engine, sentences(512, min_words=4, max_words=20), args.seconds))
    ratio, steady = job["texts_s"] / alone["texts_s"], job["steady_texts_s"] / alone["texts_s"]
    print(f"embedding job ({job['precision']}, {args.texts} texts, {os.cpu_count()} CPUs): {job['texts_s']:.0f} texts/s "
          f"from its start = {ratio:.2f}x the engine alone; {job['steady_texts_s']:.0f} texts/s between its first "
          f"and last shard = {steady:.2f}x", flush=True)
    print(f"engine alone ({engine.runtime.runtime} {engine.runtime.precision}, same run): {alone['texts_s']:.0f} texts/s",
          flush=True)
    if args.json:
        args.json.write_text(json.dumps([
            {"engine": f"the embedding job ({job['precision']}): python -m jobs embed, {args.texts} texts", "job": True,
             "texts_s": job["texts_s"], "steady_texts_s": job["steady_texts_s"], "vs_engine_alone": ratio},
            {"engine": f"the engine alone ({engine.runtime.runtime} {engine.runtime.precision}), same run",
             "engine_alone": True, "bound": True, "texts_s": alone["texts_s"]}]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
