"""bundle.json: one definition of the manifest, and a loader that verifies a bundle.

The exporter writes a `BundleManifest`; the service calls `load_bundle` and refuses to
start on any `BundleError`. Nothing here imports torch or onnxruntime.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bundle.contract import (
    BUNDLE_MANIFEST,
    INPUT_NAMES,
    MIN_OPSET,
    PACKED_INPUT_NAMES,
    PACKED_POOLINGS,
    encodings_output_names,
    output_names,
    packed_output_names,
)

# 2: encodings-only graph variants (fp32 fused, int8, fp16) beside the full graph
# 3: bf16 (OpenVINO), a variant's runtime, and the attention gate of a precision
# 4: the packed graph (several texts in one row, no padding)
# 5: a classifier's score activation (CrossEncoder.predict's); schema 3 and 4 embedding bundles are still read,
#    a classifier of schema 3 or 4 must be exported again (its rerank scores assumed a sigmoid)
# 7: a model's sparse and multi-vector representations (ModelInfo.sparse, .multivector) and their gates
# 8: lossy variants of classifiers (VariantInfo.head_gate), the floor `auto` holds a lossy variant to
#    (QualityGate.auto_min_cosine) and the token encodings' gate (QualityGate.tokens); schema 3 to 7 bundles are
#    read, their variants held to AUTO_MIN_COSINE
SCHEMA_VERSION = 8
# sentence-transformers 6's pooling modes (its Pooling module), one per model; splade_max and splade_sum are
# SparseEncoder's SpladePooling (the masked-LM head's logits per token, log(1 + relu), max or sum over real
# tokens): the graph's pooled output is then one weight per vocabulary entry
Pooling = Literal["mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken", "splade_max",
                  "splade_sum"]
SPLADE_POOLINGS = ("splade_max", "splade_sum")
# what a model can return for a text: one pooled vector, one weight per vocabulary entry, one vector per token
Representation = Literal["dense", "sparse", "multivector"]
REPRESENTATIONS: tuple[str, ...] = ("dense", "sparse", "multivector")
# the arrays of the token-level heads the service applies to last_hidden_state (numpy, bundle/representations.py)
HEADS_FILE = "representations.npz"
Precision = Literal["fp32", "int8", "fp16", "bf16"]
RuntimeName = Literal["onnxruntime", "openvino"]
Task = Literal["embedding", "classification"]
# transformers' config.problem_type: how the logits are read (softmax, sigmoid per label, a value)
ProblemType = Literal["single_label_classification", "multi_label_classification", "regression"]
# what sentence-transformers' CrossEncoder.predict applies to the logits: its activation_fn, saved with the model
ScoreActivation = Literal["sigmoid", "identity", "tanh"]


class BundleError(Exception):
    """A bundle that must not be served; the message is one line naming the file and reason."""


class _Strict(BaseModel):
    # Unknown keys are a sign of a manifest from another version: refuse, don't guess.
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class OutputParity(_Strict):
    """One line of the parity table: how far onnxruntime is from PyTorch on one output."""

    output: str
    shape: str
    probes: int = Field(ge=0, description="probe batches compared")
    values: int = Field(ge=0, description="real (unpadded) values compared")
    max_abs_diff: float
    max_rel_diff: float
    atol: float
    rtol: float
    passed: bool
    problems: list[str] = Field(default_factory=list)


class ParityReport(_Strict):
    passed: bool
    reference: str = "pytorch"
    candidate: str = "onnxruntime"
    provider: str
    probe_shapes: list[tuple[int, int]] = Field(description="(batch, seq) of each probe batch")
    outputs: list[OutputParity]


def parity_lines(report: ParityReport) -> list[str]:
    """The parity table, one line per output, then one line per problem."""
    lines = [
        f"{'output':<20} {'shape':<34} {'values':>10} {'max_abs':>9} {'max_rel':>9}  result",
    ]
    for o in report.outputs:
        lines.append(
            f"{o.output:<20} {o.shape:<34} {o.values:>10} {o.max_abs_diff:>9.2e} {o.max_rel_diff:>9.2e}  "
            f"{'PASS' if o.passed else 'FAIL'} (atol {o.atol:g}, rtol {o.rtol:g})"
        )
        lines.extend(f"    {o.output}: {problem}" for problem in o.problems)
    lines.append(
        f"parity {'PASSED' if report.passed else 'FAILED'}: {len(report.probe_shapes)} probes "
        f"(batch, seq) {report.probe_shapes} on {report.provider}"
    )
    return lines


class RepresentationGate(_Strict):
    """One lossy gate of a sparse or multi-vector output against fp32 PyTorch: a sparse vector's cosine and
    the overlap of its top terms; a multi-vector's MaxSim scores (their relative error and the order they
    give each query's documents)."""

    representation: Representation
    metric: str = Field(description="what was measured, in words")
    value: float
    required: float
    passed: bool


