"""A model repository (issue 57): a directory of 12 small bundles of four families, each available by its
directory's name and loaded on demand. In-process, the repository itself with real bundles and onnxruntime:
single-flight loads, eviction of the model used least lately within a memory budget, models in use never evicted, a corrupt
bundle refused by its hashes with the others unaffected, bundles added and removed while serving, idle
unloads, the concurrent-loads limit and an unreadable directory. Through Ray Serve on loopback, two replicas
each with room for about three models: a rotation over all twelve with no failed request and every answer
equal to sentence-transformers on the model's checkpoint, the listings, tritonclient's repository calls over
HTTP and gRPC, the 404 of an unknown model in each API's style, and the metrics."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import weakref
from pathlib import Path

import httpx
import numpy as np
import pytest

from service.engine.repository import MISS_SCAN_PERIOD_S
from tests.conftest import deploy, exported_once, shared_dir, wait_until
from tests.families import make_checkpoint
from tests.metrics_scrape import poll, scrape, total
from tests.reliability import record

FAMILIES = ("bert", "roberta", "xlm-roberta", "mpnet")
SEEDS = (0, 1, 2)
NAMES = [f"{family}-{seed}" for family in FAMILIES for seed in SEEDS]
TEXTS = ["The weather is lovely today.", "Der Zug nach München fährt um acht Uhr ab."]
APP, PREFIX = "repository", "/repository"


@pytest.fixture(scope="session")
def repository_sources(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (checkpoint, bundle): 12 random checkpoints (4 families, 3 seeds) exported once per run."""
    from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
    from export.pipeline import ExportOptions, build_bundle

    root = shared_dir(tmp_path_factory, "repository")
    made = {}
    for name in NAMES:
        family, seed = name.rsplit("-", 1)
        checkpoint = root / f"{name}-ckpt"

        def export(out: Path, family=family, seed=int(seed), checkpoint=checkpoint, name=name) -> None:
            make_checkpoint(family, checkpoint, pooling="mean", seed=seed, normalize=True)
            build_bundle(ExportOptions(str(checkpoint), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, name=name,
                                       lossy=()), progress=lambda _: None)

        made[name] = (checkpoint, exported_once(root / name, export))
    return made


def repository_of(sources: dict[str, tuple[Path, Path]], directory: Path, names=NAMES) -> Path:
    """A repository directory: one entry per name, each a copy of its exported bundle (a real directory, as
    a team would copy one in)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(sources[name][1].resolve(), directory / name)
    return directory


def references(sources, names) -> dict[str, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    return {name: SentenceTransformer(str(sources[name][0]), device="cpu").encode(TEXTS, convert_to_numpy=True)
            for name in names}


def min_cosine(got, expected) -> float:
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(((got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)).min())


# ---- the repository in-process: real bundles, real onnxruntime, no Ray ----

def in_process(directory: Path, budget: int = 1 << 40, **settings):
    """A replica's models as the deployment builds them: the default loaded at start, the others on demand."""
    from service.config import ServiceSettings
    from service.engine.engine import EngineTable, load_engine
    from service.engine.repository import ModelRepository

    s = ServiceSettings(models_dir=directory, default_model=NAMES[0], warmup=False, **settings)
    engines = EngineTable([load_engine(ref, s) for ref in s.bundles])
    repo = ModelRepository(s.models_dir, engines, lambda ref: load_engine(ref, s), budget,
                           s.max_concurrent_loads, s.idle_unload_s)
    engines.repository = repo
    return engines, repo


def test_a_model_loads_once_for_concurrent_requests_and_serves_what_its_bundle_computes(repository_sources, tmp_path):
    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:3])
    engines, repo = in_process(directory)
    assert [r["state"] for r in repo.index()] == ["READY", "UNAVAILABLE", "UNAVAILABLE"]
    assert engines.names == [NAMES[0]]

    async def both() -> None:
        await asyncio.gather(repo.ensure(NAMES[1], 60), repo.ensure(NAMES[1], 60), repo.ensure(NAMES[1], 60))

    asyncio.run(both())
    assert repo.entries[NAMES[1]].loads == 1  # three requests, one load
    assert engines.get(NAMES[1]).name == NAMES[1] and repo.entries[NAMES[1]].bytes >= 1 << 20
    state = {r["name"]: r["state"] for r in repo.index()}
    assert state == {NAMES[0]: "READY", NAMES[1]: "READY", NAMES[2]: "UNAVAILABLE"}


