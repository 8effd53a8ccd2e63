"""One large request at 1 client, in-process (no HTTP, no Ray): the p50 of a rerank of 1 query x 32
documents on the rerank benchmark's cross-encoder, and of one client batch of 32 texts on the default
model, both bundles served together as `make bench`'s rerank rows serve them; CrossEncoder fp32
in-process on the same pairs beside them.

    python -m benchmarks.one_request [--bundle DIR] [--ranker DIR] [--requests N]

What it isolates is the engine's path for one request on an otherwise idle replica (tokenizer, batch
queue, runs on the runner's slots): the service adds HTTP and JSON to both figures alike. The
cross-encoder bundle is the one `make bench` exports (results/bench/minilm-l6-cross-encoder-bundle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

RANKER = Path("results/bench/minilm-l6-cross-encoder-bundle")


async def p50_ms(request, n: int) -> float:
    """The median of n requests one after another (after 3 of warm-up)."""
    for _ in range(3):
        await request()
    times = []
    for _ in range(n):
        started = time.perf_counter()
        await request()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def measure(svc, requests: int) -> dict:
    from benchmarks.corpus import sentences
    from benchmarks.rerank import DOCUMENTS, workload
    from service.engine.runner import EncodeJob
    from service.engine.scoring import classification_job

    embedder, ranker = svc.engines.default, svc.engines.get("ranker")
    texts = sentences(32)
    queries, documents = workload()
    pairs = [(queries[0], d) for d in documents[0]]

    async def embed():
        tokenized = await svc.tokenize(embedder, texts, True, "bench")
        await svc.infer(embedder, EncodeJob(route="bench", ids=[t.ids for t in tokenized], normalize=True), 60)

    async def rerank():
        tokenized = await svc.tokenize_pairs(ranker, pairs, True, "bench")
        await svc.infer(ranker, classification_job("bench", tokenized, True), 60)

    got = {"rerank_p50_ms": await p50_ms(rerank, requests), "batch32_p50_ms": await p50_ms(embed, requests)}
    counters = ranker.runner.counters
    got["ranker_lent_runs"] = counters.get("lent_runs", 0)  # absent before the lent slots
    got["documents"] = DOCUMENTS
    return got


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.one_request", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    p.add_argument("--ranker", type=Path, default=RANKER)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--cross-encoder", type=Path, help="the checkpoint: also measure CrossEncoder fp32 in-process")
    p.add_argument("--json", type=Path, help="also write the figures there")
    args = p.parse_args()

    from service.config import ServiceSettings
    from service.engine.encoder_service import EncoderService
    from service.engine.engine import EngineTable, load_engine

    settings = ServiceSettings(bundles=[{"path": str(args.bundle.resolve())},
                                        {"path": str(args.ranker.resolve()), "name": "ranker"}])
    svc = EncoderService(settings, EngineTable([load_engine(ref, settings) for ref in settings.bundles]))
    svc.warm_up()
    got = asyncio.run(measure(svc, args.requests))
    got["runtime"] = {e.name: f"{e.runtime.runtime} {e.runtime.precision}, {e.runtime.threads} thread(s) per run"
                      for e in svc.engines}
    if args.cross_encoder:
        from benchmarks.rerank import cross_encoder_rate, workload

        queries, documents = workload()
        got["cross_encoder_fp32_p50_ms"] = cross_encoder_rate(args.cross_encoder, queries, documents)["p50"]
    print(json.dumps(got), flush=True)
    if args.json:
        args.json.write_text(json.dumps(got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
