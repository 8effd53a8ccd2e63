"""What the gates run a candidate graph on: an onnxruntime session, or OpenVINO behind the same calls.

export.parity and export.quality compare a graph against PyTorch through four calls of
onnxruntime's InferenceSession (`run`, `get_inputs`, `get_outputs`, `get_providers`); OpenVINO's
compiled model answers them here, so that bf16 is gated by the same code as every other variant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnxruntime as ort

from bundle.contract import INPUT_NAMES
from service.runtimes.openvino import OvGraph


def quiet_options() -> ort.SessionOptions:
    """Session options that log errors only (onnxruntime's warnings about the graph are noise at export)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return options


def ort_session(path: Path, providers: Sequence[str] = ("CPUExecutionProvider",)) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), quiet_options(), providers=list(providers))


@dataclass(frozen=True)
class _Port:
    name: str
    shape: list


class _GraphAsSession:
    """The ports of an InferenceSession, read from a service graph (`self.graph`, with `shapes`)."""

    graph: Any

    def get_inputs(self) -> list[_Port]:
        return [_Port(name, []) for name in INPUT_NAMES]

    def get_outputs(self) -> list[_Port]:
        return [_Port(name, shape) for name, shape in self.graph.shapes.items()]


class OpenVinoSession(_GraphAsSession):
    """A graph compiled by OpenVINO at `precision` (fp32 or bf16), answering like an InferenceSession."""

    def __init__(self, path: Path, outputs: Sequence[str], precision: str, threads: int = 0):
        import os

        threads = threads or len(os.sched_getaffinity(0))
        self.graph = OvGraph(path, INPUT_NAMES, outputs, f"openvino-{precision}", precision, threads, streams=1)

    def get_providers(self) -> list[str]:
        return [f"{self.graph.provider} ({self.graph.precision})"]

    def run(self, outputs: Sequence[str], feed: dict) -> list:
        got = self.graph.run(feed["input_ids"], feed["attention_mask"], outputs, feed.get("token_type_ids"))
        return [got[name] for name in outputs]


class PackedSession(_GraphAsSession):
    """The packed graph answering like an InferenceSession on padded feeds, so that the parity and
    quality gates judge it with the code that judges every other graph: each padded batch's rows are
    packed as the service packs them (service/runtimes/packing.py: plan_packs, then pack), so what is
    gated is what is served."""

    def __init__(self, graph, pooling: str, position_offset: int, max_tokens: int, packed_tokens: int = 256):
        self.graph, self.pooling, self.position_offset = graph, pooling, position_offset
        self.row_tokens = max(packed_tokens, max_tokens)  # a text longer than a row is a row alone in the service

    def get_providers(self) -> list[str]:
        return [f"{self.graph.provider}, packed ({self.graph.label})"]

    def run(self, outputs: Sequence[str], feed: dict) -> list:
        import numpy as np

        from service.runtimes.packing import pack, plan_packs

        lengths = [int(n) for n in feed["attention_mask"].sum(axis=1)]
        ids = [feed["input_ids"][row, :n] for row, n in enumerate(lengths)]
        types = [feed["token_type_ids"][row, :n] for row, n in enumerate(lengths)] if "token_type_ids" in feed else None
        pooled = None
        for rows in plan_packs(lengths, self.row_tokens):
            got = self.graph.run_packed(pack([ids[r] for r in rows], [types[r] for r in rows] if types else None,
                                             self.position_offset, self.pooling, self.graph.multiple))
            if pooled is None:
                pooled = np.zeros((len(ids), got.shape[1]), dtype=got.dtype)
            pooled[rows] = got
        return [pooled]