def test_the_idle_model_used_least_lately_makes_room_and_a_model_in_use_never_does(repository_sources, tmp_path):
    from service.engine.repository import ModelsBusy

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:6])
    engines, repo = in_process(directory)
    for name in NAMES[1:4]:
        asyncio.run(repo.ensure(name, 60))
    # each loaded model reckoned at 100 MiB, a budget of three: the next load must unload one first
    for name in NAMES[1:4]:
        repo.entries[name].bytes = 100 << 20
    repo.budget_bytes = 300 << 20
    for _ in range(5):  # 1 is hot: used five times more, though longest ago
        repo.entries[NAMES[1]].used()
    repo.entries[NAMES[1]].last_used -= 1.0
    engines.get(NAMES[2]).leases += 1  # 2 is held by a request
    asyncio.run(repo.ensure(NAMES[4], 60))
    assert sorted(engines.names) == sorted([NAMES[0], NAMES[1], NAMES[2], NAMES[4]])  # 3 went: not 2, not 1
    # only the hot model idle: a cold load is refused rather than unload it
    repo.entries[NAMES[4]].bytes = 100 << 20
    engines.get(NAMES[4]).leases += 1
    with pytest.raises(ModelsBusy, match="used more lately"):
        asyncio.run(repo.ensure(NAMES[5], 60))
    assert NAMES[1] in engines.names
    assert repo.used_bytes() <= repo.budget_bytes
    # every on-demand model in use: no room, a 503 with Retry-After, and nothing unloaded
    for name in (NAMES[1], NAMES[4]):
        repo.entries[name].bytes = 100 << 20
    engines.get(NAMES[1]).leases += 1
    with pytest.raises(ModelsBusy) as refused:
        asyncio.run(repo.ensure(NAMES[5], 60))
    assert refused.value.retry_after_s >= 1 and "model_memory_bytes" in refused.value.message
    assert sorted(engines.names) == sorted([NAMES[0], NAMES[1], NAMES[2], NAMES[4]])
    # a model larger than the whole budget is refused as such
    repo.budget_bytes = 1024
    with pytest.raises(ModelsBusy, match="more than this replica's whole model budget"):
        asyncio.run(repo.ensure(NAMES[5], 60))
    # every on-demand model in use, and one's request ends a moment later: the load waits for it, then unloads it
    repo.budget_bytes = 300 << 20

    async def room_made_meanwhile() -> float:
        async def request_ends() -> None:
            await asyncio.sleep(0.3)
            engines.get(NAMES[4]).leases -= 1

        ending = asyncio.get_running_loop().create_task(request_ends())
        started = time.monotonic()
        await repo.ensure(NAMES[5], 60)
        await ending
        return time.monotonic() - started

    assert asyncio.run(room_made_meanwhile()) >= 0.3
    assert sorted(engines.names) == sorted([NAMES[0], NAMES[1], NAMES[2], NAMES[5]])


def test_a_corrupt_bundle_is_refused_by_its_hashes_and_the_others_are_unaffected(repository_sources, tmp_path):
    from service.engine.errors import NotFound
    from service.engine.repository import ModelUnavailable

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:3])
    graph = directory / NAMES[2] / "model.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of a half-copied or damaged file
    graph.write_bytes(bytes(data))
    engines, repo = in_process(directory)
    with pytest.raises(ModelUnavailable) as refused:
        asyncio.run(repo.ensure(NAMES[2], 60))
    assert "model.onnx" in refused.value.message and "\n" not in refused.value.message
    row = next(r for r in repo.index() if r["name"] == NAMES[2])
    assert row["state"] == "UNAVAILABLE" and "model.onnx" in row["reason"]
    asyncio.run(repo.ensure(NAMES[1], 60))  # the others load and serve
    assert NAMES[1] in engines.names
    # names that are not a directory of the repository are never looked up on disk
    for bad in ("../" + NAMES[1], NAMES[1] + "/..", "..", "/etc", ".hidden", "a" * 300):
        asyncio.run(repo.ensure(bad, 60))  # not the repository's: the model table answers 404
        with pytest.raises(NotFound, match="GET /v1/models or POST /v2/repository/index"):
            engines.get(bad)


def test_bundles_added_and_removed_while_serving_and_idle_models_unload(repository_sources, tmp_path):
    from service.engine.errors import NotFound

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:2])
    engines, repo = in_process(directory, idle_unload_s=0.5)
    assert repo.available() == NAMES[:2]
    shutil.copytree(repository_sources[NAMES[2]][1].resolve(), directory / NAMES[2])  # dropped in: found by the
    time.sleep(MISS_SCAN_PERIOD_S)  # first request once the last listing is this old (a flood of misses lists it 5x a second)
    asyncio.run(repo.ensure(NAMES[2], 60))
    assert NAMES[2] in engines.names
    # removed from the directory while a request holds it: no new request reaches it (404), the one in flight
    # finishes on it, then it is unloaded
    held = engines.get(NAMES[2])
    held.leases += 1
    shutil.rmtree(directory / NAMES[2])
    repo.scan(force=True)
    repo.sweep()
    assert NAMES[2] not in engines.names and NAMES[2] not in repo.available()
    assert repo.entries[NAMES[2]].engine is held  # still loaded for the request in flight
    with pytest.raises(NotFound):
        asyncio.run(repo.ensure(NAMES[2], 60))
        engines.get(NAMES[2])
    held.leases -= 1
    repo.sweep()
    assert NAMES[2] not in repo.entries
    # idle for idle_unload_s: unloaded; the default (loaded by configuration) stays
    asyncio.run(repo.ensure(NAMES[1], 60))
    unloaded = weakref.ref(engines.get(NAMES[1]))
    time.sleep(0.6)
    repo.sweep()
    assert engines.names == [NAMES[0]]
    assert unloaded() is None  # nothing holds the unloaded model (its batch queue's task, its sessions), nor a
    # reference cycle: freed at once, with no garbage collection (which took 100 ms of the event loop)
    assert {r["name"]: r["state"] for r in repo.index()} == {NAMES[0]: "READY", NAMES[1]: "UNAVAILABLE"}


