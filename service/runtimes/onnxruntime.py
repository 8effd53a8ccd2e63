"""onnxruntime sessions: provider choice, session and CUDA provider options, one padded run.

Whether CUDA can be used at all is service/runtimes/cuda.py's question; this module acts on its answer.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bundle.contract import INPUT_NAMES, PACKED_INPUT_NAMES, encodings_output_names, output_names, packed_output_names
from bundle.manifest import Bundle, BundleError, load_bundle
from service.config import ServiceSettings
from service.runtimes import Sizing, TwoGraphs
from service.runtimes.cuda import CUDA, CudaCheck, CudaOptions, GpuAssignment, check_cuda, session_memory_limit

logger = logging.getLogger("service.runtimes.onnxruntime")

CPU = "CPUExecutionProvider"


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota.

    onnxruntime's own default counts the host's cores, which in a container limited to 4 CPUs
    on a 64-core node means 64 threads fighting over 4 CPUs.
    """
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def choose_providers(preference: str, cuda: CudaCheck | None = None) -> list[str]:
    """Providers to ask onnxruntime for, best first. CPU is always the last resort.

    `auto` asks for CUDA only where check_cuda() says it can work, so a CPU-only machine never
    sees onnxruntime's provider errors; `cuda` always asks, and fails if it is not granted.
    """
    if preference == "cuda":
        return [CUDA, CPU]
    if preference == "auto" and (cuda or check_cuda()).usable:
        return [CUDA, CPU]
    return [CPU]


SPINNING = "session.intra_op.allow_spinning"


def _session_options(threads: int, inter_op_threads: int, allow_spinning: bool) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Idle onnxruntime threads spin by default; in a replica that shares cores with the
    # HTTP proxy and the ingress, spinning steals the CPU those need to feed it.
    options.add_session_config_entry(SPINNING, "1" if allow_spinning else "0")
    return options


