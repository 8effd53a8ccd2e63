"""A real redis-server on 127.0.0.1 (Debian's package: make test installs it), stopped and started again on the
same port at will: the rate-limit store of tests/test_quotas.py and tests/test_multinode.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from service.hosting.processes import free_port
from tests.waiting import wait_until


class Redis:
    def __init__(self, directory: Path) -> None:
        self.port, self.directory, self.proc = free_port(), directory, None
        self.uri = f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert shutil.which("redis-server"), "redis-server is missing: make test installs Debian's redis-server"
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.directory)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                                          text=True).stdout.strip() == "PONG", "redis-server to answer", timeout=20)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """One redis-server for a test module (imported by name where it is used), stopped whatever happens."""
    server = Redis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
