"""Two tokens at once on one jobs_dir (issue 55: "another token" was only ever a rotation). Two applications
of the service, each with its own token, share one jobs_dir, as two services (or two replicas of a service
whose token is being rotated) on one volume do: each token's files and batches are its own on every route,
while the runners, which take any unfinished batch, complete both."""

from __future__ import annotations

import io

import httpx
import openai
import pytest

from tests.conftest import deploy
from tests.test_batch_api import embedding_line, finished, jsonl


@pytest.fixture(scope="module")
def two_tokens(ray_serve, default_bundle, tmp_path_factory):
    """Clients of two applications on one jobs_dir, token A's and token B's."""
    root = tmp_path_factory.mktemp("two-tokens")
    jobs_dir = root / "jobs"
    clients = []
    for name, token in (("a", "token-of-a"), ("b", "token-of-b")):
        (root / f"{name}.token").write_text(token)
        deploy({"num_cpus": 1, "jobs_dir": str(jobs_dir), "auth_token_file": str(root / f"{name}.token")},
               f"tokens-{name}", f"/tokens-{name}", default_bundle)
        clients.append(openai.OpenAI(base_url=f"{ray_serve.url}/tokens-{name}/v1", api_key=token, max_retries=0,
                                     timeout=60))
    yield clients[0], clients[1], ray_serve.url
    from ray import serve

    for name, c in zip("ab", clients, strict=True):
        c.close()
        serve.delete(f"tokens-{name}")  # its replica and runner gone: the session's later tests have the CPUs


def test_each_token_sees_only_its_own_files_and_batches_while_both_complete(two_tokens):
    a, b, url = two_tokens
    file_a = a.files.create(file=("a.jsonl", io.BytesIO(jsonl([embedding_line("a1", {"input": "from a"})]))),
                            purpose="batch")
    file_b = b.files.create(file=("b.jsonl", io.BytesIO(jsonl([embedding_line("b1", {"input": "from b"})]))),
                            purpose="batch")
    batch_a = a.batches.create(input_file_id=file_a.id, endpoint="/v1/embeddings", completion_window="24h")

    # B can neither see, read, delete, cancel nor build on A's file and batch: 404 in OpenAI's body, as for none
    for call in (lambda: b.files.retrieve(file_a.id), lambda: b.files.content(file_a.id),
                 lambda: b.files.delete(file_a.id), lambda: b.batches.retrieve(batch_a.id),
                 lambda: b.batches.cancel(batch_a.id),
                 lambda: b.batches.create(input_file_id=file_a.id, endpoint="/v1/embeddings", completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.body["code"] == "not_found" and caught.value.body["type"] == "invalid_request_error"
    assert batch_a.id not in {x.id for x in b.batches.list(limit=100)}
    # the other application's token is refused outright at A's routes (each service knows its own token)
    r = httpx.get(f"{url}/tokens-a/v1/batches/{batch_a.id}", headers={"authorization": "Bearer token-of-b"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text

    batch_b = b.batches.create(input_file_id=file_b.id, endpoint="/v1/embeddings", completion_window="24h")
    done_a, done_b = finished(a, batch_a.id), finished(b, batch_b.id)
    assert done_a.status == done_b.status == "completed", (done_a, done_b)
    assert [x.id for x in a.batches.list(limit=100)] == [batch_a.id]
    assert [x.id for x in b.batches.list(limit=100)] == [batch_b.id]
    with pytest.raises(openai.NotFoundError):  # nor A's output, though a runner of either service wrote it
        b.files.content(done_a.output_file_id)
    assert b"a1" in a.files.content(done_a.output_file_id).content
    assert b"b1" in b.files.content(done_b.output_file_id).content
    a.files.retrieve(file_a.id)  # B's attempt to delete it changed nothing
