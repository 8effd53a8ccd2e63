"""What the locust files share: the corpus, response checks and the texts/tokens totals.

No User classes here: locust runs every User class it finds in a locustfile's namespace.
"""

from __future__ import annotations

import json
import os
import threading

from locust import events

from benchmarks.corpus import multilingual

MODEL = os.environ.get("LOADTEST_MODEL", "all-MiniLM-L6-v2")
HIDDEN = int(os.environ.get("LOADTEST_HIDDEN", "384"))
CORPUS = multilingual(4000, seed=7)
SHORT = [t for t in CORPUS if len(t) < 120]
TOTALS = {"texts": 0, "tokens": 0, "shed": 0, "shed_without_retry_after": 0}
LOCK = threading.Lock()


def count(texts: int, tokens: int) -> None:
    with LOCK:
        TOTALS["texts"] += texts
        TOTALS["tokens"] += tokens


@events.quitting.add_listener
def _write_totals(environment, **_: object) -> None:
    path = os.environ.get("LOADTEST_TOTALS")
    if path:
        with open(path, "w") as fh:
            json.dump(TOTALS, fh)


def fail(response, why: str) -> None:
    response.failure(f"{response.status_code}: {why}: {response.text[:200]}")
