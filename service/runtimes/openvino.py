"""OpenVINO on CPU: the bf16 matrix units (AVX512_BF16, AMX) that onnxruntime's x86 kernels do not use.

OpenVINO reads the bundle's ONNX graphs as they are; `INFERENCE_PRECISION_HINT=bf16` makes its CPU
plugin run the matrix products in bf16 (accumulating in fp32). On this kind of CPU that is as fast
as int8 at nearly fp32's fidelity (docs/performance.md). Its compiled models go to a cache
directory, so that a restarted replica loads instead of compiling. The service and the export
stage (which gates bf16 with it) share this module's probing and compile options.
"""

from __future__ import annotations

import copy
import logging
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bundle.contract import INPUT_NAMES, PACKED_INPUT_NAMES, encodings_output_names, output_names, packed_output_names
from bundle.manifest import Bundle, BundleError
from service.runtimes import TwoGraphs

if TYPE_CHECKING:
    from service.runtimes import Graph

logger = logging.getLogger("service.runtimes.openvino")

DEVICE = "CPU"
PROVIDER = "OpenVINO CPU"  # what /info, /health and the model-info metric say a graph runs on
HINTS = {"fp32": "f32", "bf16": "bf16"}  # our precision names -> OpenVINO's INFERENCE_PRECISION_HINT
RUNTIME_CACHE_CAPACITY = 256  # compiled shapes kept per graph
# the one line that refuses a start: a runtime asked for by name serves or refuses; only `auto` falls back
REQUIRED = "runtime 'openvino' was asked for, but OpenVINO cannot serve"
SEQ_MULTIPLE = 8  # runs are padded to a multiple of this many tokens (masked: the outputs do not change)


@dataclass(frozen=True)
class OpenVinoCheck:
    """Whether OpenVINO can run here, and with bf16 units; `reason` says why not, in one line."""

    installed: bool
    bf16_units: bool
    version: str = ""
    cpu: str = ""
    reason: str = ""


@cache
def check_openvino() -> OpenVinoCheck:
    """Is the openvino package importable, and does its CPU plugin report bf16 units (OPTIMIZATION_CAPABILITIES)?"""
    try:
        import openvino as ov
    except ImportError as exc:
        return OpenVinoCheck(False, False, reason=f"openvino is not installed ({exc}); pip install '.[serve]'")
    try:
        core = ov.Core()
        capabilities = core.get_property(DEVICE, "OPTIMIZATION_CAPABILITIES")
        cpu = str(core.get_property(DEVICE, "FULL_DEVICE_NAME"))
    except Exception as exc:  # a CPU plugin that does not load
        return OpenVinoCheck(True, False, ov.__version__, reason=f"OpenVINO's CPU plugin does not load: {exc}")
    bf16 = "BF16" in capabilities
    return OpenVinoCheck(True, bf16, ov.__version__.split("-")[0], cpu,
                         "" if bf16 else f"this CPU ({cpu}) has no bf16 units (OpenVINO reports {', '.join(capabilities)})")


def usable_cache_dir(path: Path | None) -> tuple[Path | None, str]:
    """The cache directory if it can be written, else None and why (one line): a cache that cannot
    be written must cost a recompile at each start, never the replica."""
    if path is None:
        return None, "no cache directory configured"
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as exc:
        return None, f"cache directory {path} is not usable ({exc.strerror or exc}): compiling without a cache"
    return path, ""


def compile_options(precision: str, threads: int, streams: int) -> dict:
    """The CPU plugin's options: bf16 or f32 matrix products, the replica's CPU share as threads,
    one stream per batch that may run at once (each stream's runs use threads / streams), and stream
    threads the kernel may move between cores."""
    if precision not in HINTS:
        raise ValueError(f"OpenVINO runs fp32 or bf16 here, not {precision}")
    return {
        # compiled kernels are cached per input shape; OpenVINO keeps 5000 by default, which grew a
        # replica by 700 MB over 1500 runs of varied shapes: bounded here, and sequence lengths padded
        # to a multiple of SEQ_MULTIPLE so that few shapes recur (as fast as the unbounded cache)
        "CPU_RUNTIME_CACHE_CAPACITY": RUNTIME_CACHE_CAPACITY,
        "INFERENCE_PRECISION_HINT": HINTS[precision],
        "INFERENCE_NUM_THREADS": max(1, threads),
        "NUM_STREAMS": max(1, min(streams, threads)),
        "PERFORMANCE_HINT": "THROUGHPUT" if streams > 1 else "LATENCY",
        # OpenVINO pins a THROUGHPUT model's stream threads to cores by default. A replica shares its cores
        # (with its own event loops, Ray's processes, a neighbour pod), and a pinned stream whose core is busy
        # waits for it while another core idles: beside one process spinning on one core, single texts at 2
        # clients had a p99 of 5.3-5.7x alone pinned, 1.5-1.9x unpinned (the same capacity alone, 2-core EPYC)
        "ENABLE_CPU_PINNING": False,
    }


