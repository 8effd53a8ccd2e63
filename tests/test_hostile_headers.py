"""Hostile headers against the running service, through both ingresses (HAProxy to the replica's own
HTTP server, and Ray Serve's proxy): header values that are not UTF-8 in the headers Serve reads, and
request ids that fail the service's rule or come twice. Raw bytes go over a socket with h11 (httpx
refuses non-ASCII header values). Every answer is JSON with one request id, the same in the
X-Request-Id header, the error body and the access log line (tests/access_log.py)."""

from __future__ import annotations

import json
import os
import socket
import uuid

import h11
import httpx
import pytest

from tests.access_log import access_line
from tests.reliability import record

INGRESSES = ("haproxy", "proxy")
# what Ray Serve 2.60 decodes as UTF-8 before any code of ours ran (ray/serve/_private/replica.py,
# proxy.py, http_util.py): each made its replica or proxy fail with a plain-text 500
NOT_UTF8 = [(b"x-request-id", b"caf\xe9"), (b"x-request-timeout-seconds", b"\xff"),
            (b"serve_multiplexed_model_id", b"\xff"), (b"Serve-Multiplexed-Model-Id", b"\xfe\xff"),
            (b"x-session-id", b"\xc3"), (b"x-request-disconnect-disabled", b"?\xff"), (b"traceparent", b"00-\xff")]


def ingress_url(ray_serve, ingress: str) -> str:
    """The session's HAProxy, or the Serve proxy every HAProxy cluster runs beside it."""
    if ingress == "haproxy":
        return ray_serve.url
    return f"http://127.0.0.1:{os.environ['RAY_SERVE_FALLBACK_PROXY_HTTP_PORT']}"


def raw_post(url: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, list, bytes]:
    """One POST with header bytes exactly as given: (status, [(name, value)...] lowercased names, body)."""
    parsed = httpx.URL(url)
    conn = h11.Connection(h11.CLIENT)
    with socket.create_connection((parsed.host, parsed.port), timeout=60) as sock:
        sock.sendall(conn.send(h11.Request(method="POST", target=path, headers=[
            (b"host", f"{parsed.host}:{parsed.port}".encode()), (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), (b"connection", b"close"), *headers])))
        sock.sendall(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        response, chunks = None, []
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                chunks.append(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
    assert response is not None
    return response.status_code, list(response.headers), b"".join(chunks)


def one_id(headers: list) -> str:
    ids = [v.decode() for k, v in headers if k == b"x-request-id"]
    assert len(ids) == 1, headers
    return ids[0]


def json_answer(status: int, headers: list, body: bytes) -> dict:
    content_type = dict(headers).get(b"content-type", b"")
    assert content_type.startswith(b"application/json"), (status, headers, body[:300])
    return json.loads(body)


def test_a_header_that_is_not_utf8_is_a_json_400_with_its_id_in_the_access_log(service_url, ray_serve):
    """Each of the headers Serve decodes, with bytes that are not UTF-8, on an inference route: a 400
    `bad_request` naming the header, in the error shape of the route (ours; TEI's on /embed; Cohere's on
    /v2/embed), with one X-Request-Id that the body and the access log line carry; never Serve's 500."""
    saw: dict[str, int] = {}
    for ingress in INGRESSES:
        url = ingress_url(ray_serve, ingress)
        for name, value in NOT_UTF8:
            status, headers, body = raw_post(url, "/v1/embeddings", [(name, value)], b'{"input": "a text"}')
            saw[str(status)] = saw.get(str(status), 0) + 1
            assert status == 400, (ingress, name, value, status, body[:300])
            error = json_answer(status, headers, body)["error"]
            request_id = one_id(headers)
            assert error["type"] == "bad_request" and name.decode().lower() in error["message"], error
            assert error["request_id"] == request_id, (error, headers)
            line = access_line(service_url, request_id)
            assert line["status"] == 400 and line["tokens"] == 0, line
        # the protocols whose clients parse their own error bodies get theirs
        status, headers, body = raw_post(url, "/embed", [(b"x-request-timeout-seconds", b"\xff")], b'{"inputs": "a"}')
        tei = json_answer(status, headers, body)
        assert status == 422 and tei["error_type"] == "Validation" and "x-request-timeout-seconds" in tei["error"], tei
        status, headers, body = raw_post(url, "/v2/embed", [(b"serve_multiplexed_model_id", b"\xff")],
                                         b'{"texts": ["a"], "input_type": "search_document"}')
        cohere = json_answer(status, headers, body)
        assert status == 400 and cohere["id"] == one_id(headers) and "serve_multiplexed_model_id" in cohere["message"]
        saw["400/422 in the route's style"] = saw.get("400/422 in the route's style", 0) + 2
        # and the service answers the next request as ever
        status, headers, body = raw_post(url, "/v1/embeddings", [], b'{"input": "a text"}')
        assert status == 200 and len(json_answer(status, headers, body)["data"][0]["embedding"]) == 384
    record("headers that are not UTF-8", f"{len(NOT_UTF8)} headers Ray Serve decodes (X-Request-Id, "
           "X-Request-Timeout-Seconds, serve_multiplexed_model_id, the session id, traceparent...) with non-UTF-8 "
           "bytes, through HAProxy and through Serve's proxy", saw,
           note="a JSON 400 naming the header (the route's own error style), one request id in header, body and "
                "access log; was Serve's plain-text 500 with no log line")


def test_a_request_id_that_fails_the_rule_or_comes_twice_is_one_id_everywhere(service_url, ray_serve):
    """An id the service does not take (a space, 200 characters, a control character) is replaced by one
    made for the request; of two X-Request-Id headers the first is the request's. Either way the response
    carries one id, and its error body and access log line carry the same."""
    def cases():
        first = f"first-{uuid.uuid4().hex}".encode()  # a fresh one each time: the log line must be this request's
        return [([(b"x-request-id", b"two words")], None), ([(b"x-request-id", b"a" * 200)], None),
                ([(b"x-request-id", b"tab\there")], None), ([(b"x-request-id", b"caf\xc3\xa9")], None),
                ([(b"x-request-id", first), (b"x-request-id", b"second-id")], first.decode()),
                ([(b"x-request-id", b"not valid"), (b"x-request-id", b"second-id")], None)]

    saw: dict[str, int] = {}
    for ingress in INGRESSES:
        url = ingress_url(ray_serve, ingress)
        for body, status_wanted in ((b'{"input": []}', 422), (b'{"input": "a text"}', 200)):
            for headers_sent, expected in cases():
                status, headers, answer = raw_post(url, "/v1/embeddings", headers_sent, body)
                assert status == status_wanted, (ingress, headers_sent, status, answer[:300])
                request_id = one_id(headers)
                assert 1 <= len(request_id) <= 128, request_id
                assert request_id == expected if expected else request_id.encode() not in {v for _, v in headers_sent}
                if status >= 400:
                    assert json_answer(status, headers, answer)["error"]["request_id"] == request_id
                line = access_line(service_url, request_id)
                assert line["status"] == status, line
                saw[f"{status}, one id"] = saw.get(f"{status}, one id", 0) + 1
    record("request ids that fail the rule or come twice", "X-Request-Id with a space, 200 characters, a tab, "
           "non-ASCII UTF-8; two X-Request-Id headers; through HAProxy and Serve's proxy", saw,
           note="one id per request in the response header, the error body and the access log line (the first "
                "of two when it is valid, else one made); was the client's echoed by Serve, another logged")
