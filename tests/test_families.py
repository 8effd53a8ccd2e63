"""Every checkpoint family we load (BERT, RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT learned and
sinusoidal, ELECTRA discriminator, MPNet, ModernBERT, GTE, NomicBert, EmbeddingGemma's Gemma 3, the Qwen3
decoder embedder), loaded into our encoder and held against the references:
transformers (hidden states, attention probabilities) and sentence-transformers (pooled embedding),
through PyTorch and through the bundle's ONNX graphs, on small random checkpoints built locally."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL, GRAPH_FILE, encodings_file
from bundle.manifest import load_bundle
from export.checkpoint import FAMILIES as LOADED_FAMILIES
from export.checkpoint import CheckpointError, load_checkpoint
from export.pipeline import ExportOptions, build_bundle
from tests.families import FAMILIES, MAX_TOKENS, POOLINGS, add_dense, make_checkpoint

TOLERANCE = 1e-4

# Varied scripts and lengths; "" is special tokens only; the last one is cut at MAX_TOKENS, so the
# batch is padded everywhere but one row, and that row reaches the last position in the table.
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Der Zug nach München fährt um acht Uhr ab.",
    "Le renard brun rapide saute par-dessus le chien paresseux, n'est-ce pas ?",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "🙂 ok",
    "a",
    "",
    " ".join(["a long support ticket that keeps going and going"] * 20),
]

# The pooling each family's bundle is exported with: every mode goes through ONNX at least twice.
BUNDLE_POOLING = {
    "bert": "mean", "roberta": "cls", "xlm-roberta": "max", "camembert": "mean",
    "distilbert": "cls", "distilbert-sinusoidal": "max", "electra": "mean", "mpnet": "mean",
    "qwen3": "lasttoken", "modernbert": "mean", "gte": "cls", "nomic": "mean", "gemma3": "mean",
}
EXPECTED = {  # family name, pad id, position offset, embedding width, token types, position kind
    "bert": ("BERT", 0, 0, 32, 2, "learned"),
    "roberta": ("RoBERTa", 1, 2, 32, 1, "learned"),
    "xlm-roberta": ("XLM-RoBERTa", 1, 2, 32, 1, "learned"),
    "camembert": ("CamemBERT", 1, 2, 32, 1, "learned"),
    "distilbert": ("DistilBERT", 0, 0, 32, 0, "learned"),
    "distilbert-sinusoidal": ("DistilBERT", 0, 0, 32, 0, "sinusoidal"),
    "mpnet": ("MPNet", 1, 2, 32, 0, "learned"),
    "qwen3": ("Qwen3", 0, 0, 32, 0, "rotary"),
    "modernbert": ("ModernBERT", 0, 0, 32, 0, "rotary"),
    "gte": ("GTE", 1, 0, 32, 1, "rotary"),
    "nomic": ("NomicBert", 0, 0, 32, 2, "rotary"),
    "gemma3": ("Gemma3", 1, 0, 32, 0, "rotary"),
    "electra": ("ELECTRA", 0, 0, 16, 2, "learned"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {
        family: make_checkpoint(family, root / family, pooling=BUNDLE_POOLING[family], normalize=family == "electra")
        for family in FAMILIES
    }


def tokenize(tokenizer_path: Path, pad_id: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TEXTS as the service batches them: truncated, right-padded with the pad id, a mask."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.enable_truncation(max_tokens)
    tokenizer.enable_padding(pad_id=pad_id)
    encodings = tokenizer.encode_batch(TEXTS)
    return torch.tensor([e.ids for e in encodings]), torch.tensor([e.attention_mask for e in encodings])


@pytest.fixture(scope="module")
def reference_cache() -> dict:
    return {}


def reference(directory: Path, ids: torch.Tensor, mask: torch.Tensor, cache: dict):
    """transformers' own model of the checkpoint (AutoModel, eager attention) on a padded batch."""
    from transformers import AutoModel

    key = (str(directory), ids.numpy().tobytes())
    if key not in cache:
        model = AutoModel.from_pretrained(str(directory), attn_implementation="eager").eval()
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        cache[key] = (out.last_hidden_state, torch.stack(out.attentions))  # attentions (layers, B, heads, T, T)
    return cache[key]