# The fidelity `auto` holds a lossy variant to: every probe text's embedding within cosine 0.999 of PyTorch fp32's
# (the export gate's floor, DEFAULT_COSINE_FLOOR, is 0.95). A variant that passed its gate but not this is
# published and served when asked for by name (`precision: bf16`), never by `auto`.
AUTO_MIN_COSINE = 0.999


class TokenGate(_Strict):
    """A lossy variant's token encodings (last_hidden_state: /v1/encode's token outputs) against PyTorch fp32:
    the cosine of every real token's vector, the smallest over all tokens of the gate's texts."""

    tokens: int = Field(ge=0, description="real (unpadded) tokens compared")
    min_cosine: float
    mean_cosine: float
    min_cosine_required: float
    passed: bool


class HeadGate(_Strict):
    """The gate of a classifier's lossy variant: its logits against PyTorch fp32 on probe inputs (texts for a
    classifier of several labels, (query, document) pairs for a cross-encoder of one): every logit within
    `atol`, every label (argmax) unchanged, and each query's order of its documents CrossEncoder's (documents
    the reference scores within `atol` of each other are ties)."""

    passed: bool
    reference: str = "pytorch fp32"
    provider: str
    inputs: Literal["texts", "pairs"]
    count: int = Field(ge=0, description="probe texts or pairs compared")
    max_abs_diff: float = Field(description="the largest |candidate logit - reference logit|")
    atol: float
    labels: int = Field(ge=0, description="inputs whose argmax label is the reference's (several labels)")
    queries: int = Field(ge=0, description="queries whose documents were ranked (pairs)")
    rankings_kept: int = Field(ge=0, description="queries whose documents the candidate orders as the reference")
    problems: list[str] = Field(default_factory=list)


class QualityGate(_Strict):
    """The gate of a lossy variant: embeddings close to fp32 PyTorch, and retrieval unchanged.

    Cosine per probe text against the reference embedding (mean over the corpus, and a floor
    for every single text); on a small labelled retrieval set,
    every query's top-ranked document must be the reference's, and no query the reference
    answers correctly may be lost.
    """

    passed: bool
    reference: str = "pytorch fp32"
    provider: str
    texts: int = Field(ge=0, description="probe texts compared")
    min_cosine: float
    mean_cosine: float
    mean_cosine_required: float
    min_cosine_floor: float
    queries: int = Field(ge=0, description="labelled retrieval queries")
    top1_agreement: int = Field(ge=0, description="queries whose top document is the reference's")
    reference_hits: int = Field(ge=0, description="queries the reference ranks the labelled document first")
    candidate_hits: int = Field(ge=0, description="queries the candidate ranks the labelled document first")
    problems: list[str] = Field(default_factory=list)
    representations: list[RepresentationGate] = Field(
        default_factory=list, description="the gates of the sparse and multi-vector outputs of this variant")
    auto_min_cosine: float = Field(
        AUTO_MIN_COSINE, description="the smallest min_cosine with which `auto` serves this variant; below it, "
        "only a request for the precision by name does")
    tokens: TokenGate | None = Field(None, description="the token encodings' gate (null: measured before schema 8)")


