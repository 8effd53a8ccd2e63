"""Each key's limits (issue 58), counted for the whole service: the store in-process (limits' memory storage and
a real redis-server on loopback), then two keys with different limits against two replicas through Ray Serve,
counted in Redis: requests per minute hold to within one request across the replicas, tokens per minute refuse
before the batch, concurrent requests, the answers each API's clients read (OpenAI's body and x-ratelimit-*
headers, TEI's, Cohere's, KServe v2's, gRPC RESOURCE_EXHAUSTED with the same facts in trailing metadata), the
openai SDK's own retry ending in success once the window refills, and Redis stopped mid-test (limited keys
refused with 503, the others served, and counted again once it is back)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import time

import grpc
import httpx
import pytest
import yaml

from service.front.quotas import LimitStore, duration
from tests.conftest import deploy, wait_until
from tests.redis_server import redis_server  # noqa: F401 - the fixture, used by name
from tests.errors import error_message, error_type

APP = "quotas"
MODEL = "all-MiniLM-L6-v2"


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


# ---- the store in-process: limits' memory storage and a real Redis ----

@pytest.mark.parametrize("where", ["memory", "redis"])
def test_a_store_counts_requests_tokens_and_leases_and_says_when_they_refill(where, redis_server):
    store = LimitStore("memory://" if where == "memory" else redis_server.uri)
    name = f"key-{where}-{time.monotonic_ns()}"

    async def scenario() -> None:
        answers = [await store.charge(name, "requests", 3, 1) for _ in range(4)]
        assert [a for a, _ in answers] == [True, True, True, False]  # the fourth is not counted
        assert [w.remaining for _, w in answers] == [2, 1, 0, 0] and 0 < answers[-1][1].reset_s <= 60
        assert (await store.charge(name, "tokens", 100, 60))[0]
        refused, window = await store.charge(name, "tokens", 100, 60)  # 120 > 100: refused, nothing counted
        assert not refused and window.remaining == 40
        assert (await store.charge(name, "tokens", 100, 40))[0]
        leases = [await store.lease(name, 2, 30, f"lease-{i}") for i in range(3)]
        assert leases[:2] == ["lease-0", "lease-1"] and leases[2] is None
        assert await store.in_flight(name) == 2
        await store.release(name, leases[0])
        assert await store.lease(name, 2, 30, "lease-3")
        assert await store.lease(name + "-expiring", 1, 0.2, "a") and await store.lease(name + "-expiring", 1, 0.2, "b") is None
        await asyncio.sleep(0.3)  # a lease whose request's replica died expires with its deadline
        assert await store.lease(name + "-expiring", 1, 30, "c")
        # a request's admission in one call: lease, request, tokens' window; it stops at the first refusal
        other = name + "-admit"
        first = await store.admit(other, 1, 30, "a", 5, 100)
        assert first["lease"] == "a" and first["held"] == 1 and first["requests"][0] and first["requests"][1].remaining == 4
        assert first["tokens"].remaining == 100
        second = await store.admit(other, 1, 30, "b", 5, 100)  # its one concurrent slot is taken: nothing counted
        assert second == {"lease": None, "held": 1, "requests": None, "granted": 0, "tokens": None}
        assert (await store.charge(other, "requests", 5, 0))[1].remaining == 4

    asyncio.run(scenario())


def test_reset_durations_are_written_as_openai_writes_them():
    assert [duration(s) for s in (0.02, 1, 1.5, 59.9999, 360, 61.25)] == ["20ms", "1s", "1.5s", "1m0s", "6m0s", "1m1.25s"]


def test_a_large_request_refused_for_tokens_is_told_to_wait_for_as_many_to_free():
    """10,000 tokens a minute, none left: 5,000 more free in about 30 s, not in the next second's trickle."""
    from service.front.keys import ApiKey
    from service.front.quotas import Quotas, Window

    key = ApiKey(name="k", sha256="0" * 64, tokens_per_minute=10_000)
    assert Quotas.tokens_wait_s(key, Window(10_000, 0, 0.5), 5_000) == 30
    assert Quotas.tokens_wait_s(key, Window(10_000, 4_000, 0.5), 5_000) == 6
    assert Quotas.tokens_wait_s(key, Window(10_000, 0, 45.0), 10) == 45  # the store's own reset when longer
    assert Quotas.tokens_wait_s(key, Window(10_000, 0, 0.0), 50_000) == 60  # at most a minute


