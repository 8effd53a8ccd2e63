"""The two ways to start the service as a user does: `python -m service` (what `make run` runs)
and `serve run deploy/serve_config.yaml`; both answer over HTTP and stop cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from service.hosting import processes
from service.config import DEFAULT_INGRESS, INGRESS_ENV
from tests.conftest import free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]


def still_running(pids: set[int]) -> set[int]:
    return {p for p in pids if processes.alive(p)}


def kill_tree(proc: subprocess.Popen) -> None:
    """A failed test leaves nothing either: the service, Ray's processes and its HAProxy (which outlives a
    killed Ray and keeps its port)."""
    if proc.poll() is None:
        spawned = processes.descendants(proc.pid)
        proc.kill()
        processes.stop({p for p in spawned if processes.alive(p)})


def service_env() -> dict[str, str]:
    """The environment of a service the test starts: Ray Serve's own ports of its own, never those
    of the test session's cluster (HAProxy would send its traffic to the other cluster's replicas)."""
    return {**os.environ, **processes.local_cluster_ports()}


def assert_no_orphans(pids: set[int], timeout: float = 30) -> None:
    wait_until(lambda: not still_running(pids), f"the service's processes to exit ({sorted(still_running(pids))} left)",
               timeout=timeout, interval=0.5)


def wait_for_health(url: str, proc: subprocess.Popen, lines: list[str] | None = None,
                    timeout: float = 240) -> httpx.Response:
    """Wait for this service's own answer on /health: 200 with its JSON (not another server's).
    The bound is start-up on a loaded 2-core CI machine (make run once took over 120 s beside the other worker's tests).
    On failure, say what the service printed (`lines`, from collect())."""
    def output() -> str:
        printed = "".join(lines or [])
        said = f"\n--- its output ---\n{printed[-4000:]}"
        # a start that failed names its log ("details: PATH"): its end says which actor died and why
        log = re.search(r"\(details: (\S+)\)", printed)
        if log and Path(log.group(1)).is_file():
            said += f"\n--- the end of {log.group(1)} ---\n" + "\n".join(
                Path(log.group(1)).read_text(errors="replace").splitlines()[-60:])[-6000:]
        return said

    def healthy() -> httpx.Response | None:
        assert proc.poll() is None, f"the service exited early with {proc.returncode}{output()}"
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            return r if r.status_code == 200 and r.headers.get("content-type") == "application/json" \
                and r.json().get("status") == "ok" else None
        except httpx.HTTPError:
            return None

    try:
        return wait_until(healthy, f"{url}/health to answer 200 with the service's JSON", timeout=timeout, interval=0.5)
    except AssertionError as exc:
        if "exited early" in str(exc):
            raise
        raise AssertionError(f"{exc}{output()}") from None


def start_service(bundle: Path, port: int, *flags: str, env: dict[str, str] | None = None
                  ) -> tuple[subprocess.Popen, list[str]]:
    """`python -m service` on `port` with one replica on 2 CPUs and its own ports; its output lines."""
    grpc = [] if "--grpc-port" in flags else ["--grpc-port", str(free_port())]
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--bundle", str(bundle), "--port", str(port), "--num-cpus", "2",
         "--metrics-port", str(free_port()), "--replicas", "1", *grpc, *flags],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or service_env(),
    )
    return proc, collect(proc)


def stop_with_sigterm(proc: subprocess.Popen) -> set[int]:
    """SIGTERM, as an orchestrator sends it: the service must exit 0. Returns the processes it had."""
    spawned = processes.descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    return spawned


def collect(proc: subprocess.Popen) -> list[str]:
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return lines


def test_python_m_service_serves_on_loopback_only_says_what_matters_quietly_and_stops_on_sigterm(
        default_bundle, tmp_path):
    """`python -m service` as the README runs it: it serves HTTP and gRPC, prints a short summary and
    nothing in colour, keeps Ray's messages in its log file, stops on SIGTERM leaving no process behind;
    and every listener of its processes faces loopback: GCS, raylet, agents, metrics, the HTTP and gRPC
    ingress (HAProxy), HAProxy's stats and Prometheus ports, the fallback proxy's gRPC port and each
    replica's own HTTP and gRPC ports (service/hosting/listeners.py moves those Ray binds to every interface)."""
    import numpy as np
    import tritonclient.grpc as triton_grpc

    from tests.reliability import record

    port, metrics_port, grpc_port = free_port(), free_port(), free_port()
    log = tmp_path / "service.log"
    env = service_env()
    haproxy_own = {int(env["RAY_SERVE_HAPROXY_STATS_PORT"]), int(env["RAY_SERVE_HAPROXY_METRICS_PORT"])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "service", "--config", str(ROOT / "deploy/serve_config.yaml"),
         "--bundle", str(default_bundle), "--port", str(port), "--num-cpus", "2",
         "--metrics-port", str(metrics_port), "--log-file", str(log), "--grpc-port", str(grpc_port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines = collect(proc)
    try:
        url = f"http://127.0.0.1:{port}"
        health = wait_for_health(url, proc, lines)
        sockets = sockets_once_serving(proc, port)
        assert health.json()["provider"] == "CPUExecutionProvider"
        spawned = processes.descendants(proc.pid)
        assert spawned, "Ray should run in child processes"
        r = httpx.post(f"{url}/v1/encode", json={"inputs": ["started by python -m service"]}, timeout=30)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        info = httpx.get(f"{url}/info", timeout=30).json()
        explorer = httpx.get(f"{url}/explorer", timeout=30)
        assert explorer.status_code == 200 and explorer.headers["content-type"].startswith("text/html")
        # KServe v2 over gRPC, beside HTTP, as the config turns it on
        grpc_client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        text = triton_grpc.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"started by python -m service"], dtype=object))
        embedded = grpc_client.infer("all-MiniLM-L6-v2", [text]).as_numpy("sentence_embedding")
        # the same vector; at a lossy precision (bf16, which auto picks on CPUs with bf16 units) within its
        # rounding, as the packed graph (/v1/encode's pooled output) and the padded one (v2's outputs) differ there
        np.testing.assert_allclose(embedded[0], r.json()["data"][0]["embedding"],
                                   atol=1e-5 if info["precision"] == "fp32" else 2e-3)
        grpc_client.close()
        # the summary is printed before health answers; wait for its last line all the same
        wait_until(lambda: any(line.startswith("stop it with Ctrl-C") for line in lines), "the start-up summary")
        spawned |= stop_with_sigterm(proc)
    finally:
        kill_tree(proc)
    output = "".join(lines)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    # what a user needs, in plain lines: where it listens, the metrics, model, precision, provider, how to stop
    assert f"serving all-MiniLM-L6-v2 at http://127.0.0.1:{port} (haproxy ingress)" in output, output
    assert f"{info['precision']} encodings graph on {info['runtime']} ({info['precision_note']})" in output, output
    assert re.search(r"provider +CPUExecutionProvider, \d+ onnxruntime thread", output), output
    assert info["provider_note"] and f"(CUDA not used: {info['provider_note']})" in output, output
    assert f"metrics    {metrics_url}" in output and info["metrics"]["prometheus_url"] == metrics_url
    assert f"logs       {log}" in output
    assert f"explore    {url}/explorer" in output
    assert f"grpc       127.0.0.1:{grpc_port}: KServe v2" in output
    assert "stop it with Ctrl-C or SIGTERM" in output and output.rstrip().endswith("stopped")
    # and nothing else: no colour codes (red errors, Ray's coloured prefixes), no warnings, no tracebacks
    assert "\x1b[" not in output and "Traceback" not in output and "WARNING" not in output, output
    assert "[W:onnxruntime" not in output and "[E:onnxruntime" not in output, output  # its own log lines
    assert len(output.splitlines()) <= 15, output
    # Ray's own messages are kept, in the log file
    logged = log.read_text()
    assert "Started Serve" in logged or "serve" in logged.lower(), logged[-2000:]
    assert_no_orphans(spawned)

    names = {name for name, _, _ in sockets}
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), names
    assert any(n.startswith("ray::ServeReplica") for n in names), names  # the replica's ports are among them
    on_port = [s for s in sockets if s[2] == port]
    assert all(name == "haproxy" and processes.is_loopback(address) for name, address, _ in on_port), on_port
    on_grpc_port = [s for s in sockets if s[2] == grpc_port]
    assert on_grpc_port and all(name == "haproxy" for name, _, _ in on_grpc_port), on_grpc_port
    assert int(env["RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"]) in {p for name, _, p in sockets if name.startswith("ray::ProxyActor")}
    assert haproxy_own <= {p for name, _, p in sockets if name == "haproxy"}, sockets  # stats, metrics
    beyond = [s for s in sockets if not processes.is_loopback(s[1])]
    assert not beyond, f"listening beyond loopback: {beyond}"
    record("Ray's own ports under make run", "every listening TCP socket of the service's processes, read from /proc",
           f"{len(sockets)} listeners, all on loopback (GCS, raylet, agents, metrics, the HTTP and gRPC ports, HAProxy's "
           "stats and Prometheus ports, the fallback proxy's ports, replicas' own HTTP and gRPC ports)",
           note="no dashboard, no Ray client server")


