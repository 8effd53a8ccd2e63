"""Client timeouts and disconnects cancel queued work: it is not computed for nobody, and later
requests do not hang behind it."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from ray import cloudpickle, serve

from service.deployment import Encoder
from tests.conftest import wait_until
from tests.reliability import record


class HoldsTheFirstBatch(Encoder.func_or_class):  # type: ignore[misc]
    """The real replica, whose first batch waits for the test's `release()` before it runs: the
    queue behind it is certain to exist while clients give up, however fast the machine is."""

    async def __init__(self, settings) -> None:  # the ingress wrapper's __init__ is async
        await super().__init__(settings)
        self._gate = asyncio.Event()
        self._held = 0

    async def release(self) -> None:
        self._gate.set()

    async def held(self) -> int:
        return self._held

    async def _run_batch(self, jobs):
        if not self._gate.is_set():
            self._held += len(jobs)
            await self._gate.wait()
        return await super()._run_batch(jobs)


def test_abandoned_requests_are_not_computed(ray_serve, default_bundle):
    from service.app import compose
    from service.config import ServiceSettings

    cloudpickle.register_pickle_by_value(__import__(__name__))
    # one batch at a time: the held batch keeps the model while the impatient requests queue
    settings = ServiceSettings.model_validate({"bundle": str(default_bundle), "num_cpus": 0.5, "intra_op_threads": 1,
                                              "batching": {"max_concurrent_batches": 1}})
    serve.run(compose(settings, serve.deployment(HoldsTheFirstBatch, name="Encoder")), name="cancel",
              route_prefix="/cancel", logging_config={"enable_access_log": False})
    url = f"{ray_serve.url}/cancel"
    handle = serve.get_deployment_handle("Encoder", "cancel")
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
                r = httpx.post(f"{url}/v1/encode", json={"inputs": [f"abandoned {i}"]}, timeout=0.5)
                return f"answered {r.status_code}"
            except httpx.TimeoutException:
                return "client gave up"

        with ThreadPoolExecutor(max_workers=6) as pool:
            outcomes = list(pool.map(impatient, range(6)))
        # the abandoned requests are gone from the replica before the model is free again
        wait_until(lambda: handle.info.remote().result()["load"]["inference_requests"] == 1,
                   "the replica to hold only the first request once the impatient clients left", timeout=30)
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
    abandoned = outcomes.count("client gave up")
    assert abandoned == 6, outcomes  # the model was held: nobody could have been answered
    # the first request's 8 texts and the later single one; the abandoned ones never ran
    assert computed == 8 + 1, (computed, outcomes)
    record("client timeouts and disconnects", f"{abandoned} clients gave up after 0.5 s while queued behind a running batch",
           {"200 (first)": 1, "client gave up": abandoned, "200 (later)": 1}, None,
           note=f"abandoned requests were not computed ({computed} texts ran); the next request took {later_s:.2f} s")