def quality_line(precision: str, gate: QualityGate) -> str:
    """One line: the lossy variant's gate figures and verdict."""
    return (
        f"{precision}: cosine vs {gate.reference} mean {gate.mean_cosine:.5f} (>= {gate.mean_cosine_required:g}), "
        f"min {gate.min_cosine:.5f} (>= {gate.min_cosine_floor:g}) over {gate.texts} texts; retrieval top-1 agreement "
        f"{gate.top1_agreement}/{gate.queries}, labelled hits {gate.candidate_hits} vs {gate.reference_hits}: "
        f"{'PASS' if gate.passed else 'FAIL'}" + "".join(f"; {p}" for p in gate.problems)
        + "".join(f"; {g.representation} {g.metric} {g.value:.5f} (required {g.required:g}): "
                  f"{'PASS' if g.passed else 'FAIL'}" for g in gate.representations)
        + (f"; token encodings min cosine {gate.tokens.min_cosine:.5f} (>= {gate.tokens.min_cosine_required:g}) over "
           f"{gate.tokens.tokens} tokens: {'PASS' if gate.tokens.passed else 'FAIL'}" if gate.tokens else "")
        + f"; auto serves it: {'yes' if gate.min_cosine >= gate.auto_min_cosine else 'no'} "
          f"(min cosine >= {gate.auto_min_cosine:g})"
    )


def head_line(precision: str, gate: HeadGate) -> str:
    """One line: a classifier's lossy variant's head gate figures and verdict."""
    return (
        f"{precision}: logits vs {gate.reference} on {gate.count} {gate.inputs}, max abs diff {gate.max_abs_diff:.2e} "
        f"(<= {gate.atol:g})" + (f", labels kept {gate.labels}/{gate.count}" if gate.inputs == "texts" else
                                 f", rankings kept {gate.rankings_kept}/{gate.queries}")
        + f": {'PASS' if gate.passed else 'FAIL'}" + "".join(f"; {p}" for p in gate.problems)
    )


class VariantInfo(_Strict):
    """An encodings-only graph (no attention weights), optimised for speed, at one precision."""

    file: str
    precision: Precision
    opset: int = Field(ge=MIN_OPSET)
    inputs: list[str]
    outputs: list[str]
    optimizer: str = Field(description="what rewrote the graph after export")
    fusions: dict[str, int] = Field(description="fused operators the optimizer produced, by type")
    providers: list[str] = Field(description="execution providers this variant is meant for")
    runtime: RuntimeName = Field(
        "onnxruntime", description="what runs it: onnxruntime, or OpenVINO (bf16: the fp32 file, compiled with "
        "INFERENCE_PRECISION_HINT=bf16)")
    parity: ParityReport | None = Field(None, description="strict gate vs PyTorch (fp32)")
    quality: QualityGate | None = Field(None, description="cosine/retrieval gate vs PyTorch (lossy precisions)")
    attention_gate: ParityReport | None = Field(
        None, description="the full graph's attention weights at this precision vs PyTorch fp32 (1e-3 absolute): "
        "requests for attention weights run at this precision only if it passed, else on the fp32 graph")
    head_gate: HeadGate | None = Field(None, description="a classifier's logits vs PyTorch fp32 (lossy precisions)")

    @property
    def passed(self) -> bool:
        gates = [g for g in (self.parity, self.quality, self.head_gate) if g is not None]
        return bool(gates) and all(g.passed for g in gates)

    @property
    def auto_verdict(self) -> tuple[bool, str]:
        """Whether `auto` may serve this variant, and why, with the figure: fp32 always; a lossy variant only
        where its gate holds the model's fidelity (an embedding's min cosine >= its auto_min_cosine and its
        token encodings' gate passed; a classifier's head gate passed)."""
        if self.precision == "fp32":
            return True, "fp32"
        if self.head_gate is not None:
            g = self.head_gate
            return g.passed, (f"its head gate: logits within {g.max_abs_diff:.2e} of PyTorch fp32 (<= {g.atol:g}), "
                              f"labels and rankings kept" if g.passed else f"its head gate failed ({g.problems})")
        q = self.quality
        if q is None:
            return False, "no quality gate"
        if q.min_cosine < q.auto_min_cosine:
            return False, (f"its gate's min cosine {q.min_cosine:.5f} vs PyTorch fp32 is below the {q.auto_min_cosine:g} "
                           f"auto holds the model to (it passed the export gate: served only when asked for by name)")
        if q.tokens is not None and not q.tokens.passed:
            return False, (f"its token encodings' min cosine {q.tokens.min_cosine:.5f} is below "
                           f"{q.tokens.min_cosine_required:g} (served only when asked for by name)")
        return True, f"its gate: min cosine {q.min_cosine:.5f} vs PyTorch fp32 (>= {q.auto_min_cosine:g})"