def test_with_the_store_unreachable_limited_keys_are_answered_at_once_not_after_a_wait_each(monkeypatch):
    """A store that does not answer: the first request waits STORE_CALL_S, the next ones (for DOWN_S) are
    refused at once with 503, or let through uncounted when limited keys fail open."""
    from service.engine.errors import NotReady
    from service.front import quotas
    from service.front.call import Call
    from service.front.keys import ApiKey
    from service.front.quotas import Quotas

    class Silent:
        uri = "redis://nowhere"

        async def admit(self, *args):
            await asyncio.sleep(3600)

    monkeypatch.setattr(quotas, "STORE_CALL_S", 0.2)
    monkeypatch.setattr(Quotas, "store", Silent())
    monkeypatch.setattr(Quotas, "_down_until", float("-inf"))
    key = ApiKey(name="k", sha256="0" * 64, requests_per_minute=5)

    async def scenario() -> list[float]:
        waited = []
        for fail_open in (False, False, True):
            monkeypatch.setattr(Quotas, "fail_open", fail_open)
            call = Call("id", "http", "POST", key=key)
            started = time.monotonic()
            if fail_open:
                await Quotas.admit(call)  # uncounted
                assert call.limits == {}
            else:
                with pytest.raises(NotReady):
                    await Quotas.admit(call)
            waited.append(time.monotonic() - started)
        return waited

    waited = asyncio.run(scenario())
    assert waited[0] >= 0.2 and waited[1] < 0.05 and waited[2] < 0.05, waited


class CountingStore:
    """A real LimitStore whose calls are counted: how many a request of a busy key costs."""

    def __init__(self, store: LimitStore) -> None:
        self.store, self.uri, self.calls = store, store.uri, 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        async def counted(*args):
            self.calls += 1
            await asyncio.sleep(self.hop_s)
            return await method(*args)
        return counted

    hop_s = 0.0  # each call's way to the store and back (a Ray hop, a Redis round trip)


@pytest.fixture
def quotas_on(monkeypatch, redis_server, request):
    """Quotas in this process on a counted store: limits' memory storage, or the real Redis."""
    from service.front.quotas import Quotas

    store = CountingStore(LimitStore(redis_server.uri if request.param == "redis" else "memory://"))
    for name, value in (("store", store), ("shares", {}), ("pools", {}), ("fail_open", False), ("_sweeper", None),
                        ("_down_until", float("-inf")), ("lease_ttl_s", 90.0)):
        monkeypatch.setattr(Quotas, name, value)
    return store


@pytest.mark.parametrize("quotas_on", ["memory", "redis"], indirect=True)
def test_a_busy_key_is_counted_a_share_at_a_time_and_exactly_near_its_limit(quotas_on):
    """A key far from its limits: after its rate is known (RATE_S), its requests and tokens are counted in shares,
    a store call per many requests, and the store's count covers every one admitted. Near a limit the share is 0:
    a key of 300 requests a minute gets exactly 300, however fast it asks."""
    from service.front.call import Call
    from service.front.keys import ApiKey
    from service.front import quotas
    from service.front.quotas import Quotas, RateLimited

    run = time.monotonic_ns()
    busy = ApiKey(name=f"busy-{run}", sha256="0" * 64, requests_per_minute=1_000_000, tokens_per_minute=100_000_000)
    tight = ApiKey(name=f"tight-{run}", sha256="0" * 64, requests_per_minute=300)

    async def one(key: ApiKey, tokens: int) -> Call:
        call = Call("id", "http", "POST", key=key)
        await Quotas.admit(call)
        await Quotas.charge_tokens(call, tokens)
        return call

    async def scenario() -> None:
        started, admitted = time.monotonic(), 0
        while time.monotonic() - started < 0.5:  # its rate learnt
            await one(busy, 10)
            admitted += 1
        calls_before, second_half = quotas_on.calls, 0
        while time.monotonic() - started < 1.5:
            call = await one(busy, 10)
            admitted, second_half = admitted + 1, second_half + 1
        calls = quotas_on.calls - calls_before
        assert second_half > 100 and calls * 10 < second_half, (calls, second_half)  # a store call per 10+ requests
        assert call.limits["requests"].remaining <= 1_000_000 - admitted  # what the headers say: never more than is left
        counted = await quotas_on.store.charge(busy.name, "requests", busy.requests_per_minute, 0)
        tokens = await quotas_on.store.charge(busy.name, "tokens", busy.tokens_per_minute, 0)
        taken = 1_000_000 - counted[1].remaining
        # every one counted; what is counted and not spent is at most the last share: 1/SHARE_OF_REST of what was left
        assert admitted <= taken <= admitted + 1_000_000 // quotas.SHARE_OF_REST, (admitted, taken)
        assert 10 * admitted <= 100_000_000 - tokens[1].remaining
        passed = refused = 0
        for _ in range(400):
            try:
                await one(tight, 1)
                passed += 1
            except RateLimited:
                refused += 1
        assert (passed, refused) == (300, 100)

    asyncio.run(scenario())


