"""The clients people already have, unchanged but for their URL, against the TEI and Cohere routes:
huggingface_hub's InferenceClient (feature extraction, text classification), the `cohere` SDK's ClientV2
(embed, rerank), LlamaIndex's TEI embedding and rerank classes, Haystack's TEI embedders. Each answer is
held against sentence-transformers, CrossEncoder or transformers on the same texts.

Two applications on the session's Ray Serve: /dropin serves all-MiniLM-L6-v2 (first, so TEI's root
embeds; Cohere's `embed-english-v3.0` an alias of it), a BERT cross-encoder (`rerank-v3.5` its alias) and
a three-label RoBERTa classifier; /dropin-classify serves the classifier alone (TEI's root predicts).
Both at fp32: what is held here is each protocol's mapping onto the engine, to 1e-4 (the precisions'
own closeness is held elsewhere, and bf16, which auto picks on CPUs with bf16 units, moves values by 1e-3).
"""

from __future__ import annotations

import base64
import os

import httpx
import numpy as np
import pytest

from tests.conftest import deploy
from tests.families import classifier_labels

os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")  # no phoning home from a test

TEXTS = ["A man is eating food.", "The museum is closed on Mondays.", "Der Himmel ist heute blau.", "hello"]
QUERY = "how do I reset my password"
DOCUMENTS = ["click forgot password on the sign in page", "the museum is closed on mondays",
             "reset it from the account settings page", "password"]
LONG = " ".join(f"word{i} is here" for i in range(300))  # past the model's 256 tokens


@pytest.fixture(scope="module")
def dropin(ray_serve, default_bundle, exported_classifier):
    """(base URL of /dropin, of /dropin-classify, the classifiers' checkpoints): a BERT ranker and a
    three-label RoBERTa classifier (the session's exports, tests/conftest.py)."""
    (ranker, ranker_bundle), (sentiment, sentiment_bundle) = map(exported_classifier, ("ranker", "sentiment"))
    checkpoints = {"ranker": ranker, "sentiment": sentiment}
    deploy({"bundles": [{"path": str(default_bundle), "aliases": ["embed-english-v3.0"]},
                        {"path": str(ranker_bundle), "name": "ranker", "aliases": ["rerank-v3.5"]},
                        {"path": str(sentiment_bundle), "name": "sentiment"}], "num_cpus": 0.5, "precision": "fp32"},
           "dropin", "/dropin", default_bundle)
    deploy({"bundles": [{"path": str(sentiment_bundle), "name": "sentiment"}], "num_cpus": 0.5, "precision": "fp32"},
           "dropin-classify", "/dropin-classify", default_bundle)
    try:
        yield f"{ray_serve.url}/dropin", f"{ray_serve.url}/dropin-classify", checkpoints
    finally:
        from ray import serve

        serve.delete("dropin")
        serve.delete("dropin-classify")


@pytest.fixture(scope="module")
def st(checkpoint):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(checkpoint.path), device="cpu")


def unnormalized(st, texts):
    """sentence-transformers' embedding before its Normalize module: TEI's normalize false."""
    features = st.tokenize(texts)
    import torch

    with torch.no_grad():
        out = st[1](st[0](features))  # Transformer, then Pooling
    return out["sentence_embedding"].numpy()


def test_huggingface_hub_feature_extraction_is_sentence_transformers(dropin, st):
    from huggingface_hub import InferenceClient

    url, _, _ = dropin
    client = InferenceClient(model=url + "/")  # TEI's root: posts to the URL itself
    got = client.feature_extraction(TEXTS)
    np.testing.assert_allclose(got, st.encode(TEXTS), atol=1e-4)
    one = client.feature_extraction(TEXTS[0])  # a single text: TEI's 2-D answer, one row
    assert one.shape == (1, 384)
    raw = client.feature_extraction(TEXTS, normalize=False)
    np.testing.assert_allclose(raw, unnormalized(st, TEXTS), atol=1e-4)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1, atol=1e-3)
    # truncation from the start keeps a long text's end, as the tokenizer's left truncation does
    left = InferenceClient(model=url + "/embed").feature_extraction(LONG, truncation_direction="left")
    st.tokenizer.truncation_side = "left"
    try:
        expected = st.encode([LONG])
    finally:
        st.tokenizer.truncation_side = "right"
    np.testing.assert_allclose(left, expected, atol=1e-4)
    assert not np.allclose(left, st.encode([LONG]), atol=1e-2)