class PackedInfo(_Strict):
    """The packed fp32 graph: the texts of a run one after another in one row, each attending only
    its own tokens, pooled by a matrix; the service runs texts that need only their pooled output on
    it (on a CPU: onnxruntime fp32, or OpenVINO), so no work goes to padding."""

    file: str
    opset: int = Field(ge=MIN_OPSET)
    inputs: list[str]
    outputs: list[str]
    position_offset: int = Field(ge=0, description="a text's first position id (RoBERTa's padding_idx + 1; else 0)")
    parity: ParityReport = Field(description="its pooled output vs PyTorch's padded forward, texts packed as the "
                                 "service packs them (strict fp32 tolerances)")
    bf16: QualityGate | None = Field(
        None, description="OpenVINO bf16 on this graph vs PyTorch fp32 (the bf16 variant's gate); served in bf16 "
        "only if it passed, else bf16 runs stay padded")

    @property
    def passed(self) -> bool:
        return self.parity.passed


class SparseInfo(_Strict):
    """How a model gives one weight per vocabulary entry.

    - splade: the graph's pooled output (sentence_embedding, vocab_size wide) is the vector; zeros are
      left out by the service.
    - bge-m3: relu(last_hidden_state @ sparse.weight.T + sparse.bias) per token (HEADS_FILE), the largest
      weight per token id, the ids of `skip_ids` (its special tokens) left out (FlagEmbedding's BGEM3).
    """

    kind: Literal["splade", "bge-m3"]
    skip_ids: list[int] = Field(default_factory=list, description="token ids never given a weight (bge-m3)")


class MultiVectorInfo(_Strict):
    """How a model gives one vector per token (late interaction, scored by MaxSim).

    Each kept token's vector is last_hidden_state @ multivector.weight.T (+ multivector.bias, where
    HEADS_FILE has one), L2-normalised when `normalize`.

    - bge-m3: every token but the first `skip_leading` (its CLS), padding left out (FlagEmbedding's BGEM3).
    - colbert (PyLate's ColBERT.tokenize and encode): a text is cut to `query_length` - 1 tokens (a query)
      or `document_length` - 1 (a document), special tokens included; the marker's id is put after the
      first token; a query with `do_query_expansion` is padded with `expansion_token_id` to
      `query_length`, those tokens attended to only when `attend_to_expansion_tokens` (their vectors are
      kept either way); a document's tokens whose id is in `skip_ids` (its punctuation) are left out.
    """

    kind: Literal["colbert", "bge-m3"]
    dim: int = Field(gt=0, description="width of one token's vector")
    normalize: bool = True
    skip_leading: int = Field(0, ge=0, description="leading tokens never returned (bge-m3: its CLS)")
    query_prefix_id: int | None = Field(None, ge=0, description="ColBERT's query marker token ([Q] ), put second")
    document_prefix_id: int | None = Field(None, ge=0, description="ColBERT's document marker token ([D] ), put second")
    query_length: int | None = Field(None, gt=1, description="a query's length in tokens, marker included")
    document_length: int | None = Field(None, gt=1, description="a document's longest length, marker included")
    do_query_expansion: bool = Field(False, description="queries padded to query_length with expansion tokens")
    expansion_token_id: int | None = Field(None, ge=0, description="what a query is padded with ([MASK])")
    attend_to_expansion_tokens: bool = Field(False, description="false: expansion tokens are not attended to "
                                             "(their attention mask is 0); their vectors are returned either way")
    skip_ids: list[int] = Field(default_factory=list, description="a document's token ids left out (PyLate's "
                                "skiplist: punctuation)")