def test_loads_past_the_replicas_limit_wait_hot_first_and_an_unreadable_directory_keeps_what_was_listed(
        repository_sources, tmp_path, monkeypatch):
    from service.engine import repository
    from service.engine.repository import ModelsBusy

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:5])
    engines, repo = in_process(directory, max_concurrent_loads=1)
    repo.entries[NAMES[3]].uses = 50.0  # hot lately (used, then unloaded here)
    repo.entries[NAMES[3]].last_used = time.monotonic()
    order: list[str] = []
    loader = repo.loader
    repo.loader = lambda ref: (order.append(ref.name), loader(ref))[1]

    async def four_at_once() -> list:
        return await asyncio.gather(*(repo.ensure(n, 60) for n in NAMES[1:5]), return_exceptions=True)

    assert asyncio.run(four_at_once()) == [None] * 4  # one load at a time, the others waited their turn
    assert order[0] == NAMES[1] and order[1] == NAMES[3]  # the hot one first among those that waited
    # past the waiting bound, refused at once with Retry-After
    for name in NAMES[1:5]:
        repo._unload(repo.entries[name], "unloaded")
    monkeypatch.setattr(repository, "MAX_WAITING_LOADS", 0)
    first, second = asyncio.run(four_at_once())[:2]
    assert first is None and isinstance(second, ModelsBusy) and "max_concurrent_loads" in second.message
    moved = directory.with_name("moved")
    directory.rename(moved)  # the volume gone from under the replica
    try:
        repo.scan(force=True)
        assert "unreadable" in repo.scan_error and NAMES[1] in engines.names
        assert set(repo.available()) == set(NAMES[:5])  # what was listed stays listed
    finally:
        moved.rename(directory)
    repo.scan(force=True)
    assert repo.scan_error == ""


# ---- through Ray Serve: two replicas, a budget of about three models each ----

@pytest.fixture(scope="module")
def repository_app(ray_serve, default_bundle, repository_sources, tmp_path_factory):
    from ray import serve

    directory = repository_of(repository_sources, tmp_path_factory.mktemp("repository") / "models")
    budget = 16 << 20  # room for about three on each replica: one of these measures 3.5-5 MiB at its load
    deploy({"models_dir": str(directory), "replicas": 2, "num_cpus": 0.5, "model_memory_bytes": budget},
           APP, PREFIX, default_bundle)
    try:
        yield ray_serve.url + PREFIX, directory, budget
    finally:
        serve.delete(APP)


def test_a_rotation_over_twelve_models_on_two_replicas_fails_no_request_and_answers_as_each_model(
        repository_app, repository_sources, metrics_url):
    import openai

    url, _, budget = repository_app
    expected = references(repository_sources, NAMES)
    failed, answered = [], 0
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        for _ in range(2):
            for name in NAMES:
                try:
                    got = client.embeddings.create(model=name, input=TEXTS)
                except openai.APIError as exc:
                    failed.append((name, str(exc)))
                    continue
                answered += 1
                assert got.model == name
                assert min_cosine([d.embedding for d in got.data], expected[name]) > 0.9999, name
    assert not failed, failed
    listed = {m.id: m for m in openai.OpenAI(base_url=f"{url}/v1", api_key="none").models.list().data}
    assert set(NAMES) <= set(listed)
    # what each replica holds stays within its budget: the gauges of both replicas, set each second
    samples = poll(metrics_url, lambda f: total(f, "ray_encoder_model_loads_total", application=APP,
                                                outcome="loaded") >= len(NAMES) - 1
                   and total(f, "ray_encoder_model_evictions_total", application=APP, reason="memory") >= 1,
                   "the loads and evictions counted")
    per_replica: dict[str, float] = {}
    for s in samples["ray_encoder_model_loaded_bytes"].samples:
        if s.labels.get("application") == APP:
            per_replica[s.labels.get("replica", "")] = per_replica.get(s.labels.get("replica", ""), 0) + s.value
    assert per_replica and max(per_replica.values()) <= budget, per_replica
    record("a rotation over 12 on-demand models", "2 replicas, room for about 3 models each, 24 requests naming "
           "each model in turn", {"200": answered, "failed": len(failed)},
           note="every answer equal to sentence-transformers on the model's checkpoint (cosine > 0.9999)")


def haproxy_backend_rows(backend: str) -> list[str]:
    """An HAProxy backend's rows on its stats page (requests, retries, redispatches, status), to tell why."""
    stats = httpx.get(f"http://127.0.0.1:{os.environ['RAY_SERVE_HAPROXY_STATS_PORT']}/stats;csv", timeout=10).text
    lines = stats.splitlines()
    header = lines[0].lstrip("# ").split(",")
    wanted = ("pxname", "svname", "status", "stot", "wretr", "wredis", "chkdown", "lastchg", "scur")
    return [" ".join(f"{k}={v}" for k, v in zip(header, line.split(",")) if k in wanted) for line in lines[1:]
            if line.startswith((backend + ",", backend.removesuffix("-by-model") + ","))]


def replicas_holding(metrics_url: str, model: str) -> set[str]:
    """The replicas whose loaded-bytes gauge shows `model` (set each second)."""
    family = scrape(metrics_url).get("ray_encoder_model_loaded_bytes")  # none until a replica loads one
    return {s.labels["replica"] for s in (family.samples if family else [])
            if s.labels.get("application") == APP and s.labels.get("model") == model and s.value > 0}


def assert_loaded_once_on_one_replica(metrics_url: str, name: str, backend: str) -> None:
    """`name` loaded once, and held by one replica; else HAProxy's rows of `backend`, to tell why."""
    samples = poll(metrics_url, lambda f: total(f, "ray_encoder_model_loads_total", application=APP,
                                                model=name, outcome="loaded") >= 1, f"{name}'s load counted")
    loads = total(samples, "ray_encoder_model_loads_total", application=APP, model=name)
    held = replicas_holding(metrics_url, name)
    assert loads == 1 and len(held) == 1, (f"{name} loaded {loads:g} times, held by {held}; HAProxy's rows:\n" +
                                           "\n".join(haproxy_backend_rows(backend)))


