"""How responses are written: orjson bodies, arrays as floats or base64, bytes counted by output kind."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import orjson
from fastapi import Request
from fastapi.responses import Response

JSON_FLOAT_BYTES = 16  # a float32 in JSON, with its separator, at most


def value_bytes(fmt: str, dtype: str) -> float:
    """Bytes one array value takes in a response: a JSON float, or its base64 share."""
    if fmt == "base64":
        return (2 if dtype == "float16" else 4) * 4 / 3
    return JSON_FLOAT_BYTES


class JSONResponse(Response):
    """orjson with numpy support: float32 arrays are written as float32, not widened to float64."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_array(array: np.ndarray, fmt: str, dtype: str) -> Any:
    """An array as nested floats or as base64 of little-endian bytes."""
    typed = array.astype("<f2" if dtype == "float16" else "<f4", copy=False)
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(typed).tobytes()).decode("ascii")
    # float16 goes out as the float32 of its rounded value: JSON has no half floats
    return np.ascontiguousarray(typed.astype(np.float32, copy=False))


class KindCounter:
    """Serialises each output once (as an orjson Fragment) and keeps its size by kind."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def fragment(self, kind: str, value: Any) -> orjson.Fragment:
        raw = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
        self.bytes[kind] = self.bytes.get(kind, 0) + len(raw)
        return orjson.Fragment(raw)

    def report(self, request: Request) -> None:
        """Hand the sizes to the metrics middleware; it adds the envelope as kind 'other'."""
        request.scope["response_kinds"] = self.bytes
