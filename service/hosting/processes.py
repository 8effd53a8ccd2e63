"""Processes and ports, read from /proc: who holds a port, what a process started, and Ray's
HAProxy children that outlive their cluster (they keep the port, and the next start fails)."""

from __future__ import annotations

import os
import random
import signal
import socket
import time
from pathlib import Path


# free_port's ports lie above what free_port_range hands out (20000-30000) and Ray Serve's default
# replica ports (30000-31000), and below the kernel's ephemeral range
FREE_PORT_LOW = 31000
_taken: set[int] = set()  # ports free_port handed out in this process: never twice
# the single ports local_cluster_ports hands a cluster through the environment: a child process that inherits
# them (a benchmark's phase) must not choose one of them again before HAProxy binds it
CLUSTER_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


def _reserved_by_environment() -> set[int]:
    return {int(v) for k in CLUSTER_PORT_ENV if (v := os.environ.get(k, "")).isdigit()}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on every interface right now, below the kernel's ephemeral range. Between
    choosing a port and binding it (Ray and HAProxy take seconds to start), the kernel may hand a
    port of that range to any process that binds port 0 or connects out, as Ray's workers do; HAProxy
    then fails to start ("cannot bind socket (Address already in use)"). Never a port this process
    handed out before, nor one the environment gives a cluster (CLUSTER_PORT_ENV: chosen by a parent
    process, not bound until HAProxy starts). The kernel's own choice only where that range leaves no
    room below it."""
    rng, high = random.Random(), _ephemeral_low()
    reserved = _taken | _reserved_by_environment()
    for _ in range(200 if high - FREE_PORT_LOW >= 100 else 0):
        port = rng.randrange(FREE_PORT_LOW, high)
        if port in reserved:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _taken.add(port)
        return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def free_port_range(size: int, low: int = 20000, high: int = 30000) -> int:
    """The first port of `size` consecutive ports that are free right now, below the kernel's
    ephemeral range (so connections it hands out do not take them meanwhile)."""
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(low, high - size)
        try:
            held = []
            for port in range(start, start + size):
                s = socket.socket()
                held.append(s)
                s.bind(("", port))
            return start
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {size} consecutive free ports between {low} and {high}")


def local_cluster_ports() -> dict[str, str]:
    """Ray Serve's own fixed ports, made free ones: the environment for a local cluster.

    With HAProxy, Ray Serve listens on fixed ports on every node: HAProxy's stats page (8404) and
    Prometheus endpoint (9101), the fallback proxy (8500, 9500), and replicas' own HTTP and gRPC
    ports from 30000 and 40000 (bound with SO_REUSEPORT). Two clusters on one machine, two
    `make run`s or a test suite beside a running service, would share them, and traffic sent to
    one would reach the other's replicas. Its stats and metrics ports also listen on every
    interface: service/hosting/listeners.py puts them on the HTTP host.
    """
    from service.hosting.listeners import haproxy_on_http_host_env

    http, grpc = free_port_range(64), free_port_range(64)
    return {
        **haproxy_on_http_host_env(),  # HAProxy's stats and metrics ports on the HTTP host too
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http + 63),
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc + 63),
    }


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def cmdline(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every process below pid (Ray's GCS, raylet, workers and their HAProxy are below the driver)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def listening_pids(port: int) -> set[int]:
    """Processes with a TCP socket listening on `port` (any address)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    pids = set()
    if not inodes:
        return pids
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    pids.add(int(entry.name))
                    break
        except OSError:
            continue
    return pids


def is_ray_haproxy(pid: int) -> bool:
    """A HAProxy that Ray Serve started (its config lies under Ray Serve's haproxy-serve directory)."""
    args = cmdline(pid)
    return bool(args) and Path(args[0]).name == "haproxy" and any("haproxy-serve" in a for a in args[1:])


def left_behind(pid: int) -> bool:
    """A Ray Serve HAProxy whose manager (the `ray::HAProxyManager` actor that started it) is gone."""
    stat = _stat(pid)
    if stat is None or not is_ray_haproxy(pid):
        return False
    parent = cmdline(stat[1])
    return not (alive(stat[1]) and parent and parent[0].startswith("ray::HAProxyManager"))


def stop(pids: set[int], timeout: float = 5.0) -> set[int]:
    """SIGTERM, then SIGKILL what is still there after `timeout`; returns the pids that were running."""
    running = {p for p in pids if alive(p)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in running:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while any(alive(p) for p in running) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not any(alive(p) for p in running):
            break
    return running


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
            found.append((Path(cmdline(inodes[inode])[0] if cmdline(inodes[inode]) else "?").name,
                          address, int(hex_port, 16)))
    return found


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("0000:0000:0000:0000:0000:0000:0000:0001",) or (
        address.startswith("0000:0000:0000:0000:0000:ffff:7f")
    )
