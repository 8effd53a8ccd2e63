"""Smoke test of a built image: for the CUDA image, the CUDA library step (python -m service.runtimes.cuda
--libraries) from the image's filesystem; then start the service from the image's own filesystem, call
/v2/health/ready and /v1/embeddings, stop it with SIGTERM and check that nothing is left running;
then start Ray the way KubeRay does (`/bin/bash -lc -- "ray start ..."`, as uid 1000) and ask it
the manifests' liveness probe (wget .../api/local_raylet_healthz).

`podman --runtime runc run --ulimit ...` (or docker run) where containers can run; where they cannot,
a writable container filesystem (`podman create` + `podman mount`) entered with chroot as the image's user, in a private mount namespace with /proc, /dev and /sys, on the host's
loopback. Standard library only. Usable alone: python deploy/image/smoke.py IMAGE
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

READY_TIMEOUT_S = 300  # Ray start-up plus loading the bundle; minutes on a busy two-core machine
STOP_TIMEOUT_S = 120  # the replica's graceful shutdown (20 s in the Serve config) and Ray's own
TEXT = "The image serves this sentence."
HIDDEN = 384  # all-MiniLM-L6-v2
POD_UID = 1000  # the manifests' runAsUser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def http(method: str, url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    """(status, body) of one request; status 0 when nothing answers."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout):
        return 0, b""


# A container's runtime must not raise the rlimits above the host's here (crun and runc both fail at
# setrlimit otherwise): podman runs containers with Debian's runc and these limits (docs/images.md).
ULIMITS = ("nofile=16384:16384", "nproc=16384:16384")


def run_prefix(engine: str) -> list[str]:
    """`ENGINE run` as containers run here: runc (podman's default crun failed) and explicit rlimits."""
    runtime = ["--runtime", "runc"] if engine == "podman" and shutil.which("runc") else []
    return [engine, *runtime, "run", *(f"--ulimit={u}" for u in ULIMITS)]


def container_run_works(engine: str, image: str) -> tuple[bool, str]:
    """Whether `ENGINE run` works here, and the engine's last line when it does not."""
    probe = subprocess.run([*run_prefix(engine), "--rm", "--network", "none", "--entrypoint", "true", image],
                           capture_output=True, text=True, timeout=120)
    why = (probe.stderr or probe.stdout).strip().splitlines()[-1:] or [f"exit {probe.returncode}"]
    return probe.returncode == 0, why[0]


