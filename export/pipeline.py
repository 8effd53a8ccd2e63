"""Checkpoint -> ONNX -> parity gate -> bundle, published atomically or not at all."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import onnx
import onnxruntime
import tokenizers
import torch
from tokenizers import Tokenizer

from bundle.contract import (
    DEFAULT_COSINE_FLOOR,
    DEFAULT_MEAN_COSINE,
    GRAPH_FILE,
    INPUT_NAMES,
    PACKED_FILE,
    PACKED_INPUT_NAMES,
    PACKED_POOLINGS,
    TOKENIZER_FILE,
    encodings_file,
    encodings_output_names,
    output_names,
    packed_output_names,
)
from bundle.manifest import (
    AUTO_MIN_COSINE,
    HEADS_FILE,
    HeadGate,
    BundleManifest,
    GraphInfo,
    ModelInfo,
    SPLADE_POOLINGS,
    PackedInfo,
    ParityReport,
    QualityGate,
    SparseInfo,
    VariantInfo,
    file_entry,
    load_bundle,
    head_line,
    parity_lines,
    quality_line,
)
from export import onnx_export, optimize, parity, quality
from export.checkpoint import Checkpoint, load_checkpoint
from export.sessions import PackedSession, ort_session, quiet_options
from service.runtimes.onnxruntime import OrtPackedGraph


# the attention weights' gate at a lossy precision: probabilities within 1e-3 of PyTorch fp32
ATTENTION_ATOL_BF16 = 1e-3
# a classifier's lossy variants (their gate: quality.check_heads); int8 is not made for classifiers
CLASSIFIER_LOSSY = ("fp16", "bf16")


class ExportError(Exception):
    """The export did not produce a publishable bundle; nothing was published."""


@dataclass(frozen=True)
class ExportOptions:
    checkpoint: str
    out: Path
    opset: int
    atol: float
    rtol: float
    name: str | None = None
    force: bool = False
    # lossy encodings graphs to build; each is published only if its quality gate passes
    lossy: tuple[str, ...] = ("int8", "fp16", "bf16")
    mean_cosine: float = DEFAULT_MEAN_COSINE
    cosine_floor: float = DEFAULT_COSINE_FLOOR
    # the embedding sizes the model was trained to be cut to, when its config.json does not say
    matryoshka_dimensions: tuple[int, ...] | None = None
    # --pooling: splade (max), splade_sum: a bare *ForMaskedLM exported as a SPLADE model
    pooling: str | None = None


@dataclass(frozen=True)
class ExportResult:
    out: Path
    manifest: BundleManifest


Progress = Callable[[str], None]


def _step(progress: Progress, n: int, total: int, what: str) -> float:
    progress(f"[{n}/{total}] {what}")
    return time.perf_counter()


def _save_tokenizer(source: Path, target: Path, max_tokens: int) -> None:
    """Copy the tokenizer with truncation at the model's limit and no fixed-length padding.

    Checkpoints often ship a tokenizer.json that pads every input to 128 tokens; the service
    pads per batch instead, so the bundle's copy says only what is true of the model.
    """
    tokenizer = Tokenizer.from_file(str(source))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_tokens)
    tokenizer.save(str(target))


def build_bundle(options: ExportOptions, progress: Progress = print) -> ExportResult:
    """Run the whole export; publish options.out only when the bundle verified end to end."""
    # absolute, but not resolved: `out` itself is the symlink that publishing replaces
    out = options.out.parent.resolve() / options.out.name
    if out.exists() and not options.force:
        raise ExportError(f"{out} already exists (use --force to replace it)")
    total = 7

    started = _step(progress, 1, total, f"loading checkpoint {options.checkpoint}")
    ckpt = load_checkpoint(options.checkpoint, options.name, options.matryoshka_dimensions, options.pooling)
    cfg = ckpt.config
    progress(
        f"      {ckpt.name} ({ckpt.architecture}): {cfg.n_layers} layers, {cfg.n_heads} heads, "
        f"hidden {cfg.d_model}, max {ckpt.max_tokens} tokens, {cfg.pooling} pooling"
        f"{', L2-normalised' if cfg.normalize else ''} ({time.perf_counter() - started:.1f}s)"
    )
    if ckpt.classifier is not None:
        head = ckpt.classifier
        progress(f"      task classification: {head.num_labels} label(s) {list(head.labels)}, "
                 f"problem_type {head.problem_type}, head {head.activation}{' + norm' if head.norm else ''} on "
                 f"{'the first token' if cfg.pooling == 'cls' else 'the mean of the tokens'}, "
                 f"scores {head.score_activation} of the logits (CrossEncoder.predict's)")
    elif cfg.pooling in SPLADE_POOLINGS:
        progress(f"      task embedding: SPLADE, the masked-LM head's logits, log(1 + relu), {cfg.pooling[7:]} over "
                 f"tokens: one weight per vocabulary entry ({cfg.vocab_size})")
    else:
        progress("      task embedding")
    for name in ckpt.ignored:
        progress(f"      not used: {name}")

    out.parent.mkdir(parents=True, exist_ok=True)
    # Same parent as the target, so the final rename is atomic (one filesystem).
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        started = _step(progress, 2, total, f"exporting ONNX (opset {options.opset}) and running onnx.checker")
        graph_files = onnx_export.export_onnx(ckpt.encoder, staging, options.opset, cfg.max_positions)
        opset = onnx_export.graph_opset(staging / GRAPH_FILE)
        size_mb = sum((staging / f).stat().st_size for f in graph_files) / 1e6
        progress(f"      wrote {', '.join(graph_files)} ({size_mb:.1f} MB, {time.perf_counter() - started:.1f}s)")

        started = _step(progress, 3, total, f"parity gate: PyTorch vs onnxruntime (atol {options.atol:g}, rtol {options.rtol:g})")
        tokenizer = Tokenizer.from_file(str(ckpt.tokenizer_path))
        probes = parity.make_probes(ckpt.max_tokens, cfg.vocab_size, cfg.pad_token_id, tokenizer,
                                    parity.rows_per_probe(ckpt.max_tokens, cfg.n_layers, cfg.n_heads))
        report: ParityReport = parity.check_parity(
            ckpt.encoder, staging / GRAPH_FILE, probes, options.atol, options.rtol
        )
        report = _representation_parity(ckpt, staging / GRAPH_FILE, report, options)
        for line in parity_lines(report):
            progress("      " + line)
        if not report.passed:
            raise ExportError("parity gate failed: nothing published")
        progress(f"      ({time.perf_counter() - started:.1f}s)")

        started = _step(progress, 4, total, "encodings-only fp32 graphs: fused (padded rows) and packed (texts in one "
                        "row), parity gates")
        variants = {"fp32": _encodings_fp32(ckpt, staging, probes, options, progress)}
        packed = _packed(ckpt, staging, probes, options, progress)
        progress(f"      ({time.perf_counter() - started:.1f}s)")

        lossy = _lossy_precisions(ckpt, options)
        if ckpt.classifier is not None:
            what = (f"head gate: logits within {quality.HEAD_LOGITS_ATOL:g} of PyTorch fp32, labels and each query's "
                    "ranking kept")
        else:
            what = (f"gate mean cosine >= {options.mean_cosine:g} and every text >= {options.cosine_floor:g} vs PyTorch "
                    f"fp32, retrieval unchanged; auto serves a variant only at min cosine >= {AUTO_MIN_COSINE:g}")
        started = _step(progress, 5, total, f"lossy variants {', '.join(lossy) or '(none)'}: {what}")
        for precision in lossy:
            if precision == "bf16":
                variant = _bf16_variant(ckpt, tokenizer, staging, variants["fp32"], probes, options, progress)
                if variant is not None and packed is not None and ckpt.classifier is None:
                    packed = packed.model_copy(update={"bf16": _packed_bf16(ckpt, tokenizer, staging, packed,
                                                                             options, progress)})
            else:
                variant = _lossy_variant(precision, ckpt, tokenizer, staging, variants["fp32"], options, progress)
            if variant is not None:
                variants[precision] = variant
        progress(f"      ({time.perf_counter() - started:.1f}s)")

        _step(progress, 6, total, "writing tokenizer, manifest and hashes")
        _save_tokenizer(ckpt.tokenizer_path, staging / TOKENIZER_FILE, ckpt.max_tokens)
        manifest = BundleManifest(
            model=ModelInfo(
                name=ckpt.name,
                architecture=ckpt.architecture,
                source=str(ckpt.path),
                hidden_size=cfg.d_model,
                embedding_dim=cfg.sentence_dim if cfg.dense or cfg.sentence_dim != cfg.d_model else None,
                dense_layers=len(cfg.dense),
                num_layers=cfg.n_layers,
                num_heads=cfg.n_heads,
                vocab_size=cfg.vocab_size,
                max_tokens=ckpt.max_tokens,
                pooling=cfg.pooling,
                normalize=cfg.normalize,
                pad_token_id=cfg.pad_token_id,
                task=ckpt.task,
                labels=list(ckpt.classifier.labels) if ckpt.classifier else None,
                problem_type=ckpt.classifier.problem_type if ckpt.classifier else None,
                score_activation=ckpt.classifier.score_activation if ckpt.classifier else None,
                prompts=ckpt.conventions.prompts,
                default_prompt_name=ckpt.conventions.default_prompt_name,
                prompt_tokens=ckpt.conventions.prompt_tokens,
                include_prompt=ckpt.conventions.include_prompt,
                matryoshka=ckpt.conventions.matryoshka,
                matryoshka_dimensions=list(ckpt.conventions.matryoshka_dimensions)
                if ckpt.conventions.matryoshka_dimensions else None,
                **_representation_fields(ckpt),
                **_splade_fields(cfg),
            ),
            graph=GraphInfo(
                file=GRAPH_FILE, opset=opset, inputs=list(INPUT_NAMES), outputs=list(output_names(ckpt.task))
            ),
            tokenizer=TOKENIZER_FILE,
            files={
                name: file_entry(staging / name)
                for name in _with_data(staging, [*graph_files, *(v.file for v in variants.values()),
                                                 *([packed.file] if packed else []), TOKENIZER_FILE,
                                                 *_write_heads(ckpt, staging)])
            },
            parity=report,
            variants=variants,
            packed=packed,
            versions={
                "python": platform.python_version(),
                "torch": torch.__version__,
                "onnx": onnx.__version__,
                "onnxruntime": onnxruntime.__version__,
                "tokenizers": tokenizers.__version__,
                "exporter": "torch.onnx.export(dynamo=True); encodings graphs: torch.onnx.export(dynamo=False)",
            },
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        manifest.write(staging)
        staging.chmod(0o755)  # mkdtemp makes it owner-only; a service user must be able to read it
        load_bundle(staging)  # the service's own loader must accept it before anyone else sees it

        _step(progress, 7, total, f"publishing {out}")
        _publish(staging, out)
        return ExportResult(out=out, manifest=manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _splade_fields(cfg) -> dict:
    """A SPLADE model's manifest fields: its pooled output is its sparse vector, not a dense embedding."""
    return dict(dense=False, sparse=SparseInfo(kind="splade")) if cfg.pooling in SPLADE_POOLINGS else {}


