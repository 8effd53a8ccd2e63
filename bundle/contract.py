"""The ONNX I/O contract, written once and shared by the exporter and the service."""

from __future__ import annotations

from typing import Final

# Input names follow the BERT/transformers convention so that tooling written for
# Hugging Face ONNX graphs (and our tokenizer output) feeds them without renaming.
INPUT_NAMES: Final = ("input_ids", "attention_mask", "token_type_ids")
# attentions is [layers, batch, heads, seq, seq]: one tensor, so the graph has a fixed
# number of outputs whatever the depth of the model.
OUTPUT_NAMES: Final = ("last_hidden_state", "sentence_embedding", "attentions")

# The encodings-only graphs (fused attention cannot expose its probabilities) return the
# first two outputs, under the same names.
ENCODINGS_OUTPUT_NAMES: Final = OUTPUT_NAMES[:2]

# A sequence classifier (a cross-encoder with one label) returns its head's logits, (batch, labels),
# where an embedding model returns the sentence embedding; everything else is the same.
CLASSIFIER_OUTPUT_NAMES: Final = ("last_hidden_state", "logits", "attentions")
CLASSIFIER_ENCODINGS_OUTPUT_NAMES: Final = CLASSIFIER_OUTPUT_NAMES[:2]


def output_names(task: str) -> tuple[str, ...]:
    """The full graph's outputs for a task."""
    return {"embedding": OUTPUT_NAMES, "classification": CLASSIFIER_OUTPUT_NAMES}[task]


def encodings_output_names(task: str) -> tuple[str, ...]:
    """The encodings-only graphs' outputs for a task."""
    return {"embedding": ENCODINGS_OUTPUT_NAMES, "classification": CLASSIFIER_ENCODINGS_OUTPUT_NAMES}[task]


# The packed graph: several texts in one row, no padding (export.encoder.Encoder.packed). Inputs
# are (1, tokens) but pool_weights, (texts, tokens); its one output is the pooled one, (texts, dim).
PACKED_INPUT_NAMES: Final = ("input_ids", "token_type_ids", "position_ids", "segment_ids", "pool_weights")
PACKED_FILE: Final = "packed-fp32.onnx"
# what one pooling matrix can say (max pooling cannot): a weight per token of each text
PACKED_POOLINGS: Final = ("mean", "cls", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


def packed_output_names(task: str) -> tuple[str, ...]:
    """The packed graph's output: the sentence embedding, or a classifier's logits."""
    return encodings_output_names(task)[1:]


PACKED_DYNAMIC_AXES: Final = {
    "input_ids": {1: "tokens"},
    "token_type_ids": {1: "tokens"},
    "position_ids": {1: "tokens"},
    "segment_ids": {1: "tokens"},
    "pool_weights": {0: "texts", 1: "tokens"},
    "sentence_embedding": {0: "texts"},
    "logits": {0: "texts"},
}

DYNAMIC_AXES: Final = {
    "input_ids": {0: "batch", 1: "seq"},
    "attention_mask": {0: "batch", 1: "seq"},
    "token_type_ids": {0: "batch", 1: "seq"},
    "last_hidden_state": {0: "batch", 1: "seq"},
    "sentence_embedding": {0: "batch"},
    "logits": {0: "batch"},
    "attentions": {1: "batch", 3: "seq", 4: "seq"},
}

# Opset 17 is the oldest with LayerNormalization as one op; 18 is the one torch's
# torch.export-based exporter emits natively (lower opsets go through a version converter).
DEFAULT_OPSET: Final = 18
MIN_OPSET: Final = 17

# fp32 parity tolerances: tight enough that a wrong mask, a wrong scale or a swapped
# weight fails (those move values by 1e-2 and more), loose enough for the reordered
# float sums that onnxruntime kernels do (observed around 1e-6).
DEFAULT_ATOL: Final = 1e-4
DEFAULT_RTOL: Final = 1e-4

BUNDLE_MANIFEST: Final = "bundle.json"
GRAPH_FILE: Final = "model.onnx"
# Encodings-only graph of each precision: encodings-fp32.onnx, encodings-int8.onnx, encodings-fp16.onnx
PRECISIONS: Final = ("fp32", "int8", "fp16")


def encodings_file(precision: str) -> str:
    return f"encodings-{precision}.onnx"


# Lossy precisions are gated against fp32 PyTorch on a probe corpus and a labelled retrieval set:
# mean cosine over the corpus, and a floor no single text may fall below (one-word texts move
# most under int8: measured 0.96 for "yes" with per-channel dynamic int8).
DEFAULT_MEAN_COSINE: Final = 0.99
DEFAULT_COSINE_FLOOR: Final = 0.95
TOKENIZER_FILE: Final = "tokenizer.json"