def reason(exc: Exception) -> str:
    """OpenVINO's error in one line: its last line that says something (the first ones name source files:
    `Exception from src/inference/src/cpp/core.cpp:132:`)."""
    lines = [line.strip(" -") for line in str(exc).splitlines()]
    said = [line for line in lines if line and not line.startswith(("Exception from ", "Check '"))]
    return said[-1] if said else (lines[0] if lines else type(exc).__name__)


def matches(ports, names: Sequence[str]) -> bool:
    """Whether the graph's ports are the manifest's, in order. A port is matched by any of its names
    (`get_names()`): OpenVINO gives a tensor the names of the values it was merged with (an input
    followed by a Cast is also `/encoder/embeddings/Cast_output_0`), and `get_any_name()` may be any of them."""
    return len(ports) == len(names) and all(name in port.get_names() for port, name in zip(ports, names))


def port_names(ports, names: Sequence[str]) -> list[str]:
    """Each port as the error line shows it: the manifest's name where the port has it, else all its names."""
    shown = []
    for i, port in enumerate(ports):
        own = port.get_names()
        shown.append(names[i] if i < len(names) and names[i] in own else "|".join(sorted(own)))
    return shown


class OvGraph:
    """One compiled graph; `run` may be called from several threads at once (one infer request each).
    Compiled with `threads` in all, shared by `streams` runs at once; afterwards `threads` (per run) and
    `streams` are what the compiled model reports."""

    def __init__(self, path: Path, inputs: Sequence[str], outputs: Sequence[str], label: str, precision: str,
                 threads: int, streams: int, cache_dir: Path | None = None):
        self.path, self.outputs, self.label, self.precision = path, tuple(outputs), label, precision
        self.inputs, self.cache_dir, self.provider = tuple(inputs), cache_dir, PROVIDER
        self._compile(threads, streams)

    def _compile(self, threads: int, streams: int) -> None:
        import openvino as ov

        core = ov.Core()
        if self.cache_dir is not None:
            core.set_property({"CACHE_DIR": str(self.cache_dir)})
        try:
            self.compiled = core.compile_model(str(self.path), DEVICE, compile_options(self.precision, threads, streams))
        except Exception as exc:  # OpenVINO raises RuntimeError with multi-line text
            raise BundleError(f"{self.path}: OpenVINO cannot compile the graph: {reason(exc)}") from None
        inputs, outputs = self.compiled.inputs, self.compiled.outputs
        if not (matches(inputs, self.inputs) and matches(outputs, self.outputs)):
            raise BundleError(f"{self.path}: graph I/O {port_names(inputs, self.inputs)} -> "
                              f"{port_names(outputs, self.outputs)} does not match the manifest "
                              f"{list(self.inputs)} -> {list(self.outputs)}")
        self.sized_for = (threads, streams)
        # what the plugin made of the options (it caps threads at the CPUs it sees): the figures in use
        self.streams = int(self.compiled.get_property("NUM_STREAMS"))
        self.threads = max(1, int(self.compiled.get_property("INFERENCE_NUM_THREADS")) // max(1, self.streams))
        self.shapes = {name: [d.get_length() if d.is_static else None for d in o.get_partial_shape()]
                       for name, o in zip(self.outputs, outputs, strict=True)}
        self._ports = dict(zip(self.outputs, outputs, strict=True))
        self._feeds = dict(zip(self.inputs, inputs, strict=True))
        self._local = threading.local()  # infer requests are the compiled model's: new ones for a new one

    def resized(self, threads: int, streams: int) -> OvGraph:
        """This graph compiled for `threads` per run and `streams` runs at once (threads x streams in all),
        or itself when it was compiled so. Blocking (a compile, or a cache load); this one keeps serving
        the runs that hold it."""
        if self.sized_for == (threads * streams, streams):
            return self
        graph = copy.copy(self)
        graph._compile(threads * streams, streams)
        return graph

    def _request(self):
        request = getattr(self._local, "request", None)
        if request is None:
            request = self._local.request = self.compiled.create_infer_request()
        return request

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str],
            token_type_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One padded batch; the outputs are copied out of the request's buffers, which its next run overwrites."""
        tokens = input_ids.shape[1]
        types = np.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        if extra := -tokens % SEQ_MULTIPLE:  # masked padding: a shape the kernel cache has seen
            input_ids, attention_mask, types = (np.pad(a, ((0, 0), (0, extra))) for a in (input_ids, attention_mask, types))
        feed = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": types}
        result = self._request().infer({port: feed[name] for name, port in self._feeds.items()})
        out = {}
        for name in outputs:
            value = result[self._ports[name]]
            if extra and name == "last_hidden_state":
                value = value[:, :tokens]
            elif extra and name == "attentions":
                value = value[..., :tokens, :tokens]
            out[name] = np.array(value, copy=True)
        return out


