"""Locust users that mirror real traffic to the encoder service (`make loadtest`).

Every request checks its response (status and shape), so a wrong answer counts as a failure,
a 429/503 included. Texts and tokens served are summed from the responses for the summary.
Weights: single texts 5, client batches 2, OpenAI client 2, attention 1, v2 1.
"""

from __future__ import annotations

import random

from locust import HttpUser, between, task

from loadtests.common import CORPUS, HIDDEN, MODEL, SHORT, count, fail


class SingleTextUser(HttpUser):
    """Interactive traffic: one short text per request (search queries, chat messages)."""

    weight = 5
    wait_time = between(0.05, 0.2)

    @task
    def encode_one(self) -> None:
        with self.client.post("/v1/encode", json={"inputs": random.choice(SHORT)}, name="encode 1 text",
                              catch_response=True) as r:
            if r.status_code != 200:
                return fail(r, "status")
            body = r.json()
            if len(body["data"]) != 1 or len(body["data"][0]["embedding"]) != HIDDEN:
                return fail(r, "shape")
            count(1, body["usage"]["tokens"])


class BatchUser(HttpUser):
    """Indexing traffic: client batches of 8-64 texts of mixed lengths, some near the maximum."""

    weight = 2
    wait_time = between(0.2, 0.5)

    @task
    def encode_batch(self) -> None:
        texts = random.sample(CORPUS, random.randint(8, 64))
        with self.client.post("/v1/encode", json={"inputs": texts}, name="encode 8-64 texts",
                              catch_response=True) as r:
            if r.status_code != 200:
                return fail(r, "status")
            data = r.json()["data"]
            if [d["index"] for d in data] != list(range(len(texts))) or any(len(d["embedding"]) != HIDDEN for d in data):
                return fail(r, "shape")
            count(len(texts), r.json()["usage"]["tokens"])


class OpenAIUser(HttpUser):
    """Traffic from the openai client: base64 embeddings, as the client requests by default."""

    weight = 2
    wait_time = between(0.1, 0.3)

    @task
    def embeddings(self) -> None:
        texts = random.sample(CORPUS, random.randint(1, 16))
        payload = {"input": texts, "model": MODEL, "encoding_format": "base64"}
        with self.client.post("/v1/embeddings", json=payload, name="openai embeddings", catch_response=True) as r:
            if r.status_code != 200:
                return fail(r, "status")
            data = r.json()["data"]
            # base64 of HIDDEN little-endian float32 values
            if len(data) != len(texts) or any(len(d["embedding"]) != (HIDDEN * 4 + 2) // 3 * 4 for d in data):
                return fail(r, "shape")
            count(len(texts), r.json()["usage"]["total_tokens"])


class AttentionUser(HttpUser):
    """A small share of interpretability traffic: one layer's attention, base64 float16."""

    weight = 1
    wait_time = between(0.2, 0.5)

    @task
    def attention(self) -> None:
        text = random.choice(SHORT)
        payload = {"inputs": [text], "attention": {"layers": [5], "heads": [0, 1], "format": "base64", "dtype": "float16"}}
        with self.client.post("/v1/encode", json=payload, name="encode + attention", catch_response=True) as r:
            if r.status_code != 200:
                return fail(r, "status")
            item = r.json()["data"][0]
            n = item["n_tokens"]
            if item["attention"]["shape"] != [1, 2, n, n]:
                return fail(r, "shape")
            count(1, n)


class V2User(HttpUser):
    """KServe / Triton clients: Open Inference Protocol v2 with JSON tensors."""

    weight = 1
    wait_time = between(0.1, 0.3)

    @task
    def infer(self) -> None:
        texts = random.sample(SHORT, random.randint(1, 8))
        payload = {
            "inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
            "outputs": [{"name": "sentence_embedding"}, {"name": "attention_mask"}],
        }
        with self.client.post(f"/v2/models/{MODEL}/infer", json=payload, name="v2 infer", catch_response=True) as r:
            if r.status_code != 200:
                return fail(r, "status")
            outputs = {o["name"]: o for o in r.json()["outputs"]}
            if outputs["sentence_embedding"]["shape"] != [len(texts), HIDDEN]:
                return fail(r, "shape")
            count(len(texts), int(sum(outputs["attention_mask"]["data"])))