class ModelInfo(_Strict):
    name: str = Field(min_length=1, description="served model name (OpenAI `model`, v2 `{name}`)")
    architecture: str
    source: str = Field(description="checkpoint the bundle was exported from")
    hidden_size: int = Field(gt=0, description="width of the token encodings")
    embedding_dim: int | None = Field(
        None, gt=0, description="width of the sentence embedding when a Dense projection changes it; null: hidden_size"
    )
    dense_layers: int = Field(0, ge=0, description="Dense projections of the pooled embedding inside the graph")
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_tokens: int = Field(gt=0, description="longest input, in tokens incl. special tokens")
    pooling: Pooling
    normalize: bool
    pad_token_id: int = Field(ge=0)
    task: Task = Field(
        "embedding", description="embedding: the graphs return sentence_embedding; classification: a sequence "
        "classifier's logits (batch, labels) in its place")
    labels: list[str] | None = Field(
        None, min_length=1, description="classification: the name of each logits column (config.json's id2label, "
        "in id order)")
    problem_type: ProblemType | None = Field(
        None, description="classification: how the logits are read (config.json's problem_type, or transformers' "
        "rule: regression for one label, else single_label_classification)")
    score_activation: ScoreActivation | None = Field(
        None, description="classification: what sentence-transformers' CrossEncoder.predict applies to the logits, "
        "and so /v1/rerank's relevance_score (the activation_fn saved with the model; none saved: sigmoid for one "
        "label, identity otherwise)")

    prompts: dict[str, str] = Field(
        default_factory=dict, description="sentence-transformers' prompts (config_sentence_transformers.json): name "
        "-> text put before an input; requests pick one by prompt_name or input_type")
    default_prompt_name: str | None = Field(None, description="the prompt used when a request names none")
    prompt_tokens: dict[str, int] = Field(
        default_factory=dict, description="each prompt's length in tokens as sentence-transformers counts it (a "
        "trailing special token left out): what pooling skips when include_prompt is false")
    include_prompt: bool = Field(True, description="false: a prompt's tokens are left out of pooling (the Pooling "
                                 "module's include_prompt)")
    matryoshka: bool = Field(False, description="trained to be cut: `dimensions` may shorten the embedding")
    matryoshka_dimensions: list[int] | None = Field(
        None, description="the sizes it may be cut to, largest first; null: any size (when matryoshka)")
    dense: bool = Field(True, description="the pooled output is a dense embedding clients may ask for (false for a "
                        "SPLADE model, whose pooled output is its sparse vector, and for a ColBERT, whose graph "
                        "pools nothing it was trained for)")
    sparse: SparseInfo | None = Field(None, description="the sparse representation, where the model has one")
    multivector: MultiVectorInfo | None = Field(None, description="the multi-vector representation, where the model "
                                                "has one")

    @property
    def representations(self) -> list[str]:
        """What the model gives: dense, sparse, multivector, in that order."""
        return [name for name, has in (("dense", self.dense and self.task == "embedding"),
                                       ("sparse", self.sparse is not None),
                                       ("multivector", self.multivector is not None)) if has]

    @property
    def needs_heads(self) -> bool:
        """Whether the service applies token-level heads from HEADS_FILE (bge-m3's sparse, any multi-vector)."""
        return self.multivector is not None or (self.sparse is not None and self.sparse.kind == "bge-m3")

    @model_validator(mode="after")
    def _representations(self) -> ModelInfo:
        """A SPLADE sparse output is the pooled vocabulary vector; representations belong to embedding models."""
        splade = self.pooling in SPLADE_POOLINGS
        if splade != (self.sparse is not None and self.sparse.kind == "splade"):
            raise ValueError(f"pooling {self.pooling!r} with sparse {self.sparse!r}: SPLADE pooling and a splade sparse "
                             "output go together")
        if splade and (self.dense or self.sentence_dim != self.vocab_size):
            raise ValueError("a SPLADE model's pooled output is its sparse vector: dense false, and one weight per "
                             f"vocabulary entry ({self.vocab_size}), not {self.sentence_dim}")
        if (self.sparse or self.multivector) and self.task != "embedding":
            raise ValueError("sparse and multi-vector representations belong to embedding models, not classifiers")
        return self

    @model_validator(mode="after")
    def _sentence_conventions(self) -> ModelInfo:
        """A default prompt is one of the prompts, every prompt has its length, listed sizes mean matryoshka."""
        if self.default_prompt_name is not None and self.default_prompt_name not in self.prompts:
            raise ValueError(f"default_prompt_name {self.default_prompt_name!r} is not one of the prompts "
                             f"{sorted(self.prompts)}")
        if set(self.prompt_tokens) != set(self.prompts):
            raise ValueError(f"prompt_tokens {sorted(self.prompt_tokens)} do not name the prompts {sorted(self.prompts)}")
        if self.matryoshka_dimensions is not None and (not self.matryoshka or not self.matryoshka_dimensions or any(
                not 0 < d <= self.sentence_dim for d in self.matryoshka_dimensions)):
            raise ValueError(f"matryoshka_dimensions {self.matryoshka_dimensions} need matryoshka true and sizes "
                             f"from 1 to {self.sentence_dim}")
        return self

    @model_validator(mode="after")
    def _task_fields(self) -> ModelInfo:
        """labels, problem_type and score_activation belong to classifiers, and every classifier has them."""
        classifier = self.task == "classification"
        fields = (self.labels, self.problem_type, self.score_activation)
        if any(classifier != (f is not None) for f in fields):
            raise ValueError(f"task {self.task!r} with labels {self.labels!r}, problem_type {self.problem_type!r} "
                             f"and score_activation {self.score_activation!r}: a classifier has all three, an "
                             "embedding model none")
        return self

    @property
    def sentence_dim(self) -> int:
        """Size of the sentence embedding the graph returns."""
        return self.embedding_dim or self.hidden_size


