"""Which runtime and precision a replica serves, and why: one table, RULES, read top to bottom by
`choose_runtime` and shown in /info (`runtime_choice`), so the whole decision reads at a glance.

A row matches the settings (`runtime`, `precision` as asked) and what this replica finds: whether
onnxruntime got CUDA, and whether OpenVINO bf16 can run here (openvino installed, a CPU with bf16
units, a bundle whose bf16 gate passed). The first row that matches says what serves and the reason
(`precision_note`). Two things happen outside the table, each in one place:
- a precision the bundle does not have is never served: bf16 asked for without a gated bf16 graph
  is an error here, int8 and fp16 in onnxruntime's resolve_precision;
- OpenVINO that cannot start (not installed, a graph it cannot compile) falls back to onnxruntime
  fp32 with one warning line under `runtime: auto`; under `runtime: openvino`, asked for by name, the
  start is refused in one line (before Ray, by check_bundles' preflight; in the replica otherwise).
  A cache directory that cannot be written costs a compile, not the replica.
- `runtime: openvino` keeps onnxruntime's full graph (attention weights) on the CPU too: a GPU never
  turns a replica asked to run OpenVINO into one that runs onnxruntime on CUDA.
int8 is never picked by `auto`: its cosine loss is two orders of magnitude above bf16's
(docs/performance.md). Nor is a bf16 (or, on CUDA, fp16) variant whose gate did not hold the model's
fidelity (VariantInfo.auto_verdict: an embedding's min cosine >= bundle.manifest.AUTO_MIN_COSINE and its token
encodings' gate, a classifier's head gate): such a variant is served when asked for by name, and the
note says which floor it missed, with the figure.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from bundle.contract import encodings_output_names
from bundle.manifest import Bundle, BundleError
from service.config import ServiceSettings
from service.runtimes import Runtime
from service.runtimes.cuda import GpuAssignment
from service.runtimes.onnxruntime import CUDA, CudaSettings, OrtEncoder
from service.runtimes.openvino import REQUIRED, OvEncoder, check_openvino, usable_cache_dir

logger = logging.getLogger("service.runtimes.choice")

PROBE_SHAPE = (8, 32)  # the batch both candidates run at start-up: 8 texts of 32 tokens, a typical batch
ANY = None  # a column a row does not look at
ORT = "as resolved"  # by onnxruntime's resolve_precision (fp16 on CUDA where gated, ...)
FASTER = "faster"  # OpenVINO bf16 and onnxruntime fp32 both run a probe batch; the faster serves


@dataclass(frozen=True)
class Rule:
    """One row: the configuration it matches (ANY: whatever it is) -> what serves, and why.

    `note` becomes the runtime's precision_note, with {ort} (onnxruntime's own note), {why} (why not
    OpenVINO bf16) and {gate} (the bf16 gate's figure and whether `auto` may serve it) filled in; `warning`,
    where set, is logged once. `fidelity`: the bundle's bf16 variant holds the floor `auto` serves at."""

    runtime: tuple[str, ...] | None  # settings.runtime
    precision: tuple[str, ...] | None  # settings.precision, as asked
    cuda: bool | None  # onnxruntime's session got CUDA
    bf16: bool | None  # OpenVINO bf16 can run here: installed, bf16 units, the bundle's bf16 gate passed
    serves: str  # onnxruntime | openvino | faster
    precision_served: str  # fp32 | bf16 | as resolved (by onnxruntime's resolve_precision)
    note: str
    warning: str = ""
    fidelity: bool | None = ANY  # the bf16 variant's gate holds auto's floor (VariantInfo.auto_verdict)

    def matches(self, found: Found) -> bool:
        """Lazily: OpenVINO is probed (imported) only when a row that looks at it is reached."""
        return ((self.runtime is ANY or found.runtime in self.runtime)
                and (self.precision is ANY or found.precision in self.precision)
                and (self.cuda is ANY or found.cuda == self.cuda)
                and (self.bf16 is ANY or found.bf16 == self.bf16)
                and (self.fidelity is ANY or found.fidelity == self.fidelity))

    def line(self) -> str:
        """The row as /info shows it."""
        def column(name: str, values) -> str:
            return f"{name} {'|'.join(values)}" if values is not ANY else f"any {name}"

        found = [column("runtime", self.runtime), column("precision", self.precision)]
        found += [] if self.cuda is ANY else ["CUDA" if self.cuda else "no CUDA"]
        found += [] if self.bf16 is ANY else ["OpenVINO bf16 can run" if self.bf16 else "OpenVINO bf16 cannot run"]
        found += [] if self.fidelity is ANY else ["its gate holds auto's fidelity floor" if self.fidelity
                                                  else "its gate misses auto's fidelity floor"]
        if self.serves == FASTER:
            serves = "the faster on a probe batch of openvino bf16 and onnxruntime fp32"
        elif self.precision_served == ORT:
            serves = "onnxruntime, precision as resolved (fp16 on CUDA where gated, int8/fp16 where meant for the device, else fp32)"
        else:
            serves = f"{self.serves} {self.precision_served}"
        return f"{', '.join(found)} -> {serves}"


# First match wins. Columns: settings.runtime, settings.precision (as asked), CUDA, OpenVINO bf16 can
# run -> what serves the encodings graph, its precision, the reason (precision_note), a warning line.
OV, BF16_ASKED_NOT_SERVED = "openvino", "precision bf16: {why}; serving fp32"
RULES: tuple[Rule, ...] = (
    Rule(("onnxruntime",), ANY, ANY, ANY, "onnxruntime", ORT, "{ort}"),
    Rule(ANY, ("int8", "fp16"), ANY, ANY, "onnxruntime", ORT, "{ort}"),
    Rule(ANY, ("bf16",), True, ANY, "onnxruntime", ORT,
         "bf16 runs on OpenVINO (CPU); this replica runs on CUDA: {ort}", "precision bf16: {note}"),
    Rule(ANY, ANY, True, ANY, "onnxruntime", ORT, "{ort}"),
    Rule(("auto",), ("fp32",), False, ANY, "onnxruntime", "fp32", "{ort}"),
    Rule(("auto",), ("auto",), False, False, "onnxruntime", "fp32", "{ort}; not OpenVINO bf16: {why}"),
    Rule(("auto",), ("auto",), False, True, "onnxruntime", "fp32", "{ort}; not OpenVINO bf16 under auto: {gate}",
         fidelity=False),
    Rule(("auto",), ("auto",), False, True, FASTER, "bf16|fp32", "(both probe figures: _faster)"),
    Rule(("auto",), ("bf16",), False, False, "onnxruntime", "fp32", "bf16 asked for, fp32 on onnxruntime: {why}",
         BF16_ASKED_NOT_SERVED),
    Rule(("auto", OV), ("bf16",), False, True, OV, "bf16", "bf16 as configured ({gate})"),
    Rule((OV,), ("fp32",), False, ANY, OV, "fp32", "fp32 as configured, on OpenVINO"),
    Rule((OV,), ("auto",), False, False, OV, "fp32", "fp32 on OpenVINO: {why}"),
    Rule((OV,), ("auto",), False, True, OV, "fp32", "auto on runtime openvino: fp32, not bf16: {gate}", fidelity=False),
    Rule((OV,), ("auto",), False, True, OV, "bf16", "auto on runtime openvino: bf16 ({gate})"),
    Rule((OV,), ("bf16",), False, False, OV, "fp32", "fp32 on OpenVINO: {why}", BF16_ASKED_NOT_SERVED),
)
TABLE = [rule.line() for rule in RULES]  # /info's runtime_choice.table


@dataclass
class Found:
    """The six factors of the choice, as this replica finds them."""

    runtime: str
    precision: str
    cuda: bool
    bundle: Bundle

    @cached_property
    def check(self):
        return check_openvino()

    @cached_property
    def bf16(self) -> bool:
        check = self.check
        return check.installed and check.bf16_units and self.bundle.manifest.variants.get("bf16") is not None

    @property
    def why(self) -> str:
        """Why OpenVINO bf16 cannot run here, in one line: every reason that applies (CPU or OpenVINO, bundle)."""
        reasons = [self.check.reason] if self.check.reason else []
        if self.bundle.manifest.variants.get("bf16") is None:
            reasons.append("this bundle has no gated bf16 graph (exported on a CPU without bf16 units, or before bf16 "
                           "existed: export it again on a CPU with bf16 units)")
        return "; ".join(reasons)

    @cached_property
    def fidelity(self) -> bool:
        """The bf16 variant's gate holds the floor `auto` serves a lossy variant at (asked only where bf16 can run)."""
        return self.bundle.manifest.variants["bf16"].auto_verdict[0]

    @property
    def gate(self) -> str:
        """The bf16 variant's gate, its figure and whether `auto` may serve it."""
        return self.bundle.manifest.variants["bf16"].auto_verdict[1]

    def describe(self) -> dict:
        return {"runtime": self.runtime, "precision": self.precision, "cuda": self.cuda,
                "openvino_bf16": self.__dict__.get("bf16"),  # None: no row needed to ask
                "bf16_holds_auto_floor": self.__dict__.get("fidelity")}


def choose_runtime(bundle: Bundle, settings: ServiceSettings, threads: int, gpu: GpuAssignment,
                   streams: int = 1) -> Runtime:
    """The replica's runtime for one bundle (threads: per batch; streams: batches that run at once): the
    first row of RULES that matches. The onnxruntime encoder is made first: it runs the full graph
    (attention weights) whatever serves the encodings graph, and it is where CUDA is found or not."""
    variants = bundle.manifest.variants
    wanted = settings.precision
    if wanted == "bf16" and "bf16" not in variants:
        raise BundleError(
            f"{bundle.root}: no gated bf16 graph in this bundle (has {', '.join(variants)}); export it again on a "
            "CPU with bf16 units (the export log says why it was not published)")
    ort_precision = "auto" if wanted == "bf16" or settings.runtime == "openvino" else wanted
    # runtime openvino, asked for by name, runs on the CPU: its full graph too, never onnxruntime on CUDA instead
    on_openvino = settings.runtime == "openvino"
    encoder = OrtEncoder(bundle, "cpu" if on_openvino else settings.provider, threads, settings.inter_op_threads,
                         settings.allow_spinning, ort_precision, CudaSettings.from_settings(settings, gpu))
    if on_openvino:
        encoder.provider_note = "runtime openvino runs on the CPU"
    encoder.precision_requested = wanted
    found = Found(settings.runtime, wanted, encoder.provider == CUDA, bundle)
    index, rule = next((i, r) for i, r in enumerate(RULES) if r.matches(found))
    choice = {"rule": index, "matched": TABLE[index], "found": found.describe(), "table": TABLE}
    values = {"ort": encoder.precision_note}
    for name in ("why", "gate"):  # only what the row says: a gate is there only where bf16 can run
        if "{" + name + "}" in rule.note + rule.warning:
            values[name] = getattr(found, name)
    note = rule.note.format(**values)
    if rule.warning:
        logger.warning(rule.warning.format(note=note, **values))

    runtime: Runtime
    if rule.serves == "onnxruntime":
        encoder.precision_note = note
        runtime = encoder
    elif rule.serves == FASTER:  # each candidate's note says both figures (_faster)
        candidate = _openvino(bundle, settings, threads, streams, encoder, "bf16", wanted, "")
        runtime = encoder if candidate is None else _faster(candidate, encoder, variants["bf16"].auto_verdict[1])
    else:
        runtime = _openvino(bundle, settings, threads, streams, encoder, rule.precision_served, wanted, note) or encoder
    runtime.choice = choice
    return runtime


def _openvino(bundle: Bundle, settings: ServiceSettings, threads: int, streams: int, encoder: OrtEncoder,
              precision: str, wanted: str, note: str) -> OvEncoder | None:
    """OpenVINO for the encodings graph (the full graph stays the onnxruntime encoder's). When it cannot
    start: with `runtime: auto`, None and one warning line (the replica serves on onnxruntime); with
    `runtime: openvino`, asked for by name, a RuntimeError of one line (that runtime or none)."""
    required = settings.runtime == "openvino"
    check = check_openvino()
    if not check.installed:
        if required:
            raise RuntimeError(f"{REQUIRED}: {check.reason}")
        logger.warning("OpenVINO not used: %s; serving on onnxruntime", check.reason)
        encoder.precision_note += f"; OpenVINO not used: {check.reason}"
        return None
    cache_dir, why = usable_cache_dir(settings.openvino_cache_dir)
    if why and settings.openvino_cache_dir is not None:
        logger.warning("OpenVINO: %s", why)
    try:
        return OvEncoder(bundle, precision, threads, streams, cache_dir, encoder.full, encoder.provider,
                         wanted, note, encoder.provider_note, encoder.describe_cuda())
    except Exception as exc:  # noqa: BLE001 - any failure to start: refused (asked for by name) or onnxruntime
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if required:
            raise RuntimeError(f"{REQUIRED}: OpenVINO {precision} could not start: {reason}") from None
        logger.warning("OpenVINO %s could not start (%s); serving onnxruntime fp32", precision, reason)
        encoder.precision_note += f"; OpenVINO {precision} could not start: {reason}"
        return None


def probe_ms(runtimes: list[Runtime], repeats: int = 7) -> list[float]:
    """Median milliseconds of each runtime's encodings graph on the probe batch, after two warm-up runs;
    their runs alternate, so that a replica starting beside others (a busy CPU) slows all of them alike."""
    rng = np.random.default_rng(0)
    vocab = runtimes[0].manifest.model.vocab_size
    ids = rng.integers(min(1000, vocab - 1), min(vocab, 20000), PROBE_SHAPE, dtype=np.int64)
    mask = np.ones_like(ids)
    pooled = encodings_output_names(runtimes[0].manifest.model.task)[-1]  # sentence_embedding, or a classifier's logits
    times: list[list[float]] = [[] for _ in runtimes]
    for i in range(repeats + 2):
        for runtime, own in zip(runtimes, times, strict=True):
            started = time.perf_counter()
            runtime.fast.run(ids, mask, [pooled])
            if i >= 2:
                own.append((time.perf_counter() - started) * 1000)
    return [float(np.median(t)) for t in times]


def _faster(openvino: OvEncoder, ort: OrtEncoder, gate: str) -> Runtime:
    """auto: the candidate that ran the probe batch faster, with both figures in its note (and bf16's gate)."""
    ov_ms, ort_ms = probe_ms([openvino, ort])
    shape = "x".join(map(str, PROBE_SHAPE))
    figures = f"a probe batch of {shape} tokens in {ov_ms:.1f} ms on OpenVINO bf16 and {ort_ms:.1f} ms on onnxruntime fp32"
    if ov_ms < ort_ms:
        openvino.precision_note = f"auto: bf16 on OpenVINO, {figures}; {gate}"
        return openvino
    ort.precision_note = f"auto: fp32 on onnxruntime, {figures}"
    return ort
