"""BGE-M3 and PyLate ColBERT exported by `python -m export`'s pipeline: the manifest's representations, the heads
file, the strict gate's sparse and multivector rows, and the bundle's outputs on onnxruntime (bundle/representations
applied to last_hidden_state) against transformers' own model with the heads in torch, at 1e-4: BGE-M3's three
outputs as FlagEmbedding's BGEM3 computes them, ColBERT's queries (expanded with [MASK], not attended) and
documents (skiplist) as PyLate's ColBERT.tokenize and encode do. Refusals by name. One export of each, per module."""

from __future__ import annotations

import json
import string

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL, encodings_file
from bundle.manifest import HEADS_FILE, load_bundle
from bundle.representations import bge_m3_terms, kept_tokens, load_heads, maxsim, token_vectors
from export.checkpoint import load_checkpoint
from export.errors import CheckpointError
from export.pipeline import ExportOptions, build_bundle
from export.token_heads import pad_rows, token_rows
from tests.late_interaction_models import COLBERT_DIM, DOCUMENT_LENGTH, QUERY_LENGTH, make_bge_m3, make_pylate_colbert

TOLERANCE = 1e-4
QUERIES = ["Where is Paris?", "How do I reset my password, please?", "fox"]
DOCUMENTS = ["Paris is the capital and largest city of France.",
             "Hello, world! The quick brown fox jumps over the lazy dog; near the riverbank, at dawn.",
             " ".join(["Refunds are issued to the original payment method within fourteen days."] * 6)]


def _export(checkpoint, out, lossy):
    return build_bundle(ExportOptions(str(checkpoint), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, lossy=lossy),
                        progress=lambda _: None)


@pytest.fixture(scope="module")
def bge_m3(tmp_path_factory):
    root = tmp_path_factory.mktemp("bge-m3")
    checkpoint = make_bge_m3(root / "checkpoint")
    return checkpoint, _export(checkpoint, root / "bundle", lossy=("bf16",))


@pytest.fixture(scope="module")
def colbert(tmp_path_factory):
    root = tmp_path_factory.mktemp("colbert")
    checkpoint = make_pylate_colbert(root / "checkpoint")
    return checkpoint, _export(checkpoint, root / "bundle", lossy=("int8",))


def _last_hidden_state(bundle_dir, rows, pad_id):
    session = ort.InferenceSession(str(bundle_dir / encodings_file("fp32")), providers=["CPUExecutionProvider"])
    ids, mask, types = pad_rows(rows, pad_id)
    return session.run(["last_hidden_state", "sentence_embedding"],
                       {"input_ids": ids, "attention_mask": mask, "token_type_ids": types})


def test_bge_m3_manifest_heads_and_gates(bge_m3):
    checkpoint, result = bge_m3
    bundle = load_bundle(result.out)
    model = bundle.manifest.model
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert model.representations == ["dense", "sparse", "multivector"]
    assert (model.pooling, model.normalize) == ("cls", True)
    # FlagEmbedding's BGEM3 unused_tokens: cls, eos, pad and unk
    unused = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id} - {None}
    assert model.sparse.kind == "bge-m3" and model.sparse.skip_ids == sorted(unused)
    assert (model.multivector.kind, model.multivector.dim, model.multivector.skip_leading,
            model.multivector.normalize) == ("bge-m3", 32, 1, True)
    assert HEADS_FILE in bundle.manifest.files
    heads = load_heads(result.out / HEADS_FILE, model.hidden_size, model.sparse, model.multivector)
    colbert_linear = torch.load(checkpoint / "colbert_linear.pt", weights_only=True)
    sparse_linear = torch.load(checkpoint / "sparse_linear.pt", weights_only=True)
    assert np.array_equal(heads.multivector_weight, colbert_linear["weight"].numpy())
    assert np.array_equal(heads.sparse_bias, sparse_linear["bias"].numpy())
    for report in (bundle.manifest.parity, bundle.manifest.variants["fp32"].parity):
        rows = {o.output: o for o in report.outputs}
        assert rows["sparse"].passed and rows["multivector"].passed and rows["sparse"].values > 0
        assert rows["multivector"].max_abs_diff <= DEFAULT_ATOL
    for precision, variant in bundle.manifest.variants.items():  # bf16 where this CPU has bf16 units
        if precision != "fp32":
            gates = {(g.representation, g.passed) for g in variant.quality.representations}
            assert gates == {("sparse", True), ("multivector", True)}, precision


