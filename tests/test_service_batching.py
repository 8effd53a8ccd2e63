"""Dynamic batching under concurrency: fewer batches than requests, and no mix-ups."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from service.engine.runner import pad, plan_sub_batches
from tests.conftest import wait_until
from tests.holding import deploy_holding

SUBJECTS = ["cat", "dog", "ship", "river", "violin", "mountain", "bakery", "satellite"]
VERBS = ["watches", "paints", "remembers", "follows", "builds", "hears"]


def distinct_texts(n: int) -> list[str]:
    texts = []
    for i in range(n):
        s, v = SUBJECTS[i % len(SUBJECTS)], VERBS[(i // len(SUBJECTS)) % len(VERBS)]
        texts.append(f"The {s} {v} {'the old ' * (i % 7)}{SUBJECTS[(i * 3 + 1) % len(SUBJECTS)]} number {i}.")
    return texts


def test_plan_sub_batches_respects_budget_and_keeps_every_text():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 257, size=200).tolist()
    groups = plan_sub_batches(lengths, token_budget=1024, max_size=32)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(200))
    for g in groups:
        assert len(g) <= 32
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 1024
    real = sum(lengths)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    assert 1 - real / padded < 0.15, "length-sorted groups waste little on padding"
    bounded = plan_sub_batches(lengths, token_budget=1024, max_size=32, max_padding=0.05)
    assert sorted(i for g in bounded for i in g) == list(range(200))
    for g in bounded:  # every group within the padding bound, each text once
        longest = max(lengths[i] for i in g)
        assert len(g) == 1 or 1 - sum(lengths[i] for i in g) / (len(g) * longest) <= 0.05


def test_pad_builds_ids_and_mask():
    ids, mask = pad([np.array([101, 5, 102]), np.array([101, 102])], pad_id=0)
    assert ids.tolist() == [[101, 5, 102], [101, 102, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0]]


def test_concurrent_requests_are_batched_and_each_client_gets_its_own_result(ray_serve, default_bundle, checkpoint):
    """64 single-text clients queue behind a running batch (held until all of them are in the
    replica), then run in far fewer batches than requests, and every client gets its own text's
    embedding."""
    from ray import serve
    from sentence_transformers import SentenceTransformer

    texts = distinct_texts(64)
    reference = SentenceTransformer(str(checkpoint.path), device="cpu").encode(texts, convert_to_numpy=True)
    handle = deploy_holding("batching", "/batching", default_bundle, num_cpus=0.5,
                            batching={"max_concurrent_batches": 1})
    url = f"{ray_serve.url}/batching"
    try:
        before = handle.info.remote().result()
        admitted = lambda: handle.info.remote().result()["load"]["inference_requests_admitted"]  # noqa: E731

        def one(i: int) -> tuple[int, list[float]]:
            with httpx.Client(base_url=url, timeout=60) as c:
                r = c.post("/v1/encode", json={"inputs": texts[i]})
                assert r.status_code == 200, r.text
                return i, r.json()["data"][0]["embedding"]

        with ThreadPoolExecutor(max_workers=65) as pool:
            first = pool.submit(lambda: httpx.post(f"{url}/v1/encode", json={"inputs": ["the batch that is held"]},
                                                   timeout=60).status_code)
            wait_until(lambda: handle.held.remote().result() == 1, "the first request's batch to be held")
            results = pool.map(one, range(len(texts)))
            wait_until(lambda: admitted() - before["load"]["inference_requests_admitted"] == 1 + len(texts),
                       "all 64 concurrent requests to be inside the replica")
            handle.release.remote().result()
            results = list(results)
            assert first.result() == 200
        after = handle.info.remote().result()["counters"]
    finally:
        serve.delete("batching")
    requests = after["requests"] - before["counters"]["requests"] - 1
    batches = after["batches"] - before["counters"]["batches"] - 1
    assert requests == len(texts) and after["texts"] - before["counters"]["texts"] == len(texts) + 1
    assert batches < requests / 4, f"{batches} batches for {requests} queued requests: they were not batched"

    got = np.array([emb for _, emb in sorted(results)])
    similarity = got @ reference.T  # unit vectors: cosine matrix
    assert np.all(np.argmax(similarity, axis=1) == np.arange(len(texts))), "a client got another input's embedding"
    assert np.diag(similarity).min() >= 0.9999
    print(f"\n{requests} concurrent requests ran in {batches} batches")


def test_mixed_client_batches_keep_order(service_url, checkpoint):
    from sentence_transformers import SentenceTransformer

    texts = distinct_texts(40)
    reference = SentenceTransformer(str(checkpoint.path), device="cpu").encode(texts, convert_to_numpy=True)
    chunks = [texts[0:3], texts[3:20], texts[20:21], texts[21:40]]

    def one(chunk: list[str]) -> list[list[float]]:
        with httpx.Client(base_url=service_url, timeout=60) as c:
            r = c.post("/v1/encode", json={"inputs": chunk})
            assert r.status_code == 200
            return [d["embedding"] for d in r.json()["data"]]

    with ThreadPoolExecutor(max_workers=4) as pool:
        got = np.array([e for chunk in pool.map(one, chunks) for e in chunk])
    assert np.diag(got @ reference.T).min() >= 0.9999


def test_a_batch_of_large_attention_requests_is_split_by_its_attention_bound(ray_serve, default_bundle):
    """Four requests for attention weights queue behind a held batch. By tokens they fit one batch;
    each holds 60 % of the per-batch attention bound, so they run one per batch, and no batch holds
    more attention weights than the bound."""
    from ray import serve

    text = "a sentence long enough that its attention weights count " * 3
    layers, heads = 6, 12
    one = {"inputs": [text], "embedding": False, "attention": {"format": "base64", "dtype": "float16"}}
    with httpx.Client(timeout=60) as c:
        n = len(c.post(f"{ray_serve.url}/v1/tokenize", json={"inputs": [text]}).json()["data"][0]["tokens"])
    values = layers * heads * n * n
    bound = int(values / 0.6)
    handle = deploy_holding("attn-bound", "/attn-bound", default_bundle, num_cpus=0.5,
                            batching={"max_concurrent_batches": 1, "max_batch_attention_values": bound})
    url = f"{ray_serve.url}/attn-bound"
    try:
        before = handle.info.remote().result()
        admitted = lambda: handle.info.remote().result()["load"]["inference_requests_admitted"]  # noqa: E731
        with ThreadPoolExecutor(max_workers=5) as pool:
            first = pool.submit(lambda: httpx.post(f"{url}/v1/encode", json={"inputs": ["held"]}, timeout=60))
            wait_until(lambda: handle.held.remote().result() == 1, "the first request's batch to be held")
            large = [pool.submit(lambda: httpx.post(f"{url}/v1/encode", json=one, timeout=60)) for _ in range(4)]
            wait_until(lambda: admitted() - before["load"]["inference_requests_admitted"] == 5,
                       "the four attention requests to be inside the replica")
            handle.release.remote().result()
            assert first.result().status_code == 200
            assert [f.result().status_code for f in large] == [200] * 4
        after = handle.info.remote().result()
    finally:
        serve.delete("attn-bound")
    batches = after["counters"]["batches"] - before["counters"]["batches"]
    requests = after["counters"]["requests"] - before["counters"]["requests"]
    assert (requests, batches) == (5, 5), (requests, batches)  # the held one, then one per large request


def test_a_live_max_concurrent_batches_starts_queued_work_and_resizes_the_threads(ray_serve, default_bundle):
    """Serve applies a new user_config (max_concurrent_batches 1 -> 2) to the running replica, with no
    restart: the request queued behind a held batch starts its own at once, nothing else happening, and /info
    shows the threads its sessions now have (the replica's 2 CPUs shared by 2 batches: 1 each), and the
    row of the runtime table that chose its runtime."""
    import os

    from ray import cloudpickle, serve

    import tests.holding as holding
    from service.app import compose
    from service.config import ServiceSettings

    cloudpickle.register_pickle_by_value(holding)
    # a fixed code version, as a Serve config file gives one (serve.run makes a new one per call, which
    # restarts every replica): so that the second run changes only user_config, applied by reconfigure
    encoder = serve.deployment(holding.HoldsTheFirstBatch, name="Encoder").options(version="live-threads", _internal=True)
    name, url = "live-threads", f"{ray_serve.url}/live-threads"
    base = {"bundle": str(default_bundle), "num_cpus": 2, "runtime": "onnxruntime"}

    def run(concurrent: int) -> None:
        settings = ServiceSettings.model_validate({**base, "batching": {"max_concurrent_batches": concurrent}})
        serve.run(compose(settings, encoder), name=name, route_prefix=f"/{name}", logging_config={"enable_access_log": False})

    cpus = min(2, len(os.sched_getaffinity(0)))
    run(1)
    handle = serve.get_deployment_handle("Encoder", name)
    try:
        before = httpx.get(f"{url}/info", timeout=30).json()
        assert (before["intra_op_threads"], before["batching"]["max_concurrent_batches"]) == (cpus, 1), before
        choice = before["runtime_choice"]
        assert choice["matched"] == choice["table"][choice["rule"]] and choice["matched"].startswith("runtime onnxruntime")
        with ThreadPoolExecutor(max_workers=2) as pool:
            held = pool.submit(lambda: httpx.post(f"{url}/v1/encode", json={"inputs": ["held"]}, timeout=120))
            wait_until(lambda: handle.held.remote().result() == 1, "the first request's batch to hold the only slot")
            queued = pool.submit(lambda: httpx.post(f"{url}/v1/encode", json={"inputs": ["queued"]}, timeout=120))
            wait_until(lambda: handle.info.remote().result()["load"]["requests_queued"] == 1, "a request queued behind it")
            run(2)  # user_config only: Serve calls reconfigure on the running replica
            # the queued request forms a batch in the new slot at once (the holding replica holds it too)
            wait_until(lambda: handle.held.remote().result() == 2, "the queued request's batch to start", timeout=20)
            assert handle.info.remote().result()["load"]["requests_queued"] == 0 and not held.done()
            after = httpx.get(f"{url}/info", timeout=30).json()
            handle.release.remote().result()
            assert [f.result(timeout=60).status_code for f in (held, queued)] == [200, 200]
    finally:
        serve.delete(name)
    assert (after["replica"]["replica_id"], after["replica"]["pid"]) == (before["replica"]["replica_id"], before["replica"]["pid"])
    assert after["batching"]["max_concurrent_batches"] == 2
    assert after["intra_op_threads"] == max(1, cpus // 2), after["intra_op_threads"]
