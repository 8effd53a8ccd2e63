"""The only module that imports onnxruntime: session creation, provider choice, one padded run."""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bundle.contract import ENCODINGS_OUTPUT_NAMES, INPUT_NAMES, OUTPUT_NAMES
from bundle.manifest import Bundle, BundleError, load_bundle
from service.config import ServiceSettings

logger = logging.getLogger("service.runtime")

CUDA = "CUDAExecutionProvider"
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


@dataclass(frozen=True)
class CudaCheck:
    """Whether onnxruntime can use CUDA in this process, and if not, why (one plain line)."""

    usable: bool
    reason: str = ""


@cache
def check_cuda() -> CudaCheck:
    """Ask, without creating a session, whether the CUDA provider can work here.

    onnxruntime-gpu lists CUDA as available whenever it was compiled in; creating a session on
    a machine without a GPU or without CUDA's libraries prints red errors and falls back to CPU.
    Checked in the order a user fixes things: the build, the driver and a device, then the
    libraries the provider links against (the loader's message names the missing one).
    """
    if CUDA not in ort.get_available_providers():
        return CudaCheck(False, f"this onnxruntime build ({ort.__version__}) has no CUDA provider (install onnxruntime-gpu)")
    if not sys.platform.startswith("linux"):
        return CudaCheck(True)  # the checks below are written for Linux's loader
    reason = cuda_device_error() or cuda_provider_library_error()
    return CudaCheck(reason is None, reason or "")