def max_diffs(hidden, attentions, ref_hidden, ref_attentions, mask) -> tuple[float, float]:
    """Largest |ours - reference| over real tokens, and over attention between real tokens."""
    hidden, attentions = torch.as_tensor(hidden), torch.as_tensor(attentions)
    assert hidden.shape == ref_hidden.shape and attentions.shape == ref_attentions.shape
    real = mask.bool()
    pairs = real[:, :, None] & real[:, None, :]
    hidden_diff = (hidden[real] - ref_hidden[real]).abs().max().item()
    by_pair = lambda a: a.permute(1, 3, 4, 0, 2)[pairs]  # noqa: E731  (n_pairs, layers, heads)
    attn_diff = (by_pair(attentions) - by_pair(ref_attentions)).abs().max().item()
    return hidden_diff, attn_diff


@pytest.mark.parametrize("family", list(FAMILIES))
def test_loads_into_our_encoder_and_matches_transformers(family, checkpoints, reference_cache):
    ckpt = load_checkpoint(checkpoints[family])
    name, pad_id, offset, width, types, positions = EXPECTED[family]
    cfg = ckpt.config
    got = (ckpt.family, cfg.pad_token_id, cfg.position_offset, cfg.d_embed, cfg.type_vocab_size, cfg.position_kind)
    assert got == (name, pad_id, offset, width, types, positions)
    assert ckpt.max_tokens == MAX_TOKENS and cfg.d_model == 32 and cfg.n_layers == 2 and cfg.n_heads == 4
    assert (ckpt.encoder.embeddings.project is not None) == (family == "electra")
    ids, mask = tokenize(ckpt.tokenizer_path, pad_id, ckpt.max_tokens)
    specials = 1 if family == "qwen3" else 2  # an empty text: [CLS] [SEP], or a decoder's EOS alone
    assert mask.sum(1).max() == MAX_TOKENS and mask.sum(1).min() == specials and not mask.all()  # padded batch
    with torch.no_grad():
        hidden, _, attentions = ckpt.encoder(ids, mask, torch.zeros_like(ids))
    ref_hidden, ref_attentions = reference(checkpoints[family], ids, mask, reference_cache)
    hidden_diff, attn_diff = max_diffs(hidden, attentions, ref_hidden, ref_attentions, mask)
    assert hidden_diff <= TOLERANCE and attn_diff <= TOLERANCE, (hidden_diff, attn_diff)


def check_bundle(family: str, out: Path, checkpoints: dict[str, Path], cache: dict) -> None:
    """A published bundle of `family`: verified, its manifest right, both fp32 graphs equal to the references."""
    from sentence_transformers import SentenceTransformer

    bundle = load_bundle(out)  # the service's own loader
    m = bundle.manifest
    assert m.parity.passed and m.variants["fp32"].parity.passed
    assert all(o.values > 0 and o.max_abs_diff <= DEFAULT_ATOL for o in m.parity.outputs)
    assert m.model.pad_token_id == EXPECTED[family][1] and m.model.max_tokens == MAX_TOKENS
    assert m.model.pooling == BUNDLE_POOLING[family] and m.model.normalize == (family == "electra")

    # The bundle ships the checkpoint's tokenizer; batch as the service does: right-padded with the
    # manifest's pad id, token_type_ids all zeros; the graph computes positions itself.
    ids, mask = tokenize(bundle.tokenizer_path, m.model.pad_token_id, m.model.max_tokens)
    assert torch.equal(ids, tokenize(checkpoints[family] / "tokenizer.json", m.model.pad_token_id, MAX_TOKENS)[0])
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": np.zeros_like(ids.numpy())}
    full = ort.InferenceSession(str(out / GRAPH_FILE), providers=["CPUExecutionProvider"])
    fused = ort.InferenceSession(str(out / encodings_file("fp32")), providers=["CPUExecutionProvider"])
    assert [i.name for i in full.get_inputs()] == [i.name for i in fused.get_inputs()] == list(feed)
    hidden, embedding, attentions = full.run(None, feed)
    fused_hidden, fused_embedding = fused.run(None, feed)

    ref_hidden, ref_attentions = reference(checkpoints[family], ids, mask, cache)
    hidden_diff, attn_diff = max_diffs(hidden, attentions, ref_hidden, ref_attentions, mask)
    fused_diff, _ = max_diffs(fused_hidden, attentions, ref_hidden, ref_attentions, mask)
    assert max(hidden_diff, attn_diff, fused_diff) <= TOLERANCE, (hidden_diff, attn_diff, fused_diff)

    st = SentenceTransformer(str(checkpoints[family]), device="cpu")
    expected = st.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    assert np.abs(embedding - expected).max() <= TOLERANCE
    assert np.abs(fused_embedding - expected).max() <= TOLERANCE

    # the packed graph: every text one after another in one row, as the service packs them
    from bundle.contract import PACKED_POOLINGS
    from service.runtimes.packing import pack

    if m.model.pooling not in PACKED_POOLINGS:
        assert m.packed is None  # max pooling: no pooling matrix says it
        return
    assert m.packed is not None and m.packed.parity.passed
    rows = [ids[i, : int(n)].numpy() for i, n in enumerate(mask.sum(dim=1))]
    packed = ort.InferenceSession(str(bundle.packed_path), providers=["CPUExecutionProvider"])
    (packed_embedding,) = packed.run(None, pack(rows, None, m.packed.position_offset, m.model.pooling))
    assert np.abs(packed_embedding - expected).max() <= TOLERANCE


