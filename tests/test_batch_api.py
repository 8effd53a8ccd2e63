"""OpenAI's Batch API (service/apis/openai_batch) driven by the `openai` SDK, unchanged: files and batches on the
shared service; a malformed line, a cancelled batch, the per-token limit; outputs equal to /v1/embeddings'
answers; a `python -m service` stopped mid-batch and started again (resumed, every line once), where another
token sees nothing of the first one's."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import yaml

from tests.conftest import BATCH_LIMITS, free_port
from tests.test_service_cli import kill_tree, service_env, start_service, stop_with_sigterm, wait_for_health
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
TERMINAL = {"completed", "failed", "cancelled", "expired"}


def jsonl(lines: list[dict | str]) -> bytes:
    return b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines)


def embedding_line(custom_id: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def big_file(n_lines: int, texts: int) -> bytes:
    """Enough work that a batch is still running when the test acts on it."""
    return jsonl([embedding_line(f"req-{i}", {"input": [f"document {i} sentence {j} " * 8 for j in range(texts)]})
                  for i in range(n_lines)])


def finished(client: openai.OpenAI, batch_id: str, timeout: float = 180):
    return wait_until(lambda: (b := client.batches.retrieve(batch_id)).status in TERMINAL and b,
                      f"batch {batch_id} to end", timeout=timeout, interval=0.3)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(raw) for raw in client.files.content(file_id).read().splitlines()]


def test_the_embedding_jobs_input_rows_map_back_to_each_line_and_place():
    """What a batch hands issue 50's embedding job: one row per text of each line that can run, its id the
    line's custom_id and the text's place in the line's input (the last '#' splits them)."""
    from service.apis.openai_batch.runner import job_rows, parse_lines

    data = jsonl([embedding_line("a", {"input": "one"}), "{not json", embedding_line("b#2", {"input": ["x", "y"]}),
                  {"custom_id": "c", "method": "POST", "url": "/v1/score", "body": {"input": "z"}},
                  embedding_line("a", {"input": "the same custom_id again"})])
    lines = parse_lines(data, "/v1/embeddings")
    assert [(line.custom_id, line.problem is None) for line in lines] == [
        ("a", True), (None, False), ("b#2", True), ("c", False), ("a", False)]
    rows = job_rows(lines)
    assert rows == [{"id": "a#0", "text": "one"}, {"id": "b#2#0", "text": "x"}, {"id": "b#2#1", "text": "y"}]
    assert [tuple(r["id"].rsplit("#", 1)) for r in rows] == [("a", "0"), ("b#2", "0"), ("b#2", "1")]


