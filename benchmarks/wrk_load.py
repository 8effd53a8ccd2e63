"""A cheap load generator for single-text requests: wrk (Debian's package `wrk`) with a Lua script.

The Python clients (httpx, locust) cost 2.5-5 ms of CPU per request on the same cores as the
server, which hides most of the server's own cost at small requests; wrk costs a fraction of that.
The script (written next to the request bodies in a scratch folder) POSTs JSON bodies cycling
through a file of bodies, one request per line, and its `done()` prints one JSON line: requests,
duration, non-2xx responses, socket errors and wrk's latency percentiles.

    run_wrk(url, path, bodies, connections=32, duration_s=15) -> {"requests", "texts_s", "p50", ...}
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import tempfile
from pathlib import Path

PACKAGE = "wrk"  # Debian's package name

# One body per line (JSON has no raw newlines), cycled through by every connection; each wrk
# thread has its own Lua state, so each starts at a different offset of the same list.
LUA = r"""
local bodies = {}
for line in io.lines(os.getenv("WRK_BODIES")) do bodies[#bodies + 1] = line end
assert(#bodies > 0, "no request bodies")
local path = os.getenv("WRK_PATH")
local headers = {["Content-Type"] = "application/json"}
local counter = 0
local threads = {}

function setup(thread)
  thread:set("offset", #threads * 7919)
  table.insert(threads, thread)
end

function init(args)
  counter = offset or 0
end

function request()
  counter = counter + 1
  return wrk.format("POST", path, headers, bodies[(counter % #bodies) + 1])
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "bytes": %d, "non2xx": %d, "connect": %d, "read": %d, ' ..
    '"write": %d, "timeout": %d, "p50_us": %.1f, "p95_us": %.1f, "p99_us": %.1f, "max_us": %.1f, ' ..
    '"mean_us": %.1f}\n',
    summary.requests, summary.duration, summary.bytes, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(95), latency:percentile(99), latency.max, latency.mean))
end
"""


def ensure_wrk(progress=print) -> str:
    """The wrk binary: on the PATH, or installed from Debian's package when apt-get is there;
    otherwise SystemExit with one line naming the package."""
    found = shutil.which("wrk")
    if found:
        return found
    if not shutil.which("apt-get"):
        raise SystemExit(f"wrk not found and no apt-get here: install the package `{PACKAGE}` (Debian/Ubuntu: apt-get install {PACKAGE})")
    progress(f"  installing the load generator: apt-get install -y {PACKAGE}", flush=True)
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", PACKAGE]):
        result = subprocess.run(cmd, capture_output=True, text=True, env={"DEBIAN_FRONTEND": "noninteractive",
                                                                            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"`{' '.join(cmd)}` failed ({tail[0]}): install the package `{PACKAGE}` by hand")
    found = shutil.which("wrk")
    if not found:
        raise SystemExit(f"apt-get installed `{PACKAGE}` but no wrk is on the PATH")
    return found


def run_wrk(url: str, path: str, bodies: list[str], connections: int, duration_s: float,
            threads: int | None = None, warmup_s: float = 0.0, timeout_s: int = 30) -> dict:
    """Drive POST `url``path` with `bodies` (JSON strings) from `connections` connections for
    `duration_s` seconds (after `warmup_s` seconds whose results are dropped). Returns requests,
    texts_s (2xx answers per second), failures (non-2xx + socket errors), p50/p95/p99 in ms, and
    load_cpu_s: the CPU seconds wrk itself used in the measured run."""
    binary = ensure_wrk()
    threads = max(1, min(threads or 2, connections))
    with tempfile.TemporaryDirectory(prefix="bench-wrk-") as scratch:
        script, body_file = Path(scratch) / "post.lua", Path(scratch) / "bodies.jsonl"
        script.write_text(LUA)
        for b in bodies:
            if "\n" in b:
                raise ValueError("a request body must be one line")
        body_file.write_text("\n".join(bodies) + "\n")
        env = {"WRK_BODIES": str(body_file), "WRK_PATH": path, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}

        def once(seconds: float) -> tuple[dict, float]:
            cmd = [binary, "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(seconds))}s",
                   "--timeout", f"{timeout_s}s", "-s", str(script), url.rstrip("/")]
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=seconds + timeout_s + 30)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            line = next((s for s in reversed(result.stdout.splitlines()) if s.startswith("{")), None)
            if result.returncode != 0 or line is None:
                tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
                raise RuntimeError(f"wrk failed (exit {result.returncode}): {' | '.join(tail)}")
            return json.loads(line), cpu

        if warmup_s > 0:
            once(warmup_s)
        stats, cpu = once(duration_s)
    seconds = stats["duration_us"] / 1e6
    errors = stats["connect"] + stats["read"] + stats["write"] + stats["timeout"]
    ok = stats["requests"] - stats["non2xx"]
    return {
        "requests": stats["requests"],
        "duration_s": seconds,
        "texts_s": ok / seconds if seconds else 0.0,
        "failures": stats["non2xx"] + errors,
        "non2xx": stats["non2xx"],
        "socket_errors": errors,
        "p50": stats["p50_us"] / 1000,
        "p95": stats["p95_us"] / 1000,
        "p99": stats["p99_us"] / 1000,
        "load_cpu_s": cpu,
        "wrk_threads": threads,
        "connections": connections,
    }


def wrk_version() -> str:
    """wrk's version as it prints it, e.g. 4.1.0 (Debian's build says debian/4.1.0-3+b2)."""
    binary = shutil.which("wrk")
    if not binary:
        return "(not installed)"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.split()
    return out[1].removeprefix("debian/") if len(out) > 1 else "?"