def processes_under(root: Path) -> list[tuple[int, str]]:
    """Processes whose root directory is the image's filesystem: what a stopped service left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "root") == str(root):
                    found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]))
            except OSError:
                continue
    return found


class Runner:
    """Runs commands from the image: `ENGINE run --network host` where containers can run, else chroot
    into a writable container filesystem as the image's user (or a given uid)."""

    def __init__(self, engine: str, image: str):
        self.engine, self.image = engine, image
        self.container = f"mha-encoder-smoke-{os.getpid()}"
        self.runs = 0
        self.config = json.loads(self._engine("image", "inspect", image))[0].get("Config") or {}
        self.root: Path | None = None
        works, why = container_run_works(engine, image)
        if works:
            self.mode = f"{' '.join(run_prefix(engine))} --network host"
        else:
            self.mode = f"chroot into the mounted image filesystem (containers cannot run here: {why})"
            self._engine("create", "--name", self.container, image)
            self.root = Path(self._engine("mount", self.container))

    def _engine(self, *args: str) -> str:
        return subprocess.run([self.engine, *args], capture_output=True, text=True, check=True).stdout.strip()

    def user(self, spec: str) -> tuple[int, int, str]:
        """(uid, gid, home) of a USER spec from the image's own /etc/passwd."""
        assert self.root
        name, _, group = spec.partition(":")
        for line in (self.root / "etc/passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) >= 6 and (fields[0] == name or fields[2] == name):
                return int(fields[2]), int(group or fields[3]), fields[5]
        if name.isdigit():
            return int(name), int(group or name), "/"
        raise ValueError(f"user {spec!r} is not in the image's /etc/passwd")

    def command(self, argv: list[str], user: str | None = None, entrypoint: str | None = None) -> list[str]:
        """The host command that runs argv from the image (with the image's environment and workdir)."""
        self.runs += 1
        if self.root is None:
            return [*run_prefix(self.engine), "--rm", "--name", f"{self.container}-{self.runs}", "--network", "host",
                    *(["--user", user] if user else []), *(["--entrypoint", entrypoint] if entrypoint else []),
                    self.image, *argv]
        uid, gid, home = self.user(user or self.config.get("User") or "0")
        env = [e for e in self.config.get("Env") or [] if not e.startswith("HOME=")] + [f"HOME={home}"]
        workdir = self.config.get("WorkingDir") or "/"
        # the mounts live in a private mount namespace: they go away with its last process
        script = "\n".join([
            "set -e",
            'mount -t proc proc "$R/proc"',
            'mount --rbind /dev "$R/dev"',  # /dev/shm for Ray's object store
            'mount --rbind /sys "$R/sys"',
            'for f in hosts resolv.conf; do touch "$R/etc/$f"; mount --bind "/etc/$f" "$R/etc/$f"; done',
            f'exec chroot --userspec={uid}:{gid} "$R" /usr/bin/env -i -C {shlex.quote(workdir)} '
            + " ".join(shlex.quote(a) for a in [*env, *([entrypoint] if entrypoint else []), *argv]),
        ])
        return ["env", f"R={self.root}", "unshare", "--mount", "--propagation", "private", "sh", "-c", script]

    def leftovers(self, wait_s: float = 30) -> list[tuple[int, str]]:
        """Processes still running from the image (waits up to wait_s for them to go)."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.root is None:
                ps = subprocess.run([self.engine, "ps", "-q", "--filter", f"name={self.container}"],
                                    capture_output=True, text=True).stdout.split()
                left = [(0, f"container {c}") for c in ps]
            else:
                left = processes_under(self.root)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(1)

    def cleanup(self) -> None:
        """Kill whatever is left (after it was counted), unmount and remove the container."""
        if self.root is not None:
            for pid, _ in processes_under(self.root):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(1)
            subprocess.run([self.engine, "umount", self.container], capture_output=True)
            subprocess.run([self.engine, "rm", "-f", self.container], capture_output=True)
        else:
            for i in range(1, self.runs + 1):
                subprocess.run([self.engine, "rm", "-f", f"{self.container}-{i}"], capture_output=True)


def echo(proc: subprocess.Popen, log, prefix: str) -> threading.Thread:
    """Copy a process's output to the log and, indented, to stdout."""
    def pump() -> None:
        assert proc.stdout
        for line in proc.stdout:
            log.write(line)
            log.flush()
            print(f"    {prefix} | {line.rstrip()}", flush=True)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def serve_check(runner: Runner, log, say: Callable[[str], None]) -> dict:
    """python -m service from the image: ready, /v1/embeddings, ready again, SIGTERM, nothing left."""
    port, metrics_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    checks: dict = {"passed": False}
    argv = ["python", "-m", "service", "--config", "deploy/serve_config.yaml", "--host", "127.0.0.1",
            "--port", str(port), "--metrics-port", str(metrics_port)]
    say(f"smoke: starting the service ({runner.mode}) on 127.0.0.1:{port}, metrics on :{metrics_port}")
    t0 = time.monotonic()
    proc = subprocess.Popen(runner.command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    echo(proc, log, "service")
    try:
        while time.monotonic() - t0 < READY_TIMEOUT_S and proc.poll() is None:
            if http("GET", f"{base}/v2/health/ready", timeout=5)[0] == 200:
                break
            time.sleep(2)
        else:
            checks["error"] = f"not ready: the service exited with {proc.poll()}" if proc.poll() is not None \
                else f"not ready after {READY_TIMEOUT_S} s"
            say(f"smoke: FAILED: {checks['error']}")
            return checks
        ready_s = time.monotonic() - t0
        checks["ready_after_s"] = round(ready_s, 1)
        say(f"smoke: GET /v2/health/ready -> 200 after {ready_s:.0f} s")
        if runner.root is not None:
            checks["processes_while_serving"] = len(processes_under(runner.root))

        t1 = time.monotonic()
        status, body = http("POST", f"{base}/v1/embeddings", {"input": TEXT})
        embedding = json.loads(body)["data"][0]["embedding"] if status == 200 else []
        norm = math.sqrt(sum(x * x for x in embedding)) if embedding else 0.0
        emb = checks["embeddings"] = {"status": status, "length": len(embedding), "norm": round(norm, 6),
                                      "all_floats": all(isinstance(x, float) for x in embedding),
                                      "first": [round(x, 6) for x in embedding[:4]],
                                      "seconds": round(time.monotonic() - t1, 3)}
        say(f"smoke: POST /v1/embeddings {{\"input\": {TEXT!r}}} -> {status}, {len(embedding)} floats, "
            f"norm {norm:.6f}, first {emb['first']}")
        ok_embedding = status == 200 and len(embedding) == HIDDEN and emb["all_floats"] and abs(norm - 1) < 1e-3
        checks["ready_status"] = http("GET", f"{base}/v2/health/ready")[0]
        say(f"smoke: GET /v2/health/ready -> {checks['ready_status']}")
        status, metrics = http("GET", f"http://127.0.0.1:{metrics_port}/metrics")
        checks["metrics_status"] = status
        say(f"smoke: GET :{metrics_port}/metrics -> {status}, {len(metrics)} bytes")

        t2 = time.monotonic()
        if runner.root is None:
            subprocess.run([runner.engine, "stop", "--time", str(STOP_TIMEOUT_S), f"{runner.container}-{runner.runs}"],
                           capture_output=True)
        else:
            proc.send_signal(signal.SIGTERM)  # the service's own pid: sh, chroot and env exec it
        try:
            code = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        checks["stop"] = {"signal": "SIGTERM", "exit_code": code, "seconds": round(time.monotonic() - t2, 1)}
        say(f"smoke: SIGTERM -> exit code {code} after {checks['stop']['seconds']:.0f} s")
        left = runner.leftovers()
        ports_free = not port_open(port) and not port_open(metrics_port)
        checks["processes_left"] = [f"{pid} {cmd}" for pid, cmd in left]
        checks["ports_free_after_stop"] = ports_free
        say(f"smoke: processes left from the image: {len(left)}"
            f"{': ' + '; '.join(checks['processes_left']) if left else ''}; "
            f"ports {port} and {metrics_port} {'free' if ports_free else 'STILL OPEN'}")
        checks["passed"] = (ok_embedding and checks["ready_status"] == 200 and code == 0 and not left and ports_free)
        return checks
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def cuda_library_check(runner: Runner, log, say: Callable[[str], None]) -> dict:
    """The CUDA image: the CUDA steps run from the image's own filesystem, as uid 1000; the build and
    the libraries must pass (they are in the image), the driver and the device come with a GPU node."""
    argv = ["python", "-m", "service.runtimes.cuda", "--libraries"]
    result = subprocess.run(runner.command(argv), capture_output=True, text=True, timeout=300)
    log.write(result.stdout + result.stderr)
    lines = result.stdout.splitlines()
    for line in lines:
        say(f"smoke: cuda: {line}")
    return {"passed": result.returncode == 0, "exit_code": result.returncode, "lines": lines}


def kuberay_check(runner: Runner, log, say: Callable[[str], None]) -> dict:
    """Ray started as KubeRay starts it (a login bash, uid 1000) answers the manifests' liveness probe."""
    gcs, agent, client, metrics = free_port(), free_port(), free_port(), free_port()
    # KubeRay: command ["/bin/bash", "-lc", "--"], args "ulimit -n 65536; ray start ... --block"; the
    # ulimit is left out (this host's hard limit is lower) and --block too, so the script goes on.
    script = "; ".join([
        "set -o pipefail",
        "echo \"PATH in a login shell: $PATH\"",
        "command -v ray && command -v wget && ray --version",
        f"ray start --head --port={gcs} --dashboard-agent-listen-port={agent} --ray-client-server-port={client} "
        f"--metrics-export-port={metrics} --node-ip-address=127.0.0.1 --num-cpus=1 --include-dashboard=false "
        "--disable-usage-stats > /tmp/ray-start.log 2>&1 || { tail -20 /tmp/ray-start.log; exit 3; }",
        "ok=1; for i in $(seq 60); do "
        f"if wget -T 2 -q -O- http://localhost:{agent}/api/local_raylet_healthz | grep success; then ok=0; break; fi; "
        "sleep 1; done",
        "ray stop > /dev/null 2>&1",
        "exit $ok",
    ])
    say(f"smoke: KubeRay's way: /bin/bash -lc -- 'ray start --head ...' as uid {POD_UID}, then the liveness probe "
        f"(wget localhost:{agent}/api/local_raylet_healthz)")
    t0 = time.monotonic()
    proc = subprocess.Popen(runner.command(["-lc", "--", script], user=str(POD_UID), entrypoint="/bin/bash"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    thread = echo(proc, log, "kuberay")
    try:
        code = proc.wait(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = None
    thread.join(timeout=5)
    left = runner.leftovers()
    checks = {"exit_code": code, "seconds": round(time.monotonic() - t0, 1),
              "processes_left": [f"{pid} {cmd}" for pid, cmd in left]}
    checks["passed"] = code == 0 and not left
    say(f"smoke: liveness probe {'answered success' if code == 0 else f'FAILED (exit {code})'}; "
        f"after ray stop {len(left)} process(es) left")
    return checks


def smoke(engine: str, image: str, log_path: Path, say: Callable[[str], None]) -> dict:
    """Run the smoke test; a dict of what was checked, with passed: True only when all of it held."""
    result: dict = {"passed": False, "image": image}
    runner = Runner(engine, image)
    result["mode"] = runner.mode
    with log_path.open("w") as log:
        try:
            if "cuda" in image.rsplit(":", 1)[-1]:  # the CUDA image: can its libraries load?
                result["cuda"] = cuda_library_check(runner, log, say)
            result["service"] = serve_check(runner, log, say)
            result["kuberay"] = kuberay_check(runner, log, say)
        finally:
            runner.cleanup()
    result["passed"] = all(result[k]["passed"] for k in ("cuda", "service", "kuberay") if k in result)
    say(f"smoke: {'PASSED' if result['passed'] else 'FAILED'} (log {log_path})")
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python deploy/image/smoke.py IMAGE")
    engine = "podman" if subprocess.run(["podman", "--version"], capture_output=True).returncode == 0 else "docker"
    outcome = smoke(engine, sys.argv[1], Path(f"smoke-{os.getpid()}.log"), lambda m: print(m, flush=True))
    print(json.dumps(outcome, indent=2))
    sys.exit(0 if outcome["passed"] else 1)
