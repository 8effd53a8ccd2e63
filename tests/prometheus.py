"""A real Prometheus (Debian's `prometheus` package) on loopback, for the tests and `make soak`.

It scrapes the given targets with a generated config, keeps its data in a temporary directory,
loads the alert rules of deploy/prometheus-rules.yaml, and is always stopped. `make prometheus`
installs the package when it is missing; without it these tests fail with one line naming it.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from service.hosting.processes import free_port
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "prometheus"
MISSING = ("Debian's package `prometheus` (prometheus and promtool) is not installed: "
           "make prometheus (or apt-get install prometheus)")


class PrometheusMissing(RuntimeError):
    """prometheus or promtool is not on the PATH."""


def binary(name: str) -> str:
    """The path of `prometheus` or `promtool`, or PrometheusMissing saying which package to install."""
    path = shutil.which(name)
    if path is None:
        raise PrometheusMissing(f"{name} not found; {MISSING}")
    return path


def _rules_module():
    spec = importlib.util.spec_from_file_location("deploy_prometheus_rules", ROOT / "deploy" / "prometheus" / "rules.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_rules(directory: Path) -> Path:
    """The bare rule groups of deploy/prometheus-rules.yaml, as DIR/rules.yaml."""
    return _rules_module().write_rules(directory)


def scrape_config(targets: dict[str, str], interval: str, rule_files: list[Path]) -> dict:
    """A Prometheus config scraping each {job: metrics URL} every `interval`."""
    jobs = []
    for job, url in targets.items():
        parts = urlsplit(url)
        jobs.append({"job_name": job, "metrics_path": parts.path or "/metrics", "scheme": parts.scheme or "http",
                     "static_configs": [{"targets": [parts.netloc]}]})
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": jobs,
    }


class Prometheus:
    """One Prometheus process: start() waits until it is ready, stop() always ends it."""

    def __init__(self, targets: dict[str, str], workdir: Path | None = None, interval: str = "1s",
                 rules: bool = True) -> None:
        self.targets = targets
        self.interval = interval
        self.rules = rules
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="prometheus-")
        self.workdir = Path(workdir or self._tmp.name)
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout: float = 60) -> Prometheus:
        exe = binary("prometheus")
        self.workdir.mkdir(parents=True, exist_ok=True)
        rule_files = [write_rules(self.workdir)] if self.rules else []
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(self.targets, self.interval, rule_files), sort_keys=False))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = self.workdir / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [exe, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1d", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus not ready within {timeout:g} s: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the HTTP API ---------------------------------------------------------------------------
    def api(self, path: str, **params: object) -> dict | list:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query: [{"metric": {...}, "value": [t, "v"]}, ...] (a scalar as one element)."""
        data = self.api("query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The single value of an instant query, None if it returned nothing."""
        result = self.query(expr, at)
        if not result:
            return None
        if len(result) > 1:
            raise AssertionError(f"{expr} returned {len(result)} series, expected one")
        return float(result[0]["value"][1])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """A range query: [{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
        return self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")["result"]

    def wait_for_targets(self, timeout: float = 60) -> None:
        """Until every target has been scraped successfully at least once."""
        def healthy() -> bool:
            active = self.api("targets")["activeTargets"]
            return len(active) == len(self.targets) and all(t["health"] == "up" for t in active)

        wait_until(healthy, f"every scrape target of {self.url} to be up", timeout, interval=0.5,
                   last=lambda: str([(t["scrapeUrl"], t["health"], t["lastError"]) for t in self.api("targets")["activeTargets"]]))


def finite(result: list[dict]) -> bool:
    """Whether an instant query's result holds at least one number that is not NaN or infinite."""
    return any(math.isfinite(float(r["value"][1])) for r in result)
