"""A stand-in runtime for benchmarks: the model replaced by a wait, so that the CPU side of the request
path (HTTP, JSON, tokenizer, batch queue, padding, pooling, the response) is measured as a GPU host sees it.

It implements service/runtimes' `Runtime` (the full and fast graphs, `graph_for`, `run`, `smoke_test`,
`resized`, `describe_cuda`, the descriptive attributes) with no packed graph and `sizing` "device", as
onnxruntime on CUDA serves (service/runtimes/onnxruntime.py packs only on the CPU): a batch runs as one
padded run as large as the device takes (service/engine/runner.py `plan_device_runs`).
`StandInLoader(sizing="cpu")` sizes its runs as a CPU runtime's instead (length-sorted sub-batches cut
for padding), to compare.
Each run returns every output the engine asks for, in the shapes and dtype (float32) the bundle's
contract gives them (bundle/contract.py: last_hidden_state (rows, tokens, hidden), sentence_embedding
(rows, dim) or a classifier's logits (rows, labels), attentions (layers, rows, heads, tokens, tokens)),
after a wait given by a latency model of the run's rows and padded tokens (`LatencyModel`):

- `0`: no wait at all: what the CPU side alone can do;
- `h100`: docs/gpu.md's H100 (all-MiniLM-L6-v2, onnxruntime fp16 on CUDA, 2026-11-27): 1.2 ms for 1
  text (19 tokens), 1.3 ms for 8 (8 x 40), 1.7 ms for 32 (32 x 47), 1.6 ms for 128 (128 x 49); a least
  squares line through those four runs: 1.35 ms + 0.05 us per padded token (1.35 ms for 1 text,
  1.42 ms for 32 x 47, 1.66 ms for 128 x 49). A run costs about the same from 1 to 128 texts.

The wait is `time.sleep`, which releases the GIL as a device wait in onnxruntime's `session.run`
does: the replica's event loop and its other batch go on meanwhile (a busy loop would not let them).
The pooled vectors are rows of a fixed table of random unit vectors picked by each text's ids, so a
response holds as many digits per float as a real one (a constant would serialise shorter).

**Never servable by a production config.** A replica loads its runtime with service/runtimes'
`load_runtime`, chosen from ServiceSettings (`runtime`: auto, onnxruntime or openvino; nothing else
validates). The stand-in reaches a replica only as the Encoder deployment's `runtime_loader` argument,
which service/app.py `compose(settings, runtime_loader=...)` binds when code passes one: `build_app` (the
import path of every Serve config, `python -m service`, KubeRay) never does, no setting or environment
variable names one, and service/ never imports benchmarks/ (tests/test_request_path.py checks all three).
`StandInLoader` pickles (a frozen dataclass of numbers), so Ray carries it to each replica process with
the deployment's init arguments.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bundle.contract import encodings_output_names, output_names
from service.runtimes import Sizing, TwoGraphs

TABLE_ROWS = 1009  # distinct pooled vectors (a prime: ids sums spread over it)


@dataclass(frozen=True)
class LatencyModel:
    """A run's wait: fixed_ms + per_token_us x padded tokens (rows x tokens)."""

    name: str
    fixed_ms: float
    per_token_us: float
    source: str = ""

    def seconds(self, rows: int, tokens: int) -> float:
        return (self.fixed_ms * 1e3 + self.per_token_us * rows * tokens) / 1e6


ZERO = LatencyModel("0 ms", 0.0, 0.0, "no wait")
# fitted to docs/gpu.md's H100 throughput line (encodings-fp16): (rows x padded tokens, ms) =
# (1 x 19, 1.2), (8 x 40, 1.3), (32 x 47, 1.7), (128 x 49, 1.6); least squares: 1.35 ms + 0.050 us/token
H100 = LatencyModel("H100 fp16", 1.35, 0.050, "docs/gpu.md's H100 table, all-MiniLM-L6-v2 fp16: 1.35 ms + 0.05 us per padded token")
MODELS = {"0": ZERO, "h100": H100}


def latency_model(name: str) -> LatencyModel:
    """`0`, `h100`, or a fixed cost per run in ms (e.g. `1.6`)."""
    if name in MODELS:
        return MODELS[name]
    try:
        ms = float(name)
    except ValueError:
        raise ValueError(f"latency model {name!r}: one of {', '.join(MODELS)}, or a fixed cost per run in ms") from None
    if ms < 0:
        raise ValueError(f"latency model {name!r}: a cost per run is >= 0 ms")
    return LatencyModel(f"{ms:g} ms per run", ms, 0.0, "a fixed cost per run")


