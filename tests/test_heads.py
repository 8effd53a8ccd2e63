"""Sequence-classification checkpoints of every family we load, as our encoder plus the family's head,
held against transformers' AutoModelForSequenceClassification (eval mode) on single texts and on text
pairs, through PyTorch and through the bundle's ONNX graphs; a one-label BERT against
sentence-transformers' CrossEncoder; and the errors a classifier can raise. Small random
checkpoints built locally by tests/families.py's make_classifier."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from bundle.contract import (
    CLASSIFIER_ENCODINGS_OUTPUT_NAMES,
    CLASSIFIER_OUTPUT_NAMES,
    DEFAULT_ATOL,
    DEFAULT_OPSET,
    DEFAULT_RTOL,
    GRAPH_FILE,
    encodings_file,
)
from bundle.manifest import BundleError, load_bundle
from export.checkpoint import CheckpointError, load_checkpoint
from export.pipeline import ExportOptions, build_bundle
from tests.families import MAX_TOKENS, classifier_labels, make_checkpoint, make_classifier

# one per family with a classifier: BERT, RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT, ELECTRA, MPNet, ModernBERT,
# GTE, NomicBert
FAMILIES = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra", "mpnet", "modernbert", "gte",
            "nomic")
ROTARY = ("modernbert", "gte", "nomic")
LABEL_COUNTS = (1, 3)  # a cross-encoder's single score, and a three-way classifier
PYTORCH_TOLERANCE = 1e-5
ONNX_TOLERANCE = 1e-4

SINGLES = [
    "Hello, world!",
    "The new movie is awesome, I loved every minute of it!",
    "Москва — столица России.",
    "",
    " ".join(["a long support ticket that keeps going and going"] * 20),  # cut at MAX_TOKENS
]
PAIRS = [
    ("What is the capital of France?", "Paris is the capital and largest city of France."),
    ("How do I reset my password?", "Refunds are issued to the original payment method within fourteen days."),
    ("Der Zug nach München fährt um acht Uhr ab.", "東京は日本の首都です。"),
    ("🙂 ok", "a"),
    ("a", " ".join(["a long support ticket that keeps going and going"] * 20)),  # the second side cut
    (" ".join(["a long question"] * 40), " ".join(["and a long answer"] * 40)),  # both cut, longest first
]
# a tensor of each family's head, as transformers names it, that the loader must not do without
HEAD_TENSORS = {
    "bert": "bert.pooler.dense.weight",
    "roberta": "classifier.out_proj.bias",
    "xlm-roberta": "classifier.dense.weight",
    "camembert": "classifier.out_proj.weight",
    "distilbert": "pre_classifier.bias",
    "mpnet": "classifier.dense.bias",
    "electra": "classifier.dense.bias",
    "modernbert": "head.norm.weight",
    "gte": "gte.pooler.dense.weight",
    "nomic": "classifier.bias",
}


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory) -> dict[tuple[str, int], Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {(f, n): make_classifier(f, root / f"{f}-{n}", n) for f in FAMILIES for n in LABEL_COUNTS}


@pytest.fixture(scope="module")
def references() -> dict:
    return {}


def encode(tokenizer_path: Path, pad_id: int, inputs: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Texts or (text, text) pairs as the tokenizer's post-processor encodes them, the longer side of a pair
    truncated first, right-padded: (input_ids, attention_mask, token_type_ids)."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.enable_truncation(MAX_TOKENS, strategy="longest_first")
    tokenizer.enable_padding(pad_id=pad_id)
    encodings = tokenizer.encode_batch(inputs)
    fields = ("ids", "attention_mask", "type_ids")
    return tuple(torch.tensor([getattr(e, field) for e in encodings]) for field in fields)


def reference_logits(directory: Path, family: str, batch: tuple[torch.Tensor, ...], cache: dict) -> torch.Tensor:
    """transformers' own classifier of the checkpoint, in eval mode, on a padded batch."""
    from transformers import AutoModelForSequenceClassification

    ids, mask, types = batch
    key = (str(directory), ids.numpy().tobytes())
    if key not in cache:
        model = AutoModelForSequenceClassification.from_pretrained(str(directory), attn_implementation="eager").eval()
        # DistilBERT takes no token types; the RoBERTa family's are all 0, as its post-processor writes them
        extra = {} if family in ("distilbert", "modernbert") else {"token_type_ids": types}
        with torch.no_grad():
            cache[key] = model(input_ids=ids, attention_mask=mask, **extra).logits
    return cache[key]