def _sparse_gate(gate: QualityGate, ckpt: Checkpoint, tokenizer: Tokenizer, session) -> QualityGate:
    """A SPLADE model's lossy variant is held to its sparse vectors' top terms too (quality.check_sparse): it
    passes only if both gates do."""
    if ckpt.config.pooling not in SPLADE_POOLINGS:
        return gate
    gates = quality.check_sparse(ckpt.encoder, tokenizer, session, ckpt.max_tokens, ckpt.config.pad_token_id)
    return gate.model_copy(update={"representations": [*gate.representations, *gates],
                                   "passed": gate.passed and all(g.passed for g in gates)})


def _with_data(staging: Path, names: list[str]) -> list[str]:
    """The files to publish: each graph, and beside a large one its external data (`<graph>.data`)."""
    data = [optimize.external_data_of(staging / n).name for n in names]
    return list(dict.fromkeys([*names, *(d for d in data if (staging / d).exists())]))


def _remove_graph(path: Path) -> None:
    """A graph its gate rejected, with its external data: nothing of it is published."""
    path.unlink()
    optimize.external_data_of(path).unlink(missing_ok=True)


def _encodings_fp32(ckpt: Checkpoint, staging: Path, probes, options: ExportOptions, progress: Progress) -> VariantInfo:
    """Trace the encodings-only graph, fuse it, and hold it to the same strict gate as the full graph: with
    onnxruntime's contrib attention operators where they pay (export/contrib_ops.py), else, or if that graph
    fails its gate, as onnxruntime's optimizer alone fuses it."""
    cfg = ckpt.config
    target = encodings_file("fp32")
    outputs = encodings_output_names(ckpt.task)
    kind = onnx_export.contrib_attention_kind(ckpt.encoder)
    for contrib in ([True, False] if optimize.contrib_wins_on_cpu(kind) else [False]):
        with tempfile.TemporaryDirectory(prefix="encodings-") as scratch:
            traced = Path(scratch) / "traced.onnx"
            onnx_export.export_encodings_onnx(ckpt.encoder, traced, options.opset, contrib=contrib)
            fusions = optimize.optimize_fp32(traced, staging / target, cfg)
        progress(f"      fused: {', '.join(f'{n} {op}' for op, n in fusions.items()) or 'nothing'}")
        report = parity.check_parity(ckpt.encoder, staging / target, probes, options.atol, options.rtol,
                                     outputs=outputs)
        report = _representation_parity(ckpt, staging / target, report, options)
        for line in parity_lines(report):
            progress("      " + line)
        if report.passed:
            break
        if contrib:
            progress("      contrib attention failed the gate: the graph onnxruntime's optimizer fuses instead")
    if not report.passed:
        raise ExportError("parity gate of the fp32 encodings graph failed: nothing published")
    return VariantInfo(
        file=target, precision="fp32", opset=onnx_export.graph_opset(staging / target),
        inputs=list(INPUT_NAMES), outputs=list(outputs), optimizer=optimize.optimizer_label(fusions, kind),
        fusions=fusions, providers=["CUDAExecutionProvider", "CPUExecutionProvider"], parity=report,
    )