# RoBERTa's bundle is made by `python -m export` in test_make_export_cli_exports_a_roberta_checkpoint.
# Each bundle is then served by OpenVINO (tests/test_openvino_families.py): at f32, and at bf16 where this CPU
# has bf16 units and the bundle's bf16 gate passed (the export gates bf16 only there: lossy=("bf16",)).
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "roberta"])
def test_bundle_passes_parity_and_its_graphs_match_the_references(family, checkpoints, reference_cache, tmp_path):
    from tests.test_openvino_families import check_served_on_openvino

    out = tmp_path / family
    result = build_bundle(
        ExportOptions(str(checkpoints[family]), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, lossy=("bf16",)),
        progress=lambda _: None,
    )
    assert set(result.manifest.variants) <= {"fp32", "bf16"} and "fp32" in result.manifest.variants
    check_bundle(family, out, checkpoints, reference_cache)
    check_served_on_openvino(out, checkpoints[family], TEXTS)


# Pooling is the same code for every family: each family is held with two modes, taken in turn, so that every
# mode meets four families or more (its bundle's mode is held in check_bundle, the six over HTTP in
# test_sentence_conventions.py)
@pytest.mark.parametrize(("family", "pooling"), [(f, POOLINGS[(i + k) % len(POOLINGS)])
                                                 for i, f in enumerate(FAMILIES) for k in (0, 3)])
def test_pooling_config_matches_sentence_transformers(family, pooling, tmp_path):
    from sentence_transformers import SentenceTransformer

    directory = make_checkpoint(family, tmp_path / family, pooling=pooling, normalize=pooling == "max")
    ckpt = load_checkpoint(directory)
    assert (ckpt.config.pooling, ckpt.config.normalize) == (pooling, pooling == "max")
    st = SentenceTransformer(str(directory), device="cpu")
    assert st.max_seq_length == ckpt.max_tokens
    ids, mask = tokenize(ckpt.tokenizer_path, ckpt.config.pad_token_id, ckpt.max_tokens)
    assert torch.equal(st.tokenize(TEXTS)["input_ids"], ids)  # one tokenizer for both
    with torch.no_grad():
        _, ours, _ = ckpt.encoder(ids, mask, torch.zeros_like(ids))
    expected = st.encode(TEXTS, convert_to_tensor=True, batch_size=len(TEXTS))
    torch.testing.assert_close(ours, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("model_type", ["gpt2", "t5", None])
def test_an_unsupported_family_is_one_error_listing_the_supported_ones(model_type, checkpoints, tmp_path):
    import transformers

    directory = tmp_path / "other"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes((checkpoints["bert"] / "tokenizer.json").read_bytes())
    if model_type == "gpt2":
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4).save_pretrained(directory)
    elif model_type == "t5":
        transformers.T5Config(num_layers=1, d_model=32, num_heads=4).save_pretrained(directory)
    else:
        (directory / "config.json").write_text(json.dumps({"hidden_size": 32}))
    assert json.loads((directory / "config.json").read_text()).get("model_type") == model_type
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(directory)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{directory / 'config.json'}: model_type {model_type!r} is not supported")
    for name, model_types in [("BERT", "bert"), ("RoBERTa", "roberta"), ("XLM-RoBERTa", "xlm-roberta"),
                              ("CamemBERT", "camembert"), ("DistilBERT", "distilbert"), ("ELECTRA", "electra"),
                              ("MPNet", "mpnet"), ("Qwen3", "qwen3"), ("ModernBERT", "modernbert"),
                              ("GTE", "gte/new"), ("NomicBert", "nomic_bert"), ("Gemma3", "gemma3_text")]:
        assert f"{name} ({model_types})" in message
    assert len(LOADED_FAMILIES) == 12