def batches(tokenizer_path: Path, pad_id: int) -> dict[str, tuple[torch.Tensor, ...]]:
    return {"singles": encode(tokenizer_path, pad_id, SINGLES), "pairs": encode(tokenizer_path, pad_id, PAIRS)}


@pytest.mark.parametrize("num_labels", LABEL_COUNTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_our_logits_are_transformers_on_texts_and_pairs(family, num_labels, classifiers, references):
    directory = classifiers[family, num_labels]
    ckpt = load_checkpoint(directory)
    assert ckpt.task == "classification" and ckpt.ignored == ()
    assert ckpt.classifier.labels == tuple(classifier_labels(num_labels))
    assert ckpt.classifier.problem_type == ("regression" if num_labels == 1 else "single_label_classification")
    for kind, batch in batches(ckpt.tokenizer_path, ckpt.config.pad_token_id).items():
        ids, mask, types = batch
        assert mask.sum(1).max() == MAX_TOKENS and not mask.all()  # one row cut at the limit, the rest padded
        if kind == "pairs" and family in ("bert", "electra"):
            assert types.max() == 1  # segment B, as BERT's post-processor marks the second text
        with torch.no_grad():
            hidden, logits, attentions = ckpt.encoder(ids, mask, types)
        assert logits.shape == (len(ids), num_labels) and hidden.shape[:2] == ids.shape
        expected = reference_logits(directory, family, batch, references)
        torch.testing.assert_close(logits, expected, atol=PYTORCH_TOLERANCE, rtol=0, msg=f"{kind}")


def check_classifier_bundle(out: Path, family: str, num_labels: int, directory: Path, cache: dict,
                            problem_type: str | None = None) -> None:
    """A published classifier bundle: verified by the service's loader, its manifest saying task, labels and
    problem_type, both fp32 graphs giving transformers' logits on texts and pairs."""
    bundle = load_bundle(out)
    m = bundle.manifest
    assert (m.model.task, m.model.labels, m.model.problem_type) == (
        "classification", classifier_labels(num_labels),
        problem_type or ("regression" if num_labels == 1 else "single_label_classification"))
    raw = json.loads((out / "bundle.json").read_text())["model"]
    assert raw["task"] == "classification" and raw["labels"] == classifier_labels(num_labels)
    # ModernBERT's head reads the mean of the tokens (classifier_pooling), the others the first token
    pooling = "mean" if family == "modernbert" else "cls"
    assert (m.model.pooling, m.model.normalize, m.model.embedding_dim) == (pooling, False, None)
    assert tuple(m.graph.outputs) == CLASSIFIER_OUTPUT_NAMES and "fp32" in set(m.variants) <= {"fp32", "fp16", "bf16"}
    assert all(v.head_gate is not None and v.head_gate.passed for p, v in m.variants.items() if p != "fp32")
    assert tuple(m.variants["fp32"].outputs) == CLASSIFIER_ENCODINGS_OUTPUT_NAMES
    # the head leaves the optimizer's fusions as they are: every attention layer but ELECTRA's first, and
    # none of MPNet's or the RoPE families' (the optimizer's BERT attention pattern has no relative-position
    # bias and no rotation)
    assert m.variants["fp32"].fusions.get("Attention", 0) == {"electra": 1}.get(family, 0 if family in ("mpnet", *ROTARY) else 2)
    for report in (m.parity, m.variants["fp32"].parity):
        assert report.passed and "logits" in {o.output for o in report.outputs}
        assert all(o.values > 0 and o.max_abs_diff <= DEFAULT_ATOL for o in report.outputs)

    full = ort.InferenceSession(str(out / GRAPH_FILE), providers=["CPUExecutionProvider"])
    fused = ort.InferenceSession(str(out / encodings_file("fp32")), providers=["CPUExecutionProvider"])
    assert [o.name for o in full.get_outputs()] == list(CLASSIFIER_OUTPUT_NAMES)
    for kind, batch in batches(bundle.tokenizer_path, m.model.pad_token_id).items():
        assert torch.equal(batch[0], encode(directory / "tokenizer.json", m.model.pad_token_id, PAIRS if kind == "pairs"
                                            else SINGLES)[0])  # the bundle ships the checkpoint's tokenizer
        feed = dict(zip(("input_ids", "attention_mask", "token_type_ids"), (t.numpy() for t in batch)))
        expected = reference_logits(directory, family, batch, cache).numpy()
        for session in (full, fused):
            logits = session.run(["logits"], feed)[0]
            assert logits.shape == (len(batch[0]), num_labels)
            assert np.abs(logits - expected).max() <= ONNX_TOLERANCE, (kind, np.abs(logits - expected).max())


# One export per family, the label counts taken in turn (the PyTorch test above holds both counts of every
# family; the graph does not depend on the count); ELECTRA with three labels is exported by `python -m export`
# in test_export_cli_exports_a_classifier.
@pytest.mark.parametrize(("family", "num_labels"), [(f, LABEL_COUNTS[(i + 1) % 2]) for i, f in enumerate(FAMILIES)])
def test_bundle_graphs_give_the_logits_and_pass_parity(family, num_labels, classifiers, references, tmp_path):
    out = tmp_path / "bundle"
    lines: list[str] = []
    build_bundle(ExportOptions(str(classifiers[family, num_labels]), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL,
                               lossy=()), progress=lines.append)  # lossy variants: tests/test_fidelity_gates.py
    assert "[5/7] lossy variants (none): head gate: logits within 0.1 of PyTorch fp32, labels and each query's " \
           "ranking kept" in lines
    check_classifier_bundle(out, family, num_labels, classifiers[family, num_labels], references)


def test_export_cli_exports_a_classifier(tmp_path, references):
    """What `make export CHECKPOINT=DIR` runs, on an ELECTRA classifier whose config names its problem_type."""
    directory = make_classifier("electra", tmp_path / "electra-cls", 3, problem_type="multi_label_classification")
    out = tmp_path / "bundles" / "electra-cls"
    result = subprocess.run([sys.executable, "-m", "export", "--checkpoint", str(directory), "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "(ElectraForSequenceClassification)" in result.stdout
    assert ("task classification: 3 label(s) ['label_0', 'label_1', 'label_2'], "
            "problem_type multi_label_classification") in result.stdout
    assert "lossy variants fp16, bf16: head gate: logits within 0.1 of PyTorch fp32" in result.stdout
    assert result.stdout.count("parity PASSED") == 3  # the full, fp32 encodings and packed graphs
    assert f"published {out}: model electra-cls (classification)" in result.stdout
    check_classifier_bundle(out, "electra", 3, directory, references, problem_type="multi_label_classification")


def test_one_label_bert_is_what_sentence_transformers_cross_encoder_predicts(classifiers, tmp_path):
    """CrossEncoder applies Sigmoid to a one-label model's logit by default (no activation_fn saved);
    a CrossEncoder saved again (modules.json with its Transformer module only) loads as the same classifier."""
    from sentence_transformers import CrossEncoder

    directory = classifiers["bert", 1]
    ckpt = load_checkpoint(directory)
    ids, mask, types = encode(ckpt.tokenizer_path, ckpt.config.pad_token_id, PAIRS)
    with torch.no_grad():
        _, logits, _ = ckpt.encoder(ids, mask, types)
    cross_encoder = CrossEncoder(str(directory), device="cpu")
    assert isinstance(cross_encoder.activation_fn, torch.nn.Sigmoid) and cross_encoder.max_length == MAX_TOKENS
    scores = cross_encoder.predict(PAIRS, batch_size=len(PAIRS), convert_to_tensor=True)
    torch.testing.assert_close(scores, torch.sigmoid(logits[:, 0]), atol=PYTORCH_TOLERANCE, rtol=0)

    cross_encoder.save(str(tmp_path / "saved"))
    assert [m["type"].rsplit(".", 1)[-1] for m in json.loads((tmp_path / "saved" / "modules.json").read_text())] == \
        ["Transformer"]
    again = load_checkpoint(tmp_path / "saved")
    with torch.no_grad():
        torch.testing.assert_close(again.encoder(ids, mask, types)[1], logits, atol=0, rtol=0)


def save_with_identity(directory: Path) -> None:
    """As people save an MS MARCO-style model: CrossEncoder(..., activation_fn=Identity()).save()."""
    from sentence_transformers import CrossEncoder

    CrossEncoder(str(directory), device="cpu", activation_fn=torch.nn.Identity()).save(str(directory))


def edit_config(**entries):
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(config | entries))
    return edit


@pytest.mark.parametrize(("save", "expected"), [
    (save_with_identity, "identity"),
    (edit_config(sentence_transformers={"activation_fn": "torch.nn.modules.activation.Tanh"}), "tanh"),
    (edit_config(sbert_ce_default_activation_function="torch.nn.modules.linear.Identity"), "identity"),
    (lambda directory: None, "sigmoid"),
], ids=["saved-by-cross-encoder", "config-sentence-transformers", "config-sbert-ce-default", "none-saved"])
def test_the_score_activation_is_the_one_cross_encoder_applies(save, expected, classifiers, tmp_path):
    """Wherever sentence-transformers 6 reads a CrossEncoder's activation_fn, the export reads it too, and
    CrossEncoder.predict is that activation of our logit (MS MARCO cross-encoders save Identity)."""
    from sentence_transformers import CrossEncoder

    directory = shutil.copytree(classifiers["bert", 1], tmp_path / "ce")
    save(directory)
    ckpt = load_checkpoint(directory)
    assert ckpt.classifier.score_activation == expected
    ids, mask, types = encode(ckpt.tokenizer_path, ckpt.config.pad_token_id, PAIRS)
    with torch.no_grad():
        logit = ckpt.encoder(ids, mask, types)[1][:, 0]
    ours = {"identity": logit, "tanh": torch.tanh(logit), "sigmoid": torch.sigmoid(logit)}[expected]
    predicted = CrossEncoder(str(directory), device="cpu").predict(PAIRS, batch_size=len(PAIRS), convert_to_tensor=True)
    torch.testing.assert_close(predicted, ours, atol=PYTORCH_TOLERANCE, rtol=0)


def test_an_activation_the_service_cannot_apply_is_refused_by_name(classifiers, tmp_path):
    directory = shutil.copytree(classifiers["bert", 1], tmp_path / "ce")
    save_with_identity(directory)
    st_config = directory / "config_sentence_transformers.json"
    st_config.write_text(json.dumps(json.loads(st_config.read_text()) | {"activation_fn": "torch.nn.modules.activation.Softplus"}))
    with pytest.raises(CheckpointError, match=r"config_sentence_transformers.json: activation_fn "
                                              r"'torch.nn.modules.activation.Softplus' is not supported; .*Identity"):
        load_checkpoint(directory)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_missing_head_tensor_is_an_error_naming_it(family, classifiers, tmp_path):
    directory = shutil.copytree(classifiers[family, 3], tmp_path / family)
    weights = load_file(str(directory / "model.safetensors"))
    del weights[HEAD_TENSORS[family]]
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(HEAD_TENSORS[family]) + ".* classification head"):
        load_checkpoint(directory)


def test_labels_come_from_id2label_in_id_order_and_problem_type_from_the_config(tmp_path):
    directory = make_classifier("roberta", tmp_path / "twelve", 12, problem_type="multi_label_classification")
    config = json.loads((directory / "config.json").read_text())
    # ids in an order neither numeric nor textual: the labels follow the ids, not the file
    config["id2label"] = dict(sorted(config["id2label"].items(), key=lambda item: -int(item[0])))
    (directory / "config.json").write_text(json.dumps(config))
    ckpt = load_checkpoint(directory)
    assert ckpt.classifier.labels == tuple(f"label_{i}" for i in range(12))
    assert ckpt.classifier.problem_type == "multi_label_classification"

    config["problem_type"] = "ranking"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="problem_type 'ranking' is not one of"):
        load_checkpoint(directory)