@pytest.fixture(scope="module")
def client(service_url):
    with openai.OpenAI(base_url=f"{service_url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def assert_same_embeddings_answer(batch_body: dict, direct: dict) -> None:
    """A line's response body against /v1/embeddings' answer to the same body: the same document (model,
    usage, indexes, encoding); the vectors equal within float32 rounding (the engine batches the texts of
    the two requests with different company, so padding and sub-batches differ)."""
    assert {k: v for k, v in batch_body.items() if k != "data"} == {k: v for k, v in direct.items() if k != "data"}
    assert len(batch_body["data"]) == len(direct["data"])
    for got, want in zip(batch_body["data"], direct["data"], strict=True):
        assert {k: v for k, v in got.items() if k != "embedding"} == {k: v for k, v in want.items() if k != "embedding"}
        if isinstance(want["embedding"], str):  # base64 float32
            assert isinstance(got["embedding"], str)
            got_v = np.frombuffer(base64.b64decode(got["embedding"]), np.float32)
            want_v = np.frombuffer(base64.b64decode(want["embedding"]), np.float32)
        else:
            got_v, want_v = np.asarray(got["embedding"]), np.asarray(want["embedding"])
        assert got_v.shape == want_v.shape
        np.testing.assert_allclose(got_v, want_v, rtol=0, atol=1e-6)


def test_the_sdks_whole_flow_with_a_malformed_line_and_outputs_equal_to_v1_embeddings(client, service_url):
    bodies = {
        "one-string": {"input": "a batch of one text"},
        "a-list": {"input": ["first text of three", "second, a little longer than the first", "third"]},
        "base64": {"input": ["encoded as base64 floats", "like the openai client asks"], "encoding_format": "base64"},
        "named-model": {"input": "the model named", "model": "all-MiniLM-L6-v2"},
    }
    lines = [embedding_line(cid, body) for cid, body in bodies.items()]
    lines.insert(2, "{this line is not JSON")
    lines.append(embedding_line("empty-input", {"input": []}))  # the route refuses it: an error line with its 4xx
    lines.append({"custom_id": "wrong-url", "method": "POST", "url": "/v1/encode", "body": {"inputs": "x"}})

    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.object == "file" and uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).read() == jsonl(lines)

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h",
                                  metadata={"suite": "test_batch_api"})
    assert batch.status == "validating" and batch.metadata == {"suite": "test_batch_api"}
    batch = finished(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == 7 and batch.request_counts.completed == 4 and batch.request_counts.failed == 3
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.id in {b.id for b in client.batches.list(limit=100)}

    outputs = lines_of(client, batch.output_file_id)
    assert [o["custom_id"] for o in outputs] == list(bodies)  # in the file's order
    for out in outputs:
        assert out["id"].startswith("batch_req_") and out["error"] is None and out["response"]["status_code"] == 200
        direct = httpx.post(f"{service_url}/v1/embeddings", json=bodies[out["custom_id"]], timeout=60)
        assert direct.status_code == 200
        assert_same_embeddings_answer(out["response"]["body"], direct.json())

    errors = {e["custom_id"]: e for e in lines_of(client, batch.error_file_id)}
    assert set(errors) == {None, "empty-input", "wrong-url"}
    assert errors[None]["response"] is None and errors[None]["error"]["code"] == "invalid_request"
    assert "not JSON" in errors[None]["error"]["message"]
    assert "/v1/encode" in errors["wrong-url"]["error"]["message"]
    refused = errors["empty-input"]["response"]
    direct = httpx.post(f"{service_url}/v1/embeddings", json={"input": []}, timeout=60)
    assert refused["status_code"] == direct.status_code == 422 and errors["empty-input"]["error"] is None
    assert refused["body"]["error"]["type"] == direct.json()["error"]["type"]

    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_a_batchs_embeddings_are_computed_by_the_embedding_job_not_by_the_replica(client, service_url, batch_jobs_dir):
    """The job's _SUCCESS (kept in the batch's record, its folder removed when the batch ends) counts the
    batch's texts (one per text of the lines it can do), every shard written by a process that is not the
    replica answering /v1/embeddings (jobs/batch.py's actor); a line with chunking runs in the replica, and its answer is
    the route's all the same."""
    texts = [[f"job text {i} {j} " * (1 + j) for j in range(3)] for i in range(40)]
    lines = [embedding_line(f"t-{i}", {"input": t, **({"encoding_format": "base64"} if i % 7 == 3 else {})})
             for i, t in enumerate(texts)]
    lines.append(embedding_line("chunked", {"input": "chunking runs in process " * 20, "chunking": {"tokens": 16}}))
    uploaded = client.files.create(file=("job.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = finished(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                                   completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == len(lines), batch

    # the job's folder is removed with the batch's working data, just after its last state is written (so a
    # client can see `completed` first: the clean-clone make test did, at load 3-4); its record keeps what the job did
    job_dir = batch_jobs_dir / "batches" / f"{batch.id}.job"
    wait_until(lambda: not job_dir.exists(), "the ended batch's job folder removed", timeout=30)
    job = json.loads((batch_jobs_dir / "batches" / f"{batch.id}.json").read_text())["job"]
    summary = job["success"]
    n_texts = sum(len(t) for t in texts)
    assert summary["rows"] == summary["written"] == n_texts and summary["failures"] == 0, summary
    replica_pid = httpx.get(f"{service_url}/info", timeout=30).json()["replica"]["pid"]
    assert job["workers"] and replica_pid not in job["workers"]

    outputs = {o["custom_id"]: o for o in lines_of(client, batch.output_file_id)}
    for line in lines:  # the job's lines (base64 among them) and the in-process one, as the route answers
        direct = httpx.post(f"{service_url}/v1/embeddings", json=line["body"], timeout=60)
        assert direct.status_code == 200
        assert_same_embeddings_answer(outputs[line["custom_id"]]["response"]["body"], direct.json())


def test_cancelled_batches_and_the_limit_of_unfinished_batches_per_token(client):
    uploaded = client.files.create(file=("big.jsonl", io.BytesIO(big_file(300, 8))), purpose="batch")
    limit = BATCH_LIMITS["batch_max_per_token"]
    batches = [client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
               for _ in range(limit)]
    with pytest.raises(openai.BadRequestError, match="batch_max_per_token"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batches[0].id).request_counts.completed > 0,
               "the first batch to have lines done", timeout=300, interval=0.2)
    for batch in batches:
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    for batch in batches:
        ended = finished(client, batch.id)
        assert ended.status == "cancelled" and ended.cancelling_at and ended.cancelled_at
        counts = ended.request_counts
        assert counts.completed + counts.failed < 300 and counts.failed == 0
        assert len(lines_of(client, ended.output_file_id)) == counts.completed
    first = client.batches.retrieve(batches[0].id)
    assert first.request_counts.completed > 0 and first.output_file_id is not None
    # ended batches no longer count against the limit
    again = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    client.batches.cancel(again.id)
    assert finished(client, again.id).status == "cancelled"


def test_the_list_pages_newest_first_and_an_unknown_id_is_404_in_openais_error_body(client, service_url):
    page = client.batches.list(limit=1)
    ids = [b.id for b in client.batches.list(limit=100)]
    assert [b.id for b in page.data] == ids[:1] and (page.has_more == (len(ids) > 1))
    if len(ids) > 1:
        assert [b.id for b in client.batches.list(limit=1, after=ids[0]).data] == ids[1:2]
    # paths that try to leave jobs_dir are sent raw in tests/test_batch_uploads.py (httpx normalises `../`)
    for path in ("/v1/batches/batch_000000000000000000000000", "/v1/files/file-000000000000000000000000",
                 "/v1/files/file-000000000000000000000000/content", "/v1/batches/x"):
        r = httpx.get(f"{service_url}{path}", timeout=30)
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}, (path, r.text)
        assert r.json()["error"]["code"] == "not_found", r.text


@pytest.mark.parametrize("case", ["file over the limit", "too many lines", "a line over the limit", "purpose",
                                  "not multipart", "no file part"])
def test_uploads_past_a_limit_or_malformed_are_refused_with_a_clear_4xx(service_url, case):
    limit = BATCH_LIMITS["batch_max_file_bytes"]
    data = {
        # lines of 1,000 bytes: under the line limits, so the file's size is the limit it passes
        "file over the limit": (b'{"x": "' + b"y" * 990 + b'"}\n') * (limit // 1000 + 1),
        "too many lines": b"{}\n" * (BATCH_LIMITS["batch_max_lines"] + 1),
        "a line over the limit": b'{"x": "' + b"y" * BATCH_LIMITS["batch_max_line_bytes"] + b'"}\n',
    }.get(case, b"{}\n")
    if case == "not multipart":
        r = httpx.post(f"{service_url}/v1/files", content=data, headers={"content-type": "application/jsonl"}, timeout=60)
    elif case == "no file part":
        r = httpx.post(f"{service_url}/v1/files", data={"purpose": "batch"}, files={"other": ("a", b"x")}, timeout=60)
    else:
        purpose = "fine-tune" if case == "purpose" else "batch"
        r = httpx.post(f"{service_url}/v1/files", data={"purpose": purpose}, files={"file": ("f.jsonl", data)}, timeout=60)
    status, message = r.status_code, r.json()["error"]["message"]
    expected = {"file over the limit": (413, "batch_max_file_bytes"), "too many lines": (413, "batch_max_lines"),
                "a line over the limit": (413, "batch_max_line_bytes"), "purpose": (400, "purpose"),
                "not multipart": (400, "multipart/form-data"), "no file part": (400, "`file`")}[case]
    assert (status, expected[1] in message) == (expected[0], True), r.text


# ---- a service stopped mid-batch and started again ----


def service_config(tmp_path: Path, jobs_dir: Path) -> Path:
    config = yaml.safe_load((ROOT / "deploy/serve_config.yaml").read_text())
    config["grpc_options"]["port"] = free_port()  # never the config's 9000
    config["applications"][0]["args"]["jobs_dir"] = str(jobs_dir)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.serial  # two `python -m service` clusters, one after the other, beside no other: in CI's parallel phase
# (load 10-15, two workers' clusters) the second one's start lost an actor ("died unexpectedly")
def test_a_service_restarted_mid_batch_resumes_it_and_another_token_sees_none_of_it(default_bundle, tmp_path):
    """Token A submits a batch to `python -m service` and the service is stopped (SIGTERM) mid-batch; started
    again with token B and another precision, the service resumes A's batch to the end as the same embedding
    job, at the precision it began with (every line once, none lost), while B gets 404 for A's batch and file
    and an empty list."""
    jobs_dir = tmp_path / "jobs"
    config = service_config(tmp_path, jobs_dir)
    n_lines = 160
    procs = []

    def started(token: str, *flags: str):
        """`python -m service` on the same jobs_dir with `token` as its API token: its process and URL, once healthy."""
        port = free_port()
        proc, output = start_service(default_bundle, port, "--config", str(config), *flags,
                                     env={**service_env(), "ENCODER_API_TOKEN": token})
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_for_health(url, proc, output)
        return proc, url

    try:
        proc, url = started("token-a")
        with openai.OpenAI(base_url=f"{url}/v1", api_key="token-a", max_retries=0, timeout=60) as a:
            uploaded = a.files.create(file=("big.jsonl", io.BytesIO(big_file(n_lines, 16))), purpose="batch")
            batch = a.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
            wait_until(lambda: a.batches.retrieve(batch.id).request_counts.completed > 0,
                       "lines of the batch to be done", timeout=300, interval=0.2)
        stop_with_sigterm(proc)
        stored = json.loads((jobs_dir / "batches" / f"{batch.id}.json").read_text())
        assert stored["status"] == "in_progress" and 0 < stored["request_counts"]["completed"] < n_lines, stored

        # at another precision (or runtime) than the job began with: the resumed job keeps the one it began with.
        # Which the bundle has depends on the machine (int8 is published only where its gate holds)
        began = json.loads((jobs_dir / "batches" / f"{batch.id}.job" / "out" / "_progress" / "runtime.json").read_text())
        published = set(json.loads((default_bundle / "bundle.json").read_text())["variants"])
        other = sorted(({"fp32", "int8"} & published) - {began["precision"]})
        flags = (["--precision", other[0]] if other else
                 ["--precision", began["precision"],
                  "--runtime", "openvino" if began["runtime"] == "onnxruntime" else "onnxruntime"])
        proc, url = started("token-b", *flags)
        with openai.OpenAI(base_url=f"{url}/v1", api_key="token-b", max_retries=0, timeout=60) as b:
            with pytest.raises(openai.NotFoundError):
                b.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                b.files.retrieve(uploaded.id)
            with pytest.raises(openai.NotFoundError):
                b.batches.cancel(batch.id)
            assert b.batches.list().data == []
        with openai.OpenAI(base_url=f"{url}/v1", api_key="token-a", max_retries=0, timeout=60) as stale:
            with pytest.raises(openai.AuthenticationError):  # the service's token is B's now
                stale.batches.retrieve(batch.id)

        from service.apis.openai_batch.store import Store

        store, owner_a = Store(jobs_dir), hashlib.sha256(b"token-a").hexdigest()
        done = wait_until(lambda: (r := store.batch(owner_a, batch.id))["status"] in TERMINAL and r,
                          "the resumed batch to end", timeout=300, interval=0.5)
        assert done["status"] == "completed" and done["request_counts"] == {"total": n_lines, "completed": n_lines,
                                                                            "failed": 0}, done
        outputs = [json.loads(raw) for raw in store.file_bytes(owner_a, done["output_file_id"]).splitlines()]
        assert [o["custom_id"] for o in outputs] == [f"req-{i}" for i in range(n_lines)]  # each once, in order
        assert all(len(o["response"]["body"]["data"]) == 16 for o in outputs)
        assert done["error_file_id"] is None
        # the embedding job did the lines, resumed in the new service's cluster on the same output
        job = json.loads((jobs_dir / "batches" / f"{batch.id}.json").read_text())["job"]["success"]
        assert not (jobs_dir / "batches" / f"{batch.id}.job").exists()  # the working data went with the batch's end
        assert job["rows"] == job["written"] == n_lines * 16 and job["rows_this_run"] < n_lines * 16, job
        assert job["precision"] == f"{began['runtime']} {began['precision']}", (job, flags)  # not the new replica's
        stop_with_sigterm(proc)
    finally:
        for proc in procs:
            kill_tree(proc)
