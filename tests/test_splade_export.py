"""SPLADE export (issue 48): a sentence-transformers SparseEncoder (MLMTransformer or Transformer fill-mask, then
SpladePooling) and a bare *ForMaskedLM with --pooling splade exported through the parity gate; the bundle's fp32
encodings graph, run by onnxruntime, held against SparseEncoder.encode itself at 1e-4; the manifest's fields; a
lossy variant's sparse gate; what cannot be computed refused by name.

Checkpoints are tiny and random (tests/splade_models.py); each export is made once for the module.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tokenizers import Tokenizer

from bundle.manifest import load_bundle
from export.checkpoint import CheckpointError, load_checkpoint
from export.pipeline import ExportOptions, build_bundle
from tests.families import make_checkpoint
from tests.splade_models import make_masked_lm, make_sparse_encoder

# varied lengths (a batch with padding), scripts and words the tiny vocabularies know, one text past 64 tokens
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Paris is the capital and largest city of France.",
    "Der Zug nach München fährt um acht Uhr ab.",
    "東京は日本の首都です。",
    "ok",
    " ".join(["Refunds are issued to the original payment method within fourteen days."] * 8),
]
ATOL = 1e-4

# (family, pooling, SparseEncoder's first module, lossy variants built): BERT-like, XLM-R-like (positions from
# padding_idx + 1), ModernBERT (no bias in its head's dense, RoPE); DistilBERT's head (its own names) is held to
# SparseEncoder in PyTorch below, and a bare untied BERT goes through the CLI
CASES = {
    "bert-max": ("bert", "max", "MLMTransformer", ("fp16",)),
    "xlm-roberta-sum": ("xlm-roberta", "sum", "Transformer", ()),
    "modernbert-sum": ("modernbert", "sum", "Transformer", ()),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("splade")


@pytest.fixture(scope="module")
def exports(root):
    """case -> (checkpoint, bundle), each exported on first use and shared by the module's tests."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(case: str) -> tuple[Path, Path]:
        if case not in made:
            family, pooling, module, lossy = CASES[case]
            checkpoint = make_sparse_encoder(family, root / case, pooling=pooling, module=module)
            result = build_bundle(ExportOptions(str(checkpoint), root / f"{case}-bundle", 18, ATOL, ATOL, lossy=lossy),
                                  progress=lambda line: None)
            made[case] = checkpoint, result.out
        return made[case]

    return get


def bundle_vectors(bundle: Path, texts: list[str], precision: str = "fp32") -> np.ndarray:
    """The bundle's encodings graph's pooled output for `texts`, one padded batch, as the service would feed it."""
    loaded = load_bundle(bundle)
    tokenizer = Tokenizer.from_file(str(loaded.tokenizer_path))
    tokenizer.enable_padding(pad_id=loaded.manifest.model.pad_token_id)
    encodings = tokenizer.encode_batch(texts)
    ids = np.array([e.ids for e in encodings], dtype=np.int64)
    feed = {"input_ids": ids, "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.zeros_like(ids)}
    session = ort.InferenceSession(str(loaded.variant_path(precision)), providers=["CPUExecutionProvider"])
    return session.run(["sentence_embedding"], feed)[0]


def reference_vectors(model, texts: list[str]) -> np.ndarray:
    """SparseEncoder.encode's vectors, dense."""
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts)).to_dense().numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_encoder_export_matches_sparse_encoder(case, exports):
    from sentence_transformers import SparseEncoder

    checkpoint, bundle = exports(case)
    expected = reference_vectors(SparseEncoder(str(checkpoint), device="cpu"), TEXTS)
    got = bundle_vectors(bundle, TEXTS)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=ATOL, rtol=ATOL)
    assert (expected > 0).sum() > 10 * len(TEXTS)  # vectors with terms, not zeros compared with zeros
    model = load_bundle(bundle).manifest.model
    _, pooling, _, _ = CASES[case]
    assert model.pooling == f"splade_{pooling}"
    assert (model.dense, model.normalize, model.embedding_dim) == (False, False, model.vocab_size)
    assert model.sparse is not None and model.sparse.kind == "splade"
    assert model.multivector is None and model.representations == ["sparse"]
    assert load_bundle(bundle).manifest.packed is None  # max or sum over tokens: no packed graph


def test_lossy_variants_carry_the_sparse_gate(exports):
    """fp16 is published with its sparse gate beside the cosine gate; whatever lossy variant is published passed
    both; its vectors' top terms are fp32's."""
    _, bundle = exports("bert-max")
    variants = load_bundle(bundle).manifest.variants
    assert "fp16" in variants
    for precision, variant in variants.items():
        if precision == "fp32":
            continue
        gates = variant.quality.representations
        assert [g.representation for g in gates] == ["sparse", "sparse"]
        assert all(g.passed and g.value >= g.required for g in gates), gates
    fp32, fp16 = bundle_vectors(bundle, TEXTS), bundle_vectors(bundle, TEXTS, "fp16")
    for row32, row16 in zip(fp32, fp16):
        top = set(np.argsort(-row32)[:8])
        assert len(top & set(np.argsort(-row16)[:8])) >= 7