@pytest.mark.parametrize("ingress", ["haproxy", "proxy"])
def test_a_models_requests_go_to_the_replica_that_holds_it_through_either_ingress(
        repository_app, repository_sources, metrics_url, ingress):
    """A model never loaded before (copied in now), named in the body of 12 requests one after another, and by
    v2's path: loaded once, on one replica of the two, behind HAProxy (its name hashed onto the replicas) and
    behind Ray Serve's proxy (its router sends it to the replica that said it holds it). Routed by load
    alone, both replicas took some of them and loaded it twice."""
    url, directory, _ = repository_app
    if ingress == "proxy":
        url = f"http://127.0.0.1:{os.environ['RAY_SERVE_FALLBACK_PROXY_HTTP_PORT']}{PREFIX}"
    # (the v2 load below goes under the app's route prefix: HAProxy once routed /PREFIX/v2/... by load alone, and
    # it loaded the model on the other replica in about half the runs where that one had fewer in flight)
    name = f"routed-{ingress}"
    shutil.copytree(repository_sources[NAMES[5]][1].resolve(), directory / name)
    try:
        with httpx.Client(timeout=120) as client:
            for i in range(12):
                r = client.post(f"{url}/v1/embeddings", json={"model": name, "input": [f"text {i}"]})
                assert r.status_code == 200, r.text
                if i == 0 and ingress == "proxy":
                    # the replica tells Serve's controller it holds the model as its load starts, and the
                    # controller tells the routers: until then (about a second) a request may load it elsewhere,
                    # as with Serve's own @serve.multiplexed. A MiniLM load takes 2 s; this one 0.07 s
                    time.sleep(2)
            r = client.post(f"{url}/v2/repository/models/{name}/load")
            assert r.status_code == 200, r.text
        assert_loaded_once_on_one_replica(metrics_url, name, f"http-{APP}-by-model")
    finally:
        shutil.rmtree(directory / name)


def test_a_models_grpc_calls_go_to_the_replica_that_holds_it_as_its_http_requests_do(
        repository_app, repository_sources, metrics_url, ray_serve):
    """Behind HAProxy, KServe v2 gRPC calls naming a model never loaded (copied in now): 8 ModelInfer calls one
    after another, then 4 HTTP requests for it: loaded once, on one replica of two (HAProxy reads the call's
    model_name from its message and hashes it onto the same ring as HTTP's). Routed by load, both replicas
    took some of them."""
    import tritonclient.grpc as triton_grpc

    url, directory, _ = repository_app
    name = "routed-grpc"
    shutil.copytree(repository_sources[NAMES[7]][1].resolve(), directory / name)
    try:
        client = triton_grpc.InferenceServerClient(ray_serve.grpc_target)
        for i in range(8):
            text = triton_grpc.InferInput("text", [1], "BYTES")
            text.set_data_from_numpy(np.array([f"text {i}".encode()], dtype=object))
            assert client.infer(name, [text], headers={"application": APP}).as_numpy("sentence_embedding").shape[0] == 1
        client.close()
        with httpx.Client(timeout=120) as http:
            for i in range(4):
                r = http.post(f"{url}/v1/embeddings", json={"model": name, "input": [f"text {i}"]})
                assert r.status_code == 200, r.text
        assert_loaded_once_on_one_replica(metrics_url, name, f"grpc-{APP}-by-model")
    finally:
        shutil.rmtree(directory / name)


def test_tritonclient_lists_loads_and_unloads_over_http_and_grpc(repository_app, ray_serve):
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    url, _, _ = repository_app
    http = triton_http.InferenceServerClient(url=url.removeprefix("http://"))
    index = http.get_model_repository_index()
    assert {m["name"] for m in index} >= set(NAMES)
    assert all(m["state"] in ("READY", "LOADING", "UNAVAILABLE") for m in index)
    http.load_model(NAMES[5])  # raises unless the replica that took it answered 200 once the model was ready
    http.unload_model(NAMES[5])
    with pytest.raises(triton_http.InferenceServerException, match=r"\[404\] model 'no-such-model' is not in the") \
            as refused:  # the client formats KServe's {"error": message} into its own
        http.load_model("no-such-model")
    assert refused.value.status() == "404"
    grpc = triton_grpc.InferenceServerClient(ray_serve.grpc_target)
    headers = {"application": APP}
    names = {m.name for m in grpc.get_model_repository_index(headers=headers).models}
    assert names >= set(NAMES)
    grpc.load_model(NAMES[6], headers=headers)
    grpc.unload_model(NAMES[6], headers=headers)
    with pytest.raises(triton_grpc.InferenceServerException) as refused:
        grpc.load_model("no-such-model", headers=headers)
    assert refused.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize("method, path, body, words", [
    ("POST", "/v1/embeddings", {"model": "no-such-model", "input": "a"}, "GET /v1/models"),
    ("POST", "/v1/encode", {"model": "no-such-model", "inputs": "a"}, "GET /v1/models"),
    ("POST", "/embed", {"model": "no-such-model", "inputs": "a"}, "GET /v1/models"),
    ("POST", "/v2/embed", {"model": "no-such-model", "texts": ["a"], "input_type": "search_document",
                           "embedding_types": ["float"]}, "GET /v1/models"),
    ("POST", "/v2/models/no-such-model/infer", {"inputs": []}, "GET /v1/models"),
    ("POST", "/v2/repository/models/no-such-model/load", None, "POST /v2/repository/index"),
    ("POST", "/v1/embeddings", {"model": "../" + NAMES[1], "input": "a"}, "GET /v1/models"),
    ("POST", "/v2/repository/models/..etc/load", None, "letters, digits"),
])
def test_a_model_not_in_the_repository_is_a_404_in_each_apis_style_with_no_load(repository_app, method, path, body,
                                                                                words):
    url, _, _ = repository_app
    r = httpx.request(method, url + path, json=body, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert words in r.text, r.text


def test_a_bundle_copied_in_while_serving_is_served_and_one_removed_is_gone(repository_app, repository_sources):
    url, directory, _ = repository_app
    name = "added-" + NAMES[3]
    shutil.copytree(repository_sources[NAMES[3]][1].resolve(), directory / name)
    try:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": TEXTS}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        shutil.rmtree(directory / name)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": TEXTS}, timeout=120)
        if r.status_code == 404:
            break
        time.sleep(0.5)
    assert r.status_code == 404, r.text