class StandInGraph:
    """One graph of the stand-in: the outputs of `outputs`, shaped by the bundle's model, after the wait."""

    threads = 1
    provider = "stand-in (no device: benchmarks/standin.py)"

    def __init__(self, label: str, outputs: Sequence[str], model, latency: LatencyModel, table: np.ndarray) -> None:
        self.label, self.outputs, self.model, self.latency, self.table = label, tuple(outputs), model, latency, table
        self.runs = 0  # runs so far (read by the tests)
        self.shapes: list[tuple[int, int]] = []  # (rows, tokens) of the last runs, a few kept

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: Sequence[str],
            token_type_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        rows, tokens = input_ids.shape
        unknown = [o for o in outputs if o not in self.outputs]
        if unknown:
            raise ValueError(f"the {self.label} graph has no output {unknown[0]!r} (its outputs: {list(self.outputs)})")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention mask {attention_mask.shape} for input ids {input_ids.shape}")
        m = self.model
        out: dict[str, np.ndarray] = {}
        key = (input_ids * attention_mask).sum(axis=1) % TABLE_ROWS
        for name in outputs:
            if name == "sentence_embedding":
                out[name] = np.ascontiguousarray(self.table[key, : m.sentence_dim])
            elif name == "logits":
                out[name] = np.ascontiguousarray(self.table[key, : len(m.labels or [])])
            elif name == "last_hidden_state":
                out[name] = self.table[input_ids % TABLE_ROWS, : m.hidden_size]
            elif name == "attentions":  # each query spreads evenly over its row's attended keys
                spread = attention_mask / np.maximum(attention_mask.sum(axis=1, keepdims=True), 1)
                out[name] = np.ascontiguousarray(np.broadcast_to(
                    spread.astype(np.float32)[None, :, None, None, :], (m.num_layers, rows, m.num_heads, tokens, tokens)))
        self.runs += 1
        self.shapes = [*self.shapes[-15:], (rows, tokens)]
        wait = self.latency.seconds(rows, tokens) - (time.perf_counter() - started)
        if wait > 0:
            time.sleep(wait)  # releases the GIL, as a device wait does
        return out

    def resized(self, threads: int, streams: int) -> StandInGraph:
        return self  # nothing to size: the wait is the device's


class StandInRuntime(TwoGraphs):
    """The Runtime protocol over two stand-in graphs (full: with attentions; fast: encodings only), no packed graph."""

    runtime = "stand-in"
    packed = None
    sizing: Sizing = "device"  # like onnxruntime on CUDA: a run costs about the same whatever its size
    provider = "stand-in"
    precision = "fp32"
    precision_requested = "fp32"

    def __init__(self, manifest, latency: LatencyModel, seed: int = 0, sizing: Sizing = "device") -> None:
        self.manifest, self.latency, self.sizing = manifest, latency, sizing
        model = manifest.model
        width = max(model.hidden_size, model.sentence_dim, len(model.labels or []))
        table = np.random.default_rng(seed).standard_normal((TABLE_ROWS, width)).astype(np.float32)
        table /= np.linalg.norm(table[:, : model.sentence_dim], axis=1, keepdims=True)  # pooled rows: unit vectors
        self.full = StandInGraph("full-standin", output_names(model.task), model, latency, table)
        self.fast = StandInGraph("encodings-standin", encodings_output_names(model.task), model, latency, table)
        self.provider_note = f"a benchmark's stand-in for the model (benchmarks/standin.py): {latency.name}, {latency.source}"
        self.precision_note = "float32 outputs of the stand-in; no model runs"
        self.choice = {"row": "benchmarks/standin.py, bound by benchmark code (no setting selects it)"}

    def describe_cuda(self) -> dict:
        return {"usable": False, "steps": [], "device": None, "provider_options": None,
                "note": "the benchmark stand-in: no CUDA, no model"}


@dataclass(frozen=True)
class StandInLoader:
    """service/runtimes' RuntimeLoader for the stand-in: what benchmark code binds into the Encoder deployment
    (service/app.py compose's runtime_loader). Picklable: Ray carries it to every replica."""

    latency: LatencyModel = ZERO
    sizing: Sizing = "device"  # "cpu": runs sized as on a CPU (service/runtimes' Sizing), for comparison

    def __call__(self, bundle, settings, threads: int, gpu, streams: int = 1) -> StandInRuntime:
        return StandInRuntime(bundle.manifest, self.latency, sizing=self.sizing)
