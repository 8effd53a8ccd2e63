"""API keys as data (issue 58, first part; docs/access.md): the keys file read and re-read, secrets found by their
hash and never stored, the command that adds a key, and, through Ray Serve on loopback, two keys with different
models over HTTP and gRPC, the single token beside them, a key revoked while serving and a keys file broken while
serving; over gRPC too: a key past its limit, a revoked key, thousands of distinct wrong keys."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time

import grpc
import httpx
import pytest
import yaml

from service.front import keys as keys_module
from service.front.keys import INTERNAL_KEY_NAME, TOKEN_KEY_NAME, Keyring, add_key, read_keys
from tests.conftest import deploy, wait_until
from tests.errors import error_message, error_type


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def write_keys(path, *keys: dict) -> None:
    """Written whole, as a Secret's update or `add` replaces it: never half a file."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump({"keys": list(keys)}))
    os.replace(temporary, path)


# ---- the keys file, in-process ----

def test_a_keys_file_is_read_and_its_secrets_found_by_their_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(keys_module, "RELOAD_CHECK_S", 0.0)
    path = tmp_path / "keys.yaml"
    write_keys(path, {"name": "team-a", "sha256": sha("secret-a"), "models": ["m1"], "requests_per_minute": 600,
                      "tokens_per_minute": 200000, "concurrent": 16, "priority": "interactive"},
               {"name": "team-b", "sha256": sha("secret-b"), "priority": "batch"})
    ring = Keyring.load(path, b"the-token")
    a, b = ring.identify(b"secret-a"), ring.identify(b"secret-b")
    assert a.name == "team-a" and a.may_call("m1") and not a.may_call("m2") and a.requests_per_minute == 600
    assert b.name == "team-b" and b.may_call("anything") and b.priority == "batch"
    assert ring.identify(b"the-token").name == TOKEN_KEY_NAME  # the single token: one more key, no limits
    assert ring.identify(ring.internal).name == INTERNAL_KEY_NAME
    assert ring.identify(b"wrong") is None and ring.identify(sha("secret-a").encode()) is None  # the hash is no secret
    # JSON is YAML too
    path.write_text('{"keys": [{"name": "json-key", "sha256": "%s"}]}' % sha("secret-j"))
    ring.refresh()
    assert ring.identify(b"secret-j").name == "json-key" and ring.identify(b"secret-a") is None  # team-a revoked


@pytest.mark.parametrize("content, said", [
    ("keys: [{name: a, sha256: nothex}]", "keys.0.sha256"),
    ("keys: [{name: a, sha256: %s, %s}]" % (sha("x"), "rpm: 5"), "Extra inputs"),
    ("keys: [{name: a, sha256: %s}, {name: a, sha256: %s}]" % (sha("x"), sha("y")), "same name"),
    ("keys: [{name: token, sha256: %s}]" % sha("x"), "the service's own"),
    ("keys: [{name: '../a', sha256: %s}]" % sha("x"), "keys.0.name"),
    ("keys: {{{", "not YAML or JSON"),
])
def test_a_keys_file_that_does_not_parse_says_where_and_leaves_the_last_good_keys(tmp_path, monkeypatch, content, said):
    monkeypatch.setattr(keys_module, "RELOAD_CHECK_S", 0.0)
    path = tmp_path / "keys.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=said):
        read_keys(path)
    write_keys(path, {"name": "good", "sha256": sha("good")})
    ring = Keyring.load(path, None)
    path.write_text(content)
    for _ in range(3):  # said once per version of the file
        ring.refresh()
    assert ring.errors == 1 and said.split(".")[0] in ring.error
    assert ring.identify(b"good").name == "good"  # the last good keys stay
    write_keys(path, {"name": "fixed", "sha256": sha("fixed")})
    ring.refresh()
    assert ring.error == "" and ring.identify(b"fixed").name == "fixed" and ring.identify(b"good") is None


def test_ten_thousand_wrong_keys_leave_nothing_behind(tmp_path):
    """Wrong secrets are looked up, never stored: no memory grows with them."""
    path = tmp_path / "keys.yaml"
    write_keys(path, {"name": "good", "sha256": sha("good")})
    ring = Keyring.load(path, None)
    before = dict(ring.by_hash)
    assert all(ring.identify(f"wrong-{i}".encode()) is None for i in range(10_000))
    assert ring.by_hash == before


