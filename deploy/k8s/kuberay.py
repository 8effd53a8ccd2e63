"""The pods KubeRay makes of a RayService, as container command lines: what `make containers` runs.

KubeRay (1.x) does not run a Ray pod's template as written: it replaces the Ray container's command
with `/bin/bash -lc -- "ulimit -n 65536; ray start ..."`, the flags being the group's rayStartParams
plus what it fills in (a worker's `--address` of the head's service, `--block`,
`--dashboard-agent-listen-port=52365`, `--metrics-export-port=8080`, and `--num-cpus`, `--memory` and
`--num-gpus` from the container's resource limits), adds environment variables (RAY_CLUSTER_NAME,
RAY_ADDRESS, RAY_PORT, RAY_IP and the like) and mounts a memory-backed /dev/shm for the object store.
This module does the same for a rendered manifest (deploy/k8s/rayservice-*.yaml) and writes the
`podman run` argv of each pod, so that the containers started here get the manifest's own command,
resources, environment and user: nothing is copied by hand. The tests check the argv against the
manifest (tests/test_deploy.py); deploy/image/containers.py runs it.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DASHBOARD_AGENT_PORT = 52365  # KubeRay's default, and the port the liveness probe asks
METRICS_PORT = 8080
GCS_PORT = 6379
# The container runtime here must not raise rlimits above the host's (docs/images.md): pass them
# explicitly. Kubernetes' runtimes set their own; this is the host's part, not the manifest's.
HOST_ULIMITS = ("nofile=16384:16384", "nproc=16384:16384")

_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(text: str | int | float) -> float:
    """A Kubernetes resource quantity ('4', '500m', '3Gi') as a number (cores or bytes)."""
    s = str(text)
    if s.endswith("m"):
        return float(s[:-1]) / 1000
    for unit, factor in _UNITS.items():
        if s.endswith(unit):
            return float(s[: -len(unit)]) * factor
    return float(s)


@dataclass
class Pod:
    """One Ray pod of a RayService as a container: its name, group, and the `podman run` argv."""

    name: str
    group: str  # "headgroup" or a worker group's name
    head: bool
    image: str
    ray_start: str  # the shell script KubeRay puts in args
    env: dict[str, str]
    cpus: float
    memory_bytes: int
    user: int
    fs_group: int | None
    workdir: str
    gpus: int = 0
    grace_s: int = 30
    liveness: list[str] = field(default_factory=list)
    pre_stop: list[str] = field(default_factory=list)
    container_ports: list[int] = field(default_factory=list)

    def run_argv(self, engine: str = "podman", network: str | None = None, aliases: tuple[str, ...] = (),
                 publish: dict[int, int] | None = None, runtime: str | None = "runc",
                 ulimits: tuple[str, ...] = HOST_ULIMITS) -> list[str]:
        """`podman run -d` for this pod. publish maps container ports to host ports on 127.0.0.1."""
        argv = [engine, *(["--runtime", runtime] if runtime else []), "run", "-d", "--name", self.name]
        argv += [f"--ulimit={u}" for u in ulimits]
        if network:
            argv += ["--network", network, *(f"--network-alias={a}" for a in aliases)]
        for container_port, host_port in (publish or {}).items():
            argv += ["-p", f"127.0.0.1:{host_port}:{container_port}"]
        argv += ["--user", str(self.user), *(["--group-add", str(self.fs_group)] if self.fs_group is not None else [])]
        argv += ["--cap-drop=ALL", "--security-opt=no-new-privileges"]  # drop ALL, allowPrivilegeEscalation false
        argv += [f"--cpus={self.cpus:g}", f"--memory={self.memory_bytes}"]
        # KubeRay's /dev/shm is a memory emptyDir: as large as the pod's memory allows
        argv += [f"--shm-size={self.memory_bytes}"]
        if self.gpus:
            argv += ["--device", "nvidia.com/gpu=all"]  # CDI, as the NVIDIA device plugin gives a pod its GPUs
        argv += ["--workdir", self.workdir, f"--stop-timeout={self.grace_s}"]
        if self.liveness:  # the liveness probe as the container's health check (podman healthcheck run)
            argv += ["--health-cmd", json.dumps(self.liveness)]
        for key, value in self.env.items():
            argv += ["-e", f"{key}={value}"]
        argv += ["--entrypoint", json.dumps(["/bin/bash", "-lc", "--"]), self.image, self.ray_start]
        return argv


def ray_start(params: dict[str, str], head: bool, limits: dict, head_service: str) -> str:
    """The `ray start` script KubeRay writes for a group: its rayStartParams and what KubeRay fills in."""
    params = {k: str(v) for k, v in params.items()}
    if not head:
        params.setdefault("address", f"{head_service}:{params.get('port', GCS_PORT)}")
    params.setdefault("metrics-export-port", str(METRICS_PORT))
    params.setdefault("block", "true")
    params.setdefault("dashboard-agent-listen-port", str(DASHBOARD_AGENT_PORT))
    if "cpu" in limits:
        params.setdefault("num-cpus", str(math.ceil(quantity(limits["cpu"]))))
    if "memory" in limits:
        params.setdefault("memory", str(int(quantity(limits["memory"]))))
    gpus = [v for k, v in limits.items() if k.endswith("gpu")]
    if gpus:
        params.setdefault("num-gpus", str(int(quantity(gpus[0]))))
    flags = []
    for key in sorted(params):
        value = params[key]
        if value.lower() == "true" and key in ("block", "no-monitor"):
            flags.append(f"--{key}")
        else:
            flags.append(f"--{key}={shlex.quote(value)}")
    return f"ulimit -n 65536; ray start {'--head ' if head else ''}{' '.join(flags)}"


def pods(manifest: dict, image: str | None = None, workers: int | None = None) -> list[Pod]:
    """The head pod and each worker group's pods (its `replicas`, or `workers`) of a RayService."""
    name = manifest["metadata"]["name"]
    cluster = manifest["spec"]["rayClusterConfig"]
    head_service = f"{name}-head-svc"
    out = []
    groups = [("headgroup", True, cluster["headGroupSpec"], 1)]
    groups += [(g["groupName"], False, g, workers if workers is not None else g.get("replicas", 1))
               for g in cluster.get("workerGroupSpecs", [])]
    for group, head, spec, count in groups:
        template = spec["template"]["spec"]
        container = template["containers"][0]
        limits = container.get("resources", {}).get("limits", {})
        security = {**template.get("securityContext", {}), **container.get("securityContext", {})}
        script = ray_start(spec.get("rayStartParams", {}), head, limits, head_service)
        liveness = container.get("livenessProbe", {}).get("exec", {}).get("command", [])
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        for i in range(count):
            pod_name = f"{name}-head" if head else f"{name}-{group}-{i}"
            env = {e["name"]: str(e["value"]) for e in container.get("env", [])}
            # what KubeRay adds to the Ray container's environment
            env.update({
                "RAY_CLUSTER_NAME": name,
                "RAY_CLOUD_INSTANCE_ID": pod_name,
                "RAY_NODE_TYPE_NAME": group,
                "KUBERAY_GEN_RAY_START_CMD": script.split("; ", 1)[1],
                "RAY_PORT": str(GCS_PORT),
                "RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}" if head else f"{head_service}:{GCS_PORT}",
                "RAY_USAGE_STATS_KUBERAY_IN_USE": "1",
                **({} if head else {"FQ_RAY_IP": head_service, "RAY_IP": head_service}),
            })
            out.append(Pod(
                name=pod_name, group=group, head=head,
                image=image or container["image"], ray_start=script, env=env,
                cpus=quantity(limits.get("cpu", 1)), memory_bytes=int(quantity(limits.get("memory", "1Gi"))),
                user=int(security.get("runAsUser", 1000)), fs_group=template.get("securityContext", {}).get("fsGroup"),
                workdir=container.get("workingDir", "/"),
                gpus=sum(int(quantity(v)) for k, v in limits.items() if k.endswith("gpu")),
                grace_s=int(template.get("terminationGracePeriodSeconds", 30)),
                liveness=liveness, pre_stop=pre_stop,
                container_ports=[p["containerPort"] for p in container.get("ports", [])],
            ))
    return out


def load(variant: str = "cpu") -> dict:
    """A rendered RayService manifest (deploy/k8s/rayservice-{variant}.yaml)."""
    return yaml.safe_load((HERE / f"rayservice-{variant}.yaml").read_text())


def head_service(manifest: dict) -> str:
    return f"{manifest['metadata']['name']}-head-svc"


def local_image(image: str) -> str:
    """The manifest's REGISTRY/... image as `make image` tags it (localhost/...)."""
    return re.sub(r"^REGISTRY/", "localhost/", image)


if __name__ == "__main__":  # print the command lines, e.g. python deploy/k8s/kuberay.py gpu
    import sys

    manifest = load(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    for pod in pods(manifest):
        print(shlex.join(pod.run_argv(network="mha-encoder", aliases=(head_service(manifest),) if pod.head else ())))
