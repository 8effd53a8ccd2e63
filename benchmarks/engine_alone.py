"""The engine alone, no HTTP and no Ray: what the service's own model path does with client batches.

    python -m benchmarks.engine_alone [--bundle DIR] [--seconds S] [--precision fp32,auto]

Four asyncio clients send random batches of 32 of the benchmark's texts straight into the engine
(tokenizer, batch queue, packed runs, pooling: EncoderService.tokenize and .infer, as a route
calls them), in one process, with the service's own threads and settings. Beside each
configuration, the in-process reference of `make bench` (onnxruntime fp32, sorted batches of 32)
is sampled before and after. It prints texts/s, this process's CPU per text, and the ratio to the
reference's median (`make bench` runs it too, and divides by its own median): the bound on
what a server around this engine can reach on the same machine, since anything the server adds
(HTTP, JSON, Ray's processes, the load generator) takes CPU from it.

Single texts are not measured here: with no network between them, 32 closed-loop clients all
land in one batch, so the second batch slot idles; that is not what the service sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

CLIENTS, PER_REQUEST = 4, 32


async def _client(svc, engine, texts: list[str], seed: int, until: float, counted: list[int]) -> None:
    from service.engine.runner import EncodeJob

    rng = random.Random(seed)
    while time.perf_counter() < until:
        batch = rng.sample(texts, PER_REQUEST)
        tokenized = await svc.tokenize(engine, batch, True, "bench")
        await svc.infer(engine, EncodeJob(route="bench", ids=[t.ids for t in tokenized], normalize=True), 60)
        counted[0] += PER_REQUEST


async def measure(svc, engine, texts: list[str], seconds: float) -> dict:
    """1 s of warm-up, then `seconds` of load: texts/s, CPU ms per text, texts per batch and per run."""
    warm = [0]
    until = time.perf_counter() + 1
    await asyncio.gather(*(_client(svc, engine, texts, k, until, warm) for k in range(CLIENTS)))
    before = dict(engine.runner.counters)
    counted = [0]
    cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(_client(svc, engine, texts, k, started + seconds, counted) for k in range(CLIENTS)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    after = engine.runner.counters
    texts_done = after["texts"] - before["texts"]
    return {"texts_s": counted[0] / wall, "cpu_ms_per_text": cpu * 1000 / counted[0],
            "texts_per_batch": texts_done / max(1, after["batches"] - before["batches"]),
            "texts_per_run": texts_done / max(1, after["ort_runs"] - before["ort_runs"])}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_alone", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    p.add_argument("--seconds", type=float, default=8, help="seconds of load per configuration, after 1 s of warm-up")
    p.add_argument("--precision", default="fp32,auto",
                   help="the service's precision setting per configuration, comma-separated (auto: the default config)")
    p.add_argument("--json", type=Path, help="also write the rows there, as JSON (make bench reads them)")
    args = p.parse_args()

    from benchmarks.bench import ReferenceSamples
    from benchmarks.corpus import sentences
    from bundle.manifest import load_bundle
    from service.config import ServiceSettings
    from service.engine.engine import EngineTable, load_engine
    from service.engine.encoder_service import EncoderService
    from service.runtimes.onnxruntime import available_cpus

    texts = sentences(512)
    reference = ReferenceSamples(load_bundle(args.bundle), texts, 32, available_cpus())
    reference.sample(after="start-up")
    rows = []
    for precision in [p.strip() for p in args.precision.split(",") if p.strip()]:
        settings = ServiceSettings(bundle=str(args.bundle.resolve()), precision=precision)
        engine = load_engine(settings.bundles[0], settings)
        svc = EncoderService(settings, EngineTable([engine]))
        svc.warm_up()
        got = asyncio.run(measure(svc, engine, texts, args.seconds))
        reference.sample(after=f"the engine, {precision}")
        print(f"engine alone, {engine.runtime.runtime} {engine.runtime.precision} ({precision}), {CLIENTS} clients x "
              f"{PER_REQUEST} texts: {got['texts_s']:.0f} texts/s = {got['texts_s'] / reference.median():.2f}x the "
              f"reference's median ({reference.median():.0f}); {got['cpu_ms_per_text']:.2f} ms of CPU per text; "
              f"{got['texts_per_batch']:.1f} texts per batch, {got['texts_per_run']:.1f} per run", flush=True)
        rows.append({"engine": f"the engine alone, {engine.runtime.runtime} {engine.runtime.precision} ({precision} "
                               f"setting): no HTTP, no Ray, a bound, not the service", "engine_alone": True, "bound": True,
                     "setting": precision, "runtime": engine.runtime.runtime, "precision": engine.runtime.precision,
                     "per_request": PER_REQUEST, "concurrency": CLIENTS, "texts_s": got["texts_s"],
                     "texts_per_batch": got["texts_per_batch"], "cpu_ms_per_text": {"engine": got["cpu_ms_per_text"]}})
        del svc, engine
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