def test_roberta_positions_are_counted_over_real_tokens_from_padding_idx_plus_one(checkpoints):
    from transformers.models.roberta.modeling_roberta import RobertaEmbeddings

    ckpt = load_checkpoint(checkpoints["roberta"])
    ids, mask = tokenize(ckpt.tokenizer_path, ckpt.config.pad_token_id, ckpt.max_tokens)
    ours = ckpt.encoder.embeddings.counted_positions(mask)
    theirs = RobertaEmbeddings.create_position_ids_from_input_ids(ids, padding_idx=1)
    assert torch.equal(ours, theirs)
    assert ours[mask.sum(1).argmax()].tolist() == list(range(2, 2 + MAX_TOKENS))  # the full row: 2..65


def test_roberta_limit_comes_from_the_position_table_without_tokenizer_limits(checkpoints, tmp_path):
    """514-row tables hold 512 tokens: the limit is max_position_embeddings - (padding_idx + 1)."""
    import shutil

    directory = shutil.copytree(checkpoints["xlm-roberta"], tmp_path / "xlmr")
    (directory / "sentence_bert_config.json").unlink()
    (directory / "tokenizer_config.json").unlink()
    ckpt = load_checkpoint(directory)
    assert json.loads((directory / "config.json").read_text())["max_position_embeddings"] == MAX_TOKENS + 2
    assert ckpt.max_tokens == ckpt.config.max_sequence_length == MAX_TOKENS


def test_distilbert_sinusoidal_table_is_checked_then_rebuilt(checkpoints, tmp_path):
    import shutil

    ckpt = load_checkpoint(checkpoints["distilbert-sinusoidal"])
    assert ckpt.config.position_kind == "sinusoidal" and ckpt.config.embedding_scale == 1.0
    assert "embeddings.position_embeddings.weight" in ckpt.ignored
    assert not hasattr(ckpt.encoder.embeddings, "position")

    # a table that is not the encoding the config promises is refused, with the way out named
    directory = shutil.copytree(checkpoints["distilbert-sinusoidal"], tmp_path / "tampered")
    weights = load_file(str(directory / "model.safetensors"))
    weights["embeddings.position_embeddings.weight"][5, 3] += 0.01
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"embeddings.position_embeddings.weight is not the sinusoidal table "
                       r".*\(max abs diff 0.01\); set sinusoidal_pos_embds to false"):
        load_checkpoint(directory)
    # without a stored table the encoder computes it, as transformers initialises it
    del weights["embeddings.position_embeddings.weight"]
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    assert load_checkpoint(directory).config.position_kind == "sinusoidal"


def test_heads_are_skipped_by_name_and_unknown_tensors_still_refused(checkpoints, tmp_path):
    import shutil

    ignored = {family: load_checkpoint(checkpoints[family]).ignored for family in FAMILIES}
    assert all(n.startswith("lm_head.") for n in ignored["roberta"]) and ignored["roberta"]
    assert set(ignored["xlm-roberta"]) == {"pooler.dense.weight", "pooler.dense.bias"}
    assert all(re.match(r"vocab_(transform|layer_norm|projector)\.", n) for n in ignored["distilbert"])
    assert all(n.startswith("discriminator_predictions.") for n in ignored["electra"]) and len(ignored["electra"]) == 4

    directory = shutil.copytree(checkpoints["electra"], tmp_path / "electra")
    weights = load_file(str(directory / "model.safetensors"))
    weights["electra.embeddings_project.extra"] = torch.zeros(2)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"map to no encoder parameter"):
        load_checkpoint(directory)
    weights.pop("electra.embeddings_project.extra")
    weights["classifier.dense.weight"] = torch.zeros(2, 32)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"the ELECTRA encoder has no place for.*classifier.dense.weight"):
        load_checkpoint(directory)


