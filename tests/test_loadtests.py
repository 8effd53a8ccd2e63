"""The locust scenarios against the real service on loopback: a short clean run, and an
overload run that must shed load with Retry-After while accepted requests stay bounded."""

from __future__ import annotations

import pytest

from loadtests.run import run_locust, summarize
from tests.conftest import deploy

pytestmark = pytest.mark.serial  # its bounds hold on a quiet machine: make test runs it after the rest, alone


def test_short_headless_run_has_no_failures(service_url, tmp_path):
    # 11 users: the traffic mix's weights (5, 2, 2, 1, 1) give every user class at least one
    totals = run_locust(service_url, users=11, spawn_rate=11, duration="10s", out=tmp_path)
    rows = summarize(tmp_path / "stats_stats.csv")
    aggregate = rows[-1]
    assert aggregate.name == "Aggregated" and aggregate.requests > 0
    assert aggregate.failures == 0, (tmp_path / "stats_failures.csv").read_text()
    names = {r.name for r in rows[:-1]}
    assert {"encode 1 text", "encode 8-64 texts", "openai embeddings", "encode + attention", "v2 infer"} <= names
    assert totals["texts"] > 0 and totals["tokens"] > totals["texts"]
    assert (tmp_path / "report.html").stat().st_size > 0


def test_overload_sheds_with_retry_after_and_bounds_waiting(ray_serve, default_bundle, tmp_path):
    timeout_s = 10
    deploy(
        # a replica holds 1 request and Serve queues 4 more: 16 users are bound to be refused
        {"max_ongoing_requests": 1, "max_queued_requests": 4, "request_timeout_s": timeout_s,
         "num_cpus": 1, "retry_after_s": 1, "batching": {"max_concurrent_batches": 1}},
        "overload", "/overload", default_bundle,
    )
    try:
        totals = run_locust(f"{ray_serve.url}/overload", users=16, spawn_rate=16, duration="10s",
                            out=tmp_path, overload=True)
    finally:
        from ray import serve

        serve.delete("overload")
    rows = summarize(tmp_path / "stats_stats.csv")
    assert totals["shed"] > 0, "the burst never exceeded capacity"
    assert totals["shed_without_retry_after"] == 0
    accepted = [r for r in rows[:-1] if r.name == "overload 32 texts"]
    assert accepted and accepted[0].requests > 0 and accepted[0].failures == 0
    assert accepted[0].max_ms <= timeout_s * 1000, f"an accepted request waited {accepted[0].max_ms} ms"
    assert rows[-1].failures == 0