class OrtGraph:
    """One onnxruntime session over one graph file of a verified bundle.

    `provider` is what the created session actually uses: onnxruntime-gpu lists CUDA as
    available whenever it was compiled in, and silently falls back to CPU when the CUDA
    libraries or the device are missing, so only the session can tell.
    """

    def __init__(self, path: Path, outputs: Sequence[str], label: str, providers: list[str], options: ort.SessionOptions,
                 inputs: Sequence[str] = INPUT_NAMES, disabled_optimizers: Sequence[str] = ()):
        self.path, self.outputs, self.label = path, tuple(outputs), label
        self.providers, self.inputs, self.disabled_optimizers = providers, tuple(inputs), list(disabled_optimizers)
        self._open(options)

    def _open(self, options: ort.SessionOptions) -> None:
        path = self.path
        try:
            self.session = ort.InferenceSession(str(path), options, providers=self.providers,
                                                disabled_optimizers=self.disabled_optimizers)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise BundleError(f"{path}: onnxruntime cannot load the graph: {exc}") from None
        # what the session's thread pool was made with (0: onnxruntime's default); read back from the
        # options here, since the session's own get_session_options() hands out a mutable reference
        self.threads = options.intra_op_num_threads
        self.inter_op_threads = options.inter_op_num_threads
        self.allow_spinning = _config_entry(options, SPINNING) == "1"
        self.provider = self.session.get_providers()[0]
        got = tuple(o.name for o in self.session.get_outputs())
        expected, inputs = self.inputs, [i.name for i in self.session.get_inputs()]
        if tuple(inputs) != expected or got != self.outputs:
            raise BundleError(
                f"{path}: graph I/O {inputs} -> {list(got)} does not match the manifest "
                f"{list(expected)} -> {list(self.outputs)}"
            )
        self.shapes = {o.name: o.shape for o in self.session.get_outputs()}

    def resized(self, threads: int, streams: int) -> OrtGraph:
        """This graph in a new session of `threads` intra-op threads (the service's session options), or
        itself when it has them already or runs on CUDA (whose kernels do not use them). Blocking (a load);
        this one keeps serving the runs that hold it. `streams` is unused: a session runs concurrent
        batches as it is (OpenVINO's compiled models are what need it)."""
        if self.provider == CUDA or threads == self.threads:
            return self
        graph = copy.copy(self)
        graph._open(_session_options(threads, self.inter_op_threads, self.allow_spinning))
        return graph

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str],
            token_type_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One padded batch through the graph; returns only the outputs asked for. Token types matter
        only for text pairs (the second text's segment); single texts are all segment 0."""
        types = np.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        feed = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": types}
        # On CUDA too: every output goes back to the host for the response, and the inputs are a
        # few int64s per token, so session.run's one copy each way is the least there is. IO binding
        # would only pay with device buffers reused across runs, which varying (batch, tokens)
        # shapes defeat; an earlier binding path allocated per run and saved nothing (docs/gpu.md).
        return dict(zip(outputs, self.session.run(list(outputs), feed), strict=True))


class OrtPackedGraph(OrtGraph):
    """The packed graph (service/runtimes/packing.py) on onnxruntime: one row of texts in, their pooled outputs out."""

    multiple = 1  # onnxruntime needs no particular row length

    def __init__(self, path: Path, task: str, providers: list[str], options: ort.SessionOptions):
        # onnxruntime fuses each residual Add and LayerNorm of this graph into SkipLayerNormalization at
        # load time, whose CPU kernel took 4.6 ms of a 30 ms run where Add + LayerNorm take 1 (a row of
        # 8 texts, one thread; the padded graphs are not fused so): that fusion is left out here
        super().__init__(path, packed_output_names(task), "packed-fp32", providers, options, PACKED_INPUT_NAMES,
                         disabled_optimizers=["SkipLayerNormFusion"])

    def run_packed(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run(list(self.outputs), feed)[0]


def _config_entry(options: ort.SessionOptions, key: str) -> str | None:
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # onnxruntime raises when the key was never set
        return None


@dataclass(frozen=True)
class CudaSettings:
    """How a replica's CUDA sessions are set up: the device Ray gave it, its sessions' memory, TF32."""

    gpu: GpuAssignment = field(default_factory=GpuAssignment)
    sessions: int = 2  # CUDA sessions in the replica (two graphs per served model), sharing its GPU share
    mem_limit_mb: int = 0  # per session arena; 0: derived from the replica's GPU share
    tf32: bool = False

    @classmethod
    def from_settings(cls, settings: ServiceSettings, gpu: GpuAssignment) -> CudaSettings:
        return cls(gpu, 2 * len(settings.bundles), settings.gpu_mem_limit_mb, settings.cuda_tf32)


def cuda_options(check: CudaCheck, cuda: CudaSettings) -> CudaOptions:
    """Every CUDA provider option of a replica's sessions, from its device and GPU share."""
    if cuda.mem_limit_mb:
        limit = cuda.mem_limit_mb * 2**20
    elif check.device is not None:
        limit = session_memory_limit(check.device.total_bytes, cuda.gpu.share, cuda.sessions)
    else:
        limit = 0  # no device described (CUDA asked for without a usable one): onnxruntime's default
    return CudaOptions(device_id=cuda.gpu.device_id, gpu_mem_limit=limit, use_tf32=cuda.tf32)


def with_options(providers: list[str], options: CudaOptions | None) -> list:
    """onnxruntime's providers argument: CUDA with its options, CPU as it is."""
    return [(p, options.provider_options()) if p == CUDA and options else p for p in providers]


class OrtEncoder(TwoGraphs):
    """Both graphs of a bundle: the full one (attention weights) and the fast encodings-only one.

    A run that needs attention weights goes to the full graph, every other run to the
    encodings graph of the configured precision. `auto` serves the gated fp16 graph on CUDA and
    fp32 elsewhere; a precision whose graph is meant for another provider (fp16 is for CUDA)
    falls back to fp32, with a warning, rather than run slowly.
    """

    runtime = "onnxruntime"

    def __init__(
        self,
        bundle: Bundle,
        preference: str = "auto",
        intra_op_threads: int = 0,
        inter_op_threads: int = 1,
        allow_spinning: bool = False,
        precision: str = "auto",
        cuda_settings: CudaSettings | None = None,
    ):
        self.manifest = bundle.manifest
        self.cuda_settings = cuda_settings or CudaSettings()
        options = _session_options(intra_op_threads or available_cpus(), inter_op_threads, allow_spinning)
        cuda = (check_cuda(self.cuda_settings.gpu.device_id) if preference != "cpu"
                else CudaCheck(False, "provider 'cpu' was asked for"))
        self.cuda_check = cuda
        if preference == "cuda" and not cuda.usable:
            raise RuntimeError(f"provider 'cuda' was required but CUDA cannot be used: {cuda.reason}")
        requested = choose_providers(preference, cuda)
        # every CUDA provider option in one place (shown in /info); None when CUDA is not asked for
        self.cuda_options = cuda_options(cuda, self.cuda_settings) if CUDA in requested else None
        task = self.manifest.model.task
        self.full = OrtGraph(bundle.graph_path, output_names(task), "full", with_options(requested, self.cuda_options),
                             options)
        self.provider = self.full.provider
        # why this replica is not on CUDA, in one line (empty when it is)
        self.provider_note = "" if self.provider == CUDA else (
            cuda.reason or "onnxruntime could not create the CUDA provider (see its log above)"
        )
        if preference == "cuda" and self.provider != CUDA:
            raise RuntimeError(f"provider 'cuda' was required but the session runs on {self.provider}: {self.provider_note}")
        if preference == "auto" and self.provider != CUDA:
            logger.info("CUDA not used: %s; running on %s", self.provider_note, self.provider)
        self._check_dims(self.full.shapes)

        self.precision_requested = precision
        self.precision, self.precision_note = resolve_precision(bundle, precision, self.provider)
        if precision != "auto" and self.precision != precision:
            logger.warning("precision %s is meant for %s; this replica runs on %s, so it serves %s",
                           precision, self.manifest.variants[precision].providers, self.provider, self.precision)
        variant = self.manifest.variants[self.precision]
        providers = [p for p in requested if p in variant.providers] or [CPU]
        self.fast = OrtGraph(
            bundle.variant_path(self.precision), encodings_output_names(task), f"encodings-{self.precision}",
            with_options(providers, self.cuda_options), options,
        )
        self._check_dims(self.fast.shapes)
        self.sizing = sizing_for(self.fast.provider)
        # texts that need only their pooled output run packed, where the fp32 graph serves on the CPU
        # (on CUDA, the fp16 graph and the GPU's own kernels are the design: docs/gpu.md)
        self.packed = None
        if bundle.packed_path is not None and self.precision == "fp32" and self.fast.provider == CPU:
            self.packed = OrtPackedGraph(bundle.packed_path, task, [CPU], options)

    def describe_cuda(self) -> dict:
        """The CUDA side of this encoder for /info: each check step, the device, the provider options."""
        check = self.cuda_check
        return {
            "usable": check.usable,
            "steps": [{"step": s.name, "ok": s.ok, "detail": s.detail} for s in check.steps],
            "device": check.device.describe() if check.device else None,
            "provider_options": self.cuda_options.provider_options() if self.cuda_options else None,
        }

    def _check_dims(self, shapes: dict) -> None:
        """The graph must be the one the manifest describes: the dims it states."""
        m = self.manifest.model
        expected = {
            "last_hidden_state": {2: m.hidden_size},
            "sentence_embedding": {1: m.sentence_dim},
            "logits": {1: len(m.labels or [])},
            "attentions": {0: m.num_layers, 2: m.num_heads},
        }
        for name, shape in shapes.items():
            for axis, size in expected[name].items():
                if len(shape) <= axis or (isinstance(shape[axis], int) and shape[axis] != size):
                    raise BundleError(f"graph output {name} has shape {shape}, the manifest implies {size} at axis {axis}")


def sizing_for(provider: str) -> Sizing:
    """How the runner sizes runs of a graph on `provider` (service/runtimes' `Sizing`): "device" on CUDA,
    where a run's cost hardly depends on its size, "cpu" elsewhere. Read from the encodings graph's
    session, the one every run without attention weights goes to (a CUDA session that fell back to the
    CPU is sized as the CPU it runs on)."""
    return "device" if provider == CUDA else "cpu"


def resolve_precision(bundle: Bundle, precision: str, provider: str) -> tuple[str, str]:
    """The precision a replica on `provider` serves, and why: `auto` is fp16 on CUDA where the
    bundle has a gated fp16 graph (it exists only if its gate passed) that holds the fidelity floor of
    `auto` (VariantInfo.auto_verdict), fp32 otherwise; an explicit
    precision is served where its graph is meant for `provider`, else fp32. A precision the bundle
    lacks is an error, never a silent change."""
    variants = bundle.manifest.variants
    if precision == "auto":
        fp16 = variants.get("fp16")
        if provider == CUDA and fp16 is not None and provider in fp16.providers and fp16.passed:
            served, why = fp16.auto_verdict  # the fidelity floor auto holds a lossy variant to
            gate = fp16.quality
            mean = f"mean cosine {gate.mean_cosine:.5f} vs fp32; " if gate else ""
            if served:
                return "fp16", f"auto: fp16 on CUDA ({mean}{why})"
            return "fp32", f"auto: fp32 on CUDA, not the fp16 graph ({mean}{why}) (TF32 off unless cuda_tf32)"
        if provider == CUDA:
            return "fp32", "auto: fp32 on CUDA, this bundle has no gated fp16 graph (TF32 off unless cuda_tf32)"
        return "fp32", f"auto: fp32 on {provider}"
    if precision not in variants:
        raise BundleError(
            f"{bundle.root}: no {precision} encodings graph in this bundle (has {', '.join(variants)}); "
            "export it again, or check the export log: a variant whose quality gate failed is not published"
        )
    if provider in variants[precision].providers:
        return precision, f"{precision} as configured"
    return "fp32", f"{precision} is meant for {', '.join(variants[precision].providers)}; on {provider}: fp32"


def preflight(bundle: Bundle, precision: str = "auto") -> None:
    """Before any replica starts: the graphs load, match the manifest and compute finite numbers.

    Raises BundleError (or RuntimeError) with a one-line reason; a bundle whose hashes match but
    whose graph is another model's must never be served.
    """
    encoder = OrtEncoder(bundle, preference="cpu", intra_op_threads=1, precision=precision)
    try:
        encoder.smoke_test()
    except Exception as exc:
        raise BundleError(f"{bundle.graph_path}: smoke test failed: {exc}") from None


def check_bundles(settings: ServiceSettings) -> list[str]:
    """Every listed bundle verified and smoke-tested, and served under a name of its own; returns the names."""
    names = []
    for ref in settings.bundles:
        bundle = load_bundle(ref.path)
        preflight(bundle, settings.precision)
        if settings.runtime == "openvino":  # asked for by name: it serves, or the start is refused here
            from service.runtimes.openvino import preflight as openvino_preflight

            openvino_preflight(bundle)
        names.append(ref.name or bundle.manifest.model.name)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two bundles would be served as {', '.join(map(repr, twice))}; give each a name of its "
                         "own (NAME=DIR on the command line, {path, name} in the config)")
    return names