def test_huggingface_hub_text_classification_is_transformers(dropin):
    import torch
    from huggingface_hub import InferenceClient
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, classify_url, checkpoints = dropin
    path = str(checkpoints["sentiment"])
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = torch.softmax(model(**AutoTokenizer.from_pretrained(path)(TEXTS[1], return_tensors="pt")).logits,
                                 dim=-1)[0].numpy()
    got = InferenceClient(model=classify_url + "/").text_classification(TEXTS[1])
    labels = classifier_labels(3)
    assert len(got) == 3 and [x.score for x in got] == sorted((x.score for x in got), reverse=True)
    np.testing.assert_allclose([{x.label: x.score for x in got}[label] for label in labels], expected, atol=1e-4)
    top = InferenceClient(model=classify_url + "/").text_classification(TEXTS[1], top_k=1, function_to_apply="none")
    assert len(top) == 1 and top[0].label == labels[int(np.argmax(expected))]
    # TEI's /predict: a single input is one list, a batch one list per input; [a, b] is one pair
    r = httpx.post(classify_url + "/predict", json={"inputs": [[TEXTS[1]], [TEXTS[0], TEXTS[2]]]}, timeout=60)
    assert r.status_code == 200, r.text
    batch = r.json()
    assert len(batch) == 2 and all(len(row) == 3 for row in batch)
    np.testing.assert_allclose([{x["label"]: x["score"] for x in batch[0]}[label] for label in labels], expected, atol=1e-4)
    pair = httpx.post(classify_url + "/predict", json={"inputs": [TEXTS[0], TEXTS[2]]}, timeout=60).json()
    assert [x["label"] for x in pair] == [x["label"] for x in batch[1]]
    np.testing.assert_allclose([x["score"] for x in pair], [x["score"] for x in batch[1]], atol=1e-6)


def cross_encoder_scores(checkpoints):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(checkpoints["ranker"]), device="cpu").predict([(QUERY, d) for d in DOCUMENTS])


def test_tei_rerank_is_cross_encoder_through_llama_index_and_plain_http(dropin):
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.postprocessor.tei_rerank import TextEmbeddingInference

    url, _, checkpoints = dropin
    expected = cross_encoder_scores(checkpoints)
    reranker = TextEmbeddingInference(base_url=url, top_n=len(DOCUMENTS))
    nodes = reranker.postprocess_nodes([NodeWithScore(node=TextNode(text=d)) for d in DOCUMENTS],
                                       query_bundle=QueryBundle(QUERY))
    got = {n.node.text: n.score for n in nodes}
    np.testing.assert_allclose([got[d] for d in DOCUMENTS], expected, atol=1e-4)
    r = httpx.post(url + "/rerank", json={"query": QUERY, "texts": DOCUMENTS, "return_text": True, "raw_scores": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()
    assert [x["score"] for x in results] == sorted((x["score"] for x in results), reverse=True)
    assert all(x["text"] == DOCUMENTS[x["index"]] for x in results)
    logits = np.log(expected / (1 - expected))  # the ranker saves no activation: CrossEncoder's is a sigmoid
    np.testing.assert_allclose([x["score"] for x in sorted(results, key=lambda x: x["index"])], logits, atol=1e-3)


def test_vllm_score_is_cross_encoder_and_cosine_of_embeddings(dropin, st):
    """vLLM's /v1/score: a cross-encoder's pairs as CrossEncoder.predict scores them (use_activation false:
    the logit), 1:N and N:N; a bi-encoder's as the cosine of sentence-transformers' embeddings."""
    url, _, checkpoints = dropin
    expected = cross_encoder_scores(checkpoints)
    r = httpx.post(url + "/v1/score", json={"model": "ranker", "text_1": QUERY, "text_2": DOCUMENTS}, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], expected, atol=1e-4)
    raw = httpx.post(url + "/score", json={"model": "ranker", "text_1": [QUERY] * 2, "text_2": DOCUMENTS[:2],
                                           "use_activation": False}, timeout=60).json()
    np.testing.assert_allclose([d["score"] for d in raw["data"]], np.log(expected / (1 - expected))[:2], atol=1e-3)
    r = httpx.post(url + "/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[2:]}, timeout=60)
    assert r.status_code == 200, r.text
    a, b = st.encode(TEXTS[:2]), st.encode(TEXTS[2:])
    cosine = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], cosine, atol=1e-4)
    refused = httpx.post(url + "/v1/score", json={"model": "sentiment", "text_1": "a", "text_2": "b"}, timeout=60)
    assert refused.status_code == 422 and "reranking needs a one-label model" in refused.json()["error"]["message"]