def test_the_repository_is_served_with_no_bundle_named(repository_sources, tmp_path):
    """`python -m service --models-dir DIR` with no --bundle: the settings take the first model by name as the
    default, and the command line offers the flag."""
    from service.config import ServiceSettings

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:2])
    s = ServiceSettings(models_dir=directory)
    assert [b.name for b in s.bundles] == [NAMES[0]]
    with pytest.raises(ValueError, match="no bundle in it"):
        ServiceSettings(models_dir=tmp_path)
    assert os.path.isdir(directory)


def test_eager_models_load_at_start_and_stay(repository_sources, tmp_path):
    """`eager_models` (`--eager-model`): loaded at start beside the default, outside the budget, never unloaded
    for another model's room or on request; a name that is not in the directory is refused at start; the
    settings validate again as they dump (a replica's copy)."""
    from service.config import ServiceSettings
    from service.engine.errors import BadRequest
    from service.engine.repository import ModelsBusy

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:4])
    engines, repo = in_process(directory, budget=1024, eager_models=[NAMES[2]])
    assert sorted(engines.names) == sorted([NAMES[0], NAMES[2]]) and repo.used_bytes() == 0
    with pytest.raises(BadRequest, match="loaded at start"):
        repo.unload(NAMES[2])
    with pytest.raises(ModelsBusy):  # a budget of 1 KiB fits no on-demand model, and the eager one stays
        asyncio.run(repo.ensure(NAMES[1], 60))
    assert NAMES[2] in engines.names
    s = ServiceSettings(models_dir=directory, eager_models=[NAMES[3], NAMES[2]])
    assert [b.name for b in s.bundles] == [NAMES[0], NAMES[3], NAMES[2]]
    assert ServiceSettings.model_validate(s.model_dump()).bundles == s.bundles
    s = ServiceSettings(models_dir=directory, model_placement={NAMES[1]: {"load": "eager"}, NAMES[3]: {"min_loaded": 1}})
    assert [b.name for b in s.bundles] == [NAMES[0], NAMES[1]]  # an entry's `load: eager`; min_loaded loads on demand
    assert ServiceSettings.model_validate(s.model_dump()).bundles == s.bundles
    for wrong in ({"min_loaded": 2, "max_loaded": 1}, {"min_loaded": 1, "max_loaded": 1}):
        with pytest.raises(ValueError, match="less than max_loaded"):  # the routed replica must be able to load it
            ServiceSettings(models_dir=directory, model_placement={NAMES[1]: wrong})
    with pytest.raises(ValueError, match="takes no max_loaded"):
        ServiceSettings(models_dir=directory, model_placement={NAMES[1]: {"load": "eager", "max_loaded": 1}})
    for wrong in ("no-such-model", "../models"):
        with pytest.raises(ValueError, match="is not a model of models_dir"):
            ServiceSettings(models_dir=directory, eager_models=[wrong])
    with pytest.raises(ValueError, match="give it with models_dir"):
        ServiceSettings(bundle=directory / NAMES[0], eager_models=[NAMES[1]])


def test_a_flood_naming_every_model_is_bounded_and_the_hot_model_keeps_serving(repository_app, metrics_url):
    """Four clients for 10 s, each request naming another cold model, beside a client of one hot model: the
    flood gets answers or 503s with Retry-After (loads bounded by the budget and max_concurrent_loads), never
    a 5xx of another kind, and the hot model, used all along, is never evicted for the cold ones: it stays
    loaded throughout, and its requests are answered. Those HAProxy spills over to the other replica while
    the flood's requests crowd its own (bounded load) may find that one's room held by the cold models it
    serves: a 503 with Retry-After, counted and bounded here (before requests were routed by model, each
    replica served the hot model and none was refused; routed, 3-5 of 465-480 were until a request counted as a
    use of its model where it was refused too, then 0 of 261, 2026-11-29)."""
    url, _, _ = repository_app
    hot, cold = NAMES[1], NAMES[2:]
    body = {"input": TEXTS}
    from concurrent.futures import ThreadPoolExecutor

    # the hot model loaded first, on the replica its requests are routed to (docs/models.md, "Routing"), until the
    # replicas' gauges show it
    deadline = time.monotonic() + 90
    with httpx.Client(timeout=60) as c, ThreadPoolExecutor(8) as pool:
        while not replicas_holding(metrics_url, hot):
            assert time.monotonic() < deadline, f"{hot} not loaded on a replica"
            list(pool.map(lambda _: c.post(f"{url}/v1/embeddings", json={**body, "model": hot}), range(16)))
            time.sleep(1.5)
    stop = time.monotonic() + 10
    flood_statuses: dict[str, int] = {}
    hot_statuses: dict[str, int] = {}
    missing_retry_after = []
    hot_refusals: list[str] = []

    def flood(offset: int) -> None:
        with httpx.Client(timeout=60) as c:
            i = offset
            while time.monotonic() < stop:
                r = c.post(f"{url}/v1/embeddings", json={**body, "model": cold[i % len(cold)]})
                flood_statuses[str(r.status_code)] = flood_statuses.get(str(r.status_code), 0) + 1
                if r.status_code == 503 and "retry-after" not in r.headers:
                    missing_retry_after.append(r.text)
                i += 1

    def hot_client() -> None:
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < stop:
                r = c.post(f"{url}/v1/embeddings", json={**body, "model": hot})
                hot_statuses[str(r.status_code)] = hot_statuses.get(str(r.status_code), 0) + 1
                if r.status_code != 200:
                    hot_refusals.append(r.text[:300])
                if r.status_code == 503 and "retry-after" not in r.headers:
                    missing_retry_after.append(r.text)

    import threading

    threads = [threading.Thread(target=flood, args=(k * 3,)) for k in range(4)] + [threading.Thread(target=hot_client)]
    for t in threads:
        t.start()
    holding = []
    while any(t.is_alive() for t in threads) and time.monotonic() < stop + 90:
        holding.append(len(replicas_holding(metrics_url, hot)))  # the gauges, set each second
        time.sleep(0.5)
    for t in threads:
        t.join(timeout=90)
    assert set(flood_statuses) <= {"200", "503"} and flood_statuses.get("200", 0) > 0, flood_statuses
    assert not missing_retry_after, missing_retry_after[:2]
    assert holding and min(holding) >= 1, holding  # never thrashed out: loaded on a replica all along
    assert set(hot_statuses) <= {"200", "503"}, (hot_statuses, hot_refusals[:3])
    assert hot_statuses.get("200", 0) >= 0.9 * sum(hot_statuses.values()), (hot_statuses, hot_refusals[:3])
    assert all('"overloaded"' in r for r in hot_refusals), hot_refusals[:3]
    record("a flood naming a different model each request", "4 clients for 10 s, each request a cold model of 10, "
           "beside a client of a hot one; 2 replicas with room for about 3 models each",
           {f"flood {k}": v for k, v in flood_statuses.items()} | {f"hot {k}": v for k, v in hot_statuses.items()},
           note="loads bounded by the budget and one load at a time per replica (503 + Retry-After); the hot "
           "model never evicted")


