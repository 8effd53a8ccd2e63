"""Read Ray's Prometheus endpoint with prometheus_client's parser."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict:
    """{family name: family} of one scrape."""
    text = httpx.get(url, timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def total(families: dict, sample: str, **labels: str) -> float:
    """Sum of every sample named `sample` whose labels include `labels` (all replicas)."""
    family = families.get(_family_of(sample, families))
    if family is None:
        return 0.0
    return sum(
        s.value for s in family.samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _family_of(sample: str, families: dict) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_total", ""):
        name = sample.removesuffix(suffix) if suffix else sample
        if name in families:
            return name
    return sample


def poll(url: str, done: Callable[[dict], bool], what: str, timeout: float = 45) -> dict:
    """Scrape until `done(families)`, or fail after `timeout` saying what was awaited. Ray exports
    each family on its own schedule: `done` must cover every value the caller asserts on."""
    deadline = time.monotonic() + timeout
    families = scrape(url)
    while not done(families):
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what} at {url}; the last scrape did not show it")
        time.sleep(0.5)
        families = scrape(url)
    return families


def sample_names(families: dict) -> set[str]:
    return {s.name for f in families.values() for s in f.samples}


def settled(url: str, key: Callable[[dict], object], interval: float = 2.5, timeout: float = 45) -> dict:
    """Scrape until `key` reads the same on two scrapes more than one flush interval apart,
    so that a baseline does not still include earlier requests on their way to the exporter."""
    deadline = time.monotonic() + timeout
    families = scrape(url)
    while True:
        time.sleep(interval)
        again = scrape(url)
        if key(again) == key(families):
            return again
        if time.monotonic() > deadline:
            raise AssertionError(f"the metrics at {url} kept moving for {timeout:g} s: no baseline to measure from")
        families = again