def test_llama_index_and_haystack_tei_embedders_are_sentence_transformers(dropin, st):
    from haystack import Document
    from haystack_integrations.components.embedders.huggingface_api import (HuggingFaceAPIDocumentEmbedder,
                                                                            HuggingFaceAPITextEmbedder)
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    url, _, _ = dropin
    expected = st.encode(TEXTS)
    llama = TextEmbeddingsInference(base_url=url, model_name="all-MiniLM-L6-v2")  # posts to /embed
    np.testing.assert_allclose(llama.get_text_embedding_batch(TEXTS), expected, atol=1e-4)
    np.testing.assert_allclose(llama.get_query_embedding(TEXTS[0]), expected[0], atol=1e-4)
    # Haystack's TEI embedders ask for normalize false (the vector before Normalize)
    api = {"api_type": "text_embeddings_inference", "api_params": {"url": url + "/"}}
    text = HuggingFaceAPITextEmbedder(**api).run(text=TEXTS[0])["embedding"]
    np.testing.assert_allclose(text, unnormalized(st, TEXTS[:1])[0], atol=1e-4)
    documents = HuggingFaceAPIDocumentEmbedder(**api, progress_bar=False).run(
        documents=[Document(content=t) for t in TEXTS])["documents"]
    np.testing.assert_allclose([d.embedding for d in documents], unnormalized(st, TEXTS), atol=1e-4)


def test_cohere_client_embeds_by_type_as_sentence_transformers_quantizes(dropin, st):
    import cohere
    from sentence_transformers.quantization import quantize_embeddings

    url, _, _ = dropin
    client = cohere.ClientV2(base_url=url, api_key="unused")
    r = client.embed(texts=TEXTS, model="embed-english-v3.0", input_type="search_document",
                     embedding_types=["float", "binary", "ubinary", "base64"])
    expected = st.encode(TEXTS)
    np.testing.assert_allclose(r.embeddings.float_, expected, atol=1e-4)
    # bit for bit, but where a value sits within float error of 0 (its sign is then either)
    for kind in ("ubinary", "binary"):
        got, want = np.asarray(getattr(r.embeddings, kind)), quantize_embeddings(expected, precision=kind)
        assert got.shape == want.shape == (len(TEXTS), 48)
        flipped = np.unpackbits(got.astype(np.uint8) ^ want.astype(np.uint8), axis=-1).astype(bool)
        assert (np.abs(expected[flipped]) < 1e-5).all(), kind
    decoded = [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in r.embeddings.base64]
    np.testing.assert_array_equal(decoded, np.asarray(r.embeddings.float_, dtype=np.float32))
    assert r.texts == TEXTS and r.id and r.meta.billed_units.input_tokens > len(TEXTS)
    # a query: all-MiniLM-L6-v2 has no prompts, so every input type embeds alike
    query = client.embed(texts=[QUERY], model="all-MiniLM-L6-v2", input_type="search_query")
    np.testing.assert_allclose(query.embeddings.float_, st.encode([QUERY]), atol=1e-4)
    # truncate START keeps a long text's end; max_tokens cuts first
    start = client.embed(texts=[LONG], model="embed-english-v3.0", input_type="search_document", truncate="START")
    st.tokenizer.truncation_side = "left"
    try:
        np.testing.assert_allclose(start.embeddings.float_, st.encode([LONG]), atol=1e-4)
    finally:
        st.tokenizer.truncation_side = "right"
    cut = client.embed(texts=[TEXTS[1]], model="embed-english-v3.0", input_type="search_document", max_tokens=3)
    np.testing.assert_allclose(cut.embeddings.float_, st.encode(["The museum is"]), atol=1e-4)