def test_bge_m3_outputs_match_flagembedding_semantics_in_transformers(bge_m3):
    """dense: CLS then normalize; sparse: relu(sparse_linear) per token, the largest per id, unused tokens left out;
    colbert: colbert_linear of every token after CLS, padding left out, normalized (BGEM3FlagModel's encode)."""
    checkpoint, result = bge_m3
    model = transformers.XLMRobertaModel.from_pretrained(checkpoint).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    colbert_linear, sparse_linear = torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
    colbert_linear.load_state_dict(torch.load(checkpoint / "colbert_linear.pt", weights_only=True))
    sparse_linear.load_state_dict(torch.load(checkpoint / "sparse_linear.pt", weights_only=True))
    texts = QUERIES + DOCUMENTS
    batch = tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
        dense = F.normalize(hidden[:, 0], dim=-1)
        token_weights = torch.relu(sparse_linear(hidden))[..., 0]
        colbert = F.normalize(colbert_linear(hidden[:, 1:]) * batch["attention_mask"][:, 1:, None], dim=-1)
    unused = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}

    bundle = load_bundle(result.out)
    info = bundle.manifest.model
    heads = load_heads(result.out / HEADS_FILE, info.hidden_size, info.sparse, info.multivector)
    rows = token_rows(Tokenizer.from_file(str(bundle.tokenizer_path)), texts, None, False, info.max_tokens)
    encodings, embeddings = _last_hidden_state(result.out, rows, info.pad_token_id)
    assert np.abs(embeddings - dense.numpy()).max() <= TOLERANCE
    vectors, terms = [], 0
    for i, row in enumerate(rows):
        n = int(batch["attention_mask"][i].sum())
        assert row.ids.tolist() == batch["input_ids"][i, :n].tolist()
        expected: dict[int, float] = {}
        for weight, token in zip(token_weights[i, :n].tolist(), row.ids.tolist(), strict=True):
            if token not in unused and weight > 0 and weight > expected.get(token, 0.0):
                expected[token] = weight
        indices, values = bge_m3_terms(encodings[i, :n], row.ids, heads, info.sparse.skip_ids)
        assert indices.tolist() == sorted(expected)
        terms += len(indices)
        assert np.abs(values - np.array([expected[t] for t in sorted(expected)])).max(initial=0.0) <= TOLERANCE
        got = token_vectors(encodings[i, :n], heads, info.multivector, kept_tokens(row.ids, info.multivector, False))
        assert got.shape == (n - 1, 32)
        assert np.abs(got - colbert[i, :n - 1].numpy()).max() <= TOLERANCE
        vectors.append(got)
    assert terms > len(texts)  # most texts have weighted terms: the comparison is not of empty vectors
    # FlagEmbedding's colbert_score: the mean over query tokens of their best match
    for q in range(len(QUERIES)):
        for d in range(len(QUERIES), len(texts)):
            n_q, n_d = (int(batch["attention_mask"][k].sum()) - 1 for k in (q, d))
            expected = (colbert[q, :n_q] @ colbert[d, :n_d].T).max(dim=1).values.sum() / n_q
            assert abs(maxsim(vectors[q], vectors[d], mean=True).score - float(expected)) <= TOLERANCE