def test_electra_head_is_exact_gelu_whatever_the_encoder_activation(tmp_path, references):
    """transformers' ElectraClassificationHead calls get_activation("gelu"), not the config's hidden_act."""
    directory = make_classifier("electra", tmp_path / "electra-relu", 3)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"hidden_act": "relu"}))
    ckpt = load_checkpoint(directory)
    assert ckpt.config.activation == "relu" and ckpt.classifier.activation == "gelu"
    batch = encode(ckpt.tokenizer_path, ckpt.config.pad_token_id, PAIRS)
    with torch.no_grad():
        logits = ckpt.encoder(*batch)[1]
    torch.testing.assert_close(logits, reference_logits(directory, "electra", batch, references),
                               atol=PYTORCH_TOLERANCE, rtol=0)


def test_a_classifier_with_embedding_modules_is_refused(classifiers, tmp_path):
    directory = shutil.copytree(classifiers["bert", 3], tmp_path / "with-pooling")
    shutil.copy(make_checkpoint("bert", tmp_path / "embedding") / "modules.json", directory / "modules.json")
    with pytest.raises(CheckpointError, match=r"module\(s\) \['sentence_transformers.models.Pooling'\] after a "
                                              r"sequence classifier are not supported"):
        load_checkpoint(directory)


@pytest.fixture(scope="module")
def classifier_bundle(classifiers, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("classifier-bundle") / "bundle"
    build_bundle(ExportOptions(str(classifiers["distilbert", 3]), out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL,
                               lossy=()), progress=lambda _: None)
    return out


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["model"].update(labels=["a", "b"]),
     r"2 label\(s\) \['a', 'b'\], but the graph's logits have 3 column\(s\)"),
    (lambda m: m["model"].update(labels=None), "a classifier has all three, an embedding model none"),
    (lambda m: m["model"].update(task="embedding"), "a classifier has all three, an embedding model none"),
    (lambda m: m["model"].update(score_activation="softplus"), "score_activation"),
    (lambda m: m.update(schema_version=4) or m["model"].pop("score_activation"),
     "manifest schema 4, this service reads 8; export the bundle again"),
    (lambda m: m["graph"].update(outputs=["last_hidden_state", "sentence_embedding", "attentions"]),
     "is not the contract .* of a classification model"),
    (lambda m: m["variants"].update(int8=m["variants"]["fp32"] | {"precision": "int8"}),
     r"variant\(s\) \['int8'\] of a classifier"),
], ids=["labels-vs-logits", "no-labels", "task-embedding", "unknown-activation", "schema-4-classifier",
        "embedding-outputs", "lossy-variant"])
def test_loader_refuses_a_classifier_manifest_that_does_not_fit(edit, message, classifier_bundle, tmp_path):
    copy = shutil.copytree(classifier_bundle, tmp_path / "bundle")
    load_bundle(copy)
    manifest = json.loads((copy / "bundle.json").read_text())
    edit(manifest)
    (copy / "bundle.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=message):
        load_bundle(copy)