def _packed(ckpt: Checkpoint, staging: Path, probes, options: ExportOptions, progress: Progress) -> PackedInfo | None:
    """Trace the packed graph (Encoder.packed) and hold its pooled output to the strict fp32 gate, the
    probes packed as the service packs them; None (and no file left) where packing cannot pool the
    model's way or the gate fails: the service then pads every run, as before."""
    cfg = ckpt.config
    if cfg.pooling not in PACKED_POOLINGS:
        progress(f"      packed graph: not for {cfg.pooling} pooling (a pooling matrix says mean or cls only)")
        return None
    target = staging / PACKED_FILE
    onnx_export.export_packed_onnx(ckpt.encoder, target, options.opset)
    outputs = packed_output_names(ckpt.task)
    session = PackedSession(OrtPackedGraph(target, ckpt.task, ["CPUExecutionProvider"], quiet_options()),
                            cfg.pooling, cfg.position_offset, ckpt.max_tokens)
    report = parity.check_parity(ckpt.encoder, target, probes, options.atol, options.rtol, outputs=outputs,
                                 session=session)
    for line in parity_lines(report):
        progress("      packed " + line)
    if not report.passed:
        _remove_graph(target)
        progress("      packed graph rejected by its gate: not published (every run is padded)")
        return None
    return PackedInfo(file=PACKED_FILE, opset=onnx_export.graph_opset(target), inputs=list(PACKED_INPUT_NAMES),
                      outputs=list(outputs), position_offset=cfg.position_offset, parity=report)


