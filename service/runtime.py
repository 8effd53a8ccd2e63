"""The only module that imports onnxruntime: session creation, provider choice, one padded run."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bundle.contract import INPUT_NAMES, OUTPUT_NAMES
from bundle.manifest import Bundle, BundleError

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


def choose_providers(preference: str, available: Sequence[str] | None = None) -> list[str]:
    """Providers to ask onnxruntime for, best first. CPU is always the last resort."""
    available = list(ort.get_available_providers() if available is None else available)
    if preference in ("auto", "cuda") and CUDA in available:
        return [CUDA, CPU]
    return [CPU]


class OrtEncoder:
    """An onnxruntime session over a verified bundle's graph, checked against its manifest.

    `provider` is what the created session actually uses: onnxruntime-gpu lists CUDA as
    available whenever it was compiled in, and silently falls back to CPU when the CUDA
    libraries or the device are missing, so only the session can tell.
    """

    def __init__(self, bundle: Bundle, preference: str = "auto", intra_op_threads: int = 0, inter_op_threads: int = 1, allow_spinning: bool = False):
        self.manifest = bundle.manifest
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads or available_cpus()
        options.inter_op_num_threads = inter_op_threads
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle onnxruntime threads spin by default; in a replica that shares cores with the
        # HTTP proxy and the ingress, spinning steals the CPU those need to feed it.
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if allow_spinning else "0")
        requested = choose_providers(preference)
        try:
            self.session = ort.InferenceSession(str(bundle.graph_path), options, providers=requested)
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise BundleError(f"{bundle.graph_path}: onnxruntime cannot load the graph: {exc}") from None
        self.provider = self.session.get_providers()[0]
        if preference == "cuda" and self.provider != CUDA:
            raise RuntimeError(f"provider 'cuda' was required but the session runs on {self.provider}")
        if CUDA in requested and self.provider != CUDA:
            logger.warning("CUDA was requested but could not be created; running on %s", self.provider)
        self.threads = options.intra_op_num_threads
        self._check_io()

    def _check_io(self) -> None:
        """The graph must be the one the manifest describes: names, and the dims it states."""
        m = self.manifest.model
        inputs = [i.name for i in self.session.get_inputs()]
        outputs = {o.name: o.shape for o in self.session.get_outputs()}
        if tuple(inputs) != INPUT_NAMES or tuple(outputs) != OUTPUT_NAMES:
            raise BundleError(
                f"graph I/O {inputs} -> {list(outputs)} does not match the manifest {list(INPUT_NAMES)} -> {list(OUTPUT_NAMES)}"
            )
        expected = {
            "last_hidden_state": {2: m.hidden_size},
            "sentence_embedding": {1: m.hidden_size},
            "attentions": {0: m.num_layers, 2: m.num_heads},
        }
        for name, dims in expected.items():
            shape = outputs[name]
            for axis, size in dims.items():
                if len(shape) <= axis or (isinstance(shape[axis], int) and shape[axis] != size):
                    raise BundleError(f"graph output {name} has shape {shape}, the manifest implies {size} at axis {axis}")

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One padded batch through the graph; returns only the outputs asked for."""
        feed = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "token_type_ids": np.zeros_like(input_ids),
        }
        return dict(zip(outputs, self.session.run(list(outputs), feed), strict=True))

    def smoke_test(self) -> None:
        """A tiny inference with every output: proves the session computes finite numbers."""
        ids = np.array([[101, 7592, 102]], dtype=np.int64)
        result = self.run(ids, np.ones_like(ids), OUTPUT_NAMES)
        for name, value in result.items():
            if not np.all(np.isfinite(value)):
                raise RuntimeError(f"smoke test: output {name} is not finite")


def preflight(bundle: Bundle) -> None:
    """Before any replica starts: the graph loads, matches the manifest and computes finite numbers.

    Raises BundleError (or RuntimeError) with a one-line reason; a bundle whose hashes match but
    whose graph is another model's must never be served.
    """
    encoder = OrtEncoder(bundle, preference="cpu", intra_op_threads=1)
    try:
        encoder.smoke_test()
    except Exception as exc:
        raise BundleError(f"{bundle.graph_path}: smoke test failed: {exc}") from None