def test_python_m_service_refuses_cuda_it_cannot_use_with_the_real_reason(default_bundle):
    from service.runtimes.onnxruntime import check_cuda

    if check_cuda().usable:
        return  # a machine with a usable GPU: test_runtime proves the CUDA session there
    result = subprocess.run(
        [sys.executable, "-m", "service", "--bundle", str(default_bundle), "--provider", "cuda", "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert f"service refused to start: provider 'cuda' was asked for, but CUDA cannot be used: {check_cuda().reason}" \
        in result.stderr


def test_python_m_service_refuses_a_bad_bundle_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "service", "--bundle", str(tmp_path / "missing")],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "bundle directory does not exist" in result.stderr


def _default_sigint() -> None:
    """In the child before exec: SIGINT handled by default and not blocked, as in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_serve_run_with_the_config_file(default_bundle, tmp_path):
    config = yaml.safe_load((ROOT / "deploy/serve_config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["grpc_options"]["port"] = free_port()  # never the config's 9000, which a test beside this one may hold
    config["applications"][0]["args"]["bundles"] = [str(default_bundle)]
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_bin = Path(sys.executable).with_name("serve")
    # `serve run` as docs/serving.md and the config's header say: the ingress switches exported first
    env = {**service_env(), **INGRESS_ENV[DEFAULT_INGRESS], "RAY_ADDRESS": ""}
    proc = subprocess.Popen(
        [str(serve_bin), "run", "--address", "local", str(path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        # as from a terminal: Ctrl-C interrupts. A child inherits an ignored or blocked SIGINT (and
        # Python then installs no KeyboardInterrupt handler): late in a full session `serve run`
        # never reacted to SIGINT, though it does when this test runs alone.
        preexec_fn=_default_sigint,
    )
    lines = collect(proc)
    spawned: set[int] = set()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc, lines)
        spawned = processes.descendants(proc.pid)
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "started by serve run"}, timeout=30)
        assert r.status_code == 200
        assert httpx.get(f"{url}/v2/health/live", timeout=5).status_code == 200
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve run did not exit within 120 s of SIGINT (this process's SIGINT handler: "
                                 f"{signal.getsignal(signal.SIGINT)}, blocked signals: "
                                 f"{signal.pthread_sigmask(signal.SIG_BLOCK, [])}); its last lines:\n"
                                 + "".join(lines[-40:])) from None
    finally:
        if proc.poll() is None:  # a failed test leaves nothing either: Ray's processes and its HAProxy
            spawned |= processes.descendants(proc.pid)
            proc.kill()
            processes.stop({p for p in spawned if processes.alive(p)})
    assert_no_orphans(spawned)


@pytest.mark.serial
def test_sigterm_during_load_drains_in_flight_requests(default_bundle):
    from concurrent.futures import ThreadPoolExecutor

    from tests.reliability import record

    port = free_port()
    proc, lines = start_service(default_bundle, port, "--threads", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, proc, lines)
        spawned = processes.descendants(proc.pid)
        texts = [f"in-flight request text {i} " + "with several more words " * 10 for i in range(32)]

        def one(_: int) -> int:
            return httpx.post(f"{url}/v1/encode", json={"inputs": texts}, timeout=60).status_code

        def admitted() -> int:
            return httpx.get(f"{url}/info", timeout=30).json()["replica"]["load"]["inference_requests_admitted"]

        before = admitted()
        with ThreadPoolExecutor(max_workers=6) as pool:
            futures = [pool.submit(one, i) for i in range(6)]

            def all_six_inside() -> bool:
                failed = [f.result() for f in futures if f.done() and f.result() != 200]
                assert not failed, f"requests failed before SIGTERM: {failed}"
                return admitted() - before >= 6

            try:
                wait_until(all_six_inside, "all six requests to reach the replica", interval=0.05)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; admitted since: {admitted() - before}; done: "
                                     f"{[f.result() for f in futures if f.done()]}\n{''.join(lines)[-3000:]}") from None
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            statuses = [f.result() for f in futures]
        code = proc.wait(timeout=60)
        exit_s = time.monotonic() - signalled
    finally:
        kill_tree(proc)
    assert statuses == [200] * 6, f"{statuses}\n{''.join(lines)[-3000:]}"
    assert code == 0 and exit_s < 20 + 30, (code, exit_s)  # graceful_shutdown_timeout_s is 20
    assert_no_orphans(spawned)
    record("SIGTERM during load", "SIGTERM to python -m service with 6 requests of 32 texts in flight",
           {"200": statuses.count(200)}, None, note=f"all drained; exited 0 after {exit_s:.1f} s")


def sockets_once_serving(proc: subprocess.Popen, port: int) -> list[tuple[str, str, int]]:
    """The service's listening sockets, read once its HTTP port has a listener among its processes.

    Ray Serve's HAProxy reloads by starting a new process that takes the listener over, so the
    process tree is read again on every try, never from an earlier snapshot."""

    def listing():
        found = processes.listening_sockets(processes.descendants(proc.pid) | {proc.pid})
        return found if any(p == port for _, _, p in found) else None

    return wait_until(listing, f"a listener on port {port} among the service's processes", timeout=30)


@pytest.mark.serial
def test_python_m_service_with_ray_serves_proxy_actor(default_bundle):
    """--ingress proxy, the alternative: Ray Serve's proxy actor answers on the port, on loopback
    only, and stops with the rest."""
    port = free_port()
    proc, lines = start_service(default_bundle, port, "--ingress", "proxy")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc, lines)
        r = httpx.post(f"{url}/v1/encode", json={"inputs": ["through the proxy actor"]}, timeout=30)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        assert httpx.post(f"{url}/v1/encode", json={"inputs": []}, timeout=30).status_code == 422
        sockets = sockets_once_serving(proc, port)
        spawned = stop_with_sigterm(proc)
    finally:
        kill_tree(proc)
    on_port = [s for s in sockets if s[2] == port]
    assert on_port and all(name.startswith("ray::ProxyActor") and processes.is_loopback(address) for name, address, _ in on_port), on_port
    assert not any(name == "haproxy" for name, _, _ in sockets), sockets
    assert "(proxy ingress)" in "".join(lines)
    assert_no_orphans(spawned)


def test_a_haproxy_left_behind_by_a_dead_cluster_is_stopped_before_the_next_start(default_bundle, tmp_path):
    """When Ray's processes die all at once, Ray Serve's HAProxy survives and keeps the port; the
    next start would fail with "address in use". python -m service stops such a HAProxy (and only
    a Ray Serve one whose manager is gone), says so, and starts."""
    from service.hosting.listeners import real_haproxy

    port = free_port()
    config = tmp_path / "haproxy-serve" / "deadnode" / "haproxy.cfg"  # where Ray Serve keeps its configs
    config.parent.mkdir(parents=True)
    config.write_text(
        "defaults\n  mode http\n  timeout connect 1s\n  timeout client 5s\n  timeout server 5s\n"
        f"frontend stale\n  bind 127.0.0.1:{port}\n"
        '  http-request return status 200 content-type text/plain string "stale haproxy"\n'
    )
    # started by a shell that exits at once: its parent is gone, as when Ray's processes died
    # the real HAProxy: in this session RAY_SERVE_HAPROXY_BINARY_PATH (get_haproxy_binary's first choice)
    # names the shim, which refuses a config without Ray's frontend
    subprocess.run(["bash", "-c", f"{real_haproxy()} -db -f {config} >/dev/null 2>&1 &"], check=True)
    stale = wait_until(lambda: processes.listening_pids(port), f"the stale HAProxy to listen on {port}", timeout=30)
    assert all(processes.left_behind(p) for p in stale)
    proc, lines = start_service(default_bundle, port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc, lines)
        assert httpx.post(f"{url}/v1/embeddings", json={"input": "the port is ours again"}, timeout=30).status_code == 200
        spawned = stop_with_sigterm(proc)
    finally:
        kill_tree(proc)
        processes.stop(stale)
    assert not any(processes.alive(p) for p in stale)
    assert f"stopped a HAProxy left behind by an earlier run on port {port}" in "".join(lines)
    assert_no_orphans(spawned)


def test_python_m_service_refuses_a_port_another_program_holds(default_bundle):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "service", "--bundle", str(default_bundle), "--port", str(port),
             "--grpc-port", str(free_port())],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert f"service refused to start: port {port} is in use by pid {os.getpid()}" in result.stderr


def test_python_m_service_refuses_a_metrics_port_another_program_holds(default_bundle):
    """A second service on the default metrics port would make Ray's metrics agent die and
    ray.init time out without a reason; it is refused in one line that names the holder."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        metrics_port = held.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "service", "--bundle", str(default_bundle), "--port", str(free_port()),
             "--metrics-port", str(metrics_port), "--grpc-port", str(free_port())],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert (f"service refused to start: metrics port {metrics_port} is in use by pid {os.getpid()}"
            in result.stderr) and "--metrics-port" in result.stderr


def test_make_run_prints_no_red_line_and_no_traceback(default_bundle):
    """`make run` as a newcomer types it (the bundle given, so the export is not repeated): a
    one-line bundle check, the start-up summary, nothing in colour, no traceback, a clean stop."""
    port = free_port()
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "run", f"BUNDLE={default_bundle}",
         f"SERVE_ARGS=--port {port} --metrics-port {free_port()} --replicas 1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=service_env(),
        start_new_session=True,  # Ctrl-C in a terminal signals the whole group: so does this test
    )
    lines = collect(proc)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc, lines)
        wait_until(lambda: any(line.startswith("stop it with Ctrl-C") for line in lines), "the start-up summary")
        spawned = processes.descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=90)
        wait_until(lambda: not still_running(spawned), "the service's processes to exit", timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    assert output.startswith(f"bundle {default_bundle}: all-MiniLM-L6-v2, "), output
    assert f"serving all-MiniLM-L6-v2 at http://127.0.0.1:{port}" in output
    assert "\x1b[" not in output and "Traceback" not in output and "rror" not in output, output
    assert "stopped" in output.splitlines()[-1] or "stopped" in output, output
