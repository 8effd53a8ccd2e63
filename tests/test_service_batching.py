"""Dynamic batching under concurrency: fewer batches than requests, and no mix-ups."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from service.batching import pad, plan_sub_batches

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


def test_concurrent_requests_are_batched_and_each_client_gets_its_own_result(service_url, encoder_handle, checkpoint):
    from sentence_transformers import SentenceTransformer

    texts = distinct_texts(64)
    reference = SentenceTransformer(str(checkpoint.path), device="cpu").encode(texts, convert_to_numpy=True)
    before = encoder_handle.info.remote().result()["counters"]

    def one(i: int) -> tuple[int, list[float]]:
        with httpx.Client(base_url=service_url, timeout=60) as c:
            r = c.post("/v1/encode", json={"inputs": texts[i]})
            assert r.status_code == 200, r.text
            return i, r.json()["data"][0]["embedding"]

    def busy() -> int:
        """One long request first: the encoder computes it while the others arrive and queue."""
        with httpx.Client(base_url=service_url, timeout=60) as c:
            return c.post("/v1/encode", json={"inputs": ["word " * 250] * 64}).status_code

    with ThreadPoolExecutor(max_workers=33) as pool:
        long_request = pool.submit(busy)
        time.sleep(0.05)
        results = list(pool.map(one, range(len(texts))))
        assert long_request.result() == 200

    after = encoder_handle.info.remote().result()["counters"]
    requests = after["requests"] - before["requests"] - 1
    batches = after["batches"] - before["batches"] - 1
    assert requests == len(texts) and after["texts"] - before["texts"] == len(texts) + 64
    assert batches < requests, f"{batches} batches for {requests} concurrent requests: nothing was batched"

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
