"""Hostile input against the running service: property-based tests (hypothesis) and fuzzing of
the OpenAPI spec (schemathesis). No 5xx, no crash, and every refusal is a 4xx JSON error."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability import record

STATUSES: dict[str, int] = {}


@pytest.fixture(scope="module")
def client(service_url):
    with httpx.Client(base_url=service_url, timeout=60) as c:
        yield c
    record("hostile input (hypothesis + raw payloads)",
           "arbitrary Unicode, control characters, 1 MB strings, deep nesting, huge lists, NaN/Infinity, wrong types",
           dict(STATUSES), note="no 5xx; every refusal a 4xx JSON error")


def error_shape_of(path: str, method: str = "POST") -> set[str]:
    """The keys of an error body on `path`: ours, or TEI's or Cohere's on their routes (their clients parse
    them), as the routes' APIs declare their error styles."""
    from service.apis import path_policies
    from service.apis.cohere import cohere_error_body
    from service.apis.kserve_v2 import v2_error_body
    from service.apis.tei import tei_error_body

    style = path_policies().of(method, path).error_style
    return {tei_error_body: {"error", "error_type"}, cohere_error_body: {"id", "message"},
            v2_error_body: {"error", "type", "request_id"}}.get(style, {"error"})


def is_vllms(path: str, method: str = "POST") -> bool:
    """Whether `path` answers errors in vLLM's body, `{"error": {"message", "type", "param", "code"}}`."""
    from service.apis import path_policies
    from service.apis.vllm import vllm_error_body

    return path_policies().of(method, path).error_style is vllm_error_body


def is_openais(path: str, method: str = "POST") -> bool:
    """Whether `path` answers errors in OpenAI's body (the Batch API's /v1/files and /v1/batches): the same
    four keys as vLLM's, `code` our error type (a string)."""
    from service.apis import path_policies
    from service.apis.openai_batch import openai_error_body

    return path_policies().of(method, path).error_style is openai_error_body


def check(r: httpx.Response) -> None:
    STATUSES[str(r.status_code)] = STATUSES.get(str(r.status_code), 0) + 1
    assert r.status_code < 500, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == error_shape_of(r.request.url.path, r.request.method), body
        if "error_type" in body:  # TEI's
            assert isinstance(body["error"], str) and isinstance(body["error_type"], str)
        elif "type" in body:  # KServe v2's
            assert isinstance(body["error"], str) and isinstance(body["type"], str)
        elif "id" in body:  # Cohere's
            assert body["id"] == r.headers["x-request-id"] and isinstance(body["message"], str)
        elif is_vllms(r.request.url.path, r.request.method):
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
            assert body["error"]["code"] == r.status_code and isinstance(body["error"]["message"], str)
        elif is_openais(r.request.url.path, r.request.method):
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
            assert isinstance(body["error"]["code"], str) and isinstance(body["error"]["message"], str)
            assert body["error"]["type"] in ("invalid_request_error", "authentication_error", "server_error"), body
        else:
            assert isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str)


any_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=600)  # control characters included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=50),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(texts=st.lists(any_text, min_size=1, max_size=8))
def test_any_unicode_texts_are_encoded_or_refused_cleanly(client, texts):
    r = client.post("/v1/encode", json={"inputs": texts, "tokens": True})
    check(r)
    if r.status_code == 200:
        data = r.json()["data"]
        assert len(data) == len(texts)
        for item, text in zip(data, texts, strict=True):
            assert len(item["embedding"]) == 384 and all(math.isfinite(v) for v in item["embedding"])
            assert all(0 <= t["start"] <= t["end"] <= len(text) for t in item["tokens"])


@FAST
@given(body=st.dictionaries(st.sampled_from(["inputs", "input", "truncate", "normalize", "attention", "tokens", "model",
                                             "dimensions", "encoding_format", "parameters", "texts", "input_type",
                                             "embedding_types", "truncation_direction", "text_1", "text_2",
                                             "truncate_prompt_tokens", "x"]), json_values, max_size=5),
       route=st.sampled_from(["/v1/encode", "/v1/embeddings", "/v1/tokenize", "/v2/models/all-MiniLM-L6-v2/infer",
                              "/embed", "/", "/v2/embed", "/embed_sparse", "/v1/score", "/v1/batches", "/v1/files"]))
def test_arbitrary_json_bodies_never_cause_a_server_error(client, body, route):
    check(client.post(route, json=body))


