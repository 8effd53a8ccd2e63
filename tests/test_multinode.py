"""Beyond one process: a real Ray cluster of a head node and two worker nodes on loopback, the
application deployed with `serve deploy` of deploy/serve_config.yaml as a cluster user would, one
replica on each worker; both serve, each node's metrics port reports its own replica, and a worker
node killed under steady traffic leaves the service answering through the other. Its keys are counted in a
real redis-server (issue 58): a key's requests per minute hold across the nodes, Redis stopped refuses only
limited keys."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from service.hosting import processes
from service.hosting.processes import free_port
from tests.cluster import LoopbackCluster
from tests.conftest import wait_until
from tests.errors import error_message
from tests.metrics_scrape import poll, scrape, total
from tests.redis_server import redis_server  # noqa: F401 - the fixture, used by name

ROOT = Path(__file__).resolve().parents[1]
ROUTE = "/v1/embeddings"
MODEL = "all-MiniLM-L6-v2"
AUTH = {"authorization": "Bearer free-secret"}  # a key without limits: the traffic of the tests below
TENANT = {"authorization": "Bearer tenant-secret"}  # 6 requests per minute, the default model only


@pytest.fixture(scope="module")
def cluster(default_bundle, redis_server, tmp_path_factory):
    """Head (0 CPUs: no replicas) + two workers of 1 CPU; the Serve config of deploy/ with two
    replicas of 1 CPU, at most one per node, a keys file and Redis as the limits' store; torn down, every
    process of it, whatever happens."""
    import hashlib

    keys_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [
        {"name": "free", "sha256": hashlib.sha256(b"free-secret").hexdigest()},
        {"name": "tenant", "sha256": hashlib.sha256(b"tenant-secret").hexdigest(), "models": [MODEL],
         "requests_per_minute": 6}]}))
    c = LoopbackCluster()
    try:
        c.start_node(0, head=True)
        c.start_node(1)
        c.start_node(2)
        config = yaml.safe_load((ROOT / "deploy/serve_config.yaml").read_text())
        port = free_port()
        config["proxy_location"] = "HeadOnly"  # one ingress: all nodes share 127.0.0.1 here
        config["http_options"].update(host="127.0.0.1", port=port)
        config["grpc_options"]["port"] = free_port()  # never the config's 9000: a test beside this one held it once
        app = config["applications"][0]
        app["args"].update(bundles=[str(default_bundle)], num_cpus=1, max_replicas_per_node=1,
                           keys_file=str(keys_file), rate_limit_storage=redis_server.uri)
        encoder = app["deployments"][0]
        encoder.pop("autoscaling_config")
        encoder["num_replicas"] = 2
        path = tmp_path_factory.mktemp("multinode") / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config))
        c.serve_deploy(path)
        c.config = config
        c.url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _status(f"{c.url}/v2/health/ready") == 200, "the application to be ready", timeout=180)
        wait_until(lambda: len(replica_nodes(c.url)) == 2, "a replica answering on each worker node", timeout=120)
        yield c
    finally:
        left = c.shutdown()
        assert not left, f"processes of the cluster still alive after shutdown: {sorted(left)}"
        # nothing that names the cluster's temp dir or its GCS address is left either (Ray's client
        # server, started apart from the node daemons, used to outlive it with parent 1)
        stragglers = c.processes_of_cluster()
        assert not stragglers, f"left after the cluster's teardown: {[processes.cmdline(p)[:3] for p in stragglers]}"


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def replica_nodes(url: str, calls: int = 16) -> dict[str, int]:
    """Which node answered, by the replica's own /info, over a few calls: {node_id: answers}."""
    seen: dict[str, int] = {}
    for _ in range(calls):
        try:
            node = httpx.get(f"{url}/info", timeout=10).json()["replica"]["node_id"]
        except (httpx.HTTPError, KeyError, ValueError):
            continue
        seen[node] = seen.get(node, 0) + 1
    return seen


def node_requests(families: dict) -> float:
    return total(families, "ray_encoder_requests_total", route=ROUTE, status_class="2xx")


def test_every_listener_of_the_cluster_is_on_loopback(cluster):
    """GCS, raylets, object managers, agents, the Ray client server, Serve's proxy, the replicas'
    own HTTP and gRPC ports: every listening socket of every process of the three nodes is on
    127.0.0.1 (ray start --node-ip-address 127.0.0.1, kept; service/hosting/listeners.py for the replicas)."""
    from tests.reliability import record

    pids = cluster.processes_of_cluster()
    sockets = processes.listening_sockets(pids)
    names = {name for name, _, _ in sockets}
    for daemon in ("gcs_server", "raylet", "ray::ServeReplica", "ray::ProxyActor", "ray::DashboardAgent"):
        assert any(n.startswith(daemon) for n in names), (daemon, names)
    beyond = [s for s in sockets if not processes.is_loopback(s[1])]
    assert not beyond, f"listening beyond loopback: {beyond}"
    record("listeners of the 3-node test cluster", "every listening TCP socket of its processes, read from /proc",
           f"{len(sockets)} listeners of {len(pids)} processes, all on 127.0.0.1", None,
           note="none left after teardown (the fixture checks)")


