"""The two ways to start the service as a user does: `python -m service` (what `make run` runs)
and `serve run deploy/serve_config.yaml`; both answer over HTTP and stop cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def descendants(pid: int) -> set[int]:
    """Every process below pid (Ray's GCS, raylet and workers are children of the driver)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def still_running(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def assert_no_orphans(pids: set[int], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while still_running(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not still_running(pids), f"processes left behind: {sorted(still_running(pids))}"


def wait_for_health(url: str, proc: subprocess.Popen, timeout: float = 120) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the service exited early with {proc.returncode}"
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url}/health did not answer 200 within {timeout}s")


def collect(proc: subprocess.Popen) -> list[str]:
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return lines


def test_python_m_service_serves_and_stops_on_sigterm(default_bundle):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--config", str(ROOT / "deploy/serve_config.yaml"),
         "--bundle", str(default_bundle), "--port", str(port), "--num-cpus", "2",
         "--metrics-port", str(free_port())],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = collect(proc)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            health = wait_for_health(url, proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- service output ---\n{''.join(lines)[-4000:]}") from None
        assert health.json()["provider"] == "CPUExecutionProvider"
        spawned = descendants(proc.pid)
        assert spawned, "Ray should run in child processes"
        r = httpx.post(f"{url}/v1/encode", json={"inputs": ["started by python -m service"]}, timeout=30)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert f"at http://127.0.0.1:{port} on CPUExecutionProvider" in output
    assert "stopped" in output
    assert_no_orphans(spawned)


def test_python_m_service_refuses_a_bad_bundle_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "service", "--bundle", str(tmp_path / "missing")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "bundle directory does not exist" in result.stderr


def test_serve_run_with_the_config_file(default_bundle, tmp_path):
    config = yaml.safe_load((ROOT / "deploy/serve_config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["bundle"] = str(default_bundle)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_bin = Path(sys.executable).with_name("serve")
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen(
        [str(serve_bin), "run", "--address", "local", str(path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    collect(proc)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc)
        spawned = descendants(proc.pid)
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "started by serve run"}, timeout=30)
        assert r.status_code == 200
        assert httpx.get(f"{url}/v2/health/live", timeout=5).status_code == 200
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_no_orphans(spawned)


def test_sigterm_during_load_drains_in_flight_requests(default_bundle):
    from concurrent.futures import ThreadPoolExecutor

    from tests.reliability import record

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--bundle", str(default_bundle), "--port", str(port), "--num-cpus", "2",
         "--metrics-port", str(free_port()), "--replicas", "1", "--threads", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = collect(proc)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc)
        spawned = descendants(proc.pid)
        texts = [f"in-flight request text {i} " + "with several more words " * 10 for i in range(32)]

        def one(_: int) -> int:
            return httpx.post(f"{url}/v1/encode", json={"inputs": texts}, timeout=60).status_code

        with ThreadPoolExecutor(max_workers=6) as pool:
            futures = [pool.submit(one, i) for i in range(6)]
            time.sleep(0.5)  # all six are in flight or queued
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            statuses = [f.result() for f in futures]
        code = proc.wait(timeout=60)
        exit_s = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert statuses == [200] * 6, f"{statuses}\n{''.join(lines)[-3000:]}"
    assert code == 0 and exit_s < 20 + 30, (code, exit_s)  # graceful_shutdown_timeout_s is 20
    assert_no_orphans(spawned)
    record("SIGTERM during load", "SIGTERM to python -m service with 6 requests of 32 texts in flight",
           {"200": statuses.count(200)}, None, note=f"all drained; exited 0 after {exit_s:.1f} s")


def listening_sockets(pids: set[int]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket in LISTEN state owned by pids."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = local.split(":")
            raw = bytes.fromhex(hex_ip)
            if len(raw) == 4:
                address = ".".join(str(b) for b in raw[::-1])
            else:  # IPv6 in 4-byte little-endian words
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                address = ":".join(words[i : i + 2].hex() for i in range(0, 16, 2))
            name = Path(f"/proc/{inodes[inode]}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            found.append((name, address, int(hex_port, 16)))
    return found


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("0000:0000:0000:0000:0000:0000:0000:0001",) or (
        address.startswith("0000:0000:0000:0000:0000:ffff:7f")
    )


def test_ray_listens_on_loopback_only_under_python_m_service(default_bundle):
    """GCS, raylet, agents, metrics and the HTTP proxy of `make run` face loopback only."""
    from tests.reliability import record

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--bundle", str(default_bundle), "--port", str(port), "--num-cpus", "2",
         "--metrics-port", str(free_port()), "--replicas", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    collect(proc)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc)
        spawned = descendants(proc.pid) | {proc.pid}
        sockets = listening_sockets(spawned)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sockets, "found no listening socket at all"
    names = {name for name, _, _ in sockets}
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), names
    exposed = [s for s in sockets if not is_loopback(s[1]) and not s[0].startswith("ray::ServeReplica")]
    assert not exposed, f"listening beyond loopback: {exposed}"
    replica_ports = [s for s in sockets if not is_loopback(s[1])]
    record("Ray's own ports under make run", "every listening TCP socket of the service's processes, read from /proc",
           f"{len(sockets) - len(replica_ports)} loopback-only (GCS, raylet, agents, metrics, HTTP proxy); "
           f"{len(replica_ports)} on all interfaces (Serve replicas' own gRPC ports)",
           note="no dashboard, no Ray client server")


def test_python_m_service_with_the_haproxy_ingress(default_bundle):
    """--ingress haproxy: Ray Serve's HAProxy answers on the port, on loopback only, and stops with the rest."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--bundle", str(default_bundle), "--port", str(port), "--num-cpus", "2",
         "--metrics-port", str(free_port()), "--replicas", "1", "--ingress", "haproxy"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = collect(proc)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_health(url, proc)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- service output ---\n{''.join(lines)[-4000:]}") from None
        spawned = descendants(proc.pid) | {proc.pid}
        r = httpx.post(f"{url}/v1/encode", json={"inputs": ["through haproxy"]}, timeout=30)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        assert httpx.post(f"{url}/v1/encode", json={"inputs": []}, timeout=30).status_code == 422
        sockets = listening_sockets(spawned)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    on_port = [s for s in sockets if s[2] == port]
    assert on_port and all("haproxy" in name for name, _, _ in on_port), on_port
    assert all(is_loopback(address) for _, address, _ in on_port), on_port
    assert_no_orphans(spawned)
