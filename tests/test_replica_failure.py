"""Faults inside the running service: an encoder replica killed mid-load, and a replica whose
session breaks. Requests fail cleanly or succeed, readiness tells the truth, Serve recovers."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
from ray import serve

from service.batching import Encoder
from tests.conftest import deploy
from tests.reliability import record

TIMEOUT_S = 10


def load(url: str, stop: threading.Event, results: list, workers: int = 4) -> list[threading.Thread]:
    """Closed-loop clients; each result is (start, status, elapsed, json error type or None)."""

    def client() -> None:
        with httpx.Client(base_url=url, timeout=TIMEOUT_S + 20) as c:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    r = c.post("/v1/encode", json={"inputs": ["keep going", "under fire"]})
                    kind = r.json()["error"]["type"] if r.status_code != 200 else None
                    results.append((started, r.status_code, time.monotonic() - started, kind))
                except httpx.HTTPError as exc:
                    results.append((started, type(exc).__name__, time.monotonic() - started, None))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    return threads


def test_killed_replica_is_replaced_and_the_run_recovers(ray_serve, default_bundle):
    deploy({"encoder_num_cpus": 0.5, "ingress_num_cpus": 0.25, "request_timeout_s": TIMEOUT_S}, "chaos", "/chaos",
           default_bundle)
    url = f"{ray_serve.url}/chaos"
    handle = serve.get_deployment_handle("Encoder", "chaos")
    pid = handle.info.remote().result()["pid"]
    stop, results = threading.Event(), []
    threads = load(url, stop, results)
    try:
        time.sleep(2)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        saw_not_ready = saw_live_failure = False
        ready_at = None
        with httpx.Client(base_url=url, timeout=30) as probe:
            while time.monotonic() - killed_at < 90:
                ready = probe.get("/v2/health/ready")
                if probe.get("/v2/health/live").status_code != 200:
                    saw_live_failure = True
                if ready.status_code == 503:
                    saw_not_ready = True
                    assert ready.json()["error"]["type"] == "not_ready"
                elif ready.status_code == 200 and saw_not_ready:
                    ready_at = time.monotonic()
                    break
                time.sleep(0.2)
        assert saw_not_ready, "readiness never reported the missing replica"
        assert ready_at is not None, "no replacement became ready within 90 s"
        assert not saw_live_failure, "liveness failed while a replica was being replaced"
        time.sleep(3)  # a steady stretch after recovery
        recovered_at = time.monotonic()
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        serve.delete("chaos")
    during = [r for r in results if killed_at - 1 <= r[0] < ready_at]
    after = [r for r in results if r[0] >= recovered_at]
    for started, status, elapsed, kind in results:
        assert status in (200, 408, 500, 503), (status, kind)
        assert elapsed < TIMEOUT_S + 5, f"a request took {elapsed:.1f} s, past the {TIMEOUT_S} s timeout"
        if status != 200:
            assert kind in ("backend", "not_ready", "overloaded", "timeout"), kind
    assert after and all(r[1] == 200 for r in after), "failures after the replacement was ready"
    counts: dict[str, int] = {}
    for r in during:
        counts[str(r[1])] = counts.get(str(r[1]), 0) + 1
    recovery = ready_at - killed_at
    record("encoder replica killed mid-load", "SIGKILL to the only encoder replica under 4 closed-loop clients",
           counts, recovery, note=f"readiness 503 until replaced; liveness 200 throughout; "
                                 f"{len(after)} requests after recovery all 200")


class BreaksAfterStart(Encoder.func_or_class):  # type: ignore[misc]
    """The real encoder, whose onnxruntime session starts failing two seconds after it is ready."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self._broken_at = time.monotonic() + 2

    def check_health(self) -> None:
        if time.monotonic() > self._broken_at:
            self.runtime.full.session = None  # what a lost device or a corrupted session amounts to
        super().check_health()


def test_health_check_detects_a_broken_session_and_serve_restarts_the_replica(ray_serve, default_bundle):
    from ray import cloudpickle

    from service.app import compose
    from service.config import ServiceSettings

    cloudpickle.register_pickle_by_value(__import__(__name__))
    settings = ServiceSettings.model_validate(
        {"bundle": str(default_bundle), "encoder_num_cpus": 0.5, "ingress_num_cpus": 0.25, "health_check_period_s": 1}
    )
    serve.run(compose(settings, serve.deployment(BreaksAfterStart, name="Encoder")), name="fragile",
              route_prefix="/fragile", logging_config={"enable_access_log": False})
    try:
        handle = serve.get_deployment_handle("Encoder", "fragile")
        first = handle.info.remote().result()["pid"]
        started = time.monotonic()
        pids = {first}
        while time.monotonic() - started < 60 and len(pids) < 2:
            try:
                pids.add(handle.info.remote().result(timeout_s=5)["pid"])
            except Exception:  # noqa: BLE001 - a replica being replaced may not answer
                pass
            time.sleep(0.5)
        assert len(pids) >= 2, "the broken replica was never replaced"
        replaced_after = time.monotonic() - started
    finally:
        serve.delete("fragile")
    record("broken onnxruntime session", "session set to None inside a running replica (health check every 1 s)",
           "health check failed; Serve replaced the replica", replaced_after,
           note="check_health runs a tiny real inference")


def test_liveness_stays_up_while_a_replica_loads_but_readiness_does_not(ray_serve, default_bundle):
    """Deploy an encoder that takes long to load, without waiting, and probe meanwhile."""
    from service.app import compose
    from service.config import ServiceSettings

    settings = ServiceSettings.model_validate({"bundle": str(default_bundle), "encoder_num_cpus": 0.5,
                                              "ingress_num_cpus": 0.25})
    app = compose(settings, serve.deployment(SlowToLoad, name="Encoder"))
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(__import__(__name__))
    deployer = threading.Thread(target=lambda: serve.run(app, name="slow", route_prefix="/slow",
                                                         logging_config={"enable_access_log": False}), daemon=True)
    deployer.start()
    url = f"{ray_serve.url}/slow"
    live_ok = not_ready = False
    deadline = time.monotonic() + 60
    try:
        with httpx.Client(base_url=url, timeout=10) as c:
            while time.monotonic() < deadline and not (live_ok and not_ready):
                try:
                    live = c.get("/v2/health/live")
                    ready = c.get("/v2/health/ready")
                except httpx.HTTPError:
                    time.sleep(0.3)
                    continue
                if live.status_code == 200 and ready.status_code == 503:
                    live_ok = not_ready = True
                time.sleep(0.3)
        assert live_ok and not_ready, "expected live=200 and ready=503 while the encoder loads"
        deployer.join(timeout=120)
        with httpx.Client(base_url=url, timeout=10) as c:
            assert c.get("/v2/health/ready").status_code == 200
    finally:
        serve.delete("slow")
    record("replica still loading", "an encoder whose start-up takes 15 s",
           "liveness 200, readiness 503 until loaded, then 200")


class SlowToLoad(Encoder.func_or_class):  # type: ignore[misc]
    def __init__(self, settings) -> None:
        time.sleep(15)
        super().__init__(settings)

