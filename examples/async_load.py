"""Many concurrent requests from one asyncio client, retrying the ones the service sheds.

    python examples/async_load.py [--url http://127.0.0.1:8000] [--model NAME] [--requests 200] [--concurrency 16]

When every replica is full and Serve's queue is too, the service answers 503 at once with a
Retry-After header and a JSON error of type `overloaded` (or `timeout` when a request's deadline
passed in the queue). A well-behaved client waits that long and sends again, a bounded number of
times; that is what `post_with_retry` does. Prints how many succeeded, how many 503s were retried,
and the throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import httpx


async def post_with_retry(client: httpx.AsyncClient, path: str, body: dict, attempts: int, counts: dict) -> dict:
    for attempt in range(attempts):
        r = await client.post(path, json=body)
        if r.status_code != 503 or attempt == attempts - 1:
            r.raise_for_status()
            return r.json()
        counts["retried"] += 1
        counts[r.json()["error"]["type"]] = counts.get(r.json()["error"]["type"], 0) + 1
        await asyncio.sleep(float(r.headers.get("retry-after", "1")))
    raise AssertionError("unreachable")


async def run(args: argparse.Namespace) -> dict:
    token = os.environ.get("ENCODER_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_connections=args.concurrency)
    counts = {"ok": 0, "retried": 0}
    words = "the quick brown fox jumps over the lazy dog " * (args.words // 9 + 1)
    texts = [" ".join(words.split()[: args.words])] * args.texts
    pending = iter(range(args.requests))

    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits, timeout=60) as client:
        async def worker() -> None:
            for i in pending:
                body = {"input": [f"{i} {t}" for t in texts], "model": args.model, "encoding_format": "base64"}
                result = await post_with_retry(client, "/v1/embeddings", body, args.attempts, counts)
                assert len(result["data"]) == len(texts)
                counts["ok"] += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        counts["seconds"] = time.perf_counter() - start
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="served model (required where several are served)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--texts", type=int, default=1, help="texts per request")
    p.add_argument("--words", type=int, default=12, help="words per text")
    p.add_argument("--attempts", type=int, default=20, help="tries per request before giving up")
    args = p.parse_args()
    counts = asyncio.run(run(args))
    print(f"ok {counts['ok']} of {args.requests}; retried after 503 {counts['retried']} "
          f"(overloaded {counts.get('overloaded', 0)}, timeout {counts.get('timeout', 0)}); "
          f"{counts['ok'] * args.texts / counts['seconds']:.0f} texts/s over {counts['seconds']:.1f} s")


if __name__ == "__main__":
    main()
