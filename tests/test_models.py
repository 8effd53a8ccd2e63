"""Several models behind one service: two bundles of different families served by every replica,
each picked by name through the OpenAI client, the native routes and tritonclient; the listings;
the errors; and a model replaced by a config change under steady traffic with no failed request."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from tests.errors import error_message
from tests.conftest import deploy, wait_until
from tests.families import add_dense, make_checkpoint

TEXTS = ["The weather is lovely today.", "Der Zug nach München fährt um acht Uhr ab.", "SELECT name FROM users;"]
MINILM = "all-MiniLM-L6-v2"
OTHER = "tiny-xlmr"  # a random XLM-RoBERTa checkpoint built by the test: another family, tokenizer and size


def export(checkpoint, out, name):
    from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
    from export.pipeline import ExportOptions, build_bundle

    build_bundle(ExportOptions(str(checkpoint), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, name=name, lossy=()),
                 progress=lambda _: None)
    return out


@pytest.fixture(scope="module")
def other_checkpoint(tmp_path_factory):
    return make_checkpoint("xlm-roberta", tmp_path_factory.mktemp("xlmr") / "checkpoint", pooling="mean", normalize=True)


@pytest.fixture(scope="module")
def other_bundle(other_checkpoint, tmp_path_factory):
    return export(other_checkpoint, tmp_path_factory.mktemp("xlmr-bundle") / "bundle", OTHER)


@pytest.fixture(scope="module")
def references(checkpoint, other_checkpoint):
    """Each family's own reference embeddings, from sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    return {name: SentenceTransformer(str(path), device="cpu").encode(TEXTS, convert_to_numpy=True)
            for name, path in ((MINILM, checkpoint.path), (OTHER, other_checkpoint))}


@pytest.fixture(scope="module")
def two_models(ray_serve, default_bundle, other_bundle):
    """One application serving both bundles, MiniLM first (the default)."""
    from ray import serve

    deploy({"bundles": [str(default_bundle), str(other_bundle)], "num_cpus": 0.5}, "two-models", "/two",
           default_bundle)
    try:
        yield ray_serve.url + "/two"
    finally:
        serve.delete("two-models")


def min_cosine(got, expected) -> float:
    got, expected = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    return float(((got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)).min())


