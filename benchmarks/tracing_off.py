"""What tracing costs a request while it is off: the calls the request path makes into service/observability/tracing.py
(the `enabled()` checks, the tokenize and serialize `span()` blocks, `current()`), timed in-process, and
their share of the replica's CPU per single text in the last `make bench` (its tracing-off rows).

    python -m benchmarks.tracing_off

The bench's own rows cannot show a cost this small: its phases spread by several percent.
"""

from __future__ import annotations

import json
import statistics
import timeit
from pathlib import Path

from service.observability import tracing

CALLS = 200_000


def off_path() -> None:
    """One request's calls, as the HTTP path makes them with tracing off."""
    tracing.enabled()  # middleware: no request span
    with tracing.span("tokenize"):  # engine/encoder_service.py
        pass
    tracing.current()  # the job's trace
    with tracing.span("serialize"):  # front/responses.py
        pass
    tracing.enabled()  # runner: no batch span


def main() -> int:
    if tracing.enabled():
        raise SystemExit("tracing is on in this process (OTEL_* variables?): unset them to measure it off")
    us = min(timeit.repeat(off_path, number=CALLS, repeat=5)) / CALLS * 1e6
    print(f"tracing off: {us:.2f} us per request in-process (best of 5 x {CALLS:,} requests)")
    saved = Path("results/bench.json")
    if saved.exists():
        rows = [r for r in json.loads(saved.read_text())["rows"]
                if r.get("tracing_row") and not r["tracing"] and r["per_request"] == 1]
        if rows:
            replica_ms = statistics.median(r["cpu_ms_per_text"]["encoder"] for r in rows)
            print(f"  = {us / (replica_ms * 1000):.3%} of the replica's CPU per single text ({replica_ms:.1f} ms, "
                  f"the last make bench's tracing-off rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
