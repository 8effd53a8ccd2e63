"""The one way tests (and the soak runner) wait: for exactly what they assert, with a bound and a
message that says what was awaited. No pytest import, so the soak CLI can use it too."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], what: str, timeout: float = 60, interval: float = 0.2,
               last: Callable[[], str] | None = None):
    """Poll `condition()` until it returns something truthy (returned), or fail after `timeout`
    seconds saying what was awaited and what was last seen (`last()`, or the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"last: {last()}" if last else f"last check: {value!r}"
            raise AssertionError(f"waited {timeout:g} s for {what}; it did not happen ({detail})")
        time.sleep(interval)