def cuda_device_error() -> str | None:
    """Why no CUDA device can be used (no driver, or no visible GPU); None when one can."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no GPU: the NVIDIA driver library libcuda.so.1 is not installed"
    count = ctypes.c_int(0)
    status = driver.cuInit(0)
    if status == 0:
        status = driver.cuDeviceGetCount(ctypes.byref(count))
    if status != 0 or count.value == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"no GPU visible to this process (CUDA driver error {status}, {count.value} devices"
                f"{'' if visible is None else f', CUDA_VISIBLE_DEVICES={visible!r}'})")
    return None


def cuda_provider_library_error() -> str | None:
    """The loader's message when onnxruntime's CUDA provider library cannot be loaded (it names the
    missing CUDA or cuDNN library); None when it loads."""
    capi = Path(ort.__file__).parent / "capi"
    try:
        ctypes.CDLL(str(capi / "libonnxruntime_providers_shared.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(capi / "libonnxruntime_providers_cuda.so"))
    except OSError as exc:
        return f"onnxruntime's CUDA provider cannot load: {exc}"
    return None


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


def _session_options(threads: int, inter_op_threads: int, allow_spinning: bool) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = inter_op_threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Idle onnxruntime threads spin by default; in a replica that shares cores with the
    # HTTP proxy and the ingress, spinning steals the CPU those need to feed it.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
    return options


class OrtGraph:
    """One onnxruntime session over one graph file of a verified bundle.

    `provider` is what the created session actually uses: onnxruntime-gpu lists CUDA as
    available whenever it was compiled in, and silently falls back to CPU when the CUDA
    libraries or the device are missing, so only the session can tell.
    """

    def __init__(self, path: Path, outputs: Sequence[str], label: str, providers: list[str], options: ort.SessionOptions):
        self.path, self.outputs, self.label = path, tuple(outputs), label
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise BundleError(f"{path}: onnxruntime cannot load the graph: {exc}") from None
        self.provider = self.session.get_providers()[0]
        inputs = [i.name for i in self.session.get_inputs()]
        got = tuple(o.name for o in self.session.get_outputs())
        if tuple(inputs) != INPUT_NAMES or got != self.outputs:
            raise BundleError(
                f"{path}: graph I/O {inputs} -> {list(got)} does not match the manifest "
                f"{list(INPUT_NAMES)} -> {list(self.outputs)}"
            )
        self.shapes = {o.name: o.shape for o in self.session.get_outputs()}

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One padded batch through the graph; returns only the outputs asked for."""
        feed = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": np.zeros_like(input_ids)}
        if self.provider == CUDA:
            return self._run_bound(feed, outputs)
        return dict(zip(outputs, self.session.run(list(outputs), feed), strict=True))

    def _run_bound(self, feed: dict[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """CUDA: inputs copied to the device once, outputs left there and copied back once each.

        Without IO binding, session.run stages every input and output through extra host
        buffers on each call.
        """
        binding = self.session.io_binding()
        for name, array in feed.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
        for name in outputs:
            binding.bind_output(name, "cuda", 0)
        self.session.run_with_iobinding(binding)
        return dict(zip(outputs, binding.copy_outputs_to_cpu(), strict=True))


class OrtEncoder:
    """Both graphs of a bundle: the full one (attention weights) and the fast encodings-only one.

    A run that needs attention weights goes to the full graph, every other run to the
    encodings graph of the configured precision. A precision whose graph is meant for another
    provider (fp16 is for CUDA) falls back to fp32, with a warning, rather than run slowly.
    """

    def __init__(
        self,
        bundle: Bundle,
        preference: str = "auto",
        intra_op_threads: int = 0,
        inter_op_threads: int = 1,
        allow_spinning: bool = False,
        precision: str = "fp32",
    ):
        self.manifest = bundle.manifest
        self.threads = intra_op_threads or available_cpus()
        options = _session_options(self.threads, inter_op_threads, allow_spinning)
        cuda = check_cuda() if preference != "cpu" else CudaCheck(False, "provider 'cpu' was asked for")
        if preference == "cuda" and not cuda.usable:
            raise RuntimeError(f"provider 'cuda' was required but CUDA cannot be used: {cuda.reason}")
        requested = choose_providers(preference, cuda)
        self.full = OrtGraph(bundle.graph_path, OUTPUT_NAMES, "full", requested, options)
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
        self.precision = resolve_precision(bundle, precision, self.provider)
        if self.precision != precision:
            logger.warning("precision %s is meant for %s; this replica runs on %s, so it serves %s",
                           precision, self.manifest.variants[precision].providers, self.provider, self.precision)
        variant = self.manifest.variants[self.precision]
        providers = [p for p in requested if p in variant.providers] or [CPU]
        self.fast = OrtGraph(
            bundle.variant_path(self.precision), ENCODINGS_OUTPUT_NAMES, f"encodings-{self.precision}", providers, options
        )
        self._check_dims(self.fast.shapes)

    def _check_dims(self, shapes: dict) -> None:
        """The graph must be the one the manifest describes: the dims it states."""
        m = self.manifest.model
        expected = {
            "last_hidden_state": {2: m.hidden_size},
            "sentence_embedding": {1: m.hidden_size},
            "attentions": {0: m.num_layers, 2: m.num_heads},
        }
        for name, shape in shapes.items():
            for axis, size in expected[name].items():
                if len(shape) <= axis or (isinstance(shape[axis], int) and shape[axis] != size):
                    raise BundleError(f"graph output {name} has shape {shape}, the manifest implies {size} at axis {axis}")

    def graph_for(self, outputs: Sequence[str]) -> OrtGraph:
        return self.full if "attentions" in outputs else self.fast

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One padded batch through the graph that can produce `outputs`, the cheaper one when both can."""
        return self.graph_for(outputs).run(input_ids, attention_mask, outputs)

    def smoke_test(self) -> None:
        """A tiny inference through both graphs, every output: proves the sessions compute finite numbers."""
        # BERT's "[CLS] hello [SEP]", folded into smaller vocabularies (any ids do for finite numbers)
        ids = np.array([[101, 7592, 102]], dtype=np.int64) % self.manifest.model.vocab_size
        for graph in (self.full, self.fast):
            for name, value in graph.run(ids, np.ones_like(ids), graph.outputs).items():
                if not np.all(np.isfinite(value)):
                    raise RuntimeError(f"smoke test: output {name} of the {graph.label} graph is not finite")


def resolve_precision(bundle: Bundle, precision: str, provider: str) -> str:
    """The precision a replica on `provider` serves: the one asked for, or fp32 when its graph is
    meant for other providers. A precision the bundle lacks is an error, never a silent change."""
    variants = bundle.manifest.variants
    if precision not in variants:
        raise BundleError(
            f"{bundle.root}: no {precision} encodings graph in this bundle (has {', '.join(variants)}); "
            "export it again, or check the export log: a variant whose quality gate failed is not published"
        )
    return precision if provider in variants[precision].providers else "fp32"


def preflight(bundle: Bundle, precision: str = "fp32") -> None:
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
        names.append(ref.name or bundle.manifest.model.name)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"two bundles would be served as {', '.join(map(repr, twice))}; give each a name of its "
                         "own (NAME=DIR on the command line, {path, name} in the config)")
    return names