def _pylate_reference(checkpoint, texts, is_query):
    """PyLate's ColBERT.tokenize and encode (pylate/models/colbert.py) on transformers' BertModel: the tokenizer's
    pad token set to its mask token, queries padded to query_length - 1 with it, the marker put after the first
    token, the Dense projection, normalized; a query keeps every token (expansion ones too), a document its
    attended tokens outside the skiplist."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.pad_token = tokenizer.mask_token
    model = transformers.BertModel.from_pretrained(checkpoint).eval()
    weight = load_file(str(checkpoint / "1_Dense" / "model.safetensors"))["linear.weight"]
    length = QUERY_LENGTH if is_query else DOCUMENT_LENGTH
    batch = tokenizer(texts, truncation=True, max_length=length - 1, return_tensors="pt",
                      padding="max_length" if is_query else True)
    marker = tokenizer.convert_tokens_to_ids("[Q] " if is_query else "[D] ")

    def insert(tensor, value):
        return torch.cat([tensor[:, :1], torch.full((len(texts), 1), value, dtype=tensor.dtype), tensor[:, 1:]], dim=1)

    ids, mask = insert(batch["input_ids"], marker), insert(batch["attention_mask"], 1)
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)).last_hidden_state
    projected = hidden @ weight.T
    skip = torch.tensor(tokenizer.convert_tokens_to_ids(list(string.punctuation)))
    keep = torch.ones_like(ids, dtype=torch.bool) if is_query else mask.bool() & ~torch.isin(ids, skip)
    return [F.normalize(projected[i][keep[i]], dim=-1).numpy() for i in range(len(texts))], ids, mask


def test_colbert_manifest_heads_and_gates(colbert):
    checkpoint, result = colbert
    bundle = load_bundle(result.out)
    model = bundle.manifest.model
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    assert model.representations == ["multivector"] and not model.dense and model.sparse is None
    mv = model.multivector
    assert (mv.kind, mv.dim, mv.normalize, mv.skip_leading) == ("colbert", COLBERT_DIM, True, 0)
    assert (mv.query_prefix_id, mv.document_prefix_id) == tuple(tokenizer.convert_tokens_to_ids(["[Q] ", "[D] "]))
    assert (mv.query_length, mv.document_length, mv.do_query_expansion, mv.attend_to_expansion_tokens) == \
        (QUERY_LENGTH, DOCUMENT_LENGTH, True, False)
    assert mv.expansion_token_id == tokenizer.mask_token_id
    assert mv.skip_ids == sorted(set(tokenizer.convert_tokens_to_ids(list(string.punctuation))))
    assert model.max_tokens == DOCUMENT_LENGTH
    heads = load_heads(result.out / HEADS_FILE, model.hidden_size, None, mv)
    assert heads.multivector_bias is None
    assert np.array_equal(heads.multivector_weight,
                          load_file(str(checkpoint / "1_Dense" / "model.safetensors"))["linear.weight"].numpy())
    for report in (bundle.manifest.parity, bundle.manifest.variants["fp32"].parity):
        row = next(o for o in report.outputs if o.output == "multivector")
        assert row.passed and row.values > 0
    gate = json.loads((result.out / "bundle.json").read_text())
    int8 = gate["variants"].get("int8")
    if int8 is not None:  # published only where its gates passed, the multivector rows among them
        assert {g["representation"] for g in int8["quality"]["representations"]} == {"multivector"}


@pytest.mark.parametrize("is_query", [True, False], ids=["queries", "documents"])
def test_colbert_vectors_match_pylate_semantics_in_transformers(colbert, is_query):
    checkpoint, result = colbert
    bundle = load_bundle(result.out)
    info = bundle.manifest.model
    heads = load_heads(result.out / HEADS_FILE, info.hidden_size, None, info.multivector)
    texts = QUERIES if is_query else DOCUMENTS
    expected, ids, mask = _pylate_reference(checkpoint, texts, is_query)
    rows = token_rows(Tokenizer.from_file(str(bundle.tokenizer_path)), texts, info.multivector, is_query,
                      info.max_tokens)
    encodings, _ = _last_hidden_state(result.out, rows, info.pad_token_id)
    for i, row in enumerate(rows):
        n = len(row.ids)
        assert row.ids.tolist() == ids[i, :n].tolist() and row.attended == int(mask[i].sum())
        if is_query:  # expanded with [MASK] to query_length, those tokens not attended, their vectors kept
            assert n == QUERY_LENGTH
        got = token_vectors(encodings[i, :n], heads, info.multivector, kept_tokens(row.ids, info.multivector, is_query))
        assert got.shape == expected[i].shape
        assert np.abs(got - expected[i]).max() <= TOLERANCE
    if is_query:  # short queries were expanded
        assert rows[0].attended < QUERY_LENGTH and rows[2].attended < QUERY_LENGTH
    else:  # the skiplist took the punctuation out of the second document
        assert len(expected[1]) < int(mask[1].sum())


def test_colbert_maxsim_matches_pylate_scores(colbert):
    """rank.rerank's score: the sum over query tokens of their best document token (colbert_scores)."""
    checkpoint, result = colbert
    bundle = load_bundle(result.out)
    info = bundle.manifest.model
    heads = load_heads(result.out / HEADS_FILE, info.hidden_size, None, info.multivector)
    tokenizer = Tokenizer.from_file(str(bundle.tokenizer_path))
    queries, _, _ = _pylate_reference(checkpoint, QUERIES, True)
    documents, _, _ = _pylate_reference(checkpoint, DOCUMENTS, False)
    vectors = {}
    for side, texts, is_query in (("q", QUERIES, True), ("d", DOCUMENTS, False)):
        rows = token_rows(tokenizer, texts, info.multivector, is_query, info.max_tokens)
        encodings, _ = _last_hidden_state(result.out, rows, info.pad_token_id)
        vectors[side] = [token_vectors(encodings[i, :len(r.ids)], heads, info.multivector,
                                       kept_tokens(r.ids, info.multivector, is_query)) for i, r in enumerate(rows)]
    for q, query in enumerate(queries):
        for d, document in enumerate(documents):
            expected = float((torch.from_numpy(query) @ torch.from_numpy(document).T).max(dim=1).values.sum())
            assert abs(maxsim(vectors["q"][q], vectors["d"][d]).score - expected) <= TOLERANCE * len(query)