def _packed_bf16(ckpt: Checkpoint, tokenizer: Tokenizer, staging: Path, packed: PackedInfo, options: ExportOptions,
                 progress: Progress) -> QualityGate:
    """The bf16 variant's gate, on the packed graph run by OpenVINO at bf16: bf16 runs are packed only if it passes."""
    from service.runtimes.openvino import OvPackedGraph

    graph = OvPackedGraph(staging / packed.file, ckpt.task, "bf16", len(os.sched_getaffinity(0)), streams=1)
    session = PackedSession(graph, ckpt.config.pooling, packed.position_offset, ckpt.max_tokens)
    gate = quality.check_quality(ckpt.encoder, tokenizer, staging / packed.file, ckpt.max_tokens,
                                 ckpt.config.pad_token_id, options.mean_cosine, options.cosine_floor, session=session)
    progress("      packed " + quality_line("bf16", gate) + ("" if gate.passed else " (bf16 runs stay padded)"))
    return gate


def _lossy_variant(
    precision: str,
    ckpt: Checkpoint,
    tokenizer: Tokenizer,
    staging: Path,
    fp32: VariantInfo,
    options: ExportOptions,
    progress: Progress,
) -> VariantInfo | None:
    """Build the int8 or fp16 graph and gate it; None (and no file left) if it fails."""
    target = staging / encodings_file(precision)
    if precision == "int8":  # quantized from the fused fp32 graph: its fusions stay
        optimize.quantize_int8(staging / fp32.file, target)
        fusions, providers = fp32.fusions, ["CPUExecutionProvider"]
    elif precision == "fp16":
        with tempfile.TemporaryDirectory(prefix="encodings-") as scratch:
            traced = Path(scratch) / "traced.onnx"
            onnx_export.export_encodings_onnx(ckpt.encoder, traced, options.opset,  # CUDA: the contrib operators
                                              contrib=onnx_export.contrib_attention_kind(ckpt.encoder) is not None)
            fusions = optimize.optimize_fp16(traced, target, ckpt.config)
        providers = ["CUDAExecutionProvider"]
    else:
        raise ExportError(f"unknown precision {precision!r}: expected int8 or fp16")
    gate, head = _lossy_gates(precision, ckpt, tokenizer, target, lambda: ort_session(target), options, progress)
    if not (head or gate).passed:
        _remove_graph(target)
        progress(f"      {precision} rejected by its gate: not published")
        return None
    return VariantInfo(
        file=target.name, precision=precision, opset=onnx_export.graph_opset(target), inputs=list(INPUT_NAMES),
        outputs=list(encodings_output_names(ckpt.task)),
        optimizer=optimize.optimizer_label(fusions, onnx_export.contrib_attention_kind(ckpt.encoder))
        + (", quantize_dynamic int8 weights" if precision == "int8" else ", float16"),
        fusions=fusions, providers=providers, quality=gate, head_gate=head,
    )