@pytest.mark.parametrize("quotas_on", ["memory", "redis"], indirect=True)
def test_a_busy_keys_leases_are_kept_for_its_next_requests_then_given_back(quotas_on):
    """A key with room in its `concurrent` limit: a finished request's lease serves the next request without a
    store call, and is given back once idle (LEASE_IDLE_S). A key near its limit gives each lease back at once, so
    another replica never waits on a lease this one keeps."""
    from service.front import quotas
    from service.front.call import Call
    from service.front.keys import ApiKey
    from service.front.quotas import Quotas

    run = time.monotonic_ns()
    roomy = ApiKey(name=f"roomy-{run}", sha256="0" * 64, concurrent=64)
    tight = ApiKey(name=f"tight-{run}", sha256="0" * 64, concurrent=2)

    async def scenario() -> None:
        calls = [Call("id", "http", "POST", key=roomy) for _ in range(8)]
        for call in calls:
            await Quotas.admit(call)
        assert await quotas_on.store.in_flight(roomy.name) == 8
        before = quotas_on.calls
        for _ in range(5):  # eight at a time, five times: the same eight leases
            for call in calls:
                Quotas.release_soon(call)
            for call in calls:
                await Quotas.admit(call)
        assert quotas_on.calls == before and await quotas_on.store.in_flight(roomy.name) == 8
        for call in calls:
            Quotas.release_soon(call)
        kept_at = time.monotonic()
        assert await quotas_on.store.in_flight(roomy.name) == 8  # kept ...
        while await quotas_on.store.in_flight(roomy.name) and time.monotonic() - kept_at < 10 * quotas.LEASE_IDLE_S:
            await asyncio.sleep(0.05)
        given_back_s = time.monotonic() - kept_at  # ... then given back once idle (the sweep looks every half of it)
        assert await quotas_on.store.in_flight(roomy.name) == 0 and given_back_s >= quotas.LEASE_IDLE_S, given_back_s
        first, second = Call("a", "http", "POST", key=tight), Call("b", "http", "POST", key=tight)
        await Quotas.admit(first)
        Quotas.release_soon(first)
        await asyncio.sleep(0.1)
        assert await quotas_on.store.in_flight(tight.name) == 0  # near its limit: given back at once
        await Quotas.admit(second)
        Quotas.release_soon(second)

    asyncio.run(scenario())


@pytest.mark.parametrize("quotas_on", ["memory", "redis"], indirect=True)
def test_a_burst_that_finds_a_keys_share_empty_waits_for_one_store_call_not_one_each(quotas_on):
    """32 requests of a key at once, again and again, as 32 clients send them (each store call 5 ms away): the
    requests that find the share empty wait for the one store call renewing it, and a key back from an idle spell
    takes a share as large as what it spent since (it is not one call per request until its rate is measured).
    Every request admitted is still counted in the store."""
    from service.front.call import Call
    from service.front.keys import ApiKey
    from service.front.quotas import Quotas, RATE_S

    quotas_on.hop_s = 0.005
    key = ApiKey(name=f"burst-{time.monotonic_ns()}", sha256="0" * 64, requests_per_minute=10_000_000,
                 tokens_per_minute=1_000_000_000)

    async def one() -> None:
        call = Call("id", "http", "POST", key=key)
        await Quotas.admit(call)
        await Quotas.charge_tokens(call, 12)
        assert call.limits["requests"].remaining < 10_000_000 and call.limits["tokens"].remaining < 1_000_000_000

    async def bursts(count: int) -> int:
        before = quotas_on.calls
        for _ in range(count):
            await asyncio.gather(*(one() for _ in range(32)))
            await asyncio.sleep(0.02)
        return quotas_on.calls - before

    async def scenario() -> None:
        first = await bursts(20)  # 640 requests, from a standing start
        await asyncio.sleep(3 * RATE_S)  # idle ...
        again = await bursts(20)  # ... and back
        assert first <= 24 and again <= 12, (first, again)  # 10 and 5 here; one call per request: 576 and 64
        counted = await quotas_on.store.charge(key.name, "requests", key.requests_per_minute, 0)
        tokens = await quotas_on.store.charge(key.name, "tokens", key.tokens_per_minute, 0)
        assert 10_000_000 - counted[1].remaining >= 1280 and 1_000_000_000 - tokens[1].remaining >= 1280 * 12

    asyncio.run(scenario())


