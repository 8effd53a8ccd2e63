"""The official clients, unchanged, against the running service: openai and tritonclient.http."""

from __future__ import annotations

import numpy as np
import pytest

TEXTS = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]


@pytest.fixture(scope="module")
def reference(checkpoint):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(checkpoint.path), device="cpu").encode(TEXTS, convert_to_numpy=True)


def max_cosine_gap(got, expected) -> float:
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    return float(1 - cos.min())


def test_openai_client(service_url, reference):
    from openai import OpenAI

    client = OpenAI(base_url=f"{service_url}/v1", api_key="unused", max_retries=0)
    # The client asks for base64 by default and decodes it itself.
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    assert response.model == "all-MiniLM-L6-v2"
    assert [d.index for d in response.data] == [0, 1, 2]
    assert max_cosine_gap([d.embedding for d in response.data], reference) <= 1e-4
    assert response.usage.prompt_tokens > 0

    as_floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[0], encoding_format="float")
    assert max_cosine_gap([as_floats.data[0].embedding], reference[:1]) <= 1e-4
    from openai import BadRequestError, NotFoundError

    with pytest.raises(BadRequestError, match="does not support dimensions"):  # not a matryoshka model
        client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[0], dimensions=128)

    with pytest.raises(NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")


@pytest.mark.parametrize("binary", [True, False], ids=["binary-tensors", "json-tensors"])
def test_tritonclient_http(service_url, reference, binary):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url=service_url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("all-MiniLM-L6-v2")
    metadata = client.get_model_metadata("all-MiniLM-L6-v2")
    assert metadata["inputs"][0]["datatype"] == "BYTES"

    text = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_), binary_data=binary)
    outputs = [
        httpclient.InferRequestedOutput("sentence_embedding", binary_data=binary),
        httpclient.InferRequestedOutput("last_hidden_state", binary_data=binary),
        httpclient.InferRequestedOutput("attention_mask", binary_data=binary),
    ]
    result = client.infer("all-MiniLM-L6-v2", inputs=[text], outputs=outputs, request_id="r1")
    embedding = result.as_numpy("sentence_embedding")
    assert embedding.shape == (3, 384) and embedding.dtype == np.float32
    assert max_cosine_gap(embedding, reference) <= 1e-4
    hidden, mask = result.as_numpy("last_hidden_state"), result.as_numpy("attention_mask")
    assert hidden.shape[:2] == mask.shape and hidden.shape[2] == 384
    # mean of the real token vectors, normalised, is the embedding: padding rows are zeros
    pooled = (hidden * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
    pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    np.testing.assert_allclose(pooled, embedding, atol=1e-5)
    assert np.all(hidden[mask == 0] == 0)

    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException):
        client.get_model_metadata("unknown-model")