def test_with_min_replicas_0_the_repository_scales_to_no_replica_and_the_first_request_starts_one(
        ray_serve, repository_sources, tmp_path):
    """Ray Serve's autoscaling with min_replicas 0: idle, the deployment goes to no replica; the first request
    after that waits while one starts (the default model loaded, then its own), and is answered."""
    from ray import serve

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:2])
    url = ray_serve.url + "/to-zero"
    from service.app import build_app
    from service.config import ServiceSettings

    # serve.run, not deploy(): with no replica at first, the ingress's first answer waits for one to start
    serve.run(build_app(ServiceSettings(models_dir=directory, num_cpus=0.5, autoscaling={
        "min_replicas": 0, "max_replicas": 1, "upscale_delay_s": 0, "downscale_delay_s": 2,
        "target_ongoing_requests": 1})), name="to-zero", route_prefix="/to-zero",
        logging_config={"enable_access_log": False})
    try:
        assert httpx.get(f"{url}/v2/health/live", timeout=120).status_code == 200
        def replicas() -> int:
            app = serve.status().applications["to-zero"]
            return sum(app.deployments["Encoder"].replica_states.values()) if app.deployments else 0

        deadline = time.monotonic() + 90
        while replicas() > 0:
            assert time.monotonic() < deadline, "the deployment did not scale to zero replicas"
            time.sleep(1)
        started = time.perf_counter()
        r = httpx.post(f"{url}/v1/embeddings", json={"model": NAMES[1], "input": TEXTS}, timeout=120)
        cold = time.perf_counter() - started
        assert r.status_code == 200, r.text
        warm_started = time.perf_counter()
        assert httpx.post(f"{url}/v1/embeddings", json={"model": NAMES[1], "input": TEXTS}, timeout=60).status_code == 200
        warm = time.perf_counter() - warm_started
        record("scale to zero and back", "min_replicas 0: idle until no replica runs, then one request naming an "
               "on-demand model", {"200": 2}, note=f"the first request {cold:.1f} s (a replica started, the default "
               f"and the named model loaded), the next {warm * 1000:.0f} ms")
        print(f"cold start {cold:.2f} s, warm {warm * 1000:.0f} ms")
    finally:
        serve.delete("to-zero")