# ---- two keys against two replicas, counted in Redis ----

@pytest.fixture(scope="module")
def quota_app(ray_serve, default_bundle, redis_server, tmp_path_factory):
    from ray import serve

    keys_file = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [
        {"name": "rpm", "sha256": sha("secret-rpm"), "requests_per_minute": 6},
        {"name": "tpm", "sha256": sha("secret-tpm"), "tokens_per_minute": 40},
        {"name": "conc", "sha256": sha("secret-conc"), "concurrent": 1},
        {"name": "free", "sha256": sha("secret-free")},
        {"name": "retry", "sha256": sha("secret-retry"), "requests_per_minute": 1},
        {"name": "bulk", "sha256": sha("secret-bulk"), "priority": "batch", "batch_files": 1, "unfinished_batches": 0},
        {"name": "owner", "sha256": sha("secret-owner"), "models": [MODEL], "requests_per_minute": 2},
    ]}))
    deploy({"keys_file": str(keys_file), "replicas": 2, "num_cpus": 0.5, "warmup": False,
            "rate_limit_storage": redis_server.uri, "jobs_dir": str(keys_file.parent / "jobs")}, APP, f"/{APP}",
           default_bundle)
    try:
        yield f"{ray_serve.url}/{APP}"
    finally:
        serve.delete(APP)


def embed(url: str, secret: str, texts=("a text",), path="/v1/embeddings") -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"input": list(texts), "model": MODEL},
                      headers={"authorization": f"Bearer {secret}"}, timeout=60)


def test_requests_per_minute_hold_across_the_replicas_with_openais_answers(quota_app):
    """6 requests per minute, 12 asked over many connections (both replicas take some): 6 answered, each
    with OpenAI's headers counting down, then 429s with OpenAI's body and Retry-After."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: embed(quota_app, "secret-rpm"), range(12)))
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    assert len(ok) == 6, [r.status_code for r in answers]  # counted for the whole service, not per replica
    # (each answer's remaining is read just after its own count: requests counted at the same moment may read
    # the same figure)
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in ok]
    assert min(remaining) == 0 and max(remaining) <= 5, remaining
    for r in ok:
        assert r.headers["x-ratelimit-limit-requests"] == "6" and r.headers["x-ratelimit-reset-requests"].endswith("s")
    for r in refused:
        assert r.status_code == 429, r.text
        body = r.json()["error"]
        assert body["type"] == "requests" and body["code"] == "rate_limit_exceeded", body
        assert "6 requests per minute" in body["message"] and "secret" not in r.text
        assert 1 <= int(r.headers["retry-after"]) <= 60 and r.headers["x-ratelimit-remaining-requests"] == "0"
    # other APIs' styles, same limit: TEI's, Cohere's, KServe v2's
    tei = httpx.post(f"{quota_app}/embed", json={"inputs": "a"}, headers={"authorization": "Bearer secret-rpm"},
                     timeout=60)
    assert tei.status_code == 429 and tei.json()["error_type"] == "Overloaded", tei.text
    cohere = httpx.post(f"{quota_app}/v2/embed", json={"model": MODEL, "texts": ["a"], "input_type": "search_document",
                                                       "embedding_types": ["float"]},
                        headers={"authorization": "Bearer secret-rpm"}, timeout=60)
    assert cohere.status_code == 429 and "requests per minute" in cohere.json()["message"], cohere.text
    v2 = httpx.post(f"{quota_app}/v2/models/{MODEL}/infer", json={"inputs": [
        {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
        headers={"authorization": "Bearer secret-rpm"}, timeout=60)
    assert v2.status_code == 429 and error_type(v2) == "requests", v2.text
    # another key is not slowed by it
    assert embed(quota_app, "secret-free").status_code == 200 and "x-ratelimit-limit-requests" not in \
        embed(quota_app, "secret-free").headers


def test_a_key_sees_its_usage_and_its_requests_are_counted_by_its_name(quota_app, metrics_url):
    """GET /v1/usage with the key (keyed: it counts against none of the key's limits, so a key at its limit
    sees when it refills); Prometheus counts each key's requests, tokens and 429s by its name, and no label
    holds anything but the keys file's names."""
    from tests.metrics_scrape import poll, total

    spent = httpx.get(f"{quota_app}/v1/usage", headers={"authorization": "Bearer secret-rpm"}, timeout=30)
    assert spent.status_code == 200, spent.text
    body = spent.json()
    assert body["key"] == "rpm" and body["limits"]["requests_per_minute"] == 6 and body["models"] is None
    assert body["now"]["requests"]["limit"] == 6 and body["now"]["requests"]["remaining"] == 0  # spent above
    assert body["now"]["requests"]["reset"].endswith("s") and "x-ratelimit-limit-requests" not in spent.headers
    free = httpx.get(f"{quota_app}/v1/usage", headers={"authorization": "Bearer secret-free"}, timeout=30).json()
    assert free["now"] == {} and free["limits"] == {"requests_per_minute": None, "tokens_per_minute": None,
                                                    "concurrent": None}
    assert httpx.get(f"{quota_app}/v1/usage", timeout=30).status_code == 401
    samples = poll(metrics_url, lambda f: total(f, "ray_encoder_key_rate_limited_total", application=APP, key="rpm",
                                                limit="requests") >= 9, "the rpm key's 429s counted")
    assert total(samples, "ray_encoder_key_requests_total", application=APP, key="rpm", status_class="2xx") >= 6
    assert total(samples, "ray_encoder_key_requests_total", application=APP, key="rpm", status_class="4xx") >= 9
    names = {s.labels["key"] for family in ("ray_encoder_key_requests", "ray_encoder_key_rate_limited")
             for s in samples[family].samples if s.labels.get("application") == APP}
    assert names <= {"rpm", "tpm", "conc", "free", "retry", "owner"}, names


