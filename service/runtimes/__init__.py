"""Runtimes: what runs a padded batch through a bundle's graphs, behind one small interface.

The engine (service/engine/) sees only `Runtime`: two graphs (`full`, with attention weights, and
`fast`, the fused encodings graph of the served precision), `graph_for(outputs)` to pick one, a
`smoke_test()` for health checks, what it runs on (`runtime`, `provider`, `precision`, `threads`,
the notes that say why, `choice`, `describe_cuda()`), and `resized(threads, streams)`: the same
graphs in sessions sized for another number of concurrent batches (a live max_concurrent_batches), and
`sizing`: what kind of device its runs go to, which decides how the runner cuts a batch into runs
(`cpu`, the default: length-sorted sub-batches cut where padding would cost; `device`: one run as large
as the device takes, service/engine/runner.py `plan_device_runs`).
`load_runtime` builds one from the settings (service/runtimes/choice.py, whose table says why). Implementations: onnxruntime (service/runtimes/onnxruntime.py) on CUDA
or CPU, which owns its probing (service/runtimes/cuda.py), its session options and the start-up
preflight of bundles; OpenVINO (service/runtimes/openvino.py) for bf16 on CPUs with bf16 units.

`RuntimeLoader` is `load_runtime`'s signature: the one seam where a test or a benchmark hands a replica
another loader (service/engine/engine.py `load_engine`, the Encoder deployment's `runtime_loader`
argument, service/app.py `compose`). No setting, config file or environment variable selects one: a
production replica always loads its runtime with `load_runtime` (benchmarks/standin.py's stand-in
reaches a replica only through that argument, bound by benchmark code).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

if TYPE_CHECKING:  # not at run time: `python -m service.runtimes.cuda` must find cuda.py not yet imported
    from bundle.manifest import Bundle
    from service.config import ServiceSettings
    from service.runtimes.cuda import GpuAssignment


# How the runner sizes a runtime's padded runs (service/engine/runner.py `BatchRunner._padded`):
# - "cpu": every padded token costs what a real one does and a run's fixed cost is small, so a batch is
#   length-sorted into sub-batches cut at `sub_batch_tokens`, `max_sub_batch_size` and `max_padding`;
# - "device": a run costs about the same from 1 to 128 texts (docs/gpu.md's H100: 1.2-1.7 ms for
#   fp16 MiniLM) and a padded token next to nothing, so a batch is one run as large as the device takes
#   (`device_run_tokens`), its length rounded up to a bucket (`device_length_bucket`).
Sizing = Literal["cpu", "device"]


class Graph(Protocol):
    label: str  # the inference-runs metric's `graph` label: full, encodings-fp32, ...
    threads: int  # threads one run uses, as the session or compiled model was made

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str],
            token_type_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One padded batch: (batch, tokens) int64 ids, mask and token types (None: all 0) in, the named outputs out."""
        ...

    def resized(self, threads: int, streams: int) -> Graph:
        """This graph sized for `threads` per run and `streams` runs at once: a new session (blocking),
        or itself when nothing would change."""
        ...