def read_chars(pid: int) -> int:
    """Bytes a process has read so far, page cache included (/proc/PID/io's rchar)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no rchar in /proc/{pid}/io")


def test_a_replica_killed_while_it_loads_a_model_costs_no_request(ray_serve, default_bundle, repository_sources,
                                                                   tmp_path):
    """Two replicas; a request names an on-demand model (all-MiniLM-L6-v2, a load of about 2 s: its 300 MB
    hashed, its sessions built) and its replica is killed with SIGKILL while it reads the bundle. The load is
    lost with the replica; the request is not: HAProxy sends it again to the other replica, which loads the
    model and answers 200. Serve starts a replacement, and the model is served after it too."""
    import signal

    from ray import serve

    from tests.conftest import haproxy_servers_up

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:1])
    name = "minilm-on-demand"
    os.symlink(default_bundle.resolve(), directory / name)
    app, prefix = "killed-mid-load", "/killed-mid-load"
    deploy({"models_dir": str(directory), "replicas": 2, "num_cpus": 0.5, "model_memory_bytes": 2 << 30,
            "request_timeout_s": 120}, app, prefix, default_bundle)
    url = ray_serve.url + prefix
    try:
        handle = serve.get_deployment_handle("Encoder", app)
        pids: set[int] = set()
        wait_until(lambda: pids.add(handle.info.remote().result(timeout_s=30)["pid"]) or len(pids) == 2,
                   "both replicas' pids", timeout=60, interval=0.05)
        before = {pid: read_chars(pid) for pid in pids}
        outcome: dict = {}

        def request() -> None:
            started = time.monotonic()
            try:
                r = httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": TEXTS}, timeout=180)
                outcome.update(status=r.status_code, body=r.json(), seconds=time.monotonic() - started)
            except httpx.HTTPError as exc:
                outcome.update(status=repr(exc), seconds=time.monotonic() - started)

        import threading

        sent = threading.Thread(target=request)
        sent.start()
        # the replica reading the bundle (its hashes first) is the one loading it
        loading = wait_until(lambda: next((p for p in pids if read_chars(p) - before[p] > 32 << 20), None),
                             "a replica to start loading the model", timeout=60, interval=0.01)
        os.kill(loading, signal.SIGKILL)
        sent.join(timeout=200)
        assert outcome.get("status") == 200, outcome
        assert len(outcome["body"]["data"]) == 2 and len(outcome["body"]["data"][0]["embedding"]) == 384
        # a replacement replica, then the model served again: both replicas up behind HAProxy

        def replacement() -> int | None:
            try:
                pid = handle.info.remote().result(timeout_s=10)["pid"]
            except Exception:  # noqa: BLE001 - no replica to answer yet
                return None
            return pid if pid not in pids else None

        wait_until(replacement, "a replacement replica to answer", timeout=120, interval=0.2)
        wait_until(lambda: haproxy_servers_up(f"http-{app}") == 2, "HAProxy to see 2 replicas up again", timeout=120)
        again = httpx.post(f"{url}/v1/embeddings", json={"model": name, "input": TEXTS}, timeout=180)
        assert again.status_code == 200, again.text
        record("a replica killed while it loads a model", "SIGKILL to the replica loading all-MiniLM-L6-v2 on demand "
               "(2 replicas), the request that asked for it waiting", {"200": 2},
               note=f"the request was sent again by HAProxy and answered in {outcome['seconds']:.1f} s (the other "
               "replica loaded the model); the replacement replica served it too")
    finally:
        serve.delete(app)


def test_requests_for_a_loaded_model_count_as_its_uses(repository_sources, tmp_path):
    """Every route awaits EncoderService.load_if_needed with the model its request names: for a loaded model it
    counts the request, so the hot model, loaded once and used since, is not the idle one that makes room.
    (Found by make bench-models: only loads were counted, the hot model was unloaded as often as the cold
    ones, and its p99 was 25x one model's; counted, 1.04x.)"""
    from service.config import ServiceSettings
    from service.engine.encoder_service import EncoderService

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:5])
    engines, repo = in_process(directory)
    svc = EncoderService(ServiceSettings(models_dir=directory, default_model=NAMES[0], warmup=False), engines)
    svc.repository = repo

    async def requests() -> None:
        for name in NAMES[1:4]:  # each loaded by its first request, the first model longest ago
            await svc.load_if_needed(name, 60)
        for _ in range(5):  # then the first used by five more
            await svc.load_if_needed(NAMES[1], 60)
        for name in NAMES[1:4]:
            repo.entries[name].bytes = 100 << 20
        repo.budget_bytes = 300 << 20
        await svc.load_if_needed(NAMES[4], 60)

    asyncio.run(requests())
    assert sorted(engines.names) == sorted([NAMES[0], NAMES[1], NAMES[3], NAMES[4]])  # the second made room


# ---- min_loaded and max_loaded (model_placement): what the replicas hold, told through the board ----

def placed(directory: Path, placement: dict, replicas: list[str], app: str, **settings) -> list:
    """A repository per replica name, as the deployment builds each, all telling one board (a real Ray actor,
    named for `app`). Called inside the test's event loop: each repository's sweeper runs, reporting each second."""
    from service.hosting.placement import Placement

    made = []
    for replica in replicas:
        engines, repo = in_process(directory, **settings)
        repo.placement = Placement(app, replica, models_placed(placement))
        made.append((engines, repo))
    return made


def models_placed(placement: dict) -> dict:
    from service.config import ModelPlacement

    return {name: ModelPlacement.model_validate(p) for name, p in placement.items()}


def forget_board(app: str) -> None:
    import ray

    from service.hosting.placement import NAMESPACE

    ray.kill(ray.get_actor(f"encoder-placement-{app}", namespace=NAMESPACE))


async def eventually(check, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


def test_max_loaded_keeps_a_model_on_that_many_replicas_and_the_one_refused_it_takes_it_over(
        ray_serve, repository_sources, tmp_path):
    """max_loaded 1 on two replicas: the second asked for the model while the first holds it answers 503 with
    Retry-After and loads nothing; the first, idle, then gives the model up ("moved"), and the second's next
    request loads it: a replica to which every request for it is routed (after a reload of the ring) is not
    refused for ever. Without a bound both replicas load it."""
    from service.engine.repository import ModelElsewhere

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:3])
    app = f"placement-max-{os.getpid()}"

    async def scenario() -> None:
        (e1, r1), (e2, r2) = placed(directory, {NAMES[1]: {"max_loaded": 1}}, ["a", "b"], app)
        await r1.ensure(NAMES[1], 60)
        with pytest.raises(ModelElsewhere) as refused:
            await r2.ensure(NAMES[1], 60)
        assert refused.value.retry_after_s == 1 and "max_loaded (1)" in refused.value.message, refused.value
        assert NAMES[1] not in e2.names and r2.entries[NAMES[1]].loads == 0
        moved_at = time.monotonic()
        while True:  # its client retrying, as Retry-After says
            try:
                await r2.ensure(NAMES[1], 60)
                break
            except ModelElsewhere:
                assert time.monotonic() - moved_at < 15, "the replica holding it never gave it up"
                await asyncio.sleep(0.5)
        assert NAMES[1] in e2.names and r1.entries[NAMES[1]].engine is None
        with pytest.raises(ModelElsewhere):
            await r1.ensure(NAMES[1], 60)
        await asyncio.gather(r1.ensure(NAMES[2], 60), r2.ensure(NAMES[2], 60))  # no bound: both load it
        assert NAMES[2] in e1.names and NAMES[2] in e2.names

    try:
        asyncio.run(scenario())
    finally:
        forget_board(app)