def test_tokens_per_minute_refuse_before_the_batch_and_grpc_says_the_same(quota_app, ray_serve):
    """40 tokens per minute: a request of more than 40 is refused outright (type tokens), one that fits is
    answered with the tokens' headers, and once the window is spent gRPC answers RESOURCE_EXHAUSTED with
    retry-after and the x-ratelimit-* facts in its trailing metadata."""
    too_many = embed(quota_app, "secret-tpm", texts=["word " * 60])
    assert too_many.status_code == 429 and error_type(too_many) == "tokens", too_many.text
    assert "more than the key 'tpm'" in error_message(too_many)
    fits = embed(quota_app, "secret-tpm", texts=["a short text"])
    assert fits.status_code == 200, fits.text
    assert fits.headers["x-ratelimit-limit-tokens"] == "40"
    assert int(fits.headers["x-ratelimit-remaining-tokens"]) == 40 - fits.json()["usage"]["prompt_tokens"]
    while (r := embed(quota_app, "secret-tpm", texts=["another short text here"])).status_code == 200:
        pass
    assert r.status_code == 429 and error_type(r) == "tokens", r.text
    from service.apis.kserve_v2.messages import messages, method_path

    m = messages()
    request = m.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"another short text here")
    with grpc.insecure_channel(ray_serve.grpc_target) as channel:
        infer = channel.unary_unary(method_path("ModelInfer"), request_serializer=m.ModelInferRequest.SerializeToString,
                                    response_deserializer=m.ModelInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            infer(request, metadata=(("application", APP), ("authorization", "Bearer secret-tpm")), timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    trailing = dict(refused.value.trailing_metadata())
    assert trailing["x-ratelimit-limit-tokens"] == "40" and int(trailing["retry-after"]) >= 1, trailing


def test_concurrent_requests_of_a_key_are_bounded_across_the_replicas(quota_app):
    """One request at a time for the key: of 6 sent at once (each 64 texts, so they overlap), those that found
    the key's one lease taken are 429 `concurrent`; each answered one gave its lease back."""
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: embed(quota_app, "secret-conc", texts=[f"text {i}" for i in range(64)]),
                                range(6)))
    codes = [r.status_code for r in answers]
    assert codes.count(200) >= 1 and set(codes) <= {200, 429}, codes
    assert all(error_type(r) == "concurrent" for r in answers if r.status_code == 429)
    wait_until(lambda: embed(quota_app, "secret-conc").status_code == 200, "the key's lease back", timeout=10)