class GraphInfo(_Strict):
    file: str
    opset: int = Field(ge=MIN_OPSET)
    inputs: list[str]
    outputs: list[str]


class BundleManifest(_Strict):
    schema_version: Literal[3, 4, 5, 6, 7, 8] = SCHEMA_VERSION
    model: ModelInfo
    graph: GraphInfo = Field(description="the full graph: every output, attention weights included")
    tokenizer: str
    files: dict[str, FileEntry]
    parity: ParityReport
    variants: dict[Precision, VariantInfo] = Field(
        description="encodings-only graphs by precision; fp32 is always there, int8/fp16/bf16 when their gate "
        "passed"
    )
    packed: PackedInfo | None = Field(
        None, description="the packed fp32 graph; null: every run is padded (schema 3, a model pooled by max, or "
        "a packed graph that failed its parity gate)")
    versions: dict[str, str]
    created_at: str

    def write(self, directory: Path) -> Path:
        """Write bundle.json into `directory` and return its path."""
        path = directory / BUNDLE_MANIFEST
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
        return path


@dataclass(frozen=True)
class Bundle:
    """A verified bundle on disk: every file present and matching its hash."""

    root: Path
    manifest: BundleManifest

    @property
    def graph_path(self) -> Path:
        return self.root / self.manifest.graph.file

    def variant_path(self, precision: str) -> Path:
        return self.root / self.manifest.variants[precision].file

    @property
    def packed_path(self) -> Path | None:
        return self.root / self.manifest.packed.file if self.manifest.packed else None

    @property
    def tokenizer_path(self) -> Path:
        return self.root / self.manifest.tokenizer

    @property
    def sha256(self) -> str:
        """A short identity of the whole bundle: the hash of its manifest."""
        return sha256_file(self.root / BUNDLE_MANIFEST)


@functools.lru_cache(maxsize=4096)
def _verified_sha256(path: str, device: int, inode: int, size: int, mtime_ns: int) -> str:
    """A bundle file's sha256, hashed once per version of the file in this process: a model repository loads a
    bundle again after unloading it, and its 300 MB cost a third of a second to hash each time (all-MiniLM-L6-v2,
    2-core AMD EPYC). A file written again (a new export, a copy, a truncation) has a new inode, size or
    modification time, and is hashed again."""
    return sha256_file(Path(path))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so a large graph is not loaded whole."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_entry(path: Path) -> FileEntry:
    """Hash and size of one bundle file."""
    return FileEntry(sha256=sha256_file(path), bytes=path.stat().st_size)


