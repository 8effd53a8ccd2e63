"""A short soak (`make soak` for a minute): the locust traffic mix against the running service with a
real Prometheus scraping it and the memory of the service's processes; no errors, no alert, no
replica replaced, memory within bounds, and the CSV and plot written from what Prometheus saw."""

from __future__ import annotations

import csv
import json
import math
import os

import pytest

from loadtests import soak
from tests.reliability import record

pytestmark = pytest.mark.serial  # its bounds hold on a quiet machine: make test runs it after the rest, alone

DURATION_S = 60
WARMUP_S = 20


def test_short_soak_is_clean_and_reports_from_prometheus(service_url, metrics_url, tmp_path):
    rc = soak.main([
        "--host", service_url, "--metrics-url", metrics_url, "--processes-of", str(os.getpid()),
        "--duration", f"{DURATION_S}s", "--warmup", f"{WARMUP_S}s", "--users", "11", "--spawn-rate", "11",
        "--scrape-interval", "3s", "--results", str(tmp_path),  # Ray's page is slow late in a session: test_prometheus
    ])
    outcome = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 0, outcome["problems"]

    # what the runner concluded, from Prometheus
    assert outcome["locust_requests"] > 0 and outcome["locust_failures"] == 0
    assert outcome["service_requests"] >= outcome["locust_requests"]
    assert outcome["errors_4xx"] == outcome["errors_5xx"] == outcome["proxy_errors"] == 0
    assert math.isfinite(outcome["p99_ms"]) and 0 < outcome["p50_ms"] <= outcome["p99_ms"]
    assert outcome["alerts_fired"] == []
    roles = {m["role"] for m in outcome["memory"]}
    assert {"replica", "haproxy", "proxy"} <= roles, roles
    replicas = [m for m in outcome["memory"] if m["process"] == "ray::ServeReplica:encoder:Encoder"]
    assert replicas and all(m["start_mb"] > 100 for m in replicas), replicas  # a replica holds the model

    # the series over time: throughput and p99 in every row after the warm-up, memory per process
    with (tmp_path / "soak.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    after = [r for r in rows if float(r["t_s"]) >= WARMUP_S + 10]
    assert len(after) >= 10
    assert all(float(r["requests_per_s"]) > 0 and r["p99_ms"] for r in after)
    assert any(k.startswith("rss_mb ray::ServeReplica:encoder:Encoder") for k in rows[0])
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    replica = replicas[0]
    record("soak, short (make test)",
           f"locust traffic mix at 11 users for {DURATION_S} s, Prometheus scraping every second",
           {"requests": outcome["locust_requests"], "errors": 0},
           note=(f"{outcome['requests_per_s']:.1f} requests/s, p99 {outcome['p99_ms']:.0f} ms; replica memory "
                 f"{replica['start_mb']:.0f} MB after a {WARMUP_S} s warm-up, {replica['end_mb']:.0f} MB at the end "
                 f"({replica['late_growth_mb']:+.0f} MB over the second half); no alert; `make soak` runs it for "
                 "10 minutes"))