def _lossy_precisions(ckpt: Checkpoint, options: ExportOptions) -> tuple[str, ...]:
    """The lossy variants to build: those asked for; for a classifier, those its head gate covers."""
    if ckpt.classifier is None:
        return tuple(options.lossy)
    return tuple(p for p in options.lossy if p in CLASSIFIER_LOSSY)


def _lossy_gates(precision: str, ckpt: Checkpoint, tokenizer: Tokenizer, graph: Path, session, options: ExportOptions,
                 progress: Progress, suffix: str = "") -> tuple[QualityGate | None, HeadGate | None]:
    """A lossy graph's gates, one line of progress: a classifier's head gate (quality.check_heads); an embedding
    model's quality gate (cosine, retrieval, its sparse and multi-vector rows) with its token encodings' gate
    (quality.check_tokens). `session()` makes what runs the graph (onnxruntime, or OpenVINO at bf16)."""
    cfg = ckpt.config
    if ckpt.classifier is not None:
        head = quality.check_heads(ckpt.encoder, tokenizer, session(), ckpt.max_tokens, cfg.pad_token_id,
                                   ckpt.classifier.num_labels, segments=cfg.type_vocab_size > 1)
        progress("      " + head_line(precision, head) + suffix)
        return None, head
    first = session()
    gate = quality.check_quality(ckpt.encoder, tokenizer, graph, ckpt.max_tokens, cfg.pad_token_id, options.mean_cosine,
                                 options.cosine_floor, session=first)
    gate = _representation_quality(ckpt, tokenizer, session(), gate)
    gate = _sparse_gate(gate, ckpt, tokenizer, first)
    gate = gate.model_copy(update={"tokens": quality.check_tokens(ckpt.encoder, tokenizer, first, ckpt.max_tokens,
                                                                  cfg.pad_token_id)})
    progress("      " + quality_line(precision, gate) + suffix)
    return gate, None