def test_make_export_cli_exports_a_roberta_checkpoint(checkpoints, reference_cache, tmp_path):
    """What `make export CHECKPOINT=DIR` runs, lossy variants included, on a non-BERT family."""
    out = tmp_path / "bundles" / "roberta"
    result = subprocess.run(
        [sys.executable, "-m", "export", "--checkpoint", str(checkpoints["roberta"]), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(RobertaForMaskedLM)" in result.stdout and "not used: lm_head.dense.weight" in result.stdout
    assert "parity PASSED" in result.stdout and f"published {out}" in result.stdout
    m = load_bundle(out).manifest
    assert (m.model.architecture, m.model.pad_token_id, m.model.max_tokens, m.model.pooling) == (
        "RobertaForMaskedLM", 1, MAX_TOKENS, "cls"
    )
    assert {"fp32"} <= set(m.variants) and all(v.passed for v in m.variants.values())
    check_bundle("roberta", out, checkpoints, reference_cache)
    from tests.test_openvino_families import check_served_on_openvino

    check_served_on_openvino(out, checkpoints["roberta"], TEXTS)


@pytest.mark.parametrize("family", ["distilbert", "bert"])
def test_dense_projections_after_pooling_are_in_the_graph_and_match_sentence_transformers(family, checkpoints, tmp_path):
    """A distiluse-style model: Pooling, then Dense modules (Tanh to a narrower width, then a linear one
    without bias), then Normalize, saved by sentence-transformers itself. The bundle's graphs return
    what sentence-transformers returns, at the Dense width, and the manifest says that width."""
    from sentence_transformers import SentenceTransformer

    directory = add_dense(checkpoints[family], tmp_path / "with-dense")
    hidden = load_checkpoint(checkpoints[family]).config.d_model
    st = SentenceTransformer(str(directory), device="cpu")
    expected = st.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    assert expected.shape == (len(TEXTS), 16)

    ckpt = load_checkpoint(directory)
    assert [(d.in_features, d.out_features, d.bias, d.activation) for d in ckpt.config.dense] == \
        [(hidden, 24, True, "tanh"), (24, 16, False, "identity")]
    out = tmp_path / "bundle"
    build_bundle(ExportOptions(str(directory), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, lossy=()),
                 progress=lambda _: None)
    bundle = load_bundle(out)
    assert (bundle.manifest.model.embedding_dim, bundle.manifest.model.dense_layers) == (16, 2)
    assert bundle.manifest.model.sentence_dim == 16 and bundle.manifest.model.hidden_size == hidden
    ids, mask = tokenize(bundle.tokenizer_path, bundle.manifest.model.pad_token_id, bundle.manifest.model.max_tokens)
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": np.zeros_like(ids.numpy())}
    for graph in (GRAPH_FILE, encodings_file("fp32")):
        session = ort.InferenceSession(str(out / graph), providers=["CPUExecutionProvider"])
        embedding = session.run(["sentence_embedding"], feed)[0]
        assert embedding.shape == (len(TEXTS), 16), graph
        assert np.abs(embedding - expected).max() <= TOLERANCE, graph


@pytest.mark.parametrize(("module_type", "message"), [
    ("sentence_transformers.models.LayerNorm", "module 'sentence_transformers.models.LayerNorm' (3_X) is not supported"),
    ("my_package.CustomHead", "module 'my_package.CustomHead' (3_X) is not supported"),
    # a class of another package that merely ends like one of sentence-transformers' is not it
    ("pylate.models.Dense.Dense", "module 'pylate.models.Dense.Dense' (3_X) is not supported"),
    ("my_package.Normalize", "module 'my_package.Normalize' (3_X) is not supported"),
])
def test_a_sentence_transformers_module_the_graph_does_not_compute_is_refused_by_name(
        module_type, message, checkpoints, tmp_path):
    import shutil

    directory = tmp_path / "extra-module"
    shutil.copytree(checkpoints["bert"], directory)
    modules = json.loads((directory / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_X", "type": module_type})
    (directory / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_checkpoint(directory)


def test_what_a_decoder_family_does_not_load_yet_is_refused_by_name(checkpoints, tmp_path):
    """A Qwen3 sequence classifier (the family loads as an embedder only), a scaled RoPE and sliding-window
    layers: each one CheckpointError naming it, never a model that runs and answers wrong."""
    import shutil

    def edited(name: str, **changes) -> Path:
        directory = shutil.copytree(checkpoints["qwen3"], tmp_path / name)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **changes}))
        return directory

    cases = {
        "classifier": ({"architectures": ["Qwen3ForSequenceClassification"]},
                       "Qwen3ForSequenceClassification is not supported: the Qwen3 family loads as an embedding model"),
        "yarn": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
                 "rope_type 'yarn' is not supported"),
        "sliding": ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window attention layers"),
    }
    for name, (changes, message) in cases.items():
        with pytest.raises(CheckpointError, match=re.escape(message)):
            load_checkpoint(edited(name, **changes))


def test_modernbert_reads_both_config_layouts_and_its_local_layers_see_only_their_window(checkpoints, tmp_path):
    """transformers 5 saves layer_types and a rope_parameters per layer type; ModernBERT's own configs
    (on the hub) say global_attn_every_n_layers and global/local_rope_theta. Both give the same encoder,
    whose local layer puts exactly zero weight past the window and whose global layer does not."""
    import shutil

    from tests.families import MODERNBERT_WINDOW

    cfg = load_checkpoint(checkpoints["modernbert"]).config
    assert (cfg.sliding_layers, cfg.sliding_window, cfg.rope_theta, cfg.local_rope_theta) == (
        (1,), MODERNBERT_WINDOW, 160_000.0, 10_000.0)
    assert (cfg.norm_bias, cfg.bias, cfg.gated_mlp, cfg.norm_first, cfg.first_attention_norm) == (
        False, False, True, True, False)
    directory = shutil.copytree(checkpoints["modernbert"], tmp_path / "original-layout")
    raw = json.loads((directory / "config.json").read_text())
    del raw["layer_types"], raw["rope_parameters"]
    raw |= {"global_attn_every_n_layers": 2, "global_rope_theta": 160_000.0, "local_rope_theta": 10_000.0}
    (directory / "config.json").write_text(json.dumps(raw))
    ckpt = load_checkpoint(directory)
    assert ckpt.config == cfg

    ids, mask = tokenize(ckpt.tokenizer_path, cfg.pad_token_id, ckpt.max_tokens)
    with torch.no_grad():
        _, _, attentions = ckpt.encoder(ids, mask)
    positions = torch.arange(ids.size(1))
    far = (positions[:, None] - positions[None, :]).abs() > MODERNBERT_WINDOW  # (Tq, Tk)
    real = (mask.bool()[:, :, None] & mask.bool()[:, None, :])[:, None] & far  # (B, 1, Tq, Tk): real pairs, far apart
    assert real.any()
    assert attentions[1].masked_select(real).abs().max() == 0  # the local layer
    assert attentions[0].masked_select(real).min() > 0  # the global layer

    raw["rope_parameters"] = {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 160_000.0}}
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="a scaled RoPE on full_attention layers is not supported"):
        load_checkpoint(directory)