@pytest.mark.parametrize(("kwargs", "status", "says"), [
    ({"output_dimension": 256}, 400, "does not support dimensions"),
    ({"embedding_types": ["int8"]}, 400, "calibration ranges"),
    ({"texts": [LONG], "truncate": "NONE"}, 413, "the model's limit is 256"),
    ({"texts": [LONG], "truncate": "NONE", "max_tokens": 5}, 400, "more than max_tokens 5"),
    ({"input_type": "image"}, 400, "embeds text only"),
    ({"model": "embed-v4.0"}, 404, "aliases"),
])
def test_cohere_client_gets_a_4xx_naming_what_is_wrong(dropin, kwargs, status, says):
    import cohere
    from cohere.core.api_error import ApiError

    url, _, _ = dropin
    client = cohere.ClientV2(base_url=url, api_key="unused", max_retries=0)
    call = {"texts": TEXTS[:1], "model": "embed-english-v3.0", "input_type": "search_document", **kwargs}
    with pytest.raises(ApiError) as raised:
        client.embed(**call)
    assert raised.value.status_code == status and says in raised.value.body["message"], raised.value.body
    assert raised.value.body["id"] == raised.value.headers["x-request-id"]


def test_cohere_client_reranks_as_cross_encoder(dropin):
    import cohere

    url, _, checkpoints = dropin
    expected = cross_encoder_scores(checkpoints)
    client = cohere.ClientV2(base_url=url, api_key="unused")
    r = client.rerank(model="rerank-v3.5", query=QUERY, documents=DOCUMENTS, top_n=2)
    best = np.argsort(-expected)[:2]
    assert [x.index for x in r.results] == best.tolist() and r.id
    np.testing.assert_allclose([x.relevance_score for x in r.results], expected[best], atol=1e-4)
    # max_tokens_per_doc cuts each document first, as if it had been sent cut at its second token's end
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer

    short = client.rerank(model="ranker", query=QUERY, documents=DOCUMENTS, max_tokens_per_doc=2)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoints["ranker"]))
    ends = [tokenizer(d, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"][:2][-1][1]
            for d in DOCUMENTS]
    cut = CrossEncoder(str(checkpoints["ranker"]), device="cpu").predict([(QUERY, d[:end]) for d, end in zip(DOCUMENTS, ends)])
    np.testing.assert_allclose([x.relevance_score for x in sorted(short.results, key=lambda x: x.index)], cut, atol=1e-4)


def test_tei_tokenize_decode_and_embed_all(dropin, checkpoint):
    import torch
    from transformers import BertModel

    url, _, _ = dropin
    tokens = httpx.post(url + "/tokenize", json={"inputs": "Hello world"}, timeout=60).json()
    assert tokens == [[{"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None},
                       {"id": 7592, "text": "Hello", "special": False, "start": 0, "stop": 5},
                       {"id": 2088, "text": "world", "special": False, "start": 6, "stop": 11},
                       {"id": 102, "text": "[SEP]", "special": True, "start": None, "stop": None}]]
    plain = httpx.post(url + "/tokenize", json={"inputs": ["Hello world"], "add_special_tokens": False}, timeout=60).json()
    assert [t["id"] for t in plain[0]] == [7592, 2088]
    assert httpx.post(url + "/decode", json={"ids": [101, 7592, 2088, 102]}, timeout=60).json() == ["hello world"]
    assert httpx.post(url + "/decode", json={"ids": [[101, 7592, 102]], "skip_special_tokens": False},
                      timeout=60).json() == ["[CLS] hello [SEP]"]
    r = httpx.post(url + "/embed_all", json={"inputs": TEXTS[0]}, timeout=60)
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()[0])
    bert = BertModel.from_pretrained(str(checkpoint.path)).eval()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(checkpoint.tokenizer_path))
    tokenizer.no_padding()
    ids = torch.tensor([tokenizer.encode(TEXTS[0]).ids])
    with torch.no_grad():
        expected = bert(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0].numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)


