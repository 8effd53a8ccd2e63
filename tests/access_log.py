"""The service's access log as a replica writes it: one JSON line per request on the replica's stderr,
which Ray keeps in the worker's log file under its session directory (docs/operations.md, "Request ids
and the access log"). Tests read the real file, not a logger they attach."""

from __future__ import annotations

import glob
import json
import os

import httpx

from tests.waiting import wait_until


def replica_log_file(app_url: str) -> str:
    """The stderr file of the replica that answers `app_url` (an app of one replica): Ray names a worker's
    files after its pid, which the replica reports on /info."""
    import ray

    pid = httpx.get(f"{app_url}/info", timeout=30).json()["replica"]["pid"]
    logs = ray._private.worker._global_node.get_logs_dir_path()  # this session's, not session_latest's
    found = glob.glob(os.path.join(logs, f"worker-*-{pid}.err"))
    assert len(found) == 1, (pid, found)
    return found[0]


def lines_of(path: str) -> list[dict]:
    out = []
    with open(path, errors="replace") as fh:
        for line in fh:
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return out


def access_line(app_url: str, request_id: str, timeout: float = 30) -> dict:
    """The one access log line of the request `request_id` (written as the request ends, so waited for)."""
    path = replica_log_file(app_url)

    def found():
        lines = [line for line in lines_of(path) if line.get("id") == request_id]
        return lines or None

    lines = wait_until(found, f"the access log line of request {request_id!r} in {path}", timeout=timeout, interval=0.2)
    assert len(lines) == 1, lines
    return lines[0]
