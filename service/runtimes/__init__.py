"""Runtimes: what runs a padded batch through a bundle's graphs, behind one small interface.

The engine (service/engine/) sees only `Runtime`: two graphs (`full`, with attention weights, and
`fast`, the fused encodings graph of the served precision), `graph_for(outputs)` to pick one, a
`smoke_test()` for health checks, and what it runs on (`provider`, `precision`, `threads`, the
notes that say why, `describe_cuda()`). `load_runtime` builds one from the settings. The first
implementation is onnxruntime (service/runtimes/onnxruntime.py) on CUDA or CPU; it owns its
probing (service/runtimes/cuda.py), its session options and the start-up preflight of bundles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:  # not at run time: `python -m service.runtimes.cuda` must find cuda.py not yet imported
    from bundle.manifest import Bundle
    from service.config import ServiceSettings
    from service.runtimes.cuda import GpuAssignment


class Graph(Protocol):
    label: str  # the inference-runs metric's `graph` label: full, encodings-fp32, ...

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One padded batch: (batch, tokens) int64 ids and mask in, the named outputs out."""
        ...


class Runtime(Protocol):
    full: Graph
    fast: Graph
    provider: str
    provider_note: str
    precision: str
    precision_requested: str
    precision_note: str
    threads: int

    def graph_for(self, outputs: Sequence[str]) -> Graph: ...

    def smoke_test(self) -> None: ...

    def describe_cuda(self) -> dict: ...


def load_runtime(bundle: Bundle, settings: ServiceSettings, threads: int, gpu: GpuAssignment) -> Runtime:
    """The runtime the settings ask for, on the device Ray gave the replica."""
    from service.runtimes.onnxruntime import CudaSettings, OrtEncoder

    return OrtEncoder(bundle, settings.provider, threads, settings.inter_op_threads, settings.allow_spinning,
                      settings.precision, CudaSettings.from_settings(settings, gpu))