class OvPackedGraph(OvGraph):
    """The packed graph (service/runtimes/packing.py) on OpenVINO: one row of texts in, their pooled outputs out."""

    multiple = SEQ_MULTIPLE  # rows padded to a multiple of this many tokens: a shape the kernel cache has seen

    def __init__(self, path: Path, task: str, precision: str, threads: int, streams: int, cache_dir: Path | None = None):
        super().__init__(path, PACKED_INPUT_NAMES, packed_output_names(task), f"packed-{precision}-openvino", precision,
                         threads, streams, cache_dir)

    def run_packed(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        result = self._request().infer({port: feed[name] for name, port in self._feeds.items()})
        return np.array(result[self._ports[self.outputs[0]]], copy=True)


def preflight(bundle: Bundle) -> None:
    """`runtime: openvino` before any replica starts: OpenVINO is installed, and the encodings graph (and
    the packed one) compile, match the manifest and compute finite numbers, at f32 (the loading and I/O
    code of bf16 too). Raises RuntimeError with a one-line reason: a runtime asked for by name serves or
    refuses the start, never falls back."""
    from service.runtimes import smoke_test

    check = check_openvino()
    if not check.installed:
        raise RuntimeError(f"{REQUIRED}: {check.reason}")
    task = bundle.manifest.model.task
    try:
        fast = OvGraph(bundle.root / bundle.manifest.variants["fp32"].file, INPUT_NAMES, encodings_output_names(task),
                       "encodings-fp32-openvino", "fp32", 1, 1)
        smoke_test([fast], bundle.manifest.model.vocab_size)
        if bundle.manifest.packed is not None:
            OvPackedGraph(bundle.packed_path, task, "fp32", 1, 1)
    except Exception as exc:  # noqa: BLE001 - a compile error, a graph that does not match, a smoke test
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RuntimeError(f"{REQUIRED}: {why}") from None


class OvEncoder(TwoGraphs):
    """A bundle served with its encodings graph on OpenVINO (bf16, or f32) and its full graph (attention
    weights) as given: onnxruntime fp32, unless the bundle's bf16 attention gate passed. `threads` is per
    run, as onnxruntime's per-session figure: the compiled models get threads x streams in all."""

    runtime = "openvino"

    def __init__(self, bundle: Bundle, precision: str, threads: int, streams: int, cache_dir: Path | None,
                 full: Graph, full_provider: str, precision_requested: str, precision_note: str,
                 provider_note: str = "", cuda: dict | None = None):
        self.manifest = bundle.manifest
        self.precision, self.precision_requested, self.precision_note = precision, precision_requested, precision_note
        variant = self.manifest.variants.get(precision) or self.manifest.variants["fp32"]
        task = self.manifest.model.task
        total = max(1, threads) * max(1, streams)
        self.fast = OvGraph(bundle.root / variant.file, INPUT_NAMES, encodings_output_names(task),
                            f"encodings-{precision}-openvino", precision, total, streams, cache_dir)
        gate = variant.attention_gate
        if precision == "bf16" and gate is not None and gate.passed:
            self.full = OvGraph(bundle.graph_path, INPUT_NAMES, output_names(task), "full-bf16-openvino", precision,
                                total, streams, cache_dir)
        else:
            self.full = full
        # texts that need only their pooled output run packed: at fp32, or at bf16 where its own gate passed
        packed = self.manifest.packed
        self.packed = None
        if packed is not None and (precision == "fp32" or (packed.bf16 is not None and packed.bf16.passed)):
            self.packed = OvPackedGraph(bundle.packed_path, task, precision, total, streams, cache_dir)
        self.provider = full_provider  # the device: OpenVINO runs on the CPU, the full graph on this provider
        self.provider_note = provider_note  # why not CUDA
        self._cuda = cuda or {"usable": False, "steps": [], "device": None, "provider_options": None}

    def describe_cuda(self) -> dict:
        """The onnxruntime side's CUDA check (why this replica is on the CPU), for /info."""
        return self._cuda