def test_replicas_on_both_workers_serve_and_each_node_reports_its_own(cluster):
    workers = {i: cluster.nodes[i] for i in (1, 2)}
    answered = replica_nodes(cluster.url, calls=30)
    assert len(answered) == 2 and min(answered.values()) >= 3, answered  # both serve, none on the head
    sent = 40
    with httpx.Client(timeout=30, headers=AUTH) as client:
        for i in range(sent):
            assert client.post(f"{cluster.url}{ROUTE}", json={"input": f"text {i}"}).status_code == 200
    counts: dict[int, float] = {}

    def settled_counts() -> bool:
        from tests.metrics_scrape import scrape

        counts.update({i: node_requests(scrape(node.metrics_url)) for i, node in workers.items()})
        return sum(counts.values()) == sent

    wait_until(settled_counts, f"the workers' metrics ports to add up to the {sent} requests sent", timeout=60)
    assert all(n > 0 for n in counts.values()), counts  # each node's port reports its own replica's share
    head = poll(cluster.nodes[0].metrics_url, lambda f: True, what="the head's metrics")
    assert node_requests(head) == 0  # the head runs no replica
    for i, node in workers.items():  # each port shows exactly one replica: the one on its node
        families = poll(node.metrics_url, lambda f: node_requests(f) > 0, what=f"node {i}'s own replica")
        replicas = {s.labels.get("replica") for f in families.values() for s in f.samples
                    if s.name == "ray_encoder_requests_total"}
        assert len(replicas) == 1, replicas


def test_a_keys_limits_hold_across_the_nodes_counted_in_redis(cluster, redis_server):
    """6 requests per minute: a model the key may not call is refused (403: one of the 6), then 12 asked on new
    connections: 5 answered, by both nodes' replicas (each node's metrics count some of the key's requests),
    the rest 429 with OpenAI's body; with Redis stopped the limited key gets 503 and the key without limits is
    served, and once it is back the limited key is counted again (its answers carry its window)."""
    import concurrent.futures

    def ask(_: int) -> httpx.Response:
        return httpx.post(f"{cluster.url}{ROUTE}", json={"input": "a tenant's text", "model": MODEL}, headers=TENANT,
                          timeout=60)

    forbidden = httpx.post(f"{cluster.url}{ROUTE}", json={"input": "a", "model": "another-model"}, headers=TENANT,
                           timeout=60)
    assert forbidden.status_code == 403 and "may not call model" in error_message(forbidden), forbidden.text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(12)))
    ok = [r for r in answers if r.status_code == 200]
    # counted in Redis for both nodes, not per replica: 6 a minute, the refused model's request one of them
    assert len(ok) == 5, [r.status_code for r in answers]
    for r in answers:
        if r.status_code != 200:
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.text
            assert r.headers["x-ratelimit-remaining-requests"] == "0" and int(r.headers["retry-after"]) >= 1
    workers = [node for node in cluster.nodes.values() if not node.head]

    def by_node() -> list[float]:
        return [total(scrape(node.metrics_url), "ray_encoder_key_requests_total", key="tenant") for node in workers]

    wait_until(lambda: sum(by_node()) >= 13, "the tenant's 13 requests in the nodes' metrics", timeout=45)
    assert all(n > 0 for n in by_node()), by_node()  # both nodes' replicas took some, and counted the same key
    redis_server.stop()
    try:
        down = ask(0)
        assert down.status_code == 503 and "rate-limit store is unreachable" in error_message(down), down.text
        assert httpx.post(f"{cluster.url}{ROUTE}", json={"input": "a"}, headers=AUTH, timeout=60).status_code == 200
    finally:
        redis_server.start()
    wait_until(lambda: "x-ratelimit-remaining-requests" in ask(0).headers, "the limited key counted again once Redis "
               "is back", timeout=30)