def test_colbert_settings_read_as_pylate_reads_them(tmp_path):
    """Unset values take PyLate's defaults; attend_to_expansion_tokens is false without expansion; an empty
    prefix means no marker."""
    directory = make_pylate_colbert(tmp_path / "colbert", settings={
        "query_length": None, "document_length": 50, "do_query_expansion": False,
        "attend_to_expansion_tokens": True, "document_prefix": "", "skiplist_words": ["!", "not-a-token"]})
    mv = load_checkpoint(directory).token_heads.multivector
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    assert (mv.query_length, mv.document_length) == (32, 50)  # PyLate's default query_length
    assert (mv.do_query_expansion, mv.attend_to_expansion_tokens, mv.expansion_token_id) == (False, False, None)
    assert mv.document_prefix_id is None and mv.query_prefix_id == tokenizer.convert_tokens_to_ids("[Q] ")
    assert mv.skip_ids == sorted({tokenizer.convert_tokens_to_ids("!"), tokenizer.unk_token_id})


@pytest.mark.parametrize(("change", "message"), [
    ({"dense_config": {"activation_function": "torch.nn.modules.activation.Tanh"}},
     "a ColBERT projection is served as one linear map"),
    ({"dense_config": {"use_residual": True}}, "a ColBERT projection is served as one linear map"),
    ({"settings": {"document_length": 4096}}, "document_length 4096 is not a length from 2 to the 64 tokens"),
])
def test_colbert_layouts_the_graph_cannot_serve_are_refused_by_name(change, message, tmp_path):
    directory = make_pylate_colbert(tmp_path / "colbert", **change)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(directory)


def test_colbert_expansion_on_positions_counted_by_the_mask_is_refused(tmp_path):
    """XLM-R counts positions over ids != pad (transformers) where the graph counts the attention mask: unattended
    [MASK] expansion tokens would get other positions, so other vectors than PyLate's. Attended, they are the same."""
    directory = make_pylate_colbert(tmp_path / "xlmr", family="xlm-roberta")
    with pytest.raises(CheckpointError, match="attend_to_expansion_tokens false on a model whose positions count"):
        load_checkpoint(directory)
    settings = json.loads((directory / "config_sentence_transformers.json").read_text())
    (directory / "config_sentence_transformers.json").write_text(json.dumps(settings | {
        "attend_to_expansion_tokens": True}))
    assert load_checkpoint(directory).token_heads.multivector.attend_to_expansion_tokens


def test_bge_m3_head_of_the_wrong_shape_is_refused(tmp_path):
    directory = make_bge_m3(tmp_path / "bge-m3")
    torch.save(torch.nn.Linear(16, 1).state_dict(), directory / "sparse_linear.pt")
    with pytest.raises(CheckpointError, match="sparse_linear.pt: weight .* do not map the model's hidden size 32"):
        load_checkpoint(directory)
