"""A real Prometheus (Debian's package) scraping the running service's metrics port every second,
asked through its own HTTP API: every query of the Grafana dashboard returns data after traffic,
the request and token counters move by exactly what was sent, quantiles and the padding share it
computes agree with the service's own records, and the alert rules evaluate cleanly on real series."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.metrics_scrape import poll, scrape, settled, total
from tests.prometheus import Prometheus, PrometheusMissing, finite
from tests.waiting import wait_until

pytestmark = pytest.mark.serial  # its bounds hold on a quiet machine: make test runs it after the rest, alone

ROOT = Path(__file__).resolve().parents[1]
APP = "encoder"
ROUTE = "/v1/encode"
SEL = f'application="{APP}",route="{ROUTE}"'
OK = f'ray_encoder_requests_total{{{SEL},status_class="2xx"}}'
TOKENS = f'ray_encoder_tokens_total{{application="{APP}"}}'
PADDED = f'ray_encoder_padded_tokens_total{{application="{APP}"}}'
BUCKETS = f'ray_encoder_request_duration_seconds_bucket{{{SEL},stage="total"}}'

TEXTS = [
    "a short query",
    "Prometheus scrapes the node's metrics port every second.",
    "Padding is the first cost on a CPU: texts of different lengths in one batch compute the longest.",
    "x",
    "The encoder turns every input into one embedding of 384 numbers, normalised to length one, "
    "so that the dot product of two embeddings is their cosine similarity.",
]
REQUESTS = [TEXTS[i % len(TEXTS)] if i % 3 else TEXTS[: 1 + i % len(TEXTS)] for i in range(30)]


@pytest.fixture(scope="module")
def prometheus(metrics_url):
    """Prometheus scraping Ray's metrics endpoint of the test session, with the alert rules loaded."""
    try:
        # 3 s, not 1: late in a whole `make test` session, after dozens of applications came and went, Ray's
        # node metrics page took longer than a 1 s scrape timeout (Prometheus caps the timeout at the interval)
        prom = Prometheus({"ray": metrics_url}, interval="3s").start()
    except PrometheusMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        prom.wait_for_targets()
        yield prom
    finally:
        prom.stop()


