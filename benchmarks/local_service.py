"""`python -m service` as a user starts it, for the scripts that measure or check a running service
(make gpu-check, make loop-stall): on free ports of its own, waited for until it says it serves,
stopped with SIGTERM as an orchestrator stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from service.hosting.processes import free_port, local_cluster_ports

ROOT = Path(__file__).resolve().parents[1]


class LocalService:
    """One `python -m service --bundle B --replicas 1 [flags]`; its output lines are kept in `lines`."""

    def __init__(self, bundle: Path, *flags: str) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--bundle", str(bundle), "--port", str(port), "--replicas", "1",
             "--metrics-port", str(free_port()), "--grpc-port", str(free_port()), *flags],
            cwd=ROOT, env={**os.environ, **local_cluster_ports()},  # never another cluster's Serve ports
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def ready(self, timeout_s: float) -> bool:
        """True once it printed its start-up summary; False if it exited or took longer."""
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith("serving ") for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.5)
        return True

    def stop(self) -> int | str:
        """SIGTERM; its exit code, or why there is none."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return "none: killed after 120 s"