RAW = {
    "NaN": b'{"inputs": NaN}',
    "Infinity in a number field": b'{"inputs": "x", "attention": {"layers": [Infinity]}}',
    "dimensions NaN": b'{"input": "x", "dimensions": NaN}',
    "lone surrogate": b'{"inputs": ["\\ud800 broken"]}',
    "NUL and controls": b'{"inputs": ["a\\u0000b\\u0007c\\u001b[31m"]}',
    "deeply nested": b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge list": json.dumps({"inputs": ["x"] * 100_000}).encode(),
    "1 MB string": json.dumps({"inputs": "a" * 1_000_000}).encode(),
    "1 MB of one word, truncation off": json.dumps({"inputs": "word " * 200_000, "truncate": False}).encode(),
    # the most the limits let through, each text past the characters bound (issue 55: tokenized by a prefix only)
    "64 texts of 100k characters, truncation off": json.dumps({"inputs": ["word " * 20_000] * 64,
                                                              "truncate": False}).encode(),
    "not an object": b'["inputs", "x"]',
    "empty body": b"",
    "binary garbage": bytes(range(256)) * 100,
    "utf-16": '{"inputs": "x"}'.encode("utf-16"),
}


@pytest.mark.parametrize("name", list(RAW))
@pytest.mark.parametrize("route", ["/v1/encode", "/v1/embeddings", "/v2/models/all-MiniLM-L6-v2/infer", "/embed", "/",
                                   "/embed_sparse", "/v1/score", "/v1/batches", "/v1/files"])
def test_raw_hostile_payloads_get_4xx_json(client, name, route):
    r = client.post(route, content=RAW[name], headers={"content-type": "application/json"})
    check(r)
    # control characters are text like any other; UTF-16 JSON is decoded as Python's json does; TEI's
    # routes ignore fields they do not read (as TEI does), the Infinity in `attention` among them
    fine = ("NUL and controls", "utf-16") + (("Infinity in a number field",) if route in ("/embed", "/") else ())
    assert 400 <= r.status_code < 500 or (r.status_code == 200 and name in fine)