# --- the service's own records, from a direct scrape (prometheus_client's parser) ------------------
def service_records(families: dict) -> dict:
    buckets: dict[str, float] = {}
    family = families.get("ray_encoder_request_duration_seconds")
    for s in family.samples if family else []:
        labels = s.labels
        if (s.name.endswith("_bucket") and labels.get("application") == APP and labels.get("route") == ROUTE
                and labels.get("stage") == "total"):
            le = canonical_le(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
    return {
        "ok": total(families, "ray_encoder_requests_total", application=APP, route=ROUTE, status_class="2xx"),
        "tokens": total(families, "ray_encoder_tokens_total", application=APP),
        "padded": total(families, "ray_encoder_padded_tokens_total", application=APP),
        "buckets": buckets,
    }


def canonical_le(le: str) -> str:
    return "+Inf" if le in ("+Inf", "Inf", "inf") else repr(float(le))


def prometheus_records(prom: Prometheus, at: float) -> dict:
    """The same figures, as Prometheus holds them at time `at`."""
    def one(expr: str) -> float:
        value = prom.value(f"sum({expr})", at)
        return 0.0 if value is None else value

    return {
        "ok": one(OK), "tokens": one(TOKENS), "padded": one(PADDED),
        "buckets": {canonical_le(r["metric"]["le"]): float(r["value"][1])
                    for r in prom.query(f"sum by (le) ({BUCKETS})", at)},
    }


def in_step(prom: Prometheus, direct: dict, what: str) -> float:
    """A time at which Prometheus holds exactly the service's (settled) records."""
    def matches() -> float | None:
        at = time.time()
        return at if prometheus_records(prom, at) == direct else None

    return wait_until(matches, f"Prometheus to hold the service's records ({what})", 30, interval=0.5,
                      last=lambda: f"{prometheus_records(prom, time.time())} != {direct}")


def bucket_quantile(q: float, buckets: dict[str, float]) -> float:
    """histogram_quantile's rule: find the bucket holding rank q*count, interpolate linearly in it
    (from 0 for the first bucket); in the +Inf bucket, the highest finite bound."""
    bounds = sorted((math.inf if le == "+Inf" else float(le), count) for le, count in buckets.items())
    count = bounds[-1][1]
    rank = q * count
    lower, below = 0.0, 0.0
    for upper, cumulative in bounds:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


def bucket_lower_edge(value: float, buckets: dict[str, float]) -> float:
    finite_bounds = sorted(float(le) for le in buckets if le != "+Inf")
    return max((b for b in finite_bounds if b < value), default=0.0)


def test_counters_and_quantiles_agree_with_the_service(prometheus, service_url, metrics_url):
    with httpx.Client(base_url=service_url, timeout=60) as client:
        tokens = sum(len(d["tokens"]) for r in REQUESTS
                     for d in client.post("/v1/tokenize", json={"inputs": r}).json()["data"])
        before = settled(metrics_url, service_records)
        t1 = in_step(prometheus, service_records(before), "before the traffic")
        latencies = []
        for payload in REQUESTS:  # one at a time, each timed by the client
            started = time.perf_counter()
            r = client.post(ROUTE, json={"inputs": payload})
            latencies.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text

    base = service_records(before)

    def arrived(f: dict) -> bool:
        now = service_records(f)
        return (now["ok"] - base["ok"] >= len(REQUESTS) and now["tokens"] - base["tokens"] >= tokens
                and now["buckets"].get("+Inf", 0) - base["buckets"].get("+Inf", 0) >= len(REQUESTS))

    poll(metrics_url, arrived, "the requests, tokens and latencies sent to be exported")
    after = service_records(settled(metrics_url, service_records))
    t2 = in_step(prometheus, after, "after the traffic")

    def delta(expr: str) -> float:
        return prometheus.value(delta_expr(expr, t1, t2))

    # the counters moved by what was sent, in Prometheus as in the service's records
    assert delta(OK) == len(REQUESTS) == after["ok"] - base["ok"]
    assert delta(TOKENS) == tokens == after["tokens"] - base["tokens"]
    assert delta(PADDED) == after["padded"] - base["padded"] >= tokens

    # the padding share over exactly this traffic, computed by Prometheus and from the records
    padding = prometheus.value(f"1 - ({delta_expr(TOKENS, t1, t2)}) / ({delta_expr(PADDED, t1, t2)})")
    assert padding == pytest.approx(1 - (after["tokens"] - base["tokens"]) / (after["padded"] - base["padded"]),
                                    rel=1e-12, abs=1e-12)

    # latency quantiles of exactly these requests: Prometheus's histogram_quantile against the same
    # rule applied to the service's bucket counts; and the server's time is within the client's
    window = {le: after["buckets"][le] - base["buckets"].get(le, 0.0) for le in after["buckets"]}
    assert window["+Inf"] == len(REQUESTS)
    latencies.sort()
    for q in (0.5, 0.9, 0.99):
        at_t2, at_t1 = f"sum by (le) ({BUCKETS} @ {t2:.3f})", f"sum by (le) ({BUCKETS} @ {t1:.3f})"
        promql = f"histogram_quantile({q}, {at_t2} - ({at_t1} or 0 * {at_t2}))"  # none yet at t1: zeros
        from_prometheus = prometheus.value(promql)
        assert from_prometheus == pytest.approx(bucket_quantile(q, window), rel=1e-9), q
        client_side = latencies[math.ceil(q * len(latencies)) - 1]
        assert bucket_lower_edge(from_prometheus, window) < client_side, (q, from_prometheus, client_side)


def delta_expr(expr: str, t1: float, t2: float) -> str:
    """PromQL for how much the sum of `expr` moved from t1 to t2 (a family not yet exported at t1 is 0)."""
    return f"(sum({expr} @ {t2:.3f}) or vector(0)) - (sum({expr} @ {t1:.3f}) or vector(0))"


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    return [(p["title"], t["expr"].replace("$application", APP)) for p in dashboard["panels"] for t in p.get("targets", [])]


def test_every_dashboard_query_returns_data(prometheus, service_url):
    queries = dashboard_queries()
    assert len(queries) >= 19
    stop = threading.Event()

    def traffic() -> None:  # what a dashboard shows: successes, a refusal now and then, every kind of output
        with httpx.Client(base_url=service_url, timeout=60) as c:
            i = 0
            while not stop.is_set():
                c.post(ROUTE, json={"inputs": TEXTS[: 1 + i % len(TEXTS)]})
                if i % 5 == 0:
                    c.post(ROUTE, json={"inputs": [TEXTS[1]], "attention": {"layers": [0], "heads": [0]}})
                    c.post(ROUTE, json={"inputs": []})  # 422
                i += 1

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()

    def empty() -> list[str]:
        return [f"{title}: {expr}" for title, expr in queries if not finite(prometheus.query(expr))]

    try:
        wait_until(lambda: not empty(), "every dashboard query to return a number", 90, interval=0.5,
                   last=lambda: "; ".join(empty()))
    finally:
        stop.set()
        worker.join(timeout=60)


# Selectors of the alerts that select nothing on a healthy CPU-only service.
# the model repository's loads and evictions exist only where a repository loads models (not on the shared app):
# tests/test_model_repository.py asserts them on its own
ABSENT_WHEN_HEALTHY = ('status_class="5xx"', 'reason="overloaded"', 'Name="GPU"', 'outcome="failed"',
                       'outcome="loaded"', 'reason="memory"')


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((ROOT / "deploy" / "prometheus-rules.yaml").read_text())["spec"]["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_alert_rules_evaluate_on_the_real_series(prometheus, service_url):
    httpx.post(f"{service_url}{ROUTE}", json={"inputs": TEXTS}, timeout=60)
    names = {r["alert"] for r in alert_rules()}

    def evaluated() -> list[dict]:
        rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
        done = [r for r in rules if not r["lastEvaluation"].startswith("0001")]
        return rules if len(done) == len(names) else []

    rules = wait_until(evaluated, "every alert rule to be evaluated", 30, interval=0.5)
    assert {r["name"] for r in rules} == names
    for rule in rules:
        assert rule["health"] == "ok", f"{rule['name']}: {rule.get('lastError')}"
        assert rule["state"] != "firing", f"{rule['name']} fires on the healthy test service: {rule['alerts']}"

    # every selector the alerts use selects real series (label names and values as Ray exports them)
    for rule in alert_rules():
        for name, matchers in re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", rule["expr"]):
            if any(m in matchers for m in ABSENT_WHEN_HEALTHY):
                continue
            selector = f"{name}{{{matchers}}}"
            wait_until(lambda s=selector: finite(prometheus.query(f"count({s})")),
                       f"{rule['alert']}: {selector} to select a series", 30, interval=0.5)
