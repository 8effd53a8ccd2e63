"""The metric Recorder (service/observability/metrics.py): the request path queues its counter and histogram
records, and a thread of the process records them in Ray each second. What Prometheus then sees is checked
against the real service in test_metrics.py (families move by exactly what was sent); here, what the flush
makes of the queue, and what no flush may do: lose a record silently, stop at a bad one, grow without bound."""

from __future__ import annotations

import threading
import time

import pytest

from service.observability import metrics as metrics_module
from service.observability.metrics import Deferred, Recorder


class Family:
    """Stands where a Ray family would: what the flush calls, with what."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[float, dict | None]] = []
        self.fail_on = fail_on
        self.threads: set[str] = set()

    def _call(self, value: float, tags: dict | None = None) -> None:
        self.threads.add(threading.current_thread().name)
        if self.fail_on is not None and tags and tags.get("route") == self.fail_on:
            raise ValueError("a tag set this family refuses")
        self.calls.append((value, tags))

    inc = observe = _call


def recorder() -> Recorder:
    return Recorder(period_s=3600)  # no periodic flush during the test: it flushes by hand


def test_counters_are_summed_per_tag_set_and_histograms_observed_value_by_value():
    r = recorder()
    counter, histogram = Family(), Family()
    requests, duration = Deferred(counter, r), Deferred(histogram, r)
    for i in range(1000):
        requests.inc(tags={"route": "/v1/embeddings", "status_class": "2xx" if i % 10 else "4xx"})
        duration.observe(i / 1000, tags={"route": "/v1/embeddings", "stage": "total"})
    requests.inc(5, tags={"status_class": "2xx", "route": "/v1/embeddings"})  # same tag set, another key order
    assert counter.calls == [] and histogram.calls == []  # queued: nothing reached the families yet
    r.flush()
    assert sorted((v, t["status_class"]) for v, t in counter.calls) == [(100.0, "4xx"), (905.0, "2xx")]
    assert [v for v, _ in histogram.calls] == [i / 1000 for i in range(1000)]
    assert len(r.pending) == 0
    r.flush()  # an empty queue records nothing more
    assert len(counter.calls) == 2 and len(histogram.calls) == 1000


def test_a_bad_record_is_logged_and_the_rest_still_recorded(caplog):
    r = recorder()
    family = Family(fail_on="/bad")
    d = Deferred(family, r)
    d.observe(1.0, tags={"route": "/bad"})
    d.observe(2.0, tags={"route": "/good"})
    d.inc(3.0, tags={"route": "/bad"})
    d.inc(4.0, tags={"route": "/good"})
    r.flush()
    assert sorted(v for v, _ in family.calls) == [2.0, 4.0]
    assert sum("a metric record failed" in m for m in caplog.messages) == 2


def test_past_the_limit_records_are_dropped_counted_and_the_count_recorded(monkeypatch):
    monkeypatch.setattr(metrics_module, "PENDING_LIMIT", 50)
    r = recorder()
    family, dropped = Family(), Family()
    r.dropped_family = dropped
    d = Deferred(family, r)
    for _ in range(80):
        d.observe(0.5)
    assert len(r.pending) == 50 and r.dropped == 30
    r.flush()
    assert len(family.calls) == 50 and dropped.calls == [(30, None)] and r.dropped == 0


def test_the_recorder_thread_records_within_its_period_off_the_callers_thread():
    r = Recorder(period_s=0.05)
    family = Family()
    Deferred(family, r).inc(7, tags={"route": "/x"})
    deadline = time.monotonic() + 5
    while not family.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert family.calls == [(7.0, {"route": "/x"})]
    assert family.threads == {"metrics-flush"}  # never the thread that made the record


@pytest.mark.parametrize("name", ["requests", "failures", "duration", "response_bytes", "batch_requests",
                                  "batch_tokens", "padding_ratio", "tokens", "padded_tokens", "inference_runs"])
def test_every_counter_and_histogram_of_the_service_is_deferred(name):
    families = metrics_module.service_metrics()
    assert isinstance(getattr(families, name), Deferred)
    assert getattr(families, name).recorder is families.recorder