class PackedGraph(Graph, Protocol):
    multiple: int  # a row's tokens are padded to a multiple of this (service/runtimes/packing.py)

    def run_packed(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        """One row of packed texts (packing.pack's feed) in, their pooled outputs (texts, dim) out."""
        ...


class Runtime(Protocol):
    runtime: str  # what runs the encodings graph: onnxruntime or openvino
    full: Graph
    fast: Graph
    packed: PackedGraph | None  # the packed graph, where the bundle has one and this runtime serves it
    provider: str
    provider_note: str
    precision: str
    precision_requested: str
    precision_note: str
    choice: dict | None  # the row of service/runtimes/choice.py's table that chose it, for /info
    threads: int  # per run of the encodings graph
    sizing: Sizing  # how the runner sizes its padded runs: "device" where the encodings graph runs on CUDA

    def graph_for(self, outputs: Sequence[str]) -> Graph: ...

    def resized(self, threads: int, streams: int) -> Runtime:
        """The same graphs and precision sized for `threads` per run and `streams` batches at once (a copy:
        batches running on this one finish on its sessions), or itself when nothing would change."""
        ...

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str],
            token_type_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One padded batch through the graph that can produce `outputs`, the cheaper one when both can."""
        ...

    def smoke_test(self) -> None: ...

    def describe_cuda(self) -> dict: ...


class TwoGraphs:
    """What every runtime does with its two graphs, `full` and `fast`, and its bundle's `manifest`:
    pick the cheaper graph that has the outputs asked for, run it, and smoke-test both."""

    full: Graph
    fast: Graph
    packed: PackedGraph | None = None
    choice: dict | None = None  # set by service/runtimes/choice.py
    sizing: Sizing = "cpu"  # a runtime on a device says so (onnxruntime on CUDA, the benchmarks' stand-in)

    @property
    def threads(self) -> int:
        """Threads one run of the encodings graph uses, read from its session or compiled model."""
        return self.fast.threads

    def graph_for(self, outputs: Sequence[str]) -> Graph:
        return self.full if "attentions" in outputs else self.fast

    def resized(self, threads: int, streams: int):
        """A copy whose graphs are sized for `threads` per run and `streams` runs at once, or self when
        every graph already is. Blocking (sessions load, OpenVINO compiles): call it off the event loop."""
        graphs = {"full": self.full, "fast": self.fast, "packed": self.packed}
        sized = {name: graph.resized(threads, streams) for name, graph in graphs.items() if graph is not None}
        if all(sized[name] is graphs[name] for name in sized):
            return self
        runtime = copy.copy(self)
        for name, graph in sized.items():
            setattr(runtime, name, graph)
        return runtime

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str],
            token_type_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One padded batch through the graph that can produce `outputs`, the cheaper one when both can."""
        return self.graph_for(outputs).run(input_ids, attention_mask, outputs, token_type_ids)

    def smoke_test(self) -> None:
        """A tiny inference through every graph, every output: proves the sessions compute finite numbers."""
        smoke_test((self.full, self.fast), self.manifest.model.vocab_size)
        if self.packed is not None:
            from service.runtimes.packing import pack

            model = self.manifest.model
            ids = [np.array(SMOKE_IDS, dtype=np.int64) % model.vocab_size, np.array(SMOKE_IDS[::2]) % model.vocab_size]
            pooled = self.packed.run_packed(pack(ids, None, self.manifest.packed.position_offset, model.pooling,
                                                 self.packed.multiple))
            if pooled.shape[0] != len(ids) or not np.all(np.isfinite(pooled)):
                raise RuntimeError(f"smoke test: the {self.packed.label} graph returned {pooled.shape}, or values not finite")


# BERT's "[CLS] hello [SEP]", folded into smaller vocabularies (any ids do for finite numbers)
SMOKE_IDS = (101, 7592, 102)


def smoke_test(graphs: Sequence[Graph], vocab_size: int) -> None:
    """A tiny inference through each graph, every output: proves it computes finite numbers."""
    ids = np.array([SMOKE_IDS], dtype=np.int64) % vocab_size
    for graph in graphs:
        for name, value in graph.run(ids, np.ones_like(ids), graph.outputs).items():
            if not np.all(np.isfinite(value)):
                raise RuntimeError(f"smoke test: output {name} of the {graph.label} graph is not finite")


def load_runtime(bundle: Bundle, settings: ServiceSettings, threads: int, gpu: GpuAssignment,
                 streams: int = 1) -> Runtime:
    """The runtime the settings ask for, on the device Ray gave the replica: onnxruntime (CUDA or CPU),
    or OpenVINO for the encodings graph on a CPU (service/runtimes/choice.py decides, and says why)."""
    from service.runtimes.choice import choose_runtime

    return choose_runtime(bundle, settings, threads, gpu, streams)


# load_runtime's signature (bundle, settings, threads per run, the replica's GPU, streams) -> Runtime: what
# load_engine calls. Only code (a test, a benchmark) passes another; no setting names one.
RuntimeLoader = Callable[["Bundle", "ServiceSettings", int, "GpuAssignment", int], Runtime]