def test_each_model_by_name_through_openai_native_and_triton(two_models, references):
    import tritonclient.http as httpclient
    from openai import OpenAI

    client = OpenAI(base_url=f"{two_models}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == [MINILM, OTHER]
    assert client.models.retrieve(OTHER).id == OTHER
    triton = httpclient.InferenceServerClient(url=two_models.removeprefix("http://"))
    for name, reference in references.items():
        response = client.embeddings.create(model=name, input=TEXTS)
        assert response.model == name
        assert min_cosine([d.embedding for d in response.data], reference) >= 0.9999

        native = httpx.post(f"{two_models}/v1/encode", json={"inputs": TEXTS, "model": name}, timeout=60).json()
        assert native["model"] == name
        assert min_cosine([d["embedding"] for d in native["data"]], reference) >= 0.9999

        text = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
        text.set_data_from_numpy(np.array([t.encode() for t in TEXTS], dtype=np.object_))
        result = triton.infer(name, inputs=[text], outputs=[httpclient.InferRequestedOutput("sentence_embedding")])
        assert min_cosine(result.as_numpy("sentence_embedding"), reference) >= 0.9999
        assert triton.is_model_ready(name)
        assert triton.get_model_metadata(name)["outputs"][0]["shape"][-1] == reference.shape[1]
    assert references[MINILM].shape[1] != references[OTHER].shape[1]  # two really different models
    # left out on the native routes: the first listed
    default = httpx.post(f"{two_models}/v1/encode", json={"inputs": TEXTS}, timeout=60).json()
    assert default["model"] == MINILM and min_cosine([d["embedding"] for d in default["data"]], references[MINILM]) >= 0.9999
    # and the attention routes of the other family
    attention = httpx.post(f"{two_models}/v1/attention", json={"inputs": TEXTS[1], "model": OTHER}, timeout=60).json()
    assert attention["model"] == OTHER and len(attention["data"][0]["entropy"]) == 2  # the tiny model's 2 layers


def test_listings_and_info_describe_every_model(two_models, default_bundle, other_bundle):
    index = httpx.post(f"{two_models}/v2/repository/index", timeout=30).json()
    assert [(m["name"], m["state"]) for m in index] == [(MINILM, "READY"), (OTHER, "READY")]
    info = httpx.get(f"{two_models}/info", timeout=30).json()
    assert [m["model"] for m in info["models"]] == [MINILM, OTHER]
    assert info["model"] == MINILM  # the default's description stays at the top level
    other = info["models"][1]
    assert other["architecture"] != info["models"][0]["architecture"]
    assert (other["hidden_size"], other["num_layers"], other["bundle"]["path"]) == (32, 2, str(other_bundle))
    assert httpx.get(f"{two_models}/health", timeout=30).json()["models"] == [MINILM, OTHER]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("POST", "/v1/embeddings", {"input": "x"}, 422, ["model: required", MINILM, OTHER]),
        ("POST", "/v1/embeddings", {"input": "x", "model": "gpt-4"}, 404, ["'gpt-4' is not served", MINILM, OTHER]),
        ("POST", "/v1/encode", {"inputs": "x", "model": "nope"}, 404, ["'nope' is not served", OTHER]),
        ("POST", "/v1/attention", {"inputs": "x", "model": 3}, 422, ["model"]),
        ("POST", "/v1/similarity", {"pairs": [["a", "b"]], "model": "nope"}, 404, ["not served"]),
        ("POST", "/v2/models/nope/infer", {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]},
         404, ["'nope' is not served"]),
        ("GET", "/v2/models/nope", None, 404, ["'nope' is not served"]),
        ("GET", "/v1/models/nope", None, 404, ["'nope' is not served"]),
        ("POST", "/v1/encode", {"inputs": "x", "model": OTHER, "attention": {"layers": [5]}}, 422, ["layers", "2 layers"]),
    ],
)
def test_bad_model_names_and_mixed_up_fields_are_4xx(two_models, method, path, body, status, words):
    r = httpx.request(method, f"{two_models}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    message = error_message(r)
    for word in words:
        assert word in message, message


def test_metrics_carry_the_model_label(two_models, metrics_url):
    from tests.metrics_scrape import poll, total

    def tokens(f):
        return {name: total(f, "ray_encoder_tokens_total", application="two-models", model=name) for name in (MINILM, OTHER)}

    from tests.metrics_scrape import settled

    before = tokens(settled(metrics_url, tokens))
    sent = {}
    for name in (MINILM, OTHER):
        sent[name] = httpx.post(f"{two_models}/v1/encode", json={"inputs": TEXTS, "model": name}, timeout=60).json()["usage"]["tokens"]
    poll(metrics_url, lambda f: tokens(f) == {n: before[n] + sent[n] for n in sent},
         what=f"ray_encoder_tokens_total of each model to move by the tokens sent to it ({sent})")


def test_replacing_a_model_under_traffic_fails_no_request(ray_serve, default_bundle, other_bundle):
    """The config changes the bundle served as `live` from MiniLM to the XLM-R bundle and is applied
    again, as `serve deploy` or a KubeRay update does: Serve replaces the replicas one at a time
    while four clients keep sending; every request succeeds, and the answers switch models."""
    from ray import serve

    name = "live"
    settings = {"num_cpus": 0.5, "replicas": 2, "graceful_shutdown_timeout_s": 10}
    deploy({"bundles": [f"{name}={default_bundle}"], **settings}, "swap", "/swap", default_bundle)
    url = ray_serve.url + "/swap/v1/embeddings"
    outcomes: list[tuple[float, int, int]] = []  # (time, status, dimension)
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                try:
                    r = c.post(url, json={"input": TEXTS[0], "model": name})
                    dim = len(r.json()["data"][0]["embedding"]) if r.status_code == 200 else 0
                    outcomes.append((time.monotonic(), r.status_code, dim))
                except httpx.HTTPError as exc:
                    outcomes.append((time.monotonic(), -1, 0))
                    print("client error:", exc)

    threads = [threading.Thread(target=client) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(outcomes) >= 20, "20 answers from the old model before the swap")
        swap_started = time.monotonic()
        deploy({"bundles": [f"{name}={other_bundle}"], **settings}, "swap", "/swap", default_bundle)
        swapped = time.monotonic()  # serve.run returns once the new replicas run and the old are gone
        wait_until(lambda: sum(1 for at, _, _ in outcomes if at > swapped) >= 20, "20 answers after the swap")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        serve.delete("swap")
    statuses = [s for _, s, _ in outcomes]
    failed = [s for s in statuses if s != 200]
    assert not failed, f"{len(failed)} of {len(statuses)} requests failed during the swap: {sorted(set(failed))}"
    dims = [d for _, _, d in outcomes]
    assert dims[0] == 384 and dims[-1] == 32  # answers switched from MiniLM to the other model
    first_new = next(at for at, _, d in outcomes if d == 32)
    assert all(d == 32 for at, _, d in outcomes if at > swapped)
    from tests.reliability import record

    record("model replaced by a config change", "bundle of model `live` changed from all-MiniLM-L6-v2 to a "
           "XLM-RoBERTa bundle and applied again (2 replicas, replaced one at a time) under 4 closed-loop clients",
           {"200": len(statuses)}, recovery_s=round(swapped - swap_started, 1),
           note=f"first answer of the new model {first_new - swap_started:.1f} s after the change; "
                f"{sum(1 for d in dims if d == 384)} answers by the old model and {sum(1 for d in dims if d == 32)} "
                "by the new; no request failed")


def test_the_explorer_lets_a_person_choose_the_model(two_models):
    """With several models the page offers them; `?model=` picks one, and the grid is that model's."""
    from tests.test_explorer_browser import cell_pixels, chromium_driver, console_errors, open_page

    driver = chromium_driver()
    try:
        open_page(driver, f"{two_models}/explorer?text=Der%20Zug%20f%C3%A4hrt.&model={OTHER}")
        options = driver.execute_script("return Array.from(document.querySelectorAll('#model option'), o => o.value)")
        assert options == [MINILM, OTHER]
        assert driver.execute_script("return document.getElementById('model').value") == OTHER
        cells = cell_pixels(driver)
        assert {(c["layer"], c["head"]) for c in cells} == {(str(l), str(h)) for l in range(2) for h in range(4)}
        assert OTHER in driver.find_element("id", "model-badge").text
        open_page(driver, f"{two_models}/explorer?text=The%20cat%20sat.")  # no choice: the default, MiniLM
        assert len(cell_pixels(driver)) == 6 * 12
        assert not console_errors(driver)
    finally:
        driver.quit()


def test_a_model_with_a_dense_projection_serves_its_width_and_refuses_what_it_cannot_compute(
        ray_serve, default_bundle, other_checkpoint, tmp_path):
    """A Dense projection after pooling (distiluse-style) runs inside the graph: the service answers
    sentence-transformers' vectors at the Dense width, and refuses, saying why, the two things that
    would need the embedding before the projection (an un-normalised vector, per-token shares)."""
    from ray import serve
    from sentence_transformers import SentenceTransformer

    checkpoint = add_dense(other_checkpoint, tmp_path / "dense-checkpoint")
    expected = SentenceTransformer(str(checkpoint), device="cpu").encode(TEXTS, convert_to_numpy=True)
    bundle = export(checkpoint, tmp_path / "dense-bundle", "tiny-dense")
    deploy({"bundles": [str(bundle)], "num_cpus": 0.5}, "dense", "/dense", default_bundle)
    url = ray_serve.url + "/dense"
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            data = c.post("/v1/embeddings", json={"input": TEXTS, "model": "tiny-dense"}).json()["data"]
            assert [len(d["embedding"]) for d in data] == [16] * len(TEXTS)
            assert min_cosine([d["embedding"] for d in data], expected) >= 0.9999
            info = c.get("/info").json()
            assert info["embedding_dim"] == 16 and info["hidden_size"] != 16
            shapes = {o["name"]: o["shape"] for o in c.get("/v2/models/tiny-dense").json()["outputs"]}
            assert shapes["sentence_embedding"] == [-1, 16]
            raw = c.post("/v1/encode", json={"inputs": TEXTS, "normalize": False})
            assert raw.status_code == 422 and "Dense projection" in raw.json()["error"]["message"]
            pairs = {"pairs": [[TEXTS[0], TEXTS[1]]]}
            explained = c.post("/v1/similarity", json={**pairs, "explain": True})
            assert explained.status_code == 422 and "Dense layer" in explained.json()["error"]["message"]
            score = c.post("/v1/similarity", json=pairs).json()["data"][0]["score"]
            assert abs(score - float(expected[0] @ expected[1])) <= 1e-4
    finally:
        serve.delete("dense")
