"""What sentence-transformers models carry, honoured end to end: every pooling mode of
sentence-transformers 6 (both config formats) through the parity gate, packed rows and padded
batches; prompts (prompt_name, input_type, default_prompt_name, include_prompt false) and matryoshka
sizes, each held against SentenceTransformer.encode on the same checkpoint; and the newer families
as users serve them (a Qwen3 embedder, a ModernBERT embedder and reranker) against sentence-transformers."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
from bundle.manifest import load_bundle
from export.checkpoint import CheckpointError, load_checkpoint
from export.pipeline import ExportOptions, build_bundle
from service.config import BundleRef, ServiceSettings
from service.engine.engine import EngineTable, load_engine
from service.engine.runner import EncodeJob
from service.engine.encoder_service import EncoderService
from tests.conftest import deploy
from tests.families import CORPUS, add_dense, make_checkpoint, make_classifier

TEXTS = list(CORPUS[:9]) + ["short", "a somewhat longer text that goes on for a while, with commas, and more words"]
PROMPTS = {"query": "query: ", "document": "passage: ", "instruct": "Represent this sentence for retrieval: "}
TOLERANCE = 1e-4
GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}  # EmbeddingGemma's
NOMIC_PROMPTS = {"query": "search_query: ", "document": "search_document: "}  # modernbert-embed's
PAIRS = [(CORPUS[3], CORPUS[4]), (CORPUS[3], CORPUS[5]), (CORPUS[6], CORPUS[15]), ("short", TEXTS[-1])]
QWEN_QUERY = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def export(directory, out, **options):
    build_bundle(ExportOptions(str(directory), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, lossy=(), **options),
                 progress=lambda _: None)
    return out


def engine_service(bundle, packed_tokens: int = 256) -> EncoderService:
    settings = ServiceSettings.model_validate({"bundle": str(bundle), "intra_op_threads": 1,
                                               "batching": {"max_concurrent_batches": 1, "packed_tokens": packed_tokens}})
    return EncoderService(settings, EngineTable([load_engine(BundleRef(path=bundle), settings)]))


def served(svc: EncoderService, texts: list[str], normalize: bool, pool_skip: int = 0,
           want_hidden: bool = False) -> np.ndarray:
    async def run():
        engine = svc.engines.default
        tokenized = await svc.tokenize(engine, texts, True, "/v1/embeddings")
        job = EncodeJob(route="/v1/embeddings", ids=[t.ids for t in tokenized], normalize=normalize,
                        want_hidden=want_hidden, pool_skip=pool_skip)
        return (await svc.infer(engine, job, 60.0)).embeddings
    return asyncio.run(run())


@pytest.mark.parametrize("pooling", ["mean_sqrt_len_tokens", "weightedmean", "lasttoken"])
def test_each_new_pooling_passes_the_gate_and_serves_packed_and_padded_as_sentence_transformers(pooling, tmp_path):
    from sentence_transformers import SentenceTransformer

    directory = make_checkpoint("bert", tmp_path / "ckpt", pooling=pooling, pooling_format="v6")
    bundle = export(directory, tmp_path / "bundle")
    manifest = load_bundle(bundle).manifest
    assert manifest.model.pooling == pooling and manifest.packed is not None and manifest.packed.passed
    expected = SentenceTransformer(str(directory), device="cpu").encode(TEXTS, batch_size=4)
    for packed_tokens in (256, 0):  # packed rows (pooled by weights), then padded batches
        ours = served(engine_service(bundle, packed_tokens), TEXTS, normalize=False)
        np.testing.assert_allclose(ours, expected, atol=TOLERANCE, rtol=0, err_msg=f"packed_tokens {packed_tokens}")
    ours = served(engine_service(bundle), TEXTS, normalize=False, want_hidden=True)  # repooled beside encodings
    np.testing.assert_allclose(ours, expected, atol=TOLERANCE, rtol=0)


def test_several_pooling_modes_at_once_are_refused_by_name(tmp_path):
    directory = make_checkpoint("bert", tmp_path / "ckpt", pooling_format="v6")
    config = directory / "1_Pooling" / "config.json"
    config.write_text(json.dumps({"embedding_dimension": 32, "pooling_mode": ["mean", "max"]}))
    with pytest.raises(CheckpointError, match="pooling \\['mean', 'max'\\] is not supported"):
        load_checkpoint(directory)


@pytest.fixture(scope="module")
def conventions(tmp_path_factory):
    """A prompted model (include_prompt false, mean pooling, Normalize, matryoshka sizes in config.json),
    the same with include_prompt true and a default prompt, and a plain one (no matryoshka)."""
    root = tmp_path_factory.mktemp("conventions")
    skip = make_checkpoint("bert", root / "skip", normalize=True, prompts=PROMPTS, include_prompt=False,
                           config_extra={"matryoshka_dimensions": [32, 16, 8]})
    keep = make_checkpoint("bert", root / "keep", pooling="cls", prompts=PROMPTS, default_prompt_name="query",
                           seed=1)
    plain = make_checkpoint("roberta", root / "plain", normalize=True)
    # a decoder embedder as Qwen3-Embedding is used: last-token pooling, Normalize, an instruction for
    # queries only, matryoshka sizes given at export
    qwen3 = make_checkpoint("qwen3", root / "qwen3", pooling="lasttoken", normalize=True,
                            prompts={"query": QWEN_QUERY, "document": ""})
    # ModernBERT as modernbert-embed is used (mean, Normalize, search_query/search_document prefixes), and as
    # gte-reranker-modernbert is (a one-label classifier; this one pools the mean, its head has a norm)
    modernbert = make_checkpoint("modernbert", root / "modernbert", normalize=True, prompts=NOMIC_PROMPTS)
    ranker = make_classifier("modernbert", root / "modernbert-ranker", 1)
    # EmbeddingGemma's pipeline: mean pooling, two Dense maps without bias (out to 1.5x and back), Normalize
    gemma = add_dense(make_checkpoint("gemma3", root / "gemma3-base"), root / "gemma3", like="embeddinggemma",
                      prompts=GEMMA_PROMPTS)
    return {
        "dirs": {"skip": skip, "keep": keep, "plain": plain, "qwen3": qwen3, "modernbert": modernbert,
                 "modernbert-ranker": ranker, "gemma3": gemma},
        "bundles": {"skip": export(skip, root / "b-skip"), "keep": export(keep, root / "b-keep"),
                    "plain": export(plain, root / "b-plain", matryoshka_dimensions=None),
                    "qwen3": export(qwen3, root / "b-qwen3", matryoshka_dimensions=(32, 16)),
                    "modernbert": export(modernbert, root / "b-modernbert"),
                    "modernbert-ranker": export(ranker, root / "b-modernbert-ranker"),
                    "gemma3": export(gemma, root / "b-gemma3", matryoshka_dimensions=(32, 16))},
    }


def test_the_manifest_carries_prompts_their_lengths_and_matryoshka_sizes(conventions):
    from sentence_transformers import SentenceTransformer

    model = load_bundle(conventions["bundles"]["skip"]).manifest.model
    st = SentenceTransformer(str(conventions["dirs"]["skip"]), device="cpu")
    assert model.prompts == PROMPTS and model.default_prompt_name is None and not model.include_prompt
    assert model.prompt_tokens == {name: st[0]._get_prompt_length(text) for name, text in PROMPTS.items()}
    assert (model.matryoshka, model.matryoshka_dimensions) == (True, [32, 16, 8])
    plain = load_bundle(conventions["bundles"]["plain"]).manifest.model
    assert (plain.prompts, plain.matryoshka, plain.matryoshka_dimensions) == ({}, False, None)


@pytest.mark.parametrize("packed_tokens", [256, 0])
def test_a_prompt_left_out_of_pooling_matches_sentence_transformers_packed_and_padded(conventions, packed_tokens):
    from sentence_transformers import SentenceTransformer

    bundle = conventions["bundles"]["skip"]
    st = SentenceTransformer(str(conventions["dirs"]["skip"]), device="cpu")
    model = load_bundle(bundle).manifest.model
    svc = engine_service(bundle, packed_tokens)
    for name in PROMPTS:
        expected = st.encode(TEXTS, prompt_name=name, batch_size=4)
        ours = served(svc, [PROMPTS[name] + t for t in TEXTS], normalize=True, pool_skip=model.prompt_tokens[name])
        np.testing.assert_allclose(ours, expected, atol=TOLERANCE, rtol=0, err_msg=name)
        with_prompt = served(svc, [PROMPTS[name] + t for t in TEXTS], normalize=True)
        assert np.abs(with_prompt - expected).max() > 1e-2, "pooling the prompt too should differ"


@pytest.fixture(scope="module")
def conventions_url(ray_serve, conventions):
    b = conventions["bundles"]
    deploy({"bundles": [{"path": str(b[name]), "name": name} for name in b], "num_cpus": 0.5},
           "conventions", "/conventions", b["skip"])
    return f"{ray_serve.url}/conventions"


def test_prompt_name_input_type_and_the_default_prompt_over_http_match_sentence_transformers(conventions, conventions_url):
    from sentence_transformers import SentenceTransformer

    d = conventions["dirs"]
    skip, keep = (SentenceTransformer(str(d[k]), device="cpu") for k in ("skip", "keep"))

    def embed(model, **extra):
        r = httpx.post(f"{conventions_url}/v1/embeddings", json={"model": model, "input": TEXTS, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return np.array([e["embedding"] for e in r.json()["data"]], dtype=np.float32)

    close = lambda a, b: np.testing.assert_allclose(a, b, atol=TOLERANCE, rtol=0)  # noqa: E731
    close(embed("skip", prompt_name="instruct"), skip.encode(TEXTS, prompt_name="instruct"))
    close(embed("skip", input_type="document"), skip.encode(TEXTS, prompt_name="document"))
    close(embed("skip"), skip.encode(TEXTS))  # no default prompt: none
    close(embed("keep"), keep.encode(TEXTS))  # its default_prompt_name, query, as encode applies it
    close(embed("keep", prompt_name="document"), keep.encode(TEXTS, prompt_name="document"))
    r = httpx.post(f"{conventions_url}/v1/encode", json={"model": "skip", "inputs": TEXTS, "input_type": "query"},
                   timeout=60)
    assert r.status_code == 200, r.text
    close(np.array([e["embedding"] for e in r.json()["data"]]), skip.encode(TEXTS, prompt_name="query"))


def assert_served_as(url: str, model: str, extra: dict, expected: np.ndarray) -> None:
    """/v1/embeddings of TEXTS with `extra` fields is `expected` (sentence-transformers' vectors), L2-normalised
    as OpenAI's API returns them (a cut vector normalised again)."""
    r = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": TEXTS, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    ours = np.array([e["embedding"] for e in r.json()["data"]])
    expected = expected / np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(ours, expected, atol=TOLERANCE, rtol=0, err_msg=str(extra))


def test_a_qwen3_embedder_with_its_query_prompt_and_matryoshka_sizes_is_sentence_transformers(
        conventions, conventions_url):
    """The issue's end-to-end case: a decoder embedder (last token, causal, GQA, RoPE) served with its
    query instruction and cut to a trained size, against SentenceTransformer.encode."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(conventions["dirs"]["qwen3"]), device="cpu")
    for extra, expected in (({"prompt_name": "query"}, st.encode(TEXTS, prompt_name="query")),
                            ({"input_type": "document"}, st.encode(TEXTS, prompt_name="document")),
                            ({"input_type": "query", "dimensions": 16},
                             st.encode(TEXTS, prompt_name="query", truncate_dim=16))):
        assert_served_as(conventions_url, "qwen3", extra, expected)
    r = httpx.post(f"{conventions_url}/v1/embeddings", json={"model": "qwen3", "input": "x", "dimensions": 8},
                   timeout=30)
    assert r.status_code == 400 and "supports dimensions 32, 16, not 8" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("packed_tokens", [256, 0])
@pytest.mark.parametrize(("family", "prompts"), [("modernbert", NOMIC_PROMPTS), ("gemma3", GEMMA_PROMPTS)])
def test_local_attention_embedders_serve_packed_and_padded_as_sentence_transformers(conventions, family, prompts,
                                                                                    packed_tokens):
    """Global and sliding-window layers with their two RoPE bases (ModernBERT; EmbeddingGemma's Gemma 3 with
    its Dense modules), in packed rows (each text's window and positions its own) and padded batches;
    texts run well past the window of 4 tokens each way."""
    from sentence_transformers import SentenceTransformer

    bundle = conventions["bundles"][family]
    assert load_bundle(bundle).manifest.packed.passed
    st = SentenceTransformer(str(conventions["dirs"][family]), device="cpu")
    ours = served(engine_service(bundle, packed_tokens), [prompts["query"] + t for t in TEXTS], normalize=True)
    np.testing.assert_allclose(ours, st.encode(TEXTS, prompt_name="query", batch_size=4), atol=TOLERANCE, rtol=0)


def test_an_embeddinggemma_with_its_prompts_dense_modules_and_matryoshka_sizes_is_sentence_transformers(
        conventions, conventions_url):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(conventions["dirs"]["gemma3"]), device="cpu")
    for extra, expected in (({"input_type": "query"}, st.encode(TEXTS, prompt_name="query")),
                            ({"prompt_name": "document", "dimensions": 16},
                             st.encode(TEXTS, prompt_name="document", truncate_dim=16))):
        assert_served_as(conventions_url, "gemma3", extra, expected)


def test_a_modernbert_reranker_and_embedder_over_http_are_cross_encoder_and_sentence_transformers(
        conventions, conventions_url):
    """The issue's end-to-end case: a ModernBERT reranker on /v1/rerank gives CrossEncoder.predict's scores,
    and its embedder with a prompt on /v1/embeddings gives SentenceTransformer.encode's vectors."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    ranker = CrossEncoder(str(conventions["dirs"]["modernbert-ranker"]), device="cpu")
    by_query: dict[str, list[int]] = {}
    for i, (query, _) in enumerate(PAIRS):
        by_query.setdefault(query, []).append(i)
    expected = ranker.predict(PAIRS, batch_size=len(PAIRS))
    for query, indexes in by_query.items():
        documents = [PAIRS[i][1] for i in indexes]
        r = httpx.post(f"{conventions_url}/v1/rerank",
                       json={"model": "modernbert-ranker", "query": query, "documents": documents}, timeout=60)
        assert r.status_code == 200, r.text
        scores = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
        np.testing.assert_allclose([scores[j] for j in range(len(documents))], expected[indexes], atol=TOLERANCE,
                                   rtol=0)
    st = SentenceTransformer(str(conventions["dirs"]["modernbert"]), device="cpu")
    r = httpx.post(f"{conventions_url}/v1/embeddings",
                   json={"model": "modernbert", "input": TEXTS, "input_type": "document"}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array([e["embedding"] for e in r.json()["data"]]),
                               st.encode(TEXTS, prompt_name="document"), atol=TOLERANCE, rtol=0)


def test_an_unknown_prompt_is_a_400_listing_the_models_prompts(conventions_url):
    r = httpx.post(f"{conventions_url}/v1/embeddings", json={"model": "skip", "input": "x", "prompt_name": "search"},
                   timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "bad_request" and all(repr(p) in message for p in PROMPTS), message
    r = httpx.post(f"{conventions_url}/v1/embeddings", json={"model": "plain", "input": "x", "prompt_name": "query"},
                   timeout=30)
    assert r.status_code == 400 and "its prompts: none" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{conventions_url}/v1/embeddings", json={"model": "skip", "input": "x", "input_type": "code"},
                   timeout=30)
    assert r.status_code == 422, r.text


def test_dimensions_cut_only_a_matryoshka_model_to_its_sizes(conventions, conventions_url):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(conventions["dirs"]["skip"]), device="cpu")

    def post(model, dimensions):
        return httpx.post(f"{conventions_url}/v1/embeddings",
                          json={"model": model, "input": TEXTS, "dimensions": dimensions}, timeout=60)

    r = post("skip", 16)
    assert r.status_code == 200, r.text
    ours = np.array([e["embedding"] for e in r.json()["data"]])
    cut = st.encode(TEXTS, truncate_dim=16)  # cut after the Normalize module; OpenAI re-normalises the cut
    np.testing.assert_allclose(ours, cut / np.linalg.norm(cut, axis=1, keepdims=True), atol=TOLERANCE, rtol=0)
    r = post("skip", 20)
    assert r.status_code == 400 and "supports dimensions 32, 16, 8, not 20" in r.json()["error"]["message"], r.text
    r = post("plain", 16)
    assert r.status_code == 400 and "does not support dimensions" in r.json()["error"]["message"], r.text
    listed = {m["id"]: m for m in httpx.get(f"{conventions_url}/v1/models", timeout=10).json()["data"]}
    assert listed["skip"]["dimensions"] == [32, 16, 8] and listed["plain"]["dimensions"] is None
    assert listed["keep"]["prompts"] == PROMPTS and listed["keep"]["default_prompt_name"] == "query"
    info = httpx.get(f"{conventions_url}/info", timeout=10).json()
    assert any(m.get("include_prompt") is False for m in info["models"]), info["models"]


def test_left_truncation_keeps_the_prompt_and_cuts_the_text(conventions, conventions_url):
    """TEI's truncation_direction left and Cohere's truncate START cut a long text's start, never the
    prompt before it: [CLS] + the prompt's tokens + the text's last tokens + [SEP], embedded (include_prompt
    false: pooled without the prompt) as SentenceTransformer.encode embeds the prompt and that cut text."""
    from sentence_transformers import SentenceTransformer

    bundle, directory = conventions["bundles"]["skip"], conventions["dirs"]["skip"]
    st = SentenceTransformer(str(directory), device="cpu")
    model = load_bundle(bundle).manifest.model
    long = " ".join(CORPUS[:12])
    prompt = PROMPTS["query"]
    prompt_ids = st.tokenize([prompt])["input_ids"][0].tolist()[:-1]  # [CLS] and the prompt's, not [SEP]
    assert len(prompt_ids) == model.prompt_tokens["query"] > 1
    # the text's last tokens that fit beside [CLS], the prompt and [SEP], and the text they cover
    offsets = st.tokenizer(long, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    room = model.max_tokens - len(prompt_ids) - 1
    assert len(offsets) > 2 * room, "the text must be well past the model's limit"
    cut = long[offsets[-room][0]:]
    expected_ids = st.tokenize([prompt + cut])["input_ids"][0].tolist()

    expected = st.encode([cut], prompt_name="query")
    r = httpx.post(f"{conventions_url}/embed", json={"model": "skip", "inputs": [long, "short"], "prompt_name": "query",
                                                     "truncation_direction": "left"}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()[:1]), expected, atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(np.array(r.json()[1:]), st.encode(["short"], prompt_name="query"), atol=TOLERANCE, rtol=0)
    r = httpx.post(f"{conventions_url}/v2/embed", json={"model": "skip", "texts": [long], "input_type": "search_query",
                                                        "embedding_types": ["float"], "truncate": "START"}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json()["embeddings"]["float"]), expected, atol=TOLERANCE, rtol=0)
    assert r.json()["meta"]["tokens"]["input_tokens"] == model.max_tokens

    # the ids themselves, tokenized as the routes tokenize them
    svc = engine_service(bundle)
    tokenized = asyncio.run(svc.tokenize(svc.engines.default, [prompt + long], True, "/embed", from_start=True,
                                         kept=len(prompt)))[0]
    assert tokenized.ids.tolist() == expected_ids and tokenized.truncated
    assert tokenized.ids.tolist()[:len(prompt_ids)] == prompt_ids and len(expected_ids) == model.max_tokens
