"""Optional bearer-token authentication: inference routes need the token, health and metadata
stay open, and a refused request never reaches the model."""

from __future__ import annotations

import httpx
import pytest

from tests.errors import error_type
from tests.conftest import deploy

TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def secured(ray_serve, default_bundle, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN + "\n")  # mounted secrets often end with a newline
    deploy({"auth_token_file": str(token_file), "num_cpus": 0.5},
           "secured", "/secured", default_bundle)
    yield f"{ray_serve.url}/secured"
    from ray import serve

    serve.delete("secured")


def encoder_requests() -> int:
    from ray import serve

    return serve.get_deployment_handle("Encoder", "secured").info.remote().result()["counters"]["requests"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/encode", {"inputs": "x"}),
        ("/v1/embeddings", {"input": "x"}),
        ("/v1/tokenize", {"inputs": "x"}),
        ("/v2/models/all-MiniLM-L6-v2/infer", {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}),
    ],
)
def test_inference_routes_need_the_token(secured, path, body):
    before = encoder_requests()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}):
        r = httpx.post(f"{secured}{path}", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert error_type(r) == "unauthorized"
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert encoder_requests() == before, "a refused request reached the model"
    ok = httpx.post(f"{secured}{path}", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_unauthorized_request_is_refused_before_its_body_is_read(secured):
    r = httpx.post(f"{secured}/v1/encode", content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 401


@pytest.mark.parametrize("path", ["/health", "/v2/health/live", "/v2/health/ready", "/v2/models/all-MiniLM-L6-v2", "/info", "/v2"])
def test_health_and_metadata_stay_open(secured, path):
    assert httpx.get(f"{secured}{path}", timeout=30).status_code == 200


def test_openai_client_with_the_token_as_api_key(secured):
    from openai import AuthenticationError, OpenAI

    good = OpenAI(base_url=f"{secured}/v1", api_key=TOKEN, max_retries=0)
    assert len(good.embeddings.create(model="all-MiniLM-L6-v2", input="hello").data[0].embedding) == 384
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{secured}/v1", api_key="nope", max_retries=0).embeddings.create(model="all-MiniLM-L6-v2", input="x")


def test_unauthorized_is_counted_with_its_reason(secured, metrics_url):
    from tests.metrics_scrape import poll, settled, total

    def refused(f):
        return total(f, "ray_encoder_request_failures_total", application="secured", reason="unauthorized")

    before = refused(settled(metrics_url, refused))
    assert httpx.post(f"{secured}/v1/encode", json={"inputs": "x"}, timeout=30).status_code == 401
    assert refused(poll(metrics_url, lambda f: refused(f) > before, "the refusal to be counted")) == before + 1
    from tests.reliability import record

    record("access control", "requests without, with a wrong, and with a malformed bearer token",
           "401 JSON before the body is read; the model never touched; health and metadata open",
           note="token from a mounted file or ENCODER_API_TOKEN; constant-time compare")


def test_grpc_infer_needs_the_token_in_its_metadata_and_metadata_calls_stay_open(ray_serve, secured):
    """Over gRPC as over HTTP: ModelInfer without the bearer token (in the `authorization` metadata)
    is UNAUTHENTICATED before anything reaches the model; health and metadata calls stay open."""
    import numpy as np
    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    app = {"application": "secured"}
    client = triton_grpc.InferenceServerClient(ray_serve.grpc_target)
    text = triton_grpc.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"x"], dtype=object))
    try:
        before = encoder_requests()
        for metadata in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
            with pytest.raises(InferenceServerException) as refused:
                client.infer("all-MiniLM-L6-v2", [text], headers={**app, **metadata})
            assert refused.value.status() == "StatusCode.UNAUTHENTICATED", refused.value
        assert encoder_requests() == before, "a refused call reached the model"
        assert client.is_server_ready(headers=app) and client.get_model_metadata("all-MiniLM-L6-v2", headers=app).name
        ok = client.infer("all-MiniLM-L6-v2", [text], headers={**app, "authorization": f"Bearer {TOKEN}"})
        assert ok.as_numpy("sentence_embedding").shape == (1, 384)
    finally:
        client.close()


@pytest.mark.parametrize(("path", "body", "shape"), [
    ("/embed", {"inputs": "x"}, {"error", "error_type"}),
    ("/", {"inputs": "x"}, {"error", "error_type"}),
    ("/tokenize", {"inputs": "x"}, {"error", "error_type"}),
    ("/v2/embed", {"model": "all-MiniLM-L6-v2", "texts": ["x"], "input_type": "search_query"}, {"id", "message"}),
])
def test_tei_and_cohere_routes_need_the_token_and_answer_in_their_clients_shape(secured, path, body, shape):
    before = encoder_requests()
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{secured}{path}", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and set(r.json()) == shape, r.text
    assert encoder_requests() == before, "a refused request reached the model"
    ok = httpx.post(f"{secured}{path}", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_the_real_tei_and_cohere_clients_pass_the_token_as_they_always_do(secured):
    import cohere
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    assert InferenceClient(model=f"{secured}/", token=TOKEN).feature_extraction("hello").shape == (1, 384)
    with pytest.raises(HfHubHTTPError, match="missing or invalid bearer token"):
        InferenceClient(model=f"{secured}/", token="nope").feature_extraction("hello")
    co = cohere.ClientV2(base_url=secured, api_key=TOKEN)
    assert len(co.embed(texts=["hello"], model="all-MiniLM-L6-v2", input_type="search_query").embeddings.float_[0]) == 384
    with pytest.raises(cohere.UnauthorizedError):
        cohere.ClientV2(base_url=secured, api_key="nope", max_retries=0).embed(
            texts=["hello"], model="all-MiniLM-L6-v2", input_type="search_query")