def test_a_worker_node_killed_under_traffic(cluster):
    """SIGKILL a worker node's raylet, agents and replica under four closed-loop clients: the service
    keeps answering through the other node; then the node comes back (as Kubernetes restarts a pod)
    and Serve puts a replica on it again."""
    outcomes: list[tuple[float, int | str, float]] = []  # (sent, status or error, answered)
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=30, headers=AUTH) as c:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    status: int | str = c.post(f"{cluster.url}{ROUTE}", json={"input": "node loss"}).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                outcomes.append((started, status, time.monotonic()))

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(outcomes) >= 40, "40 answers before the node loss")
        killed_at = time.monotonic()
        killed = cluster.kill_node(2)
        assert killed >= 2, "the node's raylet and its replica should have been killed"
        wait_until(lambda: sum(1 for at, _, _ in outcomes if at > killed_at + 5) >= 40, "40 answers after the loss")
        answering = time.monotonic()
        cluster.start_node(2)  # the machine comes back
        restarted_at = time.monotonic()
        wait_until(lambda: len(replica_nodes(cluster.url)) == 2, "a replica on each worker node again", timeout=180)
        whole_at = time.monotonic()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    failed = [(round(done - killed_at, 2), s) for _, s, done in outcomes if s != 200]
    after = [s for at, s, _ in outcomes if at > killed_at + 5]
    assert all(s == 200 for s in after), f"requests failed well after the loss: {failed}"
    last_failure = max((done for _, s, done in outcomes if s != 200), default=killed_at)
    # only requests in flight on the killed node may fail (one per client at most)
    assert len(failed) <= len(threads), failed
    from tests.reliability import record

    record("worker node lost", "SIGKILL of one of two worker nodes (raylet, agents, replica) of a 3-node Ray "
           "cluster on loopback, under 4 closed-loop clients; then the node is started again",
           {"200": sum(1 for _, s, _ in outcomes if s == 200), "failed": len(failed)},
           recovery_s=round(last_failure - killed_at, 2),
           note=f"failures (answered s after the kill, status): {failed or 'none'}, requests in flight on the lost "
                f"node; every request 200 through the other node from {max(last_failure - killed_at, 0):.2f} s "
                "after the loss; "
                f"{answering - killed_at:.0f} s later the node was restarted and Serve had a replica on it again "
                f"{whole_at - restarted_at:.1f} s after its `ray start` returned (whole again)")


def replicas_info(url: str, count: int, timeout: float = 60) -> dict[str, dict]:
    """/info of `count` distinct replicas, by replica id (the ingress spreads calls over them)."""
    seen: dict[str, dict] = {}

    def all_seen() -> bool:
        for _ in range(8):
            try:
                info = httpx.get(f"{url}/info", timeout=10).json()
            except (httpx.HTTPError, ValueError):
                continue
            seen[info["replica"]["replica_id"]] = info
        return len(seen) >= count

    wait_until(all_seen, f"/info from {count} replicas", timeout=timeout)
    return seen


def test_live_knobs_change_under_traffic_without_a_restart_or_a_failed_request(cluster, tmp_path):
    """The config's `deployments` entry changes on the running application as Serve applies it, with
    no replica restarted and no request failed under four closed-loop clients: every batching knob
    (max_concurrent_batches included) and the request limits, then the replica count."""
    import copy

    before = replicas_info(cluster.url, 2)
    outcomes: list[int | str] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=30, headers=AUTH) as c:
            while not stop.is_set():
                try:
                    outcomes.append(c.post(f"{cluster.url}{ROUTE}", json={"input": "live change"}).status_code)
                except httpx.HTTPError as exc:
                    outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(outcomes) >= 20, "20 answers before the change")
        config = copy.deepcopy(cluster.config)
        knobs = {"max_batch_tokens": 8192, "batch_wait_timeout_s": 0.002, "max_concurrent_batches": 1,
                 "sub_batch_tokens": 2048, "max_sub_batch_size": 32, "max_padding": 0.2,
                 "max_batch_attention_values": 33554432}
        encoder = config["applications"][0]["deployments"][0]
        encoder.update(user_config=knobs, max_ongoing_requests=64, max_queued_requests=16)
        path = tmp_path / "knobs.yaml"
        path.write_text(yaml.safe_dump(config))
        cluster.serve_deploy(path)

        def applied() -> bool:
            infos = replicas_info(cluster.url, 2)
            return all(all(i["batching"][k] == v for k, v in knobs.items()) and i["limits"]["max_ongoing_requests"] == 64
                       for i in infos.values())

        wait_until(applied, "both replicas to report the new batching knobs", timeout=60)
        after = replicas_info(cluster.url, 2)
        assert set(after) == set(before), "a replica was restarted for a batching change"
        limits = [(i["limits"]["max_request_tokens"], i["limits"]["max_ongoing_requests"],
                   i["limits"]["max_queued_requests"]) for i in after.values()]
        assert limits == [(8192, 64, 16)] * 2, limits  # Serve's live limits, as each replica sees them
        big = [" ".join(["words"] * 200)] * 48  # about 9,700 tokens: over the new limit, under the old one
        r = httpx.post(f"{cluster.url}/v1/encode", json={"inputs": big}, headers=AUTH, timeout=60)
        assert r.status_code == 413 and "at most 8192" in r.json()["error"]["message"], r.text

        config["applications"][0]["deployments"][0]["num_replicas"] = 1
        path.write_text(yaml.safe_dump(config))
        cluster.serve_deploy(path)
        wait_until(lambda: len(replica_nodes(cluster.url, calls=24)) == 1, "one replica left", timeout=90)
        marker = len(outcomes)
        wait_until(lambda: len(outcomes) >= marker + 20, "20 answers after scaling down")
        remaining = replicas_info(cluster.url, 1)
        assert set(remaining) <= set(before), "the replica that stayed was restarted"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    failed = [o for o in outcomes if o != 200]
    assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {failed[:5]}"