def _bf16_variant(
    ckpt: Checkpoint,
    tokenizer: Tokenizer,
    staging: Path,
    fp32: VariantInfo,
    probes,
    options: ExportOptions,
    progress: Progress,
) -> VariantInfo | None:
    """bf16 is the fp32 encodings graph run by OpenVINO with bf16 matrix products: no file of its
    own, but a gate of its own, measured on bf16 units (a CPU without them would run f32 and prove
    nothing, so there it is not published). The full graph's attention weights get their own gate
    (1e-3 absolute): requests for them run in bf16 only if it passes."""
    from service.runtimes.openvino import check_openvino

    from export.sessions import OpenVinoSession

    check = check_openvino()
    if not check.bf16_units:
        progress(f"      bf16 not gated, not published: {check.reason}")
        return None
    graph, outputs = staging / fp32.file, encodings_output_names(ckpt.task)
    gate, head = _lossy_gates("bf16", ckpt, tokenizer, graph, lambda: OpenVinoSession(graph, outputs, "bf16"), options,
                              progress, f" (OpenVINO {check.version}, {check.cpu})")
    if not (head or gate).passed:
        progress("      bf16 rejected by its gate: not published")
        return None
    full_outputs = output_names(ckpt.task)
    attention = parity.check_parity(
        ckpt.encoder, staging / GRAPH_FILE, probes, ATTENTION_ATOL_BF16, 0.0, outputs=full_outputs,
        session=OpenVinoSession(staging / GRAPH_FILE, full_outputs, "bf16"), compare=("attentions",),
    )
    line = attention.outputs[0]
    progress(f"      bf16 attention weights: max abs diff {line.max_abs_diff:.2e} vs {ATTENTION_ATOL_BF16:g}: "
             + ("PASS, served in bf16" if attention.passed else "FAIL, requests for them run on the fp32 graph"))
    return VariantInfo(
        file=fp32.file, precision="bf16", opset=fp32.opset, inputs=list(INPUT_NAMES),
        outputs=list(outputs), optimizer=fp32.optimizer + "; OpenVINO INFERENCE_PRECISION_HINT=bf16",
        fusions=fp32.fusions, providers=["OpenVINO CPU"], runtime="openvino", quality=gate, head_gate=head,
        attention_gate=attention,
    )


def _representation_parity(ckpt: Checkpoint, graph: Path, report: ParityReport, options: ExportOptions) -> ParityReport:
    """The strict gate's sparse and multi-vector rows (export/parity.py's check_representations) added to `report`;
    it fails when they do."""
    if ckpt.token_heads is None:
        return report
    rows = parity.check_representations(
        ckpt.encoder, ort_session(graph, ["CPUExecutionProvider"]), ckpt.token_heads,
        Tokenizer.from_file(str(ckpt.tokenizer_path)), ckpt.max_tokens, ckpt.config.pad_token_id,
        ckpt.config.vocab_size, options.atol, options.rtol)
    return report.model_copy(update={"outputs": [*report.outputs, *rows],
                                     "passed": report.passed and all(row.passed for row in rows)})


