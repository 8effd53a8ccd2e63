"""Requests whose clients give up leave the queue: nothing is computed for nobody, and later
requests do not hang behind them.

A client that gives up after T seconds says so with `X-Request-Timeout-Seconds: T`, and the replica
drops its request when T runs out, whatever the ingress in front does with the closed connection
(Ray's proxy actor cancels the request, HAProxy not always: docs/serving.md, "Overload, deadlines and clients that leave")."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from ray import serve

from tests.conftest import wait_until
from tests.holding import deploy_holding
from tests.reliability import record


def test_abandoned_requests_are_not_computed(ray_serve, default_bundle):
    # one batch at a time: the held batch keeps the model while the impatient requests queue
    handle = deploy_holding("cancel", "/cancel", default_bundle, num_cpus=0.5, intra_op_threads=1,
                            batching={"max_concurrent_batches": 1})
    url = f"{ray_serve.url}/cancel"
    try:
        before = handle.info.remote().result()["counters"]
        first = {"inputs": [f"sentence {i} with a few words" for i in range(8)]}
        first_result: dict = {}

        def run_first() -> None:
            with httpx.Client(base_url=url, timeout=120) as c:
                first_result["status"] = c.post("/v1/encode", json=first).status_code

        worker = threading.Thread(target=run_first)
        worker.start()
        wait_until(lambda: handle.held.remote().result() == 1, "the first request's batch to be held", timeout=60)

        def impatient(i: int) -> str:
            try:
                r = httpx.post(f"{url}/v1/encode", json={"inputs": [f"abandoned {i}"]},
                               headers={"X-Request-Timeout-Seconds": "0.5"}, timeout=0.5)
                return f"answered {r.status_code}"
            except httpx.TimeoutException:
                return "client gave up"

        load = lambda: handle.info.remote().result()["load"]  # noqa: E731
        admitted = load()["inference_requests_admitted"]
        with ThreadPoolExecutor(max_workers=6) as pool:
            outcomes = list(pool.map(impatient, range(6)))
        # they reached the replica and were admitted (else this test would pass without them) ...
        wait_until(lambda: load()["inference_requests_admitted"] - admitted == 6,
                   "the six impatient requests to have been admitted by the replica", timeout=30)
        # ... and are gone from it before the model is free again
        try:
            wait_until(lambda: load()["inference_requests"] == 1,
                       "the replica to hold only the first request once the impatient clients' deadlines passed",
                       timeout=30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the replica's load: {load()}; clients: {outcomes}") from None
        handle.release.remote().result()
        worker.join(timeout=120)
        assert first_result.get("status") == 200
        # later requests are served promptly
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/encode", json={"inputs": ["after the abandoned ones"]}, timeout=30)
        later_s = time.monotonic() - started
        assert r.status_code == 200 and later_s < 5
        after = handle.info.remote().result()["counters"]
    finally:
        serve.delete("cancel")
    computed = after["texts"] - before["texts"]
    # the model was held: nobody could have been answered with a result. Whether the client's own
    # timer or the service's timeout (503) at the same deadline comes first is a race of clocks.
    assert set(outcomes) <= {"client gave up", "answered 503"}, outcomes
    abandoned = outcomes.count("client gave up")
    # the first request's 8 texts and the later single one; the abandoned ones never ran
    assert computed == 8 + 1, (computed, outcomes)
    record("clients that give up", "6 clients gave up after 0.5 s (X-Request-Timeout-Seconds: 0.5) while queued behind a running batch",
           {"200 (first)": 1, "client gave up": abandoned, "503 (timeout) at the deadline": 6 - abandoned, "200 (later)": 1}, None,
           note=f"abandoned requests were not computed ({computed} texts ran); the next request took {later_s:.2f} s")
