"""Above capacity on purpose (`make loadtest-overload`): a shed request (429/503 with
Retry-After) is the expected answer, not a failure; anything else is."""

from __future__ import annotations

import random
import time

from locust import HttpUser, constant, task

from loadtests.common import CORPUS, LOCK, TOTALS, count, fail


class OverloadUser(HttpUser):
    """Client batches of 32 texts with no pause between requests, backing off as Retry-After
    asks when refused (as well-behaved clients do; without it, refusals alone saturate 2 cores)."""

    wait_time = constant(0)

    @task
    def burst(self) -> None:
        texts = random.sample(CORPUS, 32)
        with self.client.post("/v1/encode", json={"inputs": texts}, name="overload 32 texts", catch_response=True) as r:
            if r.status_code in (429, 503):
                r.request_meta["name"] = "overload shed (429/503)"  # accepted latencies stay apart
                with LOCK:
                    TOTALS["shed"] += 1
                    if not r.headers.get("Retry-After"):
                        TOTALS["shed_without_retry_after"] += 1
                        return r.failure(f"{r.status_code} without Retry-After")
                r.success()
                time.sleep(min(float(r.headers["Retry-After"]), 5.0))
                return None
            if r.status_code != 200 or len(r.json()["data"]) != len(texts):
                return fail(r, "status or shape")
            count(len(texts), r.json()["usage"]["tokens"])
