"""What the gates run a candidate graph on: an onnxruntime session, or OpenVINO behind the same calls.

export.parity and export.quality compare a graph against PyTorch through four calls of
onnxruntime's InferenceSession (`run`, `get_inputs`, `get_outputs`, `get_providers`); OpenVINO's
compiled model answers them here, so that bf16 is gated by the same code as every other variant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from bundle.contract import INPUT_NAMES
from service.runtimes.openvino import OvGraph


def ort_session(path: Path, providers: Sequence[str] = ("CPUExecutionProvider",)) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=list(providers))


@dataclass(frozen=True)
class _Port:
    name: str
    shape: list


class OpenVinoSession:
    """A graph compiled by OpenVINO at `precision` (fp32 or bf16), answering like an InferenceSession."""

    def __init__(self, path: Path, outputs: Sequence[str], precision: str, threads: int = 0):
        import os

        threads = threads or len(os.sched_getaffinity(0))
        self.graph = OvGraph(path, INPUT_NAMES, outputs, f"openvino-{precision}", precision, threads, streams=1)

    def get_inputs(self) -> list[_Port]:
        return [_Port(name, []) for name in INPUT_NAMES]

    def get_outputs(self) -> list[_Port]:
        return [_Port(name, shape) for name, shape in self.graph.shapes.items()]

    def get_providers(self) -> list[str]:
        return [f"{self.graph.provider} ({self.graph.precision})"]

    def run(self, outputs: Sequence[str], feed: dict) -> list:
        got = self.graph.run(feed["input_ids"], feed["attention_mask"], outputs)
        return [got[name] for name in outputs]