def test_bare_masked_lm_with_pooling_splade_through_the_cli(root):
    """A BertForMaskedLM with untied embeddings (its decoder's own weight and bias): `python -m export --pooling
    splade` gives SparseEncoder(MLMTransformer, SpladePooling max)'s vectors."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    from export.__main__ import main

    mlm = make_masked_lm("bert", root / "bare-bert-mlm", seed=3, tie_word_embeddings=False)
    out = root / "bare-bundle"
    assert main(["--checkpoint", str(mlm), "--out", str(out), "--pooling", "splade", "--lossy", ""]) == 0
    assert load_bundle(out).manifest.model.pooling == "splade_max"
    reference = SparseEncoder(modules=[MLMTransformer(str(mlm)), SpladePooling("max")], device="cpu")
    np.testing.assert_allclose(bundle_vectors(out, TEXTS), reference_vectors(reference, TEXTS), atol=ATOL, rtol=ATOL)


def test_pooling_splade_sum_loads_the_head_of_a_bare_checkpoint(root):
    """--pooling splade_sum on a DistilBertForMaskedLM: the PyTorch encoder equals SparseEncoder with sum pooling
    (the export itself is the other tests')."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    mlm = make_masked_lm("distilbert", root / "bare-distilbert-mlm", seed=5)
    checkpoint = load_checkpoint(mlm, pooling="splade_sum")
    assert checkpoint.config.pooling == "splade_sum"
    tokenizer = Tokenizer.from_file(str(checkpoint.tokenizer_path))
    tokenizer.enable_padding(pad_id=checkpoint.config.pad_token_id)
    encodings = tokenizer.encode_batch(TEXTS[:4])
    ids = torch.tensor([e.ids for e in encodings])
    with torch.no_grad():
        _, vectors, _ = checkpoint.encoder(ids, torch.tensor([e.attention_mask for e in encodings]), torch.zeros_like(ids))
    reference = SparseEncoder(modules=[MLMTransformer(str(mlm)), SpladePooling("sum")], device="cpu")
    np.testing.assert_allclose(vectors.numpy(), reference_vectors(reference, TEXTS[:4]), atol=ATOL, rtol=ATOL)


# ---- refusals ----------------------------------------------------------------------------------------------

def test_refuses_an_activation_it_does_not_compute(root):
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    mlm = make_masked_lm("bert", root / "log1p-mlm")
    out = root / "log1p"
    SparseEncoder(modules=[MLMTransformer(str(mlm)), SpladePooling("max", activation_function="log1p_relu")],
                  device="cpu").save(str(out))
    with pytest.raises(CheckpointError, match="activation_function 'log1p_relu' is not supported"):
        load_checkpoint(out)


def test_refuses_an_inference_free_router_by_name(root):
    """opensearch's inference-free models: a Router with SparseStaticEmbedding for queries."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, Router, SparseStaticEmbedding, SpladePooling

    mlm = make_masked_lm("bert", root / "router-mlm")
    document = MLMTransformer(str(mlm))
    router = Router.for_query_document(query_modules=[SparseStaticEmbedding(tokenizer=document.tokenizer)],
                                       document_modules=[document, SpladePooling("max")])
    out = root / "router"
    SparseEncoder(modules=[router], device="cpu").save(str(out))
    with pytest.raises(CheckpointError, match=r"SparseEncoder modules \['sentence_transformers\.[\w.]*Router'\] are "
                       "not supported"):
        load_checkpoint(out)


def test_refuses_a_transformer_that_gives_no_logits(root):
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SpladePooling, Transformer

    mlm = make_masked_lm("bert", root / "features-mlm")
    out = root / "features"
    SparseEncoder(modules=[Transformer(str(mlm)), SpladePooling("max")], device="cpu").save(str(out))
    with pytest.raises(CheckpointError, match="transformer_task 'feature-extraction' before SpladePooling"):
        load_checkpoint(out)


def test_refuses_a_family_without_a_masked_lm_head(root):
    mlm = make_masked_lm("electra", root / "electra-mlm")
    with pytest.raises(CheckpointError, match="SPLADE needs the ELECTRA family's masked-LM head"):
        load_checkpoint(mlm, pooling="splade")


def test_refuses_missing_head_tensors(root, exports):
    """A SparseEncoder whose weights lost the head (saved by a tool that keeps the base model only)."""
    from safetensors.torch import load_file, save_file

    checkpoint, _ = exports("bert-max")
    copy = root / "headless"
    shutil.copytree(checkpoint, copy)
    weights = load_file(str(copy / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("cls.")}, str(copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['cls\.predictions\.transform\.dense\.weight'"):
        load_checkpoint(copy)


def test_pooling_option_needs_a_bare_masked_lm(root):
    dense = make_checkpoint("bert", root / "dense-bert")  # BertModel with modules.json (Transformer, Pooling mean)
    with pytest.raises(CheckpointError, match="a sentence-transformers model says how it pools"):
        load_checkpoint(dense, pooling="splade")
    bare = root / "bare-bert-model"
    shutil.copytree(dense, bare)
    (bare / "modules.json").unlink()
    with pytest.raises(CheckpointError, match="--pooling splade needs a \\*ForMaskedLM checkpoint.*'BertModel'"):
        load_checkpoint(bare, pooling="splade")


def test_a_pooling_module_cannot_say_splade(root):
    """Only SpladePooling gives SPLADE's pooling: sentence-transformers' Pooling module with such a mode is refused."""
    checkpoint = make_checkpoint("bert", root / "pooling-says-splade", pooling_format="v6")
    config = checkpoint / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_mode": "splade_max"}))
    with pytest.raises(CheckpointError, match=r"pooling \['splade_max'\] is not supported"):
        load_checkpoint(checkpoint)