def test_the_openai_sdks_own_retry_ends_in_success_when_the_window_refills(quota_app):
    """One request per minute: the SDK's second call is refused (429 with Retry-After), waits as it says and
    retries, and is answered."""
    import openai

    client = openai.OpenAI(base_url=f"{quota_app}/v1", api_key="secret-retry", max_retries=3, timeout=120)
    assert client.embeddings.create(model=MODEL, input="first").data
    started = time.monotonic()
    assert client.embeddings.create(model=MODEL, input="second").data  # raises if its retries ran out
    assert time.monotonic() - started >= 1  # it was refused, and waited


def test_with_redis_stopped_limited_keys_are_refused_and_the_others_served(quota_app, redis_server):
    """rate_limit_unreachable: closed (the default): a key with limits gets 503 with Retry-After while Redis is
    down, a key without limits is served as before; once Redis is back, limited keys are counted again."""
    redis_server.stop()
    try:
        down = embed(quota_app, "secret-tpm")
        assert down.status_code == 503 and "rate-limit store is unreachable" in error_message(down), down.text
        assert down.headers["retry-after"] == "1"
        assert embed(quota_app, "secret-free").status_code == 200
    finally:
        redis_server.start()
    wait_until(lambda: embed(quota_app, "secret-tpm", texts=["a"]).status_code in (200, 429),
               "limited keys counted again", timeout=20)


def test_a_keys_batch_api_quotas_are_its_own(quota_app):
    """batch_files 1 and unfinished_batches 0 in the keys file: the key's second upload and any batch are
    refused naming the key's quota, while another key keeps the service's; a batch-class key is answered as
    any other (its requests go behind interactive ones in the batch queue: tests/test_batcher.py)."""
    import io

    import openai

    bulk = openai.OpenAI(base_url=f"{quota_app}/v1", api_key="secret-bulk", max_retries=0, timeout=60)
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}}\n'
    first = bulk.files.create(file=("a.jsonl", io.BytesIO(line)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="the key's batch_files"):
        bulk.files.create(file=("b.jsonl", io.BytesIO(line)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="the key's unfinished_batches"):
        bulk.batches.create(input_file_id=first.id, endpoint="/v1/embeddings", completion_window="24h")
    free = openai.OpenAI(base_url=f"{quota_app}/v1", api_key="secret-free", max_retries=0, timeout=60)
    assert free.files.create(file=("a.jsonl", io.BytesIO(line)), purpose="batch").id
    assert free.files.create(file=("b.jsonl", io.BytesIO(line)), purpose="batch").id
    assert bulk.embeddings.create(model=MODEL, input="batch-class, still answered").data


def test_a_batchs_lines_run_as_the_key_that_created_it(quota_app, metrics_url):
    """A key with `models` and 2 requests per minute: its batch's lines are held to both (a line for another
    model fails with the route's 403; the third line waits out the 429 of the key's window instead of failing),
    and are counted as that key's requests in /v1/usage and Prometheus, not as the runner's."""
    import io
    import json

    import openai

    from tests.metrics_scrape import poll, total

    owner = openai.OpenAI(base_url=f"{quota_app}/v1", api_key="secret-owner", max_retries=0, timeout=60)
    lines = [{"custom_id": f"ok-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": f"text {i}", "model": MODEL}} for i in range(2)]
    lines.append({"custom_id": "other-model", "method": "POST", "url": "/v1/embeddings",
                  "body": {"input": "text", "model": "some-other-model"}})
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = owner.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    batch = owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    done = wait_until(lambda: (b := owner.batches.retrieve(batch.id)).status in ("completed", "failed") and b,
                      "the owner's batch to end", timeout=150, interval=0.5)
    assert done.status == "completed" and done.request_counts.completed == 2 and done.request_counts.failed == 1, done
    errors = [json.loads(raw) for raw in owner.files.content(done.error_file_id).read().splitlines()]
    assert [e["custom_id"] for e in errors] == ["other-model"]
    refused = errors[0]["response"]
    assert refused["status_code"] == 403 and "'owner' may not call model" in refused["body"]["error"]["message"]
    samples = poll(metrics_url, lambda f: total(f, "ray_encoder_key_requests_total", application=APP, key="owner",
                                                status_class="2xx") >= 2, "the owner's lines counted by its name")
    # 3 requests at 2 per minute: one was refused (429) and waited for the window, then ran
    assert total(samples, "ray_encoder_key_rate_limited_total", application=APP, key="owner", limit="requests") >= 1
    assert total(samples, "ray_encoder_key_requests_total", application=APP, key="batch-runner") == 0
