"""64 texts of 100k characters (the most max_inputs and max_text_chars let through) on HTTP and gRPC (issue 55,
defect 8): they cost 2.3 s and +413 MiB of tokenizer work before their 413. With the characters bound
(service/engine/tokenization.py: a text past max_tokens x 32 characters is tokenized by a prefix only) they
are cut (truncation on: /v1/tokenize, /v1/embeddings, KServe v2 over gRPC) or refused (truncation off:
/v1/encode's 413 in JSON, gRPC's INVALID_ARGUMENT) in a fraction of that; the cut texts' embeddings are those
of their first characters (the whole text's first tokens); a text whose first characters hold too few tokens
(one word of 100k letters, one [UNK] for WordPiece) is a 413 naming the bound on both protocols, never a
silently different answer. Against the session's real service (Ray Serve on loopback, all-MiniLM-L6-v2)."""

from __future__ import annotations

import time

import grpc
import httpx
import numpy as np
import pytest

from service.apis.kserve_v2.messages import messages
from tests.families import CORPUS
from tests.reliability import record
from tests.test_hostile_grpc import PeakRss, infer_stub, replica_pid

pytestmark = pytest.mark.serial  # its bounds hold on a quiet machine: make test runs it after the rest, alone

MODEL = "all-MiniLM-L6-v2"
WORDS = (" ".join(CORPUS) + " ") * (100_000 // len(" ".join(CORPUS)) + 1)
LONG = [WORDS[i:i + 100_000] for i in range(64)]  # 64 distinct texts of 100k characters of real words
SECONDS = 1.5  # a request that tokenizes only (was 2.3 s for the tokenizer alone, on an idle machine)
# the replica's peak growth: parsing the 6.4 MB body alone (JSON, its strings, the request's copies) takes tens
# of MiB; the tokenizer's whole texts took +413 MiB more
GROWN_MB = 120


@pytest.fixture(scope="module")
def channel(ray_serve, service_url):
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(ray_serve.grpc_target, options=options) as ch:
        yield ch


def timed(call):
    """(result, seconds, the replica's peak growth in MiB) of `call()`."""
    with PeakRss(replica_pid("encoder")) as rss:
        started = time.perf_counter()
        result = call()
        took = time.perf_counter() - started
    return result, took, rss.grown_mb


def v2_request(texts: list[str], truncate: bool = True):
    m = messages()
    request = m.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="text", datatype="BYTES", shape=[len(texts)]).contents.bytes_contents.extend(
        t.encode() for t in texts)
    request.parameters["truncate"].CopyFrom(m.InferParameter(bool_param=truncate))
    request.outputs.add(name="sentence_embedding")  # not the token encodings: 25 MB of answer, not the point here
    return request


def test_64_long_texts_are_cut_on_http_quickly_and_embed_as_their_first_characters(service_url):
    """/v1/tokenize tokenizes and answers, nothing more: the cut's own cost. Then /v1/embeddings of the same
    texts: their embeddings are those of their first 2,000 characters (past 254 tokens) sent alone."""
    (r, took, grown) = timed(lambda: httpx.post(f"{service_url}/v1/tokenize", json={"inputs": LONG}, timeout=120))
    assert r.status_code == 200, r.text[:300]
    assert [len(item["tokens"]) for item in r.json()["data"]] == [256] * 64
    assert took < SECONDS and grown < GROWN_MB, f"{took:.2f}s, replica +{grown:.0f} MiB"
    embedded = httpx.post(f"{service_url}/v1/embeddings", json={"model": MODEL, "input": LONG[:8]}, timeout=120)
    assert embedded.status_code == 200 and embedded.json()["usage"]["prompt_tokens"] == 8 * 256, embedded.text[:300]
    short = httpx.post(f"{service_url}/v1/embeddings", json={"model": MODEL, "input": [t[:2_000] for t in LONG[:8]]},
                       timeout=60).json()["data"]
    np.testing.assert_allclose([d["embedding"] for d in embedded.json()["data"]], [d["embedding"] for d in short],
                               atol=1e-5)
    record("/v1/tokenize: 64 texts of 100k characters", "64 x 100k chars of words (truncation on)", {"200": 1},
           note=f"cut by the characters bound in {took:.2f}s, replica +{grown:.0f} MiB (was 2.3 s and +413 MiB)")