def test_the_batch_runners_key_runs_a_line_as_the_batchs_owner_and_no_other_key_can(tmp_path, monkeypatch):
    """The runner's own secret with x-encoder-on-behalf-of: NAME is key NAME (its models and limits per minute),
    at batch priority and without its concurrent limit; once NAME leaves the file, refused; the header from any
    other key changes nothing."""
    from service.front.gate import Gate

    path = tmp_path / "keys.yaml"
    write_keys(path, {"name": "team-a", "sha256": sha("secret-a"), "models": ["m1"], "requests_per_minute": 5,
                      "concurrent": 2},
               {"name": "team-b", "sha256": sha("secret-b")})
    monkeypatch.setattr(keys_module, "RELOAD_CHECK_S", 0.0)
    monkeypatch.setattr(Gate, "keyring", Keyring.load(path, None))
    internal = b"Bearer " + Gate.keyring.internal
    key, refusal = Gate.identify(internal, b"team-a")
    assert refusal is None and key.name == "team-a" and key.models == ("m1",) and key.requests_per_minute == 5
    assert key.priority == "batch" and key.concurrent is None
    assert Gate.identify(internal, None)[0].name == INTERNAL_KEY_NAME
    assert Gate.identify(b"Bearer secret-b", b"team-a")[0].name == "team-b"  # only the runner may act for a key
    write_keys(path, {"name": "team-b", "sha256": sha("secret-b")})
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    key, refusal = Gate.identify(internal, b"team-a")
    assert key is None and "'team-a' that owns this batch is no longer in the keys file" in str(refusal)


def test_under_a_batch_class_keys_flood_an_interactive_keys_request_goes_first(tmp_path, monkeypatch, default_bundle):
    """The real app in process (no Ray): the gate, the keys file, the real model and its batch queue. A batch-class
    key's 24 requests of 8 texts queue behind a budget of 512 tokens (about 5 of them a batch); an interactive key's
    request sent once they are queued is answered in the next batch, while most of the flood still waits (in
    arrival order it would be answered last)."""
    import asyncio

    from service.config import BundleRef, ServiceSettings
    from service.engine.encoder_service import EncoderService
    from service.engine.engine import EngineTable, load_engine
    from service.front import deps
    from service.front.gate import Gate
    from service.http.server import app

    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(yaml.safe_dump({"keys": [
        {"name": "people", "sha256": sha("secret-people")},
        {"name": "bulk", "sha256": sha("secret-bulk"), "priority": "batch"}]}))
    settings = ServiceSettings.model_validate({
        "bundle": str(default_bundle), "runtime": "onnxruntime", "precision": "fp32", "warmup": False,
        "keys_file": str(keys_file), "batching": {"max_batch_tokens": 512, "max_concurrent_batches": 1}})
    engines = EngineTable([load_engine(BundleRef(path=default_bundle), settings)])
    monkeypatch.setattr(deps, "_current", [])  # (this test's service, gone after it)
    deps.serve_with(EncoderService(settings, engines))
    monkeypatch.setattr(Gate, "keyring", Keyring.load(keys_file, None))
    batcher = engines.default.batcher
    texts = [f"line {i} of a bulk job about the weather in the hills" for i in range(8)]

    async def scenario() -> tuple[int, list[int]]:
        answered: list[str] = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            async def post(who: str, secret: str, body: dict) -> None:
                r = await client.post("/v1/embeddings", json=body, headers={"authorization": f"Bearer {secret}"})
                assert r.status_code == 200, r.text
                answered.append(who)

            flood = [asyncio.ensure_future(post(f"bulk-{i}", "secret-bulk", {"input": texts})) for i in range(24)]
            for _ in range(3000):
                if batcher.queued >= 15:
                    break
                await asyncio.sleep(0.002)
            waiting = batcher.queued
            await post("people", "secret-people", {"input": "is it raining?"})
            still = 24 - sum(1 for who in answered if who.startswith("bulk"))
            await asyncio.gather(*flood)
        return waiting, still, answered

    waiting, still, answered = asyncio.run(scenario())
    assert waiting >= 15, waiting  # the flood was queued when the interactive request came
    assert still >= 10, (still, answered)  # answered in the next batch: most of the flood still waited
    assert sorted(answered) == sorted(["people", *(f"bulk-{i}" for i in range(24))])


