"""A real multi-node Ray cluster on loopback: a head node and worker nodes started with `ray start`,
each its own raylet with its own ports and temp dir, as on separate machines; torn down by killing
every process of the cluster (never `ray stop`, which would stop every Ray on the machine)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from service.hosting import processes

# `ray start` for a cluster of nodes on one machine's loopback. Ray 2.60 lets worker nodes join only
# with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, and with it rewrites a node address of 127.0.0.1 into the
# machine's network address (services.resolve_ip_for_localhost), where its daemons then listen, as do
# processes that look their address up again (the dashboard's). So the switch is on only inside
# `ray start` itself, and the address is kept: every process of the cluster sees it off and binds
# 127.0.0.1, as each pod binds its own IP on Kubernetes.
RAY = [sys.executable, "-c", "import sys; import ray._private.ray_constants as c; c.ENABLE_RAY_CLUSTER = True; "
       "import ray._private.services as s; s.resolve_ip_for_localhost = lambda host: host; "
       "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())"]
SERVE = str(Path(sys.executable).with_name("serve"))
ROOT = Path(__file__).resolve().parents[1]


def kill_all(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def tree_of(text: str) -> set[int]:
    """The processes whose command line mentions `text`, and every process they started."""
    own = pids_with(text)
    return own.union(*(processes.descendants(p) for p in own)) if own else set()


def pids_with(text: str) -> set[int]:
    """Processes whose command line mentions `text` (a node's temp dir names all of its daemons)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    found.add(int(entry))
            except OSError:
                continue
    return found


@dataclass
class Node:
    index: int
    temp_dir: Path
    metrics_port: int
    head: bool = False

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def processes(self) -> set[int]:
        """The node's daemons (raylet, agents; the head's GCS and dashboard) and everything they started."""
        return tree_of(str(self.temp_dir) + "/")


@dataclass
class LoopbackCluster:
    """`ray start --head` plus `ray start --address` per worker, every port free and on 127.0.0.1."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mharay-", dir="/tmp")))
    nodes: dict[int, Node] = field(default_factory=dict)
    gcs_port: int = 0
    dashboard_port: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A cluster of its own: its own token, Ray Serve's fixed ports moved to free ones, the proxy
        # actor as ingress (every node of this cluster shares one IP address, so the per-node
        # HAProxy and the replicas' direct ports of a real cluster would collide here).
        self.env = {
            **os.environ,
            **processes.local_cluster_ports(),
            "RAY_SERVE_ENABLE_HA_PROXY": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ADDRESS": "",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # on inside `ray start` alone (RAY, above)
        }

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start_node(self, index: int, head: bool = False, num_cpus: int = 1) -> Node:
        """Start one node (the head runs no replicas: 0 CPUs) and return it once `ray start` has."""
        temp_dir = self.root / f"n{index}-{int(time.monotonic() * 1000) % 100000}"
        node = Node(index, temp_dir, processes.free_port(), head)
        low = processes.free_port_range(64)
        args = [
            *RAY, "start", "--node-ip-address", "127.0.0.1", "--temp-dir", str(temp_dir), "--disable-usage-stats",
            "--metrics-export-port", str(node.metrics_port),
            "--dashboard-agent-listen-port", str(processes.free_port()),
            "--dashboard-agent-grpc-port", str(processes.free_port()),
            "--runtime-env-agent-port", str(processes.free_port()),
            "--node-manager-port", str(processes.free_port()),
            "--object-manager-port", str(processes.free_port()),
            "--min-worker-port", str(low), "--max-worker-port", str(low + 63),
        ]
        if head:
            self.gcs_port, self.dashboard_port = processes.free_port(), processes.free_port()
            args += ["--head", "--port", str(self.gcs_port), "--num-cpus", "0", "--include-dashboard", "true",
                     "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
                     "--ray-client-server-port", str(processes.free_port()),  # Ray always starts it
                     "--system-config", json.dumps({"metrics_report_interval_ms": 1000})]
        else:
            args += ["--address", f"127.0.0.1:{self.gcs_port}", "--num-cpus", str(num_cpus)]
        result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=180, cwd=ROOT)
        if result.returncode != 0:
            raise RuntimeError(f"ray start of node {index} failed: {result.stderr[-2000:]}")
        self.nodes[index] = node
        return node

    def kill_node(self, index: int) -> int:
        """SIGKILL a node's raylet, agents and workers (its replicas): the machine is gone. Returns the count."""
        node = self.nodes.pop(index)
        doomed = node.processes()
        kill_all(doomed)
        return len(doomed)

    def serve_deploy(self, config: Path) -> None:
        """`serve deploy` against the head's dashboard, as a cluster user (and KubeRay) applies a config."""
        result = subprocess.run([SERVE, "deploy", str(config), "--address", self.dashboard], env=self.env,
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        if result.returncode != 0:
            raise RuntimeError(f"serve deploy failed: {result.stderr[-2000:]}")

    def processes_of_cluster(self) -> set[int]:
        """Every process of the cluster: the node daemons name their temp dir, the Ray client server,
        started apart from them, only the GCS address; and all they started."""
        return tree_of(str(self.root) + "/") | tree_of(f"127.0.0.1:{self.gcs_port}")

    def shutdown(self) -> set[int]:
        """Kill every process of the cluster; returns those still alive afterwards (none, or a bug)."""
        doomed = self.processes_of_cluster()  # the client server outlived it otherwise, parent 1
        kill_all(doomed)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(processes.alive(p) for p in doomed):
            time.sleep(0.1)
        shutil.rmtree(self.root, ignore_errors=True)
        return {p for p in doomed if processes.alive(p)}