@pytest.mark.parametrize(("path", "body", "status", "error_type"), [
    ("/embed", {"inputs": []}, 400, "Empty"),
    ("/embed", {"inputs": "x", "normalize": "yes"}, 422, "Validation"),
    ("/embed", {"inputs": [1, 2]}, 422, "Validation"),
    ("/embed", {"inputs": ["x"] * 300}, 413, "Validation"),
    ("/embed", {"inputs": LONG, "truncate": False}, 413, "Validation"),
    ("/rerank", {"query": "q", "texts": []}, 400, "Empty"),
    ("/predict", {"inputs": ["a", "b", "c"]}, 422, "Validation"),
    ("/decode", {"ids": [10 ** 9]}, 422, "Validation"),
    ("/", {"inputs": "x", "parameters": 3}, 422, "Validation"),
])
def test_tei_errors_have_teis_body_and_status(dropin, path, body, status, error_type):
    url, _, _ = dropin
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == error_type, r.text


def test_openapi_lists_the_tei_and_cohere_routes(dropin):
    url, _, _ = dropin
    paths = httpx.get(url + "/openapi.json", timeout=60).json()["paths"]
    for path in ("/embed", "/embed_sparse", "/embed_all", "/rerank", "/predict", "/tokenize", "/decode", "/v2/embed",
                 "/v2/rerank", "/v1/score", "/score"):
        assert "post" in paths[path], path
    assert "post" in paths["/"]


def test_cohere_input_types_map_onto_the_models_prompts():
    from bundle.manifest import ModelInfo
    from service.engine.errors import BadRequest
    from service.engine.prompts import cohere_prompt_name

    def model(prompts):
        return ModelInfo.model_construct(prompts=prompts)

    qd = model({"query": "query: ", "document": "passage: "})
    assert [cohere_prompt_name(qd, "m", t) for t in ("search_query", "search_document", "classification", "clustering")] \
        == ["query", "document", "query", "query"]
    gemma = model({"query": "task: search result | query: ", "document": "title: none | text: ",
                   "Classification": "task: classification | query: ", "Clustering": "task: clustering | query: "})
    assert cohere_prompt_name(gemma, "m", "classification") == "Classification"
    assert cohere_prompt_name(gemma, "m", "clustering") == "Clustering"
    assert cohere_prompt_name(model({}), "m", "search_query") is None  # no prompts: every text alike
    queries_only = model({"search": "Represent this sentence for searching relevant passages: "})
    assert cohere_prompt_name(queries_only, "m", "search_document") is None
    with pytest.raises(BadRequest, match="none for it"):
        cohere_prompt_name(queries_only, "m", "search_query")
    with pytest.raises(BadRequest, match="text only"):
        cohere_prompt_name(qd, "m", "image")


