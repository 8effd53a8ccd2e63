"""make loadtest / make loadtest-overload: run locust headless against the service and summarise.

Starts the service on loopback (or targets --host), runs locust for a bounded time and user
count, writes CSV and HTML reports to the results directory, prints requests/s, texts/s,
tokens/s, failures and p50/p95/p99 per request type, and exits non-zero when the failure ratio
or the p99 exceeds the thresholds given (an SLO check).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.hosting.processes import free_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    """One line of locust's *_stats.csv."""

    name: str
    requests: int
    failures: int
    rps: float
    p50: float
    p95: float
    p99: float
    max_ms: float


def summarize(stats_csv: Path) -> list[Row]:
    """Parse locust's stats CSV; the last row is the aggregate ('Aggregated')."""
    rows = []
    with stats_csv.open() as fh:
        for r in csv.DictReader(fh):
            rows.append(
                Row(
                    name=r["Name"],
                    requests=int(r["Request Count"]),
                    failures=int(r["Failure Count"]),
                    rps=float(r["Requests/s"]),
                    p50=float(r["50%"] or 0),
                    p95=float(r["95%"] or 0),
                    p99=float(r["99%"] or 0),
                    max_ms=float(r["Max Response Time"] or 0),
                )
            )
    if not rows:
        raise ValueError(f"{stats_csv}: no rows")
    return rows


def start_service(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(ROOT / "results" / "loadtest-service.log", "w")  # noqa: SIM115 - lives as long as the service
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--port", str(port), "--metrics-port", str(free_port()), *extra],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the service exited with {proc.returncode}; see results/loadtest-service.log")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("the service did not become ready within 180 s")


def stop_service(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_locust(host: str, users: int, spawn_rate: float, duration: str, out: Path, overload: bool = False,
               classes: list[str] | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    totals_path = out / "totals.json"
    env = {**os.environ, "LOADTEST_TOTALS": str(totals_path), "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / ("overload.py" if overload else "locustfile.py")), "--headless",
        "--host", host, "-u", str(users), "-r", str(spawn_rate), "-t", duration, "--stop-timeout", "30",
        "--csv", str(out / "stats"), "--html", str(out / "report.html"), "--only-summary", "--exit-code-on-error", "0",
        *(classes or []),
    ]
    print(f"locust: {users} users, {duration}, against {host} ({'overload' if overload else 'traffic mix'})", flush=True)
    started = time.monotonic()
    with (out / "locust.log").open("w") as log:  # locust's own tables; the summary below is ours
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    totals = json.loads(totals_path.read_text()) if totals_path.exists() else {}
    totals["wall_s"] = time.monotonic() - started
    return totals


def report(rows: list[Row], totals: dict, seconds: float) -> list[str]:
    agg = rows[-1]
    lines = [
        f"{'request':<26} {'count':>7} {'fail':>5} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r.name:<26} {r.requests:>7} {r.failures:>5} {r.rps:>7.1f} {r.p50:>8.0f} {r.p95:>8.0f} {r.p99:>8.0f} {r.max_ms:>8.0f}"
        )
    lines.append(
        f"throughput: {agg.rps:.1f} requests/s, {totals.get('texts', 0) / seconds:.1f} texts/s, "
        f"{totals.get('tokens', 0) / seconds:.0f} tokens/s; failures {agg.failures}/{agg.requests} "
        f"({agg.failures / max(agg.requests, 1):.2%})"
    )
    return lines


def parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.run", description=__doc__)
    p.add_argument("--host", help="target service URL; default: start one on loopback")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--spawn-rate", type=float, default=8)
    p.add_argument("--duration", default="45s")
    p.add_argument("--results", type=Path, default=ROOT / "results" / "loadtest")
    p.add_argument("--max-failure-ratio", type=float, default=0.01)
    p.add_argument("--max-p99-ms", type=float, default=10_000)
    p.add_argument("--overload", action="store_true",
                   help="above capacity against tight limits: expect 429/503 + Retry-After, bounded accepted p99")
    p.add_argument("--service-args", default="", help="extra flags for python -m service")
    p.add_argument("user_classes", nargs="*", help="locust user classes (default: the traffic mix)")
    args = p.parse_args(argv)

    (ROOT / "results").mkdir(exist_ok=True)
    service_args = args.service_args.split()
    timeout_s = 10.0
    if args.overload and not args.host:
        # tiny queues so that a modest burst is over capacity; a short request timeout bounds waiting
        service_args += ["--max-ongoing-requests", "2", "--max-queued-requests", "2",
                         "--request-timeout-s", str(timeout_s), "--replicas", "1"]
    proc = None
    try:
        host = args.host
        if host is None:
            print("starting the service on loopback ...", flush=True)
            proc, host = start_service(service_args)
        totals = run_locust(host, args.users, args.spawn_rate, args.duration, args.results, args.overload,
                            args.user_classes)
    finally:
        if proc is not None:
            stop_service(proc)
    rows = summarize(args.results / "stats_stats.csv")
    seconds = parse_duration(args.duration)
    for line in report(rows, totals, seconds):
        print(line)
    print(f"reports: {args.results}/stats_stats.csv, {args.results}/report.html")

    agg = rows[-1]
    problems = []
    if args.overload:
        shed = totals.get("shed", 0)
        accepted = [r for r in rows[:-1] if not r.name.startswith("overload shed")]
        if shed == 0:
            problems.append("no request was shed: the run never exceeded capacity")
        if totals.get("shed_without_retry_after", 0):
            problems.append(f"{totals['shed_without_retry_after']} refusals had no Retry-After")
        slowest = max((r.max_ms for r in accepted), default=0)
        if slowest > timeout_s * 1000 + 5000:
            problems.append(f"an accepted request took {slowest:.0f} ms, past the {timeout_s:g} s request timeout")
        print(f"overload: {shed} requests shed with 429/503 + Retry-After; slowest accepted {slowest:.0f} ms")
    ratio = agg.failures / max(agg.requests, 1)
    if agg.requests == 0:
        problems.append("no request was made")
    if ratio > args.max_failure_ratio:
        problems.append(f"failure ratio {ratio:.2%} > {args.max_failure_ratio:.2%}")
    if not args.overload and agg.p99 > args.max_p99_ms:
        problems.append(f"p99 {agg.p99:.0f} ms > {args.max_p99_ms:.0f} ms")
    for problem in problems:
        print(f"SLO check failed: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