def _representation_quality(ckpt: Checkpoint, tokenizer: Tokenizer, session, gate: QualityGate) -> QualityGate:
    """A lossy variant's gate with its sparse and multi-vector rows (RepresentationGate): it fails when they do."""
    if ckpt.token_heads is None:
        return gate
    rows = quality.check_representation_quality(ckpt.encoder, tokenizer, session, ckpt.token_heads, ckpt.max_tokens,
                                                ckpt.config.pad_token_id, ckpt.config.vocab_size)
    rows_pass = all(r.passed for r in rows)
    if not ckpt.token_heads.dense:
        # a ColBERT's graph pools a vector nothing serves (its manifest says dense false): the cosine and
        # retrieval figures of it are kept for the record, and only the outputs served decide
        problems = [f"not deciding (no dense output is served): {p}" for p in gate.problems]
        return gate.model_copy(update={"representations": rows, "passed": rows_pass, "problems": problems})
    return gate.model_copy(update={"representations": rows, "passed": gate.passed and rows_pass})


def _representation_fields(ckpt: Checkpoint) -> dict:
    """ModelInfo's dense, sparse and multivector, where the checkpoint has token-level heads."""
    heads = ckpt.token_heads
    return {} if heads is None else {"dense": heads.dense, "sparse": heads.sparse, "multivector": heads.multivector}


def _write_heads(ckpt: Checkpoint, staging: Path) -> list[str]:
    """HEADS_FILE, where the checkpoint has token-level heads: the names of the files written."""
    if ckpt.token_heads is None:
        return []
    ckpt.token_heads.heads.save(staging / HEADS_FILE)
    return [HEADS_FILE]


def _publish(staging: Path, out: Path, keep_s: float = 600) -> None:
    """Make `staging` the bundle at `out`, atomically for readers.

    `out` is a symlink to a versioned directory beside it (`.NAME.v<ns>`), and publishing replaces
    the symlink with one rename(2): a reader finds the old bundle or the new one, whole, never none
    and never a mix (the loader resolves the link once). A version stays `keep_s` seconds after it
    was replaced, for readers that resolved the link just before (the one before is always kept).
    """
    version = out.with_name(f".{out.name}.v{time.time_ns()}")
    os.rename(staging, version)
    previous = os.readlink(out) if out.is_symlink() else None
    if out.exists() and not out.is_symlink():
        # a bundle published before versioned directories: once, it is moved to a version of its own
        # (the only moment without a bundle at `out`), so that the link can replace it from now on
        previous = f".{out.name}.v0-{os.getpid()}"
        os.rename(out, out.with_name(previous))
    link = out.with_name(f".{out.name}.link-{os.getpid()}")
    os.symlink(version.name, link)  # relative: the directory and its versions move together (images)
    os.replace(link, out)
    _remove_old_versions(out, keep={version.name, previous}, keep_s=keep_s)


def _version_ns(path: Path) -> int:
    digits = path.name.rsplit(".v", 1)[-1].split("-")[0]
    return int(digits) if digits.isdigit() else 0


def _remove_old_versions(out: Path, keep: set, keep_s: float) -> None:
    """Versions replaced more than keep_s ago go; a version was replaced when the next one was made."""
    versions = sorted((p for p in out.parent.glob(f".{out.name}.v*") if p.is_dir() and not p.is_symlink()),
                      key=_version_ns)
    now = time.time_ns()
    for old, successor in zip(versions, versions[1:]):
        if old.name not in keep and now - _version_ns(successor) > keep_s * 1e9:
            shutil.rmtree(old, ignore_errors=True)
