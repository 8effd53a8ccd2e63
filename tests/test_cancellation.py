"""Client timeouts and disconnects cancel queued work: it is not computed for nobody, and later
requests do not hang behind it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from ray import serve

from tests.conftest import deploy
from tests.reliability import record


def test_abandoned_requests_are_not_computed(ray_serve, default_bundle):
    deploy({"encoder_max_ongoing_requests": 1, "encoder_num_cpus": 0.5, "ingress_num_cpus": 0.25,
            "intra_op_threads": 1, "batching": {"max_concurrent_batches": 1}}, "cancel", "/cancel", default_bundle)
    url = f"{ray_serve.url}/cancel"
    handle = serve.get_deployment_handle("Encoder", "cancel")
    try:
        before = handle.info.remote().result()["counters"]
        heavy = {"inputs": [f"sentence {i} " + "with quite a few words in it " * 20 for i in range(48)]}
        heavy_result: dict = {}

        def run_heavy() -> None:
            with httpx.Client(base_url=url, timeout=120) as c:
                started = time.monotonic()
                r = c.post("/v1/encode", json=heavy)
                heavy_result.update(status=r.status_code, elapsed=time.monotonic() - started)

        worker = threading.Thread(target=run_heavy)
        worker.start()
        time.sleep(0.5)  # the heavy request now holds the only slot

        def impatient(i: int) -> str:
            try:
                httpx.post(f"{url}/v1/encode", json={"inputs": [f"abandoned {i}"]}, timeout=0.5)
                return "answered"
            except httpx.TimeoutException:
                return "client gave up"

        with ThreadPoolExecutor(max_workers=6) as pool:
            outcomes = list(pool.map(impatient, range(6)))
        worker.join(timeout=120)
        assert heavy_result.get("status") == 200
        # later requests are served promptly
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/encode", json={"inputs": ["after the abandoned ones"]}, timeout=30)
        later_s = time.monotonic() - started
        assert r.status_code == 200 and later_s < 5
        time.sleep(1)
        after = handle.info.remote().result()["counters"]
    finally:
        serve.delete("cancel")
    computed = after["texts"] - before["texts"]
    abandoned = outcomes.count("client gave up")
    assert abandoned >= 4, outcomes
    # the heavy request's 48 texts and the later single one; the abandoned ones never ran
    assert computed == 48 + 1 + outcomes.count("answered"), (computed, outcomes)
    record("client timeouts and disconnects", f"{abandoned} clients gave up after 0.5 s while queued behind a 48-text request",
           {"200 (heavy)": 1, "client gave up": abandoned, "200 (later)": 1}, None,
           note=f"abandoned requests were not computed ({computed} texts ran); the next request took {later_s:.2f} s")