@pytest.mark.parametrize("family", ["gte", "nomic"])
def test_the_original_and_the_native_weight_layouts_load_the_same_encoder(family, checkpoints, tmp_path):
    """transformers 5 saves these families in their original layout (fused qkv_proj/up_gate_proj; attn.Wqkv
    with fc11/fc12) and loads both; so does the export, cutting fused tensors as transformers' conversion
    tables do. (ModernBERT has one layout: transformers' own module keeps Wqkv and Wi fused.)"""
    from safetensors.torch import load_file

    from tests.families import native_layout

    original = load_checkpoint(checkpoints[family])
    native_dir = native_layout(checkpoints[family], tmp_path / "native")
    names = set(load_file(str(native_dir / "model.safetensors")))
    fused = {"gte": "qkv_proj", "nomic": "Wqkv"}[family]
    assert not any(fused in n for n in names) and any(fused in n for n in load_file(
        str(checkpoints[family] / "model.safetensors")))
    native = load_checkpoint(native_dir)
    assert native.config == original.config
    theirs = native.encoder.state_dict()
    for name, tensor in original.encoder.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_nomic_and_gte_original_configs_give_the_same_encoder_and_what_they_cannot_say_is_refused(
        checkpoints, tmp_path):
    """nomic-embed-text's own config.json (n_embd, rotary_emb_base, activation_function swiglu, ...) and GTE's
    remote-code one (model_type "new", weights under `new.`) read as transformers 5's do; a partial rotation,
    a pre-norm or a scaled RoPE is refused by name."""
    import shutil

    nomic = json.loads((checkpoints["nomic"] / "config.json").read_text())
    directory = shutil.copytree(checkpoints["nomic"], tmp_path / "nomic-original")
    original = {k: v for k, v in nomic.items() if k not in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "max_position_embeddings",
        "layer_norm_eps", "rope_parameters", "hidden_act", "head_dim")}
    original |= {"n_embd": nomic["hidden_size"], "n_layer": nomic["num_hidden_layers"],
                 "n_head": nomic["num_attention_heads"], "n_inner": nomic["intermediate_size"],
                 "n_positions": nomic["max_position_embeddings"], "layer_norm_epsilon": nomic["layer_norm_eps"],
                 "rotary_emb_base": nomic["rope_parameters"]["rope_theta"], "activation_function": "swiglu",
                 "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "prenorm": False,
                 "qkv_proj_bias": False, "rotary_scaling_factor": None}
    (directory / "config.json").write_text(json.dumps(original))
    assert load_checkpoint(directory).config == load_checkpoint(checkpoints["nomic"]).config
    for key, value, message in (("rotary_emb_fraction", 0.5, "rotary_emb_fraction 0.5 is not supported"),
                                ("prenorm", True, "prenorm True is not supported"),
                                ("activation_function", "gelu", "activation_function 'gelu' is not supported")):
        (directory / "config.json").write_text(json.dumps(original | {key: value}))
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(directory)

    gte = json.loads((checkpoints["gte"] / "config.json").read_text())
    directory = shutil.copytree(checkpoints["gte"], tmp_path / "gte-new")
    weights = {("new." + k.removeprefix("gte.")): v for k, v in load_file(str(directory / "model.safetensors")).items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    del gte["rope_parameters"]
    remote = gte | {"model_type": "new", "rope_theta": 160_000.0, "logn_attention_scale": False,
                    "layer_norm_type": "layer_norm", "position_embedding_type": "rope"}
    (directory / "config.json").write_text(json.dumps(remote))
    ckpt = load_checkpoint(directory)
    assert ckpt.config == load_checkpoint(checkpoints["gte"]).config and ckpt.family == "GTE"
    (directory / "config.json").write_text(json.dumps(remote | {"rope_scaling": {"type": "ntk", "factor": 2.0}}))
    with pytest.raises(CheckpointError, match="rope_type 'ntk' is not supported"):
        load_checkpoint(directory)


def test_gemma3_loads_as_embeddinggemma_uses_it_and_refuses_a_causal_language_model(checkpoints, tmp_path):
    """Bidirectional Gemma 3: sliding_window 8 in config.json is 4 positions each way (transformers' exclusive
    bound of 8 // 2 + 1), global and local RoPE bases, RMSNorm scaling by 1 + w; a causal one, soft-capped
    logits or a query scale other than the head width are refused by name."""
    import shutil

    from tests.families import MODERNBERT_WINDOW

    cfg = load_checkpoint(checkpoints["gemma3"]).config
    assert (cfg.sliding_layers, cfg.sliding_window, cfg.rope_theta, cfg.local_rope_theta) == (
        (0,), MODERNBERT_WINDOW, 1_000_000.0, 10_000.0)
    assert (cfg.norm, cfg.norm_weight_offset, cfg.post_sublayer_norm, cfg.causal, cfg.embedding_scale) == (
        "rmsnorm", 1.0, True, False, 32 ** 0.5)
    directory = shutil.copytree(checkpoints["gemma3"], tmp_path / "gemma3")
    raw = json.loads((directory / "config.json").read_text())
    for change, message in (({"use_bidirectional_attention": False}, "a causal gemma3_text is a language model"),
                            ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0 is not supported"),
                            ({"query_pre_attn_scalar": 8}, "query_pre_attn_scalar 8 is not supported")):
        (directory / "config.json").write_text(json.dumps(raw | change))
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(directory)


def pylate_like(bert: Path, directory: Path) -> Path:
    """`bert` as PyLate saves a ColBERT model: the Transformer, then PyLate's own Dense (a linear map of every
    token's encoding to 128 without bias) and no Pooling: one vector per token, scored by MaxSim."""
    import shutil

    shutil.copytree(bert, directory)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    shutil.rmtree(directory / "1_Pooling")
    (directory / "1_Dense").mkdir()
    (directory / "1_Dense" / "config.json").write_text(json.dumps(
        {"in_features": 32, "out_features": 128, "bias": False,
         "activation_function": "torch.nn.modules.linear.Identity", "use_residual": False}))
    save_file({"linear.weight": torch.randn(128, 32, generator=torch.Generator().manual_seed(0))},
              str(directory / "1_Dense" / "model.safetensors"))
    return directory


def test_a_token_level_model_without_pooling_is_refused_by_name(checkpoints, tmp_path):
    """A PyLate ColBERT model exported as a mean-pooled embedder before: its `pylate.models.Dense.Dense` was taken for
    sentence-transformers' Dense, and a modules.json without Pooling got mean pooling; one averaged vector served where
    the model gives one per token. Issue 48 exports PyLate's layout as a multi-vector model
    (tests/test_late_interaction_export.py); this one's PyLate defaults (document_length 180) exceed its 64 positions,
    refused by name, as is any other modules.json without a Pooling module."""
    directory = pylate_like(checkpoints["bert"], tmp_path / "colbert")
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(directory)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{directory / 'config_sentence_transformers.json'}: "
                                                      "document_length 180 is not a length from 2 to the 64 tokens")
    # the Transformer alone (sentence-transformers' token embeddings) is token-level too
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"}]))
    with pytest.raises(CheckpointError, match="no sentence-transformers Pooling module .* token-level"):
        load_checkpoint(directory)