# Where ONNX keeps tensors (onnx.proto's field numbers): the walk to every TensorProto that may name an external
# file. message -> {field: the message it holds}; ModelProto's graph and functions, a graph's nodes and initializers,
# a node's attributes, an attribute's tensors and subgraphs (If, Loop, Scan), a sparse tensor's values and indices.
_ONNX_FIELDS = {
    "model": {7: "graph", 25: "function"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "function": {7: "node"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {13: "entry"},  # external_data: StringStringEntryProto (key 1, value 2)
    "entry": {},
}


class _NotOnnx(ValueError):
    pass


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _NotOnnx("a varint runs past its message")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _external_locations(buf, start: int, end: int, kind: str, found: set[str]) -> None:
    """Add the `location` of every tensor under this message whose data lives in another file; protobuf's wire
    format is walked without copying, so a graph's weights (its raw_data) are skipped, not read."""
    pos, entry = start, {}
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(buf, pos, end)
            if pos + length > end:
                raise _NotOnnx(f"field {field} runs past its message")
            if kind == "entry" and field in (1, 2):
                entry[field] = bytes(buf[pos:pos + length]).decode("utf-8", "replace")
            elif (inner := _ONNX_FIELDS[kind].get(field)) is not None:
                _external_locations(buf, pos, pos + length, inner, found)
            pos += length
        else:
            raise _NotOnnx(f"wire type {wire}")
    if pos != end:
        raise _NotOnnx("a field runs past its message")
    if kind == "entry" and entry.get(1) == "location":
        found.add(entry.get(2, ""))


def external_data_files(graph: Path) -> set[str]:
    """The files an ONNX graph keeps tensors in besides itself (its external data's `location`s, relative to the
    graph's folder), read from the graph without onnx or onnxruntime and without loading its weights."""
    import mmap

    found: set[str] = set()
    with graph.open("rb") as fh:
        if graph.stat().st_size == 0:
            return found
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _external_locations(buf, 0, len(buf), "model", found)
    return found


def _check_external_data(root: Path, graph_file: str, manifest: BundleManifest, manifest_path: Path) -> None:
    """Every file a graph reads its weights from is inside the bundle and listed in 'files' (so hashed and
    verified): onnxruntime and OpenVINO load `<graph>.data` beside a large graph, and an unlisted one could be
    replaced without the manifest's hash noticing."""
    graph = root / graph_file
    try:
        locations = external_data_files(graph)
    except (_NotOnnx, RecursionError) as exc:
        raise BundleError(f"{graph}: not an ONNX graph ({exc})") from None
    for location in sorted(locations):
        name = Path(graph_file).parent / location
        if Path(location).is_absolute() or ".." in Path(location).parts:
            raise BundleError(f"{graph}: external data {location!r} is outside the bundle directory")
        if name.as_posix() not in manifest.files:
            raise BundleError(f"{graph}: external data {location} has no hash in 'files' ({BUNDLE_MANIFEST} must list "
                              "every file a graph reads)")


def _schema_version(path: Path) -> object:
    """The manifest's schema_version, if it is JSON with one (to name a version mismatch)."""
    try:
        return json.loads(path.read_bytes()).get("schema_version")
    except (ValueError, AttributeError):
        return None


def _logits_width(report: ParityReport) -> int | None:
    """The logits' last dimension as onnxruntime reported it to the parity gate, when it is fixed."""
    shape = next((o.shape for o in report.outputs if o.output == "logits"), "")
    last = shape.strip("()").split(",")[-1].strip()
    return int(last) if last.isdigit() else None


def _check_classifier(manifest: BundleManifest, manifest_path: Path) -> None:
    """One label per logits column, in both graphs; a lossy variant only with a head gate (logits compared)."""
    labels = manifest.model.labels or []
    for what, report in (("graph", manifest.parity), ("fp32 encodings graph", manifest.variants["fp32"].parity)):
        width = _logits_width(report)
        if width != len(labels):
            raise BundleError(
                f"{manifest_path}: {len(labels)} label(s) {labels}, but the {what}'s logits have "
                f"{width if width is not None else 'no fixed number of'} column(s)"
            )
    if lossy := sorted(p for p, v in manifest.variants.items() if p != "fp32" and v.head_gate is None):
        raise BundleError(f"{manifest_path}: variant(s) {lossy} of a classifier without a head gate (its logits "
                          "compared at that precision): export it again with this version")


def load_bundle(root: str | Path) -> Bundle:
    """Read and verify a bundle (schema, contract, file hashes); raise BundleError if unfit.

    A published bundle is a symlink to a versioned directory that a new export replaces: it is
    resolved once, here, so every file comes from the same version however the link moves."""
    root = Path(root).resolve()
    manifest_path = root / BUNDLE_MANIFEST
    if not root.is_dir():
        raise BundleError(f"{root}: bundle directory does not exist")
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: missing (not a bundle, or an export that did not finish)")
    try:
        manifest = BundleManifest.model_validate_json(manifest_path.read_bytes())
    except ValidationError as exc:
        version = _schema_version(manifest_path)
        if version is not None and version != SCHEMA_VERSION:
            raise BundleError(
                f"{manifest_path}: manifest schema {version}, this service reads {SCHEMA_VERSION}; "
                "export the bundle again with this version"
            ) from None
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise BundleError(
            f"{manifest_path}: invalid manifest at {where}: {first['msg']} ({exc.error_count()} error(s))"
        ) from None
    except ValueError as exc:
        raise BundleError(f"{manifest_path}: not valid JSON: {exc}") from None

    task = manifest.model.task
    full_outputs, fast_outputs = output_names(task), encodings_output_names(task)
    if tuple(manifest.graph.inputs) != INPUT_NAMES or tuple(manifest.graph.outputs) != full_outputs:
        raise BundleError(
            f"{manifest_path}: graph I/O {manifest.graph.inputs} -> {manifest.graph.outputs} "
            f"is not the contract {list(INPUT_NAMES)} -> {list(full_outputs)} of a {task} model"
        )
    if not manifest.parity.passed:
        raise BundleError(f"{manifest_path}: parity report says failed; this bundle must not be served")
    if "fp32" not in manifest.variants:
        raise BundleError(f"{manifest_path}: no fp32 encodings graph in 'variants'")
    for precision, variant in manifest.variants.items():
        if variant.precision != precision:
            raise BundleError(f"{manifest_path}: variant {precision!r} says precision {variant.precision!r}")
        if tuple(variant.inputs) != INPUT_NAMES or tuple(variant.outputs) != fast_outputs:
            raise BundleError(
                f"{manifest_path}: {precision} graph I/O {variant.inputs} -> {variant.outputs} is not the "
                f"contract {list(INPUT_NAMES)} -> {list(fast_outputs)} of a {task} model"
            )
        if not variant.passed:
            raise BundleError(f"{manifest_path}: the {precision} graph has no passing gate; it must not be served")
    if manifest.variants["fp32"].parity is None:
        raise BundleError(f"{manifest_path}: the fp32 encodings graph has no strict parity report")
    if task == "classification":
        _check_classifier(manifest, manifest_path)
    if manifest.model.needs_heads and HEADS_FILE not in manifest.files:
        raise BundleError(f"{manifest_path}: the model's token-level heads (sparse {manifest.model.sparse}, multivector "
                          f"{manifest.model.multivector}) need {HEADS_FILE}, which 'files' does not list")
    if (packed := manifest.packed) is not None:
        if tuple(packed.inputs) != PACKED_INPUT_NAMES or tuple(packed.outputs) != packed_output_names(task):
            raise BundleError(f"{manifest_path}: packed graph I/O {packed.inputs} -> {packed.outputs} is not the contract "
                              f"{list(PACKED_INPUT_NAMES)} -> {list(packed_output_names(task))} of a {task} model")
        if not packed.passed:
            raise BundleError(f"{manifest_path}: the packed graph failed its parity gate; it must not be served")
        if manifest.model.pooling not in PACKED_POOLINGS:
            raise BundleError(f"{manifest_path}: a packed graph for {manifest.model.pooling} pooling (packing pools "
                              f"by {' or '.join(PACKED_POOLINGS)} only)")
    packed_files = [manifest.packed.file] if manifest.packed else []
    for required in (manifest.graph.file, manifest.tokenizer, *(v.file for v in manifest.variants.values()),
                     *packed_files):
        if required not in manifest.files:
            raise BundleError(f"{manifest_path}: {required} is used but has no hash in 'files'")
    for name, entry in sorted(manifest.files.items()):
        path = root / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise BundleError(f"{manifest_path}: file name {name!r} escapes the bundle directory")
        if not path.is_file():
            raise BundleError(f"{path}: missing (listed in {BUNDLE_MANIFEST})")
        size = path.stat().st_size
        if size != entry.bytes:
            raise BundleError(f"{path}: size {size} bytes, manifest says {entry.bytes} (truncated or replaced)")
        stat = path.stat()
        actual = _verified_sha256(str(path), stat.st_dev, stat.st_ino, size, stat.st_mtime_ns)
        if actual != entry.sha256:
            raise BundleError(f"{path}: sha256 {actual[:12]}... does not match manifest {entry.sha256[:12]}...")
    for graph_file in dict.fromkeys((manifest.graph.file, *(v.file for v in manifest.variants.values()), *packed_files)):
        _check_external_data(root, graph_file, manifest, manifest_path)
    return Bundle(root=root, manifest=manifest)