def test_64_long_texts_without_truncation_are_a_413_on_http_quickly(service_url):
    (r, took, grown) = timed(lambda: httpx.post(f"{service_url}/v1/encode",
                                                json={"inputs": LONG, "truncate": False}, timeout=120))
    assert r.status_code == 413 and r.headers["content-type"].startswith("application/json"), r.text[:300]
    message = r.json()["error"]["message"]
    assert "input 0 has more than 256 tokens" in message and "of 100000 characters" in message, message
    assert took < SECONDS and grown < GROWN_MB, f"{took:.2f}s, replica +{grown:.0f} MiB"
    record("/v1/encode: 64 texts of 100k characters, truncate false", "64 x 100k chars of words", {"413": 1},
           note=f"refused from the first text's prefix in {took:.2f}s, replica +{grown:.0f} MiB")


def test_64_long_texts_are_cut_or_refused_on_grpc_quickly(channel):
    """Refused (truncate off) from the first text's prefix; cut (truncate on) at the cost of the same request
    of the texts' first 2,000 characters (its inference, 64 x 256 tokens, is the same work) plus little."""
    infer = infer_stub(channel)
    metadata = (("application", "encoder"),)
    with PeakRss(replica_pid("encoder")) as rss:
        started = time.perf_counter()
        with pytest.raises(grpc.RpcError) as refused:
            infer(v2_request(LONG, truncate=False), metadata=metadata, timeout=120)
        took = time.perf_counter() - started
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value  # too_large, as every 413
    assert "more than 256 tokens" in refused.value.details()
    assert took < SECONDS and rss.grown_mb < GROWN_MB, f"{took:.2f}s, replica +{rss.grown_mb:.0f} MiB"
    (short, short_took, _) = timed(lambda: infer(v2_request([t[:2_000] for t in LONG]), metadata=metadata, timeout=120))
    (answer, cut_took, grown) = timed(lambda: infer(v2_request(LONG), metadata=metadata, timeout=120))
    assert [list(o.shape) for o in answer.outputs] == [[64, 384]]
    assert answer.raw_output_contents == short.raw_output_contents or np.allclose(
        np.frombuffer(answer.raw_output_contents[0], np.float32), np.frombuffer(short.raw_output_contents[0], np.float32),
        atol=1e-5)
    assert cut_took < short_took + SECONDS and grown < GROWN_MB, \
        f"{cut_took:.2f}s (the texts' first characters: {short_took:.2f}s), replica +{grown:.0f} MiB"
    record("KServe v2 gRPC: 64 texts of 100k characters", "ModelInfer, 64 x 100k chars (truncate off, then on)",
           {"INVALID_ARGUMENT": 1, "OK": 1}, note=f"refused in {took:.2f}s; cut and embedded in {cut_took:.2f}s where "
           f"the same texts' first 2,000 characters took {short_took:.2f}s; replica +{grown:.0f} MiB")


def test_a_text_whose_first_characters_hold_too_few_tokens_is_a_413_naming_the_bound(service_url, channel):
    """One word of 100k letters: WordPiece makes it one [UNK], and its first 8,192 characters cannot say what
    the whole text gives; refused on both protocols rather than answered differently."""
    word = "a" * 100_000
    r = httpx.post(f"{service_url}/v1/embeddings", json={"model": MODEL, "input": [word]}, timeout=60)
    assert r.status_code == 413, r.text[:300]
    assert "past the characters bound of 8192 (the model's 256 tokens x 32)" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as refused:
        infer_stub(channel)(v2_request([word]), metadata=(("application", "encoder"),), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "past the characters bound" in refused.value.details()
    record("one word of 100k letters", "/v1/embeddings and gRPC ModelInfer", {"413": 1, "INVALID_ARGUMENT": 1},
           note="the characters bound cannot cut it exactly: refused naming the bound")