# modules.json's types as sentence-transformers writes them: up to 5.3 (and read by every version since), 5.4/5.5
# (Normalize under sentence_transformer.modules), 6 (what add_dense's save writes: base.modules.*)
_ST_NAMES = {
    "5.3": ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
            "sentence_transformers.models.Normalize"),
    "5.4": ("sentence_transformers.base.modules.transformer.Transformer",
            "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
            "sentence_transformers.sentence_transformer.modules.normalize.Normalize"),
    "6": ("sentence_transformers.base.modules.transformer.Transformer",
          "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
          "sentence_transformers.base.modules.normalize.Normalize"),
}


@pytest.mark.parametrize("version", list(_ST_NAMES))
def test_sentence_transformers_module_types_of_each_version_load(version, checkpoints, tmp_path):
    import shutil

    directory = shutil.copytree(checkpoints["electra"], tmp_path / "electra")  # saved with Normalize
    names = _ST_NAMES[version]
    modules = json.loads((directory / "modules.json").read_text())
    assert len(modules) == 3
    (directory / "modules.json").write_text(json.dumps([m | {"type": t} for m, t in zip(modules, names)]))
    ckpt = load_checkpoint(directory)
    assert (ckpt.config.pooling, ckpt.config.normalize) == (BUNDLE_POOLING["electra"], True)
    if version == "6":  # what sentence-transformers itself writes
        saved = json.loads((add_dense(checkpoints["bert"], tmp_path / "saved") / "modules.json").read_text())
        assert [m["type"] for m in saved] == [*names[:2], "sentence_transformers.base.modules.dense.Dense",
                                              "sentence_transformers.base.modules.dense.Dense", names[2]]