def test_texts_cut_to_tokens_at_either_end(checkpoint):
    from service.engine.tokenization import TextTokenizer

    tokenizer = TextTokenizer(checkpoint.tokenizer_path, 8)
    text = "the cat sat on the mat today"
    assert tokenizer.cut_to_tokens([text, "short"], 3, False) == [("the cat sat", True), ("short", False)]
    assert tokenizer.cut_to_tokens([text], 3, True) == [("the mat today", True)]
    right, left = tokenizer.encode([text + " again and again"], True)[0], tokenizer.encode([text + " again and again"],
                                                                                            True, from_start=True)[0]
    assert right.n_tokens == left.n_tokens == 8 and right.encoding.tokens[1] == "the" and left.encoding.tokens[-2] == "again"
    assert left.encoding.tokens[0] == "[CLS]" and left.encoding.tokens[-1] == "[SEP]"


def test_left_truncation_keeps_the_prompt_before_the_text(checkpoint):
    """With a prompt (`kept` characters) before the text, truncation from the start cuts the text's start and
    keeps the prompt: [CLS] query : <the text's last tokens> [SEP]; a text that fits is left whole."""
    from service.engine.tokenization import TextTokenizer

    tokenizer = TextTokenizer(checkpoint.tokenizer_path, 8)
    prompt = "query: "
    cut, whole = tokenizer.encode([prompt + "the cat sat on the mat today", prompt + "a cat"], True, from_start=True,
                                  kept=len(prompt))
    assert cut.encoding.tokens == ["[CLS]", "query", ":", "on", "the", "mat", "today", "[SEP]"] and cut.truncated
    assert whole.encoding.tokens == ["[CLS]", "query", ":", "a", "cat", "[SEP]"] and not whole.truncated
    # without a prompt, as before: the text's last tokens
    plain = tokenizer.encode([prompt + "the cat sat on the mat today"], True, from_start=True)[0]
    assert plain.encoding.tokens == ["[CLS]", "cat", "sat", "on", "the", "mat", "today", "[SEP]"]


def test_tei_and_cohere_requests_are_counted_under_their_own_routes(dropin, metrics_url):
    from tests.metrics_scrape import poll, settled, total

    url, _, _ = dropin

    def counted(f, route):
        return total(f, "ray_encoder_requests_total", application="dropin", route=route, status_class="2xx")

    routes = {"/embed": {"inputs": "x"}, "/v2/embed": {"model": "all-MiniLM-L6-v2", "texts": ["x"],
                                                       "input_type": "search_query"}}
    families = settled(metrics_url, lambda f: tuple(counted(f, r) for r in routes))
    before = {r: counted(families, r) for r in routes}
    for route, body in routes.items():
        assert httpx.post(url + route, json=body, timeout=60).status_code == 200
    poll(metrics_url, lambda f: all(counted(f, r) == before[r] + 1 for r in routes), "/embed and /v2/embed counted")


def test_an_alias_names_one_model():
    from types import SimpleNamespace

    from service.engine.engine import EngineTable

    def model(name: str, aliases: tuple[str, ...]) -> SimpleNamespace:
        """What the table reads of an engine: its names, and its batch queue (told of the others')."""
        return SimpleNamespace(name=name, aliases=aliases, batcher=SimpleNamespace(neighbours=[]))

    a, b = model("a", ("embed-v4.0",)), model("b", ("rerank-v3.5",))
    table = EngineTable([a, b])
    assert table.get("embed-v4.0") is a and table.get("rerank-v3.5") is b and table.get("a") is a
    assert a.batcher.neighbours == [b.batcher] and b.batcher.neighbours == [a.batcher]
    for clash in (("a",), ("embed-v4.0",)):
        with pytest.raises(ValueError, match="an alias names one model"):
            EngineTable([a, model("c", clash)])