def test_adding_a_key_prints_the_secret_once_and_writes_only_its_hash(tmp_path):
    path = tmp_path / "keys.yaml"
    result = subprocess.run([sys.executable, "-m", "service.front.keys", "--keys-file", str(path), "--name",
                             "team-a", "--models", "m1", "m2", "--requests-per-minute", "600", "--priority", "batch"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    secret = result.stdout.strip().splitlines()[-1]
    assert secret.startswith("enc-") and secret not in path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    key = Keyring.load(path, None).identify(secret.encode())
    assert key.name == "team-a" and key.models == ("m1", "m2") and key.requests_per_minute == 600
    assert key.priority == "batch"
    again = subprocess.run([sys.executable, "-m", "service.front.keys", "--keys-file", str(path), "--name",
                            "team-a"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "same name" in again.stderr and len(again.stderr.splitlines()) == 1
    second = add_key(path, "team-b")
    assert {k.name for k in read_keys(path).keys} == {"team-a", "team-b"} and second != secret


# ---- through Ray Serve: two keys with different models, the token beside them ----

APP = "keys"
TOKEN = "keys-test-token"


@pytest.fixture(scope="module")
def keyed_app(ray_serve, default_bundle, tmp_path_factory):
    from ray import serve

    secrets_dir = tmp_path_factory.mktemp("keys")
    keys_file, token_file = secrets_dir / "keys.yaml", secrets_dir / "token"
    token_file.write_text(TOKEN)
    write_keys(keys_file, {"name": "team-a", "sha256": sha("secret-a")},
               {"name": "team-b", "sha256": sha("secret-b"), "models": ["another-model"]},
               {"name": "team-d", "sha256": sha("secret-d"), "requests_per_minute": 2})
    deploy({"keys_file": str(keys_file), "auth_token_file": str(token_file), "num_cpus": 0.5, "warmup": False}, APP,
           f"/{APP}", default_bundle)
    try:
        yield f"{ray_serve.url}/{APP}", keys_file
    finally:
        serve.delete(APP)


def embed(url: str, secret: str | None, model: str | None = "all-MiniLM-L6-v2") -> httpx.Response:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    body = {"input": "a text"} | ({"model": model} if model else {})
    return httpx.post(f"{url}/v1/embeddings", json=body, headers=headers, timeout=60)


def grpc_infer(ray_serve, secret: str | None, channel=None):
    """One KServe v2 ModelInfer of the keyed app with `secret`: its reply, or the grpc.RpcError raised."""
    from service.apis.kserve_v2.messages import messages, method_path

    m = messages()
    request = m.ModelInferRequest(model_name="all-MiniLM-L6-v2")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"a text")
    metadata = (("application", APP),) + ((("authorization", f"Bearer {secret}"),) if secret else ())
    with contextlib.nullcontext(channel) if channel is not None else grpc.insecure_channel(ray_serve.grpc_target) as ch:
        infer = ch.unary_unary(method_path("ModelInfer"), request_serializer=m.ModelInferRequest.SerializeToString,
                               response_deserializer=m.ModelInferResponse.FromString)
        try:
            return infer(request, metadata=metadata, timeout=60)
        except grpc.RpcError as exc:
            return exc


def test_each_key_calls_its_models_and_nothing_else(keyed_app, ray_serve):
    url, _ = keyed_app
    assert embed(url, "secret-a").status_code == 200
    assert embed(url, TOKEN).status_code == 200  # the single token still works
    for wrong in (None, "wrong", sha("secret-a")):
        r = embed(url, wrong)
        assert r.status_code == 401 and error_type(r) == "unauthorized", r.text
    refused = embed(url, "secret-b")  # team-b may call another model only
    assert refused.status_code == 403 and error_type(refused) == "forbidden", refused.text
    assert "team-b" in error_message(refused) and "secret-b" not in refused.text
    assert embed(url, "secret-b", model=None).status_code == 403  # the default model is a model too
    # over gRPC (KServe v2 ModelInfer): PERMISSION_DENIED, and OK with the other key
    from service.apis.kserve_v2.messages import messages, method_path

    m = messages()
    request = m.ModelInferRequest(model_name="all-MiniLM-L6-v2")
    tensor = request.inputs.add(name="text", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(b"a text")
    with grpc.insecure_channel(ray_serve.grpc_target) as channel:
        infer = channel.unary_unary(method_path("ModelInfer"), request_serializer=m.ModelInferRequest.SerializeToString,
                                    response_deserializer=m.ModelInferResponse.FromString)
        app = (("application", APP),)
        with pytest.raises(grpc.RpcError) as denied:
            infer(request, metadata=app + (("authorization", "Bearer secret-b"),), timeout=60)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED, denied.value
        assert infer(request, metadata=app + (("authorization", "Bearer secret-a"),), timeout=60).outputs


def test_a_keys_limits_are_counted_in_the_default_memory_store(keyed_app, ray_serve):
    """rate_limit_storage left at memory:// (one Ray actor for the application): a key of 2 requests per
    minute is answered twice, with OpenAI's headers, then refused 429 `requests`; the others are not limited."""
    url, _ = keyed_app
    answers = [embed(url, "secret-d") for _ in range(3)]
    assert [r.status_code for r in answers] == [200, 200, 429], [r.text for r in answers]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["1", "0", "0"]
    assert error_type(answers[2]) == "requests" and answers[2].json()["error"]["code"] == "rate_limit_exceeded"
    assert "x-ratelimit-limit-requests" not in embed(url, "secret-a").headers
    # the same window over gRPC: RESOURCE_EXHAUSTED, the facts in its trailing metadata
    refused = grpc_infer(ray_serve, "secret-d")
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    trailing = dict(refused.trailing_metadata() or ())
    assert trailing["x-ratelimit-remaining-requests"] == "0" and int(trailing["retry-after"]) >= 1, trailing


def test_a_key_removed_from_the_file_is_refused_within_seconds_and_a_broken_file_changes_nothing(keyed_app,
                                                                                                   metrics_url,
                                                                                                   ray_serve):
    from tests.metrics_scrape import poll, total

    url, keys_file = keyed_app
    assert embed(url, "secret-a").status_code == 200
    keys_file.write_text("keys: {{{ not yaml")  # a broken file: the last good keys stay on every replica
    time.sleep(2.5)
    assert embed(url, "secret-a").status_code == 200
    poll(metrics_url, lambda f: total(f, "ray_encoder_keys_file_errors_total", application=APP) >= 1,
         "the broken keys file counted")
    write_keys(keys_file, {"name": "team-c", "sha256": sha("secret-c")})  # team-a revoked, team-c added
    started = time.monotonic()
    wait_until(lambda: embed(url, "secret-a").status_code == 401, "the revoked key to be refused", timeout=30,
               interval=0.2)
    revoked_after = time.monotonic() - started
    assert embed(url, "secret-c").status_code == 200 and revoked_after < 5, revoked_after
    revoked = grpc_infer(ray_serve, "secret-a")  # over gRPC too
    assert isinstance(revoked, grpc.RpcError) and revoked.code() == grpc.StatusCode.UNAUTHENTICATED, revoked
    assert grpc_infer(ray_serve, "secret-c").outputs


def test_thousands_of_distinct_wrong_keys_over_http_and_grpc_are_refused_and_leave_nothing_behind(keyed_app,
                                                                                                 ray_serve):
    """2,000 distinct wrong secrets over HTTP and 2,000 over gRPC (bounded here; the keyring's own test takes
    10,000): each refused 401 / UNAUTHENTICATED, the replica's memory flat, and no log line per wrong key
    (the access log's line per request aside)."""
    import concurrent.futures
    import uuid

    import psutil
    from ray import serve

    url, _ = keyed_app
    pid = serve.get_deployment_handle("Encoder", APP).info.remote().result(timeout_s=30)["pid"]
    replica = psutil.Process(pid)
    warm = [embed(url, f"wrong-{i}").status_code for i in range(50)]  # the paths' first-use allocations
    assert set(warm) == {401}
    before = replica.memory_info().rss
    started = time.monotonic()
    with httpx.Client(timeout=30) as client, grpc.insecure_channel(ray_serve.grpc_target) as channel:
        def over_http(_: int) -> int:
            return client.post(f"{url}/v1/embeddings", json={"input": "a"},
                               headers={"authorization": f"Bearer {uuid.uuid4().hex}"}).status_code

        def over_grpc(_: int) -> object:
            answer = grpc_infer(ray_serve, uuid.uuid4().hex, channel)
            return answer.code() if isinstance(answer, grpc.RpcError) else "answered"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            http_codes = set(pool.map(over_http, range(2000)))
            grpc_codes = set(pool.map(over_grpc, range(2000)))
    took = time.monotonic() - started
    assert http_codes == {401} and grpc_codes == {grpc.StatusCode.UNAUTHENTICATED}, (http_codes, grpc_codes)
    grown_mb = (replica.memory_info().rss - before) / 2**20
    assert grown_mb < 20, f"the replica grew by {grown_mb:.1f} MB over 4,000 wrong keys"
    assert embed(url, "secret-c").status_code == 200
    print(f"4,000 distinct wrong keys refused in {took:.1f} s; replica RSS {grown_mb:+.1f} MB")