def _swap_modernbert_bases(directory: Path) -> None:
    raw = json.loads((directory / "config.json").read_text())
    params = raw["rope_parameters"]
    params["full_attention"], params["sliding_attention"] = params["sliding_attention"], params["full_attention"]
    (directory / "config.json").write_text(json.dumps(raw))


def _gte_base_10000(directory: Path) -> None:
    raw = json.loads((directory / "config.json").read_text())
    raw["rope_parameters"]["rope_theta"] = 10_000.0
    (directory / "config.json").write_text(json.dumps(raw))


def _zero_mpnet_relative_bias(directory: Path) -> None:
    weights = load_file(str(directory / "model.safetensors"))
    name = next(n for n in weights if n.endswith("relative_attention_bias.weight"))
    weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("family", "mutate"), [("modernbert", _swap_modernbert_bases), ("gte", _gte_base_10000),
                                                ("mpnet", _zero_mpnet_relative_bias)])
def test_the_family_checkpoints_are_big_enough_to_see_what_the_tests_claim(family, mutate, checkpoints, tmp_path):
    """The pooled embedding the bundle tests compare with sentence-transformers must move well past TOLERANCE when
    the export reads a family wrong. At transformers' 0.02 init it did not: ModernBERT's RoPE bases swapped moved it
    by 2.2e-6, GTE's base 160000 -> 10000 by 1.8e-5, MPNet's relative bias zeroed by 2.1e-4. tests/families.py's
    INIT_STD (0.2) makes them 2.8e-2, 2.4e-1 and 1.3e-1, while the right reading stays within 1.4e-6."""
    import shutil

    from sentence_transformers import SentenceTransformer

    def pooled(directory: Path) -> np.ndarray:
        ckpt = load_checkpoint(directory)
        ids, mask = tokenize(ckpt.tokenizer_path, ckpt.config.pad_token_id, ckpt.max_tokens)
        with torch.no_grad():
            return ckpt.encoder(ids, mask, torch.zeros_like(ids))[1].numpy()

    expected = SentenceTransformer(str(checkpoints[family]), device="cpu").encode(
        TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    assert np.abs(pooled(checkpoints[family]) - expected).max() <= TOLERANCE
    wrong = shutil.copytree(checkpoints[family], tmp_path / "wrong")
    mutate(wrong)
    moved = np.abs(pooled(wrong) - expected).max()
    assert moved > 100 * TOLERANCE, moved