def test_min_loaded_keeps_a_model_loaded_on_that_many_replicas_and_another_takes_a_gone_ones_place(
        ray_serve, repository_sources, tmp_path):
    """min_loaded 2 on three replicas: two load the model with no request and keep it past idle_unload_s; one
    of them gone (it reports no more), the third loads it within a few seconds."""
    from service.hosting.placement import STALE_S

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:2])
    app = f"placement-min-{os.getpid()}"

    async def scenario() -> None:
        made = placed(directory, {NAMES[1]: {"min_loaded": 2}}, ["a", "b", "c"], app, idle_unload_s=0.5)

        def holders(among=made) -> set[str]:
            return {r.placement.replica for _, r in among if r.entries[NAMES[1]].engine is not None}

        await eventually(lambda: len(holders()) == 2, "two replicas to load the kept model")
        first = holders()
        await asyncio.sleep(2.0)  # idle four times idle_unload_s: kept
        assert holders() == first
        gone = next(r for _, r in made if r.placement.replica in first)
        gone._sweeper.cancel()  # as a replica that died: heard no more
        others = [(e, r) for e, r in made if r is not gone]
        await eventually(lambda: len(holders(others)) == 2, "the third replica to take the gone one's place",
                         STALE_S + 15)

    try:
        asyncio.run(scenario())
    finally:
        forget_board(app)


def replica_addresses(backend: str) -> list[str]:
    """The host:port of each replica behind an HAProxy backend, from the config Ray writes for this node's
    HAProxy: to call one directly."""
    import ray
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_CONFIG_FILE_LOC

    config = Path(RAY_SERVE_HAPROXY_CONFIG_FILE_LOC).parent / ray.get_runtime_context().get_node_id() / "haproxy.cfg"
    section = config.read_text().split(f"\nbackend {backend}\n", 1)[1].split("\nbackend ", 1)[0]
    return sorted(line.split()[2] for line in section.splitlines()
                  if line.strip().startswith("server SERVE_REPLICA"))


def test_model_placement_through_ray_serve(ray_serve, default_bundle, repository_sources, metrics_url, tmp_path):
    """The deployment's replicas share the board: min_loaded 2 is held on both replicas with no request; a model
    with max_loaded 1, asked of one replica and then of the other directly (as a request spilled over would
    be), is loaded by the first and refused by the second (503 with Retry-After in OpenAI's error body), until
    the first, idle, gives it up and the second's retry loads it. Deleting the application ends its detached
    actors (the board, and the limits' memory store a keys file starts)."""
    import hashlib

    import ray
    from ray import serve

    from service.front.quotas import store_name
    from service.hosting.placement import NAMESPACE, board_name

    directory = repository_of(repository_sources, tmp_path / "models", NAMES[:3])
    app, prefix = "placed", "/placed"
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"keys: [{{name: placer, sha256: {hashlib.sha256(b'placer-secret').hexdigest()}}}]\n")
    deploy({"models_dir": str(directory), "replicas": 2, "num_cpus": 0.5, "keys_file": str(keys_file),
            "model_placement": {NAMES[1]: {"min_loaded": 2}, NAMES[2]: {"max_loaded": 1}}}, app, prefix, default_bundle)
    auth = {"authorization": "Bearer placer-secret"}
    deleted = False
    try:
        def holding(name: str) -> set[str]:
            family = scrape(metrics_url).get("ray_encoder_model_loaded_bytes")
            return {s.labels["replica"] for s in (family.samples if family else [])
                    if s.labels.get("application") == app and s.labels.get("model") == name and s.value > 0}

        wait_until(lambda: len(holding(NAMES[1])) == 2, "both replicas to keep the min_loaded model", timeout=60)
        first, second = (f"http://{addr}{prefix}/v1/embeddings" for addr in replica_addresses(f"http-{app}"))
        body = {"model": NAMES[2], "input": TEXTS}
        assert httpx.post(first, json=body, headers=auth, timeout=60).status_code == 200
        refused = httpx.post(second, json=body, headers=auth, timeout=60)
        assert refused.status_code == 503 and refused.headers.get("retry-after") == "1", refused.text
        assert refused.json()["error"]["type"] == "overloaded" and "max_loaded (1)" in refused.json()["error"]["message"]
        deadline = time.monotonic() + 20
        while (r := httpx.post(second, json=body, headers=auth, timeout=60)).status_code == 503:  # retrying as Retry-After says
            assert time.monotonic() < deadline, "the first replica never gave the model up"
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        # the gauges are set each second, and exported on their own schedule: the first replica's drop can show
        # before the second's load (a scrape then sees none)
        wait_until(lambda: len(holding(NAMES[2])) == 1, "one replica holding the max_loaded model", timeout=15)
        names = (board_name(app), store_name(app))
        assert all(ray.get_actor(name, namespace=NAMESPACE) for name in names)
        serve.delete(app)
        deleted = True

        def ended(name: str) -> bool:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return True
            return False

        wait_until(lambda: all(ended(name) for name in names), "the deleted application's actors to end", timeout=30)
    finally:
        if not deleted:
            serve.delete(app)
