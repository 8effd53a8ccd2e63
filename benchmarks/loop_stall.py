"""What one large response does to everyone else on the replica: latency of short requests alone,
then while other clients keep asking for large attention responses (tens of MB of JSON each).

    python -m benchmarks.loop_stall --bundle bundles/all-MiniLM-L6-v2 [--seconds 20]

Starts `python -m service` (one replica) on free ports, runs both phases against it with real HTTP
clients, prints p50/p95/p99 of the short requests in each phase and the large responses' rate and
size, and stops the service. Building a response on the event loop stalls every request the
replica holds for as long as it takes; this shows how long.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.local_service import LocalService

ROOT = Path(__file__).resolve().parents[1]
SHORT = {"input": "A short text to embed."}
# one long text and every head of five layers as JSON floats: about 4 Mi values, under the default
# response limit (64 MiB estimated at 16 bytes per value)
LONG_TEXT = " ".join(["attention weights for a long passage of text"] * 40)
LARGE = {"inputs": [LONG_TEXT], "embedding": False, "attention": {"layers": [0, 1, 2, 3, 4], "format": "float"}}


def percentiles(values: list[float]) -> dict[str, float]:
    ms = np.array(values) * 1000
    return {"n": len(values), "p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max())}


def short_requests(url: str, seconds: float) -> list[float]:
    """Sequential short requests for `seconds`: each one's latency."""
    latencies = []
    with httpx.Client(base_url=url, timeout=60) as c:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            assert c.post("/v1/embeddings", json=SHORT).status_code == 200
            latencies.append(time.perf_counter() - started)
    return latencies


def large_requests(url: str, stop: threading.Event, sizes: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        while not stop.is_set():
            r = c.post("/v1/encode", json=LARGE)
            assert r.status_code == 200, r.text[:200]
            sizes.append(len(r.content))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loop_stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=ROOT / "bundles/all-MiniLM-L6-v2")
    p.add_argument("--seconds", type=float, default=20, help="length of each phase")
    p.add_argument("--large-clients", type=int, default=2)
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    a = p.parse_args(argv)

    service = LocalService(a.bundle)
    url = service.url
    try:
        if not service.ready(300):
            print("".join(service.lines[-20:]), file=sys.stderr)
            return 1
        short_requests(url, 2)  # warm-up
        alone = percentiles(short_requests(url, a.seconds))
        stop, sizes = threading.Event(), []
        workers = [threading.Thread(target=large_requests, args=(url, stop, sizes)) for _ in range(a.large_clients)]
        for w in workers:
            w.start()
        while not sizes:
            time.sleep(0.1)
        started, before = time.monotonic(), len(sizes)
        beside = percentiles(short_requests(url, a.seconds))
        large_rate = (len(sizes) - before) / (time.monotonic() - started)
        stop.set()
        for w in workers:
            w.join()
    finally:
        service.stop()
    result = {"alone": alone, "beside_large": beside, "large_responses_per_s": large_rate,
              "large_response_mb": float(np.mean(sizes)) / 1e6}
    for phase in ("alone", "beside_large"):
        r = result[phase]
        print(f"short requests {phase:<13} n={r['n']:<5} p50 {r['p50_ms']:7.1f} ms  p95 {r['p95_ms']:7.1f} ms  "
              f"p99 {r['p99_ms']:7.1f} ms  max {r['max_ms']:7.1f} ms")
    print(f"large responses: {large_rate:.2f}/s of {result['large_response_mb']:.1f} MB "
          f"({a.large_clients} clients)")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
