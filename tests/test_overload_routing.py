"""Overload across replicas: Serve routes only to replicas with room, queues what none has room
for (bounded), and refuses only when every replica and the queue are full, with 503 +
Retry-After and the JSON error body. Through both ingresses: HAProxy (the session's, leastconn
over the replicas' own ports, each replica queueing max_queued_requests) and Ray Serve's proxy
(the fallback proxy every HAProxy cluster runs; its router queues max_queued_requests)."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from ray import serve

from tests.conftest import haproxy_servers_up, wait_until
from tests.holding import deploy_gated
from tests.metrics_scrape import poll, scrape, total

REPLICAS, HOLDS = 3, 2  # replicas, and requests each holds at once (max_ongoing_requests)
# max_queued_requests: what Serve queues per replica (HAProxy's path) or per router (the proxy's,
# which HAProxy also falls back to while it has not yet seen a new replica healthy). The router
# counts a request as queued until a replica takes it, so a burst needs room there too.
QUEUE = 8  # > the burst of 6 below


def ingress_url(ray_serve, ingress: str) -> str:
    if ingress == "haproxy":
        return ray_serve.url
    return f"http://127.0.0.1:{os.environ['RAY_SERVE_FALLBACK_PROXY_HTTP_PORT']}"


def refusals(families: dict) -> float:
    return total(families, "ray_encoder_request_failures_total", route="serve_queue", reason="overloaded")


@pytest.mark.parametrize("ingress", ["haproxy", "proxy"])
def test_no_refusal_while_a_replica_has_room_then_json_503_when_all_are_full(ray_serve, default_bundle, ingress):
    name = f"full-{ingress}"
    gate = deploy_gated(
        name, f"/{name}", default_bundle, replicas=REPLICAS, num_cpus=0.25, max_ongoing_requests=HOLDS,
        max_queued_requests=QUEUE, retry_after_s=3, request_timeout_s=120, warmup=False,
        batching={"max_concurrent_batches": 1},
    )
    url = f"{ingress_url(ray_serve, ingress)}/{name}"
    wait_until(lambda: httpx.get(f"{url}/v2/health/live", timeout=10).status_code == 200,
               f"{ingress} to route /{name}", timeout=60)
    if ingress == "haproxy":  # else HAProxy sends to Ray's fallback proxy until its checks pass
        wait_until(lambda: haproxy_servers_up(f"http-{name}") == REPLICAS, f"HAProxy to see {REPLICAS} replicas up",
                   timeout=60)
    refused_before = refusals(scrape(ray_serve.metrics_url))
    answers: dict[int, httpx.Response | str] = {}

    def send(i: int) -> None:
        try:
            answers[i] = httpx.post(f"{url}/v1/embeddings", json={"input": f"text {i}"}, timeout=120)
        except httpx.HTTPError as exc:
            answers[i] = repr(exc)

    def start(indices: range) -> list[threading.Thread]:
        threads = [threading.Thread(target=send, args=(i,)) for i in indices]
        for t in threads:
            t.start()
        return threads

    threads: list[threading.Thread] = []
    try:
        # 1. As many requests as the replicas hold: every one is taken in, none refused
        capacity = REPLICAS * HOLDS
        threads += start(range(capacity))
        inside: list[float] = []
        try:
            poll(ray_serve.metrics_url,
                 lambda f: inside.append(total(f, "ray_encoder_in_flight_requests", application=name)) or
                 inside[-1] == capacity or bool(answers),
                 f"{capacity} requests inside the {REPLICAS} replicas", timeout=60)
        except AssertionError as exc:
            raise AssertionError(f"{exc} (in flight, last scrapes: {inside[-5:]})") from None
        assert not answers, f"answered while replicas had room: { {i: (a.status_code, a.text) if not isinstance(a, str) else a for i, a in answers.items()} }"
        # 2. More than any path queues: some are refused, at once, each with 503 + Retry-After in JSON
        extra = REPLICAS * QUEUE + 1
        threads += start(range(capacity, capacity + extra))
        wait_until(lambda: answers, "a request past every replica and the queue to be refused", timeout=30)
        first = next(iter(answers.values()))
        assert not isinstance(first, str) and first.status_code == 503, first
    finally:
        gate.open.remote()
        for t in threads:
            t.join(timeout=120)
        if any(t.is_alive() for t in threads):
            serve.delete(name)  # a failed run must not leave held replicas to the tests after it
    # 3. Once the replicas move on, everything taken in or queued is served
    statuses = [a.status_code if not isinstance(a, str) else a for a in answers.values()]
    refused = [a for a in answers.values() if not isinstance(a, str) and a.status_code == 503]
    assert sorted(set(statuses)) == [200, 503], statuses
    assert statuses.count(200) >= capacity + QUEUE, statuses  # what the replicas held and a queue's worth
    for r in refused:
        assert r.headers["retry-after"] == "3"
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["type"] == "overloaded", r.text
    poll(ray_serve.metrics_url, lambda f: refusals(f) >= refused_before + len(refused),
         "Serve's refusals counted as overloaded (the overload alert's series)", timeout=30)
    serve.delete(name)
