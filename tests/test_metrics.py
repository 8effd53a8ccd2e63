"""Metrics from the real service, read from Ray's Prometheus endpoint: every family present,
named by convention, and moving by exactly what the test sent."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import deploy
from tests.metrics_scrape import poll, sample_names, scrape, settled, total

ROOT = Path(__file__).resolve().parents[1]
APP = {"application": "encoder"}
ROUTE = "/v1/encode"

FAMILIES = {  # exported name -> Prometheus type
    "ray_encoder_requests": "counter",
    "ray_encoder_request_failures": "counter",
    "ray_encoder_request_duration_seconds": "histogram",
    "ray_encoder_in_flight_requests": "gauge",
    "ray_encoder_response_bytes": "counter",
    "ray_encoder_batch_size_requests": "histogram",
    "ray_encoder_batch_size_tokens": "histogram",
    "ray_encoder_batch_padding_ratio": "histogram",
    "ray_encoder_tokens": "counter",
    "ray_encoder_padded_tokens": "counter",
    "ray_encoder_inference_runs": "counter",
    "ray_encoder_model_info": "gauge",
}


def snapshot(families: dict) -> dict[str, float]:
    d = lambda name, **labels: total(families, name, **APP, **labels)  # noqa: E731
    return {
        "ok": d("ray_encoder_requests_total", route=ROUTE, status_class="2xx"),
        "client_errors": d("ray_encoder_requests_total", route=ROUTE, status_class="4xx"),
        "failures_validation": d("ray_encoder_request_failures_total", route=ROUTE, reason="validation"),
        "failures_all": d("ray_encoder_request_failures_total", route=ROUTE),
        "total_count": d("ray_encoder_request_duration_seconds_count", route=ROUTE, stage="total"),
        "tokenization_count": d("ray_encoder_request_duration_seconds_count", route=ROUTE, stage="tokenization"),
        "queue_count": d("ray_encoder_request_duration_seconds_count", route=ROUTE, stage="queue"),
        "inference_count": d("ray_encoder_request_duration_seconds_count", route=ROUTE, stage="inference"),
        "batches": d("ray_encoder_batch_size_requests_count"),
        "token_batches": d("ray_encoder_batch_size_tokens_count"),
        "padding_batches": d("ray_encoder_batch_padding_ratio_count"),
        "tokens": d("ray_encoder_tokens_total"),
        "padded_tokens": d("ray_encoder_padded_tokens_total"),
        "runs_full": d("ray_encoder_inference_runs_total", graph="full"),
        "runs_encodings": d("ray_encoder_inference_runs_total", graph=ENCODINGS_GRAPH[0]),
        "bytes": d("ray_encoder_response_bytes_total", route=ROUTE),
        "bytes_embedding": d("ray_encoder_response_bytes_total", route=ROUTE, kind="embedding"),
        "bytes_attention": d("ray_encoder_response_bytes_total", route=ROUTE, kind="attention"),
    }


# the graph the default app runs texts that need only their embedding on, from /info: the packed one
# (packed-fp32, or packed-bf16-openvino where the CPU has bf16 units)
ENCODINGS_GRAPH = ["packed-fp32"]


def test_families_move_by_exactly_what_was_sent(service_url, metrics_url):
    with httpx.Client(base_url=service_url, timeout=60) as client:
        served = client.get("/info").json()
        ENCODINGS_GRAPH[0] = served["graphs"]["packed"]
        assert ENCODINGS_GRAPH[0] is not None, served["graphs"]
        requests = [
            {"inputs": ["one text"]},
            {"inputs": ["two", "texts of different length"]},
            {"inputs": ["three", "texts", "here"], "attention": {"layers": [0], "heads": [0]}},
            {"inputs": "a single string"},
            {"inputs": ["five"] * 5},
        ]
        tokens = sum(
            len(d["tokens"]) for r in requests
            for d in client.post("/v1/tokenize", json={"inputs": r["inputs"]}).json()["data"]
        )
        before = snapshot(settled(metrics_url, snapshot))
        body_bytes = 0
        for payload in requests:  # one at a time: each request is its own batch
            r = client.post(ROUTE, json=payload)
            assert r.status_code == 200
            body_bytes += len(r.content)
        bad = client.post(ROUTE, json={"inputs": []})
        assert bad.status_code == 422
        body_bytes += len(bad.content)

    expected = {
        "ok": 5, "client_errors": 1, "failures_validation": 1, "failures_all": 1,
        "total_count": 6, "tokenization_count": 5, "queue_count": 5, "inference_count": 5,
        "batches": 5, "token_batches": 5, "padding_batches": 5, "tokens": tokens, "bytes": body_bytes,
        # the one request with attention weights runs on the full graph, the four others on the packed
        # one: one row each, whatever their lengths (padded, "two" beside a 7-token text took two runs)
        "runs_full": 1, "runs_encodings": 4,
    }

    def delta(families: dict) -> dict[str, float]:
        now = snapshot(families)
        return {k: now[k] - before[k] for k in now}

    def exported(f: dict) -> bool:
        return (all(delta(f)[k] >= v for k, v in expected.items())
                and total(f, "ray_encoder_in_flight_requests", **APP) == 0 and bool(model_info(f)))

    families = poll(metrics_url, exported, "every counter to move by what was sent, in-flight back at 0, model info")
    moved = delta(families)
    for key, value in expected.items():
        assert moved[key] == value, f"{key}: moved by {moved[key]}, expected exactly {value}"
    assert moved["padded_tokens"] >= tokens
    assert moved["bytes_embedding"] > 0 and moved["bytes_attention"] > 0
    assert total(families, "ray_encoder_in_flight_requests", **APP) == 0
    info = model_info(families)
    assert info and all(s.value == 1 for s in info)
    assert {s.labels["provider"] for s in info} == {"CPUExecutionProvider"}
    assert {(s.labels["runtime"], s.labels["precision"]) for s in info} == {(served["runtime"], served["precision"])}
    assert {s.labels["model"] for s in info} == {"all-MiniLM-L6-v2"}
    assert all(len(s.labels["bundle_sha256"]) == 64 for s in info)


def model_info(families: dict) -> list:
    family = families.get("ray_encoder_model_info")
    return [s for s in family.samples if s.labels.get("application") == "encoder"] if family else []


def test_every_family_is_present_and_named_by_convention(service_url, metrics_url):
    httpx.post(f"{service_url}{ROUTE}", json={"inputs": "present"}, timeout=60)
    families = poll(metrics_url, lambda f: all(name in f for name in FAMILIES), "every family of the service")
    for name, kind in FAMILIES.items():
        assert name in families, f"{name} missing from the scrape"
        family = families[name]
        assert family.type == kind, f"{name} is a {family.type}, expected {kind}"
        names = {s.name for s in family.samples}
        if kind == "counter":
            assert all(n.endswith("_total") for n in names), names
        if kind == "histogram":
            assert {f"{name}_bucket", f"{name}_count", f"{name}_sum"} <= names
        if "duration" in name:
            assert name.endswith("_seconds")
        if "bytes" in name:
            assert name.endswith("_bytes")
        assert not re.search(r"[A-Z]", name)
        for s in family.samples:  # Ray tags every sample with where it came from
            assert {"deployment", "replica", "application"} <= set(s.labels), s


def test_bad_request_counts_as_failure_with_its_reason(service_url, metrics_url):
    def counts(f):
        return (
            total(f, "ray_encoder_request_failures_total", **APP, route=ROUTE, reason="too_large"),
            total(f, "ray_encoder_requests_total", **APP, route=ROUTE, status_class="2xx"),
            total(f, "ray_encoder_requests_total", **APP, route=ROUTE, status_class="4xx"),
        )

    before = counts(settled(metrics_url, counts))
    r = httpx.post(f"{service_url}{ROUTE}", json={"inputs": ["x"] * 65}, timeout=60)
    assert r.status_code == 413
    # both counters it asserts on, each exported on Ray's schedule
    after = counts(poll(metrics_url, lambda f: counts(f)[0] > before[0] and counts(f)[2] > before[2],
                        "the too_large failure and the 4xx request to be counted"))
    assert after[0] - before[0] == 1, "failure counted with reason too_large"
    assert after[2] - before[2] == 1 and after[1] == before[1], "counted as 4xx, not as a success"


def test_two_encoder_replicas_both_report_and_add_up(ray_serve, metrics_url, default_bundle):
    deploy(
        {"replicas": 2, "num_cpus": 0.5, "intra_op_threads": 1},
        "duo", "/duo", default_bundle,
    )
    try:
        duo = {"application": "duo"}
        texts = [f"replica test sentence number {i}" for i in range(64)]
        with httpx.Client(base_url=ray_serve.url, timeout=60) as client:
            tokens = sum(len(d["tokens"]) for d in client.post("/duo/v1/tokenize", json={"inputs": texts}).json()["data"])

            def one(text: str) -> int:
                with httpx.Client(base_url=ray_serve.url, timeout=60) as c:
                    return c.post("/duo/v1/encode", json={"inputs": text}).status_code

            with ThreadPoolExecutor(max_workers=16) as pool:
                assert set(pool.map(one, texts)) == {200}

        def replicas(f):
            family = f.get("ray_encoder_tokens", None)
            samples = family.samples if family else []
            return {s.labels["replica"]: s.value for s in samples if s.labels.get("application") == "duo"}

        def info_replicas(f) -> set:
            family = f.get("ray_encoder_model_info")
            return {s.labels["replica"] for s in family.samples if s.labels.get("application") == "duo"} if family else set()

        def flushed(f) -> bool:
            return (
                sum(replicas(f).values()) >= tokens
                and total(f, "ray_encoder_request_duration_seconds_count", **duo, stage="queue") >= len(texts)
                and total(f, "ray_encoder_requests_total", **duo, route=ROUTE, status_class="2xx") >= len(texts)
                and len(info_replicas(f)) == 2
            )

        families = poll(metrics_url, flushed, "both replicas' tokens, queue times, requests and model info")
        per_replica = replicas(families)
        assert len(per_replica) == 2 and all(v > 0 for v in per_replica.values()), per_replica
        assert sum(per_replica.values()) == tokens
        assert total(families, "ray_encoder_request_duration_seconds_count", **duo, stage="queue") == len(texts)
        assert total(families, "ray_encoder_requests_total", **duo, route=ROUTE, status_class="2xx") == len(texts)
        assert info_replicas(families) == set(per_replica)
    finally:
        from ray import serve

        serve.delete("duo")


PROMQL_WORDS = {
    "sum", "rate", "irate", "increase", "histogram_quantile", "by", "without", "on", "ignoring", "group_left",
    "group_right", "max", "min", "avg", "count", "clamp_min", "clamp_max", "and", "or", "unless", "bool", "le",
    "vector", "absent", "time", "offset", "abs", "topk", "label_replace", "max_over_time", "avg_over_time", "inf",
}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords or labels."""
    expr = re.sub(r'"[^"]*"', "", expr)  # strings
    expr = re.sub(r"\b\d+(\.\d+)?([eE][-+]?\d+)?\b", "", expr)  # numbers, 1e-9 included
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\$\w+", "", expr)  # dashboard variables
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {n for n in names if n.lower() not in PROMQL_WORDS and not re.fullmatch(r"\d+[smhd]?", n)}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((ROOT / "deploy/grafana-dashboard.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((ROOT / "deploy/prometheus-rules.yaml").read_text())
    groups = rules["spec"]["groups"] if "spec" in rules else rules["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


REPOSITORY_FAMILIES = {"ray_encoder_model_loads_total", "ray_encoder_model_evictions_total"}


def test_dashboard_and_alerts_name_only_exported_families(service_url, metrics_url):
    exprs = dashboard_exprs() + alert_exprs()
    # the model repository's families exist only where one loads models (test_model_repository.py asserts them)
    wanted = set().union(*(promql_metric_names(e) for e in exprs)) - REPOSITORY_FAMILIES
    assert any(n.startswith("ray_encoder_") for n in wanted) and any(n.startswith("ray_serve_") for n in wanted)
    # Some of Ray Serve's gauges (batch queue length) exist only while batches are formed:
    # keep traffic flowing while scraping, as a real service would have.
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=service_url, timeout=60) as c:
            while not stop.is_set():
                c.post(ROUTE, json={"inputs": ["dashboard traffic"] * 4})

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        families = poll(metrics_url, lambda f: wanted <= sample_names(f),
                        "every family the dashboard and the alerts use", timeout=60)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert wanted <= sample_names(families)


def test_dashboard_has_the_panels_an_operator_opens_first():
    dashboard = json.loads((ROOT / "deploy/grafana-dashboard.json").read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "p50", "batch", "padding", "errors", "queue", "replicas"):
        assert topic in titles, f"no panel about {topic}: {titles}"
    rules = " ".join(r.get("alert", "") for g in yaml.safe_load((ROOT / "deploy/prometheus-rules.yaml").read_text())["spec"]["groups"] for r in g["rules"])
    for alert in ("ErrorRatio", "P99", "Queue", "NoReadyReplicas"):
        assert alert.lower() in rules.lower(), rules


def test_promql_name_extraction():
    expr = 'histogram_quantile(0.99, sum by (le, stage) (rate(ray_encoder_request_duration_seconds_bucket{application="encoder"}[5m])))'
    assert promql_metric_names(expr) == {"ray_encoder_request_duration_seconds_bucket"}


def test_a_client_that_leaves_mid_upload_is_counted_as_499_not_as_an_error(service_url, metrics_url):
    """Headers and half a body, then the client goes: nginx's 499 (reason cancelled), not a 5xx, so
    the error-ratio alert never pages for clients that gave up."""
    import socket
    from urllib.parse import urlparse

    def counts(f):
        return (
            total(f, "ray_encoder_requests_total", **APP, status_class="5xx"),
            total(f, "ray_encoder_requests_total", **APP, status_class="4xx"),
            total(f, "ray_encoder_request_failures_total", **APP, reason="cancelled"),
        )

    before = counts(settled(metrics_url, counts))
    url = urlparse(service_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as s:
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b'{"inputs": "' + b"a" * 20000)
    # both families move in the same replica call, but Ray may export them in different flushes
    after = counts(poll(metrics_url, lambda f: counts(f)[2] > before[2] and counts(f)[1] > before[1],
                        "the request whose client left to be counted as cancelled and as a 4xx"))
    assert after[2] - before[2] == 1 and after[1] - before[1] == 1, (before, after)  # one 499, a 4xx
    assert after[0] == before[0], "a client that left was counted as a server error"


def test_a_deadline_that_passes_first_on_serves_clock_is_the_same_503_timeout(service_url, metrics_url):
    """Serve reads X-Request-Timeout-Seconds too and answers 408 when it passes on its own clock,
    cancelling the handler. Half a body and a client that waits hold the request in the service's
    body reader, where only Serve's clock runs: the answer is still the 503 `timeout` with Retry-After,
    counted as a 5xx with reason timeout, not as a client that left."""
    import socket
    from urllib.parse import urlparse

    def counts(f):
        return (total(f, "ray_encoder_requests_total", **APP, route="unmatched", status_class="5xx")
                + total(f, "ray_encoder_requests_total", **APP, route=ROUTE, status_class="5xx"),
                total(f, "ray_encoder_request_failures_total", **APP, reason="timeout"),
                total(f, "ray_encoder_request_failures_total", **APP, reason="cancelled"))

    before = counts(settled(metrics_url, counts))
    url = urlparse(service_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"X-Request-Timeout-Seconds: 1\r\nContent-Length: 100000\r\n\r\n" + b'{"inputs": "' + b"a" * 20000)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < 10:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    assert status_line.split()[1] == "503" and headers.get("retry-after") == "1", answer
    error = json.loads(body[: int(headers["content-length"])])["error"]
    assert error == {"type": "timeout", "message": "the request did not finish within the client's deadline "
                                                   "(x-request-timeout-seconds: 1s)",
                     "request_id": headers["x-request-id"]}, (error, headers)
    # both families move in the same replica call, but Ray may export them in different flushes
    after = counts(poll(metrics_url, lambda f: counts(f)[1] > before[1] and counts(f)[0] > before[0],
                        "the deadline to be counted as a timeout and as a 5xx"))
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (1, 1, 0), (before, after)


def test_a_request_past_its_deadline_is_503_timeout_with_retry_after_and_counted(service_url, metrics_url):
    def counts(f):
        return (total(f, "ray_encoder_requests_total", **APP, route=ROUTE, status_class="5xx"),
                total(f, "ray_encoder_request_failures_total", **APP, route=ROUTE, reason="timeout"))

    before = counts(settled(metrics_url, counts))
    # 64 texts of about 250 tokens take seconds here; the client gives them 0.3 s
    long_text = " ".join(["a deadline much shorter than this inference"] * 40)
    r = httpx.post(f"{service_url}{ROUTE}", json={"inputs": [f"{i} {long_text}" for i in range(64)]},
                   headers={"X-Request-Timeout-Seconds": "0.3"}, timeout=60)
    assert r.status_code == 503 and r.headers.get("retry-after") == "1", r.text
    assert r.json()["error"]["type"] == "timeout" and "did not finish within" in r.json()["error"]["message"]
    after = counts(poll(metrics_url, lambda f: counts(f)[1] > before[1] and counts(f)[0] > before[0],
                        "the timeout to be counted as a 5xx with reason timeout"))
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
