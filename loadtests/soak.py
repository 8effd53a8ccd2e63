"""make soak: the locust traffic mix for a bounded time with a real Prometheus scraping, and what
Prometheus saw.

Starts the service on loopback as `make run` does (or uses --host and --metrics-url), a Prometheus
(Debian's package) scraping Ray's metrics port and a small exporter of the resident memory of the
service's processes (each Serve replica, the HAProxy ingress, Ray's proxy actor, the controller),
then runs locust headless for --duration. From Prometheus's HTTP API it reports throughput, p50 and
p99 over time, errors, the alerts that fired, and the memory of each process at the start, after the
warm-up, half-way and at the end; writes soak.csv and soak.png (and soak.json) to --results; exits 1
when errors appeared, an alert other than the latency one fired, the p99 passed --max-p99-ms, a
replica went away, or a replica's or the ingress's memory grew past --max-late-growth-mb over the
second half of the run.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from loadtests.run import parse_duration, run_locust, start_service, stop_service, summarize

ROOT = Path(__file__).resolve().parents[1]

# Processes whose memory is checked (the rest is reported): the model's replicas and the ingress.
CHECKED = ("replica", "haproxy", "proxy")
# Not the service's: pooled Ray workers without an actor, and what a test session running the soak
# in-process starts itself.
IGNORED = ("ray::IDLE", "prometheus", "python -m locust")
# Plotted beside them: the Serve processes an operator looks at (the CSV has every process).
PLOTTED = ("ray::ServeReplica", "haproxy", "ray::ProxyActor", "ray::HAProxyManager", "ray::ServeController")
# A replica's memory is the model's graphs, the tokenizer, Python, and onnxruntime's arenas, which
# grow in steps of 5-30 MB whenever batches of a shape larger than any before arrive: most in the
# first minutes, then more rarely (and again when the machine frees up and batches grow). That
# growth is bounded (by the largest batch the settings allow); a leak's is not. The check is the
# growth over the second half of the run after the warm-up: up to 37 MB of arena steps were seen
# there in 10-minute runs here, and 64 MB leaves room for them. A fixed bound: a 10-minute soak
# catches only a fast leak (64 MB in 5 minutes), a 2-hour one (--duration 2h) a leak of 64 MB an
# hour; slower ones are the alert's (EncoderReplicaMemoryGrowing, 25 MB/h for 2 h).
# See docs/operations.md.
MAX_LATE_GROWTH_MB = 64.0
# Alerts that fire when the run saturates the machine, which a soak on a small box does: latency is
# capacity, checked against --max-p99-ms as make loadtest does. Any other alert fails the soak.
CAPACITY_ALERTS = ("EncoderP99LatencyHigh",)


# --- the memory exporter Prometheus scrapes --------------------------------------------------------
def role(title: str) -> str:
    """What a process of the service is, from its title (Ray names actor processes ray::<Class>)."""
    if title.startswith("ray::ServeReplica:"):
        return "replica"
    if title == "haproxy" or title.endswith("/haproxy"):
        return "haproxy"
    if title == "ray::ProxyActor":
        return "proxy"
    if title in ("ray::HAProxyManager", "ray::ServeController"):
        return "serve"
    return "ray"


def process_title(proc) -> str:
    """ray::<Actor> without the method it is running (Ray adds it to the title), a Python script's
    or module's name, else the executable's."""
    cmdline = proc.cmdline()
    first = cmdline[0] if cmdline else proc.name()
    if first.startswith("ray::"):
        return re.match(r"ray::[^.\s]+", first).group(0)
    if "python" in os.path.basename(first):
        if "-m" in cmdline[1:-1]:
            return f"python -m {cmdline[cmdline.index('-m') + 1]}"
        scripts = [os.path.basename(a) for a in cmdline[1:] if a.endswith(".py")]
        if scripts:
            return scripts[0]
    return os.path.basename(first) or proc.name()


class ProcessMemory:
    """A prometheus_client collector: soak_process_resident_memory_bytes{process, role, pid} for
    every descendant of `root_pid` (the service, or the test session that runs Ray in-process)."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid

    def collect(self):
        import psutil
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("soak_process_resident_memory_bytes",
                                   "Resident memory of the service's processes.", labels=["process", "role", "pid"])
        try:
            children = psutil.Process(self.root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for proc in children:
            try:
                title = process_title(proc)
                if title in IGNORED:
                    continue
                family.add_metric([title, role(title), str(proc.pid)], proc.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        yield family
        load = GaugeMetricFamily("soak_node_load1", "This machine's 1-minute load average.")
        load.add_metric([], os.getloadavg()[0])
        yield load


def start_exporter(root_pid: int) -> tuple[object, str]:
    """Serve ProcessMemory on a free loopback port; returns (server, metrics URL)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from tests.prometheus import free_port

    registry = CollectorRegistry(auto_describe=True)
    registry.register(ProcessMemory(root_pid))
    port = free_port()
    server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    return server, f"http://127.0.0.1:{port}/metrics"


# --- what Prometheus saw ---------------------------------------------------------------------------
@dataclass
class Memory:
    process: str
    role: str
    pid: str
    first_mb: float  # when the traffic started
    start_mb: float  # after the warm-up
    mid_mb: float  # half-way from the warm-up's end to the end
    end_mb: float
    peak_mb: float

    @property
    def growth_mb(self) -> float:
        """After the warm-up."""
        return self.end_mb - self.start_mb

    @property
    def late_growth_mb(self) -> float:
        """Over the second half: what the check bounds."""
        return self.end_mb - self.mid_mb


@dataclass
class Outcome:
    duration_s: float
    warmup_s: float
    users: int
    locust_requests: int
    locust_failures: int
    service_requests: float
    errors_4xx: float
    errors_5xx: float
    proxy_errors: float
    requests_per_s: float
    texts_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float
    worst_p99_ms: float  # the highest p99 of one rate window after the warm-up
    load_mean: float = math.nan  # this machine's 1-minute load average over the run
    load_max: float = math.nan
    cpus: int = 0
    memory: list[Memory] = field(default_factory=list)
    alerts_fired: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def series_by_time(result: list[dict]) -> dict[float, float]:
    return {float(t): float(v) for t, v in result[0]["values"]} if result else {}


def collect(prom, app: str, t0: float, t_warm: float, t_end: float, step: float, window: str) -> tuple[list, dict]:
    """Range queries over the run: the CSV's columns, and the per-process memory series."""
    sel = f'application="{app}"'
    buckets = f'ray_encoder_request_duration_seconds_bucket{{{sel},stage="total"}}'
    queries = {
        "requests_per_s": f"sum(rate(ray_encoder_requests_total{{{sel}}}[{window}]))",
        "tokens_per_s": f"sum(rate(ray_encoder_tokens_total{{{sel}}}[{window}]))",
        "errors_per_s": f'sum(rate(ray_encoder_requests_total{{{sel},status_class=~"4xx|5xx"}}[{window}])) or vector(0)',
        "p50_ms": f"1000 * histogram_quantile(0.5, sum by (le) (rate({buckets}[{window}])))",
        "p99_ms": f"1000 * histogram_quantile(0.99, sum by (le) (rate({buckets}[{window}])))",
    }
    columns = {name: series_by_time(prom.query_range(q, t0, t_end, step)) for name, q in queries.items()}
    memory = {}
    for r in prom.query_range("soak_process_resident_memory_bytes", t0, t_end, step):
        m = r["metric"]
        memory[(m["process"], m["role"], m["pid"])] = [(float(t), float(v) / 1e6) for t, v in r["values"]]
    times = sorted({t for c in columns.values() for t in c} | {t for s in memory.values() for t, _ in s})
    mem_columns = sorted(memory, key=lambda k: (CHECKED.index(k[1]) if k[1] in CHECKED else 9, k[0], k[2]))
    rows = []
    for t in times:
        row = {"t_s": round(t - t0, 1) + 0.0, **{k: columns[k].get(t, math.nan) for k in queries}}
        for key in mem_columns:
            row[f"rss_mb {key[0]} {key[2]}"] = dict(memory[key]).get(t, math.nan)
        rows.append(row)
    return rows, memory


def memory_table(memory: dict, t_warm: float, t_end: float) -> list[Memory]:
    table = []
    t_mid = (t_warm + t_end) / 2
    for (process, kind, pid), points in memory.items():
        after = [(t, v) for t, v in points if t >= t_warm]
        if not after:
            continue
        mid = next((v for t, v in after if t >= t_mid), after[-1][1])
        table.append(Memory(process, kind, pid, points[0][1], after[0][1], mid, after[-1][1],
                            max(v for _, v in points)))
    return sorted(table, key=lambda m: (CHECKED.index(m.role) if m.role in CHECKED else 9, m.process, m.pid))


def exact_delta(prom, expr: str, t1: float, t2: float) -> float:
    value = prom.value(f"(sum({expr} @ {t2:.3f}) or vector(0)) - (sum({expr} @ {t1:.3f}) or vector(0))")
    return value or 0.0


# --- the plot --------------------------------------------------------------------------------------
def plot(rows: list[dict], warmup_s: float, mid_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [r["t_s"] / 60 for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    ax1.plot(minutes, [r["requests_per_s"] for r in rows], label="requests/s", color="tab:blue")
    ax1.plot(minutes, [r["errors_per_s"] for r in rows], label="errors/s (4xx + 5xx)", color="tab:red")
    ax1.set_ylabel("requests/s")
    ax1b = ax1.twinx()
    ax1b.plot(minutes, [r["tokens_per_s"] for r in rows], label="tokens/s", color="tab:green", alpha=0.6)
    ax1b.set_ylabel("tokens/s")
    lines = ax1.get_legend_handles_labels()
    lines2 = ax1b.get_legend_handles_labels()
    ax1.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right")
    ax1.set_title(title)
    ax2.plot(minutes, [r["p50_ms"] for r in rows], label="p50", color="tab:blue")
    ax2.plot(minutes, [r["p99_ms"] for r in rows], label="p99", color="tab:orange")
    ax2.set_ylabel("request latency, ms (total stage)")
    ax2.legend(loc="upper right")
    for key in [k for k in rows[0] if k.startswith("rss_mb ")] if rows else []:
        if any(k in key for k in PLOTTED):
            ax3.plot(minutes, [r[key] for r in rows], label=key.removeprefix("rss_mb "))
    ax3.set_ylabel("resident memory, MB")
    ax3.set_xlabel("minutes since the traffic started")
    ax3.legend(loc="center right", fontsize="small")
    for ax in (ax1, ax2, ax3):
        ax.axvspan(0, warmup_s / 60, color="grey", alpha=0.12, lw=0)
        ax.grid(alpha=0.3)
    ax3.text(warmup_s / 120, ax3.get_ylim()[1], "warm-up", ha="center", va="top", fontsize="small", color="grey")
    ax3.axvline(mid_s / 60, color="grey", ls="--", lw=0.8)
    ax3.text(mid_s / 60, ax3.get_ylim()[1], " growth checked from here", va="top", fontsize="small", color="grey")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["t_s"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else round(v, 3) if isinstance(v, float) else v)
                             for k, v in row.items()})


def report(o: Outcome) -> list[str]:
    lines = [
        f"soak: {o.duration_s / 60:.1f} min of the locust traffic mix at {o.users} users "
        f"(first {o.warmup_s:.0f} s warm-up), measured by Prometheus",
        f"throughput: {o.requests_per_s:.1f} requests/s, {o.texts_per_s:.1f} texts/s, {o.tokens_per_s:.0f} tokens/s; "
        f"{o.service_requests:.0f} requests counted by the service, {o.locust_requests} made by locust",
        f"latency (total stage, whole run): p50 {o.p50_ms:.0f} ms, p99 {o.p99_ms:.0f} ms; worst p99 of one window "
        f"{o.worst_p99_ms:.0f} ms",
        f"errors: 4xx {o.errors_4xx:.0f}, 5xx {o.errors_5xx:.0f}, ingress errors {o.proxy_errors:.0f}, "
        f"locust failures {o.locust_failures}",
        f"machine: {o.cpus} CPUs, 1-minute load average over the run {o.load_mean:.1f} (max {o.load_max:.1f})",
        "resident memory, MB: at the start, after the warm-up, half-way, at the end; growth after the warm-up "
        "and over the second half (checked)",
        f"{'process':<34} {'pid':>7} {'start':>7} {'warm':>7} {'half':>7} {'end':>7} {'growth':>7} {'late':>6} {'peak':>7}",
    ]
    for m in o.memory:
        lines.append(f"{m.process:<34} {m.pid:>7} {m.first_mb:>7.1f} {m.start_mb:>7.1f} {m.mid_mb:>7.1f} "
                     f"{m.end_mb:>7.1f} {m.growth_mb:>+7.1f} {m.late_growth_mb:>+6.1f} {m.peak_mb:>7.1f}")
    lines.append(f"alerts fired: {', '.join(o.alerts_fired) or 'none'}"
                 + (" (latency: the machine's capacity, checked against --max-p99-ms)"
                    if set(o.alerts_fired) & set(CAPACITY_ALERTS) else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", default="10m", help="traffic time, e.g. 90s, 10m, 2h (default 10m)")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--spawn-rate", type=float, default=8)
    p.add_argument("--warmup", help="excluded from the memory start figure (default: a tenth of the run, 20 s to 2 min)")
    p.add_argument("--max-late-growth-mb", type=float, default=MAX_LATE_GROWTH_MB,
                   help="fail when a replica's or the ingress's resident memory grows more over the second half "
                   f"of the run after the warm-up (default {MAX_LATE_GROWTH_MB:g})")
    p.add_argument("--max-p99-ms", type=float, default=10_000, help="p99 of the whole run (as make loadtest)")
    p.add_argument("--scrape-interval", default="2s")
    p.add_argument("--host", help="a running service (default: start one on loopback as make run does)")
    p.add_argument("--metrics-url", help="its Ray metrics endpoint (default: what its /info says)")
    p.add_argument("--processes-of", type=int,
                   help="the pid whose descendants are the service's processes (default: the service started here)")
    p.add_argument("--application", default="encoder")
    p.add_argument("--service-args", default="", help="extra flags for python -m service")
    p.add_argument("--results", type=Path, default=ROOT / "results" / "soak")
    args = p.parse_args(argv)

    from tests.prometheus import Prometheus, PrometheusMissing

    duration = parse_duration(args.duration)
    warmup = parse_duration(args.warmup) if args.warmup else min(120.0, max(20.0, duration / 10))
    window = f"{int(min(60, max(20, duration / 10)))}s"
    step = max(parse_duration(args.scrape_interval), round(duration / 150))
    args.results.mkdir(parents=True, exist_ok=True)
    (ROOT / "results").mkdir(exist_ok=True)

    proc = server = prom = None
    try:
        host, root_pid = args.host, args.processes_of
        if host is None:
            print("starting the service on loopback ...", flush=True)
            proc, host = start_service(args.service_args.split())
            root_pid = proc.pid
        metrics_url = args.metrics_url or httpx.get(f"{host}/info", timeout=30).json()["metrics"]["prometheus_url"]
        targets = {"ray": metrics_url}
        if root_pid is not None:
            server, targets["processes"] = start_exporter(root_pid)
        shutil.rmtree(args.results / "prometheus", ignore_errors=True)  # this run's data only
        try:
            prom = Prometheus(targets, workdir=args.results / "prometheus", interval=args.scrape_interval).start()
        except PrometheusMissing as exc:
            print(exc, file=sys.stderr)
            return 2
        prom.wait_for_targets()
        print(f"prometheus {prom.url} scraping {', '.join(targets.values())} every {args.scrape_interval}", flush=True)

        t0 = time.time()
        totals = run_locust(host, args.users, args.spawn_rate, args.duration, args.results)
        rows_locust = summarize(args.results / "stats_stats.csv")
        agg = rows_locust[-1]

        # The service's counters reach Prometheus a report interval later: wait for every request
        # locust made (bounded), then take the end there.
        sel = f'application="{args.application}"'
        requests = f"ray_encoder_requests_total{{{sel}}}"
        deadline = time.monotonic() + 90
        while exact_delta(prom, requests, t0, time.time()) < agg.requests and time.monotonic() < deadline:
            time.sleep(1)
        t_end = time.time()
        t_warm = t0 + warmup
        rows, memory = collect(prom, args.application, t0, t_warm, t_end, step, window)
        load = [float(v) for r in prom.query_range("soak_node_load1", t0, t_end, step) for _, v in r["values"]]

        buckets = f'ray_encoder_request_duration_seconds_bucket{{{sel},stage="total"}}'

        def quantile(q: float) -> float:
            at_end, at_start = f"sum by (le) ({buckets} @ {t_end:.3f})", f"sum by (le) ({buckets} @ {t0:.3f})"
            v = prom.value(f"1000 * histogram_quantile({q}, {at_end} - ({at_start} or 0 * {at_end}))")
            return math.nan if v is None else v

        elapsed = t_end - t0
        fired = prom.query(f'count by (alertname) (max_over_time(ALERTS{{alertstate="firing"}}[{int(elapsed) + 60}s]))')
        outcome = Outcome(
            duration_s=duration, warmup_s=warmup, users=args.users,
            locust_requests=agg.requests, locust_failures=agg.failures,
            service_requests=exact_delta(prom, requests, t0, t_end),
            errors_4xx=exact_delta(prom, f'ray_encoder_requests_total{{{sel},status_class="4xx"}}', t0, t_end),
            errors_5xx=exact_delta(prom, f'ray_encoder_requests_total{{{sel},status_class="5xx"}}', t0, t_end),
            proxy_errors=exact_delta(prom, f"ray_serve_num_http_error_requests_total{{{sel}}}", t0, t_end),
            requests_per_s=agg.requests / duration, texts_per_s=totals.get("texts", 0) / duration,
            tokens_per_s=totals.get("tokens", 0) / duration,
            p50_ms=quantile(0.5), p99_ms=quantile(0.99),
            worst_p99_ms=max((r["p99_ms"] for r in rows if r["t_s"] >= warmup and not math.isnan(r["p99_ms"])),
                             default=math.nan),
            memory=memory_table(memory, t_warm, t_end), cpus=os.cpu_count() or 0,
            load_mean=statistics.fmean(load) if load else math.nan, load_max=max(load, default=math.nan),
            alerts_fired=sorted(r["metric"]["alertname"] for r in fired),
        )
    finally:
        if prom is not None:
            prom.stop()
        if server is not None:
            server.shutdown()
            server.server_close()
        if proc is not None:
            stop_service(proc)

    o = outcome
    if o.locust_requests == 0:
        o.problems.append("no request was made")
    if o.locust_failures or o.errors_4xx or o.errors_5xx or o.proxy_errors:
        o.problems.append(f"errors: locust failures {o.locust_failures}, 4xx {o.errors_4xx:.0f}, 5xx {o.errors_5xx:.0f}, "
                          f"ingress {o.proxy_errors:.0f}")
    if o.service_requests < o.locust_requests:
        o.problems.append(f"Prometheus saw {o.service_requests:.0f} requests of the {o.locust_requests} locust made")
    replicas_then = {m.pid for m in o.memory if m.role == "replica"}
    if root_pid is not None:
        if not replicas_then:
            o.problems.append("no replica's memory was measured")
        last_seen = {pid: points[-1][0] for (_, kind, pid), points in memory.items() if kind == "replica"}
        gone = sorted(pid for pid, t in last_seen.items() if t < t_end - 3 * step)
        if gone:
            o.problems.append(f"replica process(es) {', '.join(gone)} went away during the run (replaced?)")
        for m in o.memory:
            if m.role in CHECKED and m.late_growth_mb > args.max_late_growth_mb:
                o.problems.append(f"{m.process} (pid {m.pid}) grew {m.late_growth_mb:.1f} MB over the second half "
                                  f"of the run (> {args.max_late_growth_mb:g} MB): a leak?")
    if not o.p99_ms <= args.max_p99_ms:
        o.problems.append(f"p99 {o.p99_ms:.0f} ms > {args.max_p99_ms:.0f} ms")
    failing = [a for a in o.alerts_fired if a not in CAPACITY_ALERTS]
    if failing:
        o.problems.append(f"alerts fired: {', '.join(failing)}")

    csv_path, png_path = args.results / "soak.csv", args.results / "soak.png"
    write_csv(rows, csv_path)
    plot(rows, warmup, (warmup + (t_end - t0)) / 2, png_path, f"soak: {duration / 60:g} min, {args.users} locust users, "
         f"{o.requests_per_s:.1f} requests/s, p99 {o.p99_ms:.0f} ms, {o.errors_4xx + o.errors_5xx:.0f} errors")
    memory_rows = [asdict(m) | {"growth_mb": m.growth_mb, "late_growth_mb": m.late_growth_mb} for m in o.memory]
    (args.results / "soak.json").write_text(json.dumps({**asdict(o), "memory": memory_rows}, indent=1))
    for line in report(o):
        print(line)
    print(f"series: {csv_path}, plot: {png_path}, locust: {args.results}/report.html")
    for problem in o.problems:
        print(f"soak check failed: {problem}", file=sys.stderr)
    if not o.problems:
        record(o, args.results / "reliability.jsonl")
    return 1 if o.problems else 0


def record(o: Outcome, log: Path) -> None:
    """The outcome as a RELIABILITY.md row (make reliability adds the last make soak's)."""
    from tests import reliability

    log.unlink(missing_ok=True)
    default_log, reliability.LOG = reliability.LOG, log
    try:
        replicas = [m for m in o.memory if m.role == "replica"]
        ingress = [m for m in o.memory if m.role in ("haproxy", "proxy")]
        memory = "; ".join(f"{m.process.removeprefix('ray::')} {m.first_mb:.0f} -> {m.start_mb:.0f} -> {m.end_mb:.0f} MB "
                           f"({m.late_growth_mb:+.0f} MB over the second half)" for m in replicas + ingress)
        reliability.record(
            f"soak ({o.duration_s / 60:g} min, make soak)",
            f"locust traffic mix at {o.users} users for {o.duration_s / 60:g} min, Prometheus scraping",
            {"requests": o.locust_requests, "errors": int(o.locust_failures + o.errors_4xx + o.errors_5xx)},
            note=(f"{o.requests_per_s:.1f} requests/s, p99 {o.p99_ms:.0f} ms (worst window {o.worst_p99_ms:.0f} ms); "
                  f"memory at the start, after the warm-up and at the end: {memory}; "
                  f"alerts fired: {', '.join(o.alerts_fired) or 'none'}"),
        )
    finally:
        reliability.LOG = default_log  # a test session that ran the soak keeps its own log


if __name__ == "__main__":
    sys.exit(main())