@pytest.mark.parametrize("content_type", ["text/plain", "application/xml", "multipart/form-data; boundary=x", ""])
def test_wrong_content_types_get_4xx_json(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/v1/encode", content=b'{"inputs": "x"}', headers=headers)
    check(r)
    assert 400 <= r.status_code < 500


def _multipart(parts: list[tuple[bytes, bytes]], boundary: bytes = b"b0undary") -> bytes:
    return b"".join(b"--" + boundary + b"\r\n" + head + b"\r\n\r\n" + content + b"\r\n" for head, content in parts) \
        + b"--" + boundary + b"--\r\n"


_PURPOSE = (b'Content-Disposition: form-data; name="purpose"', b"batch")
_FILE = b'Content-Disposition: form-data; name="file"; filename="a.jsonl"'
_MULTIPART = "multipart/form-data; boundary=b0undary"
UPLOADS = {  # (body, content type): OpenAI's Batch API upload, POST /v1/files (limits: tests/conftest.py BATCH_LIMITS)
    "no boundary": (b"--x\r\n\r\n", "multipart/form-data"),
    "garbage after the boundary": (bytes(range(256)) * 100, _MULTIPART),
    "a part without headers' end": (b"--b0undary\r\nContent-Disposition: form-data; name=file", _MULTIPART),
    "odd header bytes": (_multipart([(b'Content-Disposition: form-data; name="\xff\x00"; filename*=bad\'\'%ZZ', b"{}"),
                                     _PURPOSE]), _MULTIPART),
    "no purpose": (_multipart([(_FILE, b"{}")]), _MULTIPART),
    "a file of 3 MB": (_multipart([_PURPOSE, (_FILE, b"{}\n" * 1_000_000)]), _MULTIPART),
    "a line of 1 MB": (_multipart([_PURPOSE, (_FILE, b"x" * 1_000_000)]), _MULTIPART),
    "10,000 empty lines": (_multipart([_PURPOSE, (_FILE, b"\n" * 10_000)]), _MULTIPART),
    # issue 55: bodies that cost gigabytes or froze the loop before uploads streamed to disk
    "10,000 lines ended by a lone CR": (_multipart([_PURPOSE, (_FILE, b"{}\r" * 10_000)]), _MULTIPART),
    "a one-byte boundary, lookalike delimiters, no purpose": (_multipart([(_FILE, b"{}\r\n--y\n" * 1000)], b"x"),
                                                              "multipart/form-data; boundary=x"),
    "a one-byte boundary, 120,000 empty parts": ((b"--x\r\n\r\n\r\n") * 120_000 + b"--x--\r\n", "multipart/form-data; boundary=x"),
    "part headers of 1 MB": (b"--b0undary\r\n" + _FILE + b"\r\nX-Pad: " + b"a" * 1_000_000 + b"\r\n\r\n{}\r\n--b0undary--\r\n",
                             _MULTIPART),
    "1 MB of short part headers": (b"--b0undary\r\n" + _FILE + b"\r\n" + b"X: 1\r\n" * 200_000 + b"\r\n{}\r\n--b0undary--\r\n",
                                   _MULTIPART),
    "a boundary of 1,000 characters": (_multipart([_PURPOSE, (_FILE, b"{}")], b"b" * 1000),
                                       "multipart/form-data; boundary=" + "b" * 1000),
    "two file parts": (_multipart([_PURPOSE, (_FILE, b"{}"), (_FILE, b"{}")]), _MULTIPART),
    "purpose after the file": (_multipart([(_FILE, b"{}"), (_PURPOSE[0], b"fine-tune")]), _MULTIPART),
    "a purpose of 10 KB": (_multipart([(_PURPOSE[0], b"batch" * 2000), (_FILE, b"{}")]), _MULTIPART),
    "100 parts": (_multipart([_PURPOSE, (_FILE, b"{}")] + [(b'Content-Disposition: form-data; name="x"', b"y")] * 98),
                  _MULTIPART),
    "cut before the closing boundary": (_multipart([_PURPOSE, (_FILE, b"{}")])[:-16], _MULTIPART),
    "expires_after out of range": (_multipart([_PURPOSE, (b'Content-Disposition: form-data; name="expires_after[anchor]"',
                                                          b"created_at"),
                                               (b'Content-Disposition: form-data; name="expires_after[seconds]"', b"59"),
                                               (_FILE, b"{}")]), _MULTIPART),
    "expires_after without its anchor": (_multipart([_PURPOSE, (b'Content-Disposition: form-data; '
                                                                b'name="expires_after[seconds]"', b"3600"),
                                                     (_FILE, b"{}")]), _MULTIPART),
}


@pytest.mark.parametrize("name", list(UPLOADS))
def test_hostile_batch_file_uploads_get_4xx_json(client, name):
    body, content_type = UPLOADS[name]
    r = client.post("/v1/files", content=body, headers={"content-type": content_type})
    check(r)
    assert 400 <= r.status_code < 500
    assert r.status_code == 413 or "MB" not in name, r.text


def test_an_oversized_upload_without_a_length_is_refused(client):
    """A body with no Content-Length (chunked), a file of 8 MB of 1,000-byte lines past the upload limit:
    counted as it streams in, 413."""
    head = b"--b0undary\r\n" + _FILE + b"\r\n\r\n"
    line = b'{"x": "' + b"y" * 990 + b'"}\n'
    r = client.post("/v1/files", content=iter([head, *(line * 1049 for _ in range(8))]),
                    headers={"content-type": "multipart/form-data; boundary=b0undary"})
    check(r)
    assert r.status_code == 413, r.text


def test_service_answers_after_the_abuse(client):
    r = client.post("/v1/encode", json={"inputs": "still healthy"})
    assert r.status_code == 200


def test_openapi_fuzzing_finds_no_server_errors(service_url):
    """schemathesis generates requests for every operation of our OpenAPI spec, valid and not."""
    schema = schemathesis.openapi.from_url(f"{service_url}/openapi.json")
    statuses: dict[str, int] = {}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10

    for operation in operations:

        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def fuzz(case) -> None:
            response = case.call(base_url=service_url, timeout=60)
            key = str(response.status_code)
            statuses[key] = statuses.get(key, 0) + 1
            where = f"{case.method} {case.formatted_path}"
            assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:300]}"
            headers = {k.lower(): v for k, v in response.headers.items()}
            content_type = headers.get("content-type", "")
            content_type = content_type[0] if isinstance(content_type, list) else content_type
            assert content_type.startswith("application/json"), (where, content_type)
            if response.status_code >= 400:
                body = response.json()
                echoed = headers.get("x-request-id")
                echoed = echoed[0] if isinstance(echoed, list) else echoed
                shape = error_shape_of(case.formatted_path, case.method.upper())
                assert set(body) == shape, (where, body)
                if is_vllms(case.formatted_path, case.method.upper()):
                    assert set(body["error"]) == {"message", "type", "param", "code"}, where
                    assert body["error"]["code"] == response.status_code, where
                elif is_openais(case.formatted_path, case.method.upper()):
                    assert set(body["error"]) == {"message", "type", "param", "code"}, where
                    assert isinstance(body["error"]["code"], str), where
                elif shape == {"error"}:
                    assert set(body["error"]) == {"type", "message", "request_id"}, where
                    assert body["error"]["request_id"] == echoed, where
                elif shape == {"id", "message"}:
                    assert body["id"] == echoed, where
                elif shape == {"error", "type", "request_id"}:  # KServe v2's
                    assert isinstance(body["error"], str) and body["request_id"] == echoed, where

        fuzz()
    record("schema-driven fuzzing (schemathesis)", f"{len(operations)} OpenAPI operations, 20 generated requests each",
           statuses, note="no 5xx; every refusal a 4xx JSON error")
