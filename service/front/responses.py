"""How responses are written: orjson bodies, arrays as floats or base64, bytes counted by output kind."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from fastapi.responses import Response

from service.front.call import Call
from service.observability import tracing

JSON_FLOAT_BYTES = 16  # a float32 in JSON, with its separator, at most
# Responses estimated above this are built and serialised in a worker thread, not on the event loop
# that every other request of the replica waits on.
OFF_LOOP_BYTES = 256 * 1024
# Values per serialisation call of a large array. orjson and base64 hold the GIL for a whole call, so
# a thread serialising 60 MB in one call would stop the event loop as surely as doing it there; in
# calls of this size (about 1 MB of JSON, a few ms) the loop runs between them.
CHUNK_VALUES = 65536


def value_bytes(fmt: str, dtype: str) -> float:
    """Bytes one array value takes in a response: a JSON float, or its base64 share."""
    if fmt == "base64":
        return (2 if dtype == "float16" else 4) * 4 / 3
    return JSON_FLOAT_BYTES


class JSONResponse(Response):
    """orjson with numpy support: float32 arrays are written as float32, not widened to float64."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        with tracing.span("serialize"):
            return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_array(array: np.ndarray, fmt: str, dtype: str) -> Any:
    """An array as nested floats or as base64 of little-endian bytes."""
    typed = array.astype("<f2" if dtype == "float16" else "<f4", copy=False)
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(typed).tobytes()).decode("ascii")
    # float16 goes out as the float32 of its rounded value: JSON has no half floats
    return np.ascontiguousarray(typed.astype(np.float32, copy=False))


def array_json(array: np.ndarray, fmt: str, dtype: str) -> bytes:
    """An array as JSON bytes, nested floats or a base64 string, exactly what orjson writes for
    encode_array's value, but serialised in chunks of CHUNK_VALUES (see there)."""
    typed = np.ascontiguousarray(array.astype("<f2" if dtype == "float16" else "<f4", copy=False))
    if fmt == "base64":
        raw = memoryview(typed).cast("B")
        step = 3 * CHUNK_VALUES * 4  # a multiple of 3 bytes: the pieces' base64 joins into the whole's
        return b'"' + b"".join(base64.b64encode(raw[i:i + step]) for i in range(0, len(raw), step)) + b'"'
    return _nested(np.ascontiguousarray(typed.astype(np.float32, copy=False)))


def _nested(array: np.ndarray) -> bytes:
    if array.size <= CHUNK_VALUES or array.ndim == 1:
        return orjson.dumps(array, option=orjson.OPT_SERIALIZE_NUMPY)
    return b"[" + b",".join(_nested(sub) for sub in array) + b"]"


async def respond(build: Callable[[], Any], estimated_bytes: int) -> Response:
    """The response `build()` describes: built and serialised on the event loop when small, in a
    worker thread (in GIL-releasing chunks, see array_json) when it is estimated to be large."""
    if estimated_bytes <= OFF_LOOP_BYTES:
        return JSONResponse(build())
    body = await asyncio.to_thread(lambda: orjson.dumps(build(), option=orjson.OPT_SERIALIZE_NUMPY))
    return Response(body, media_type="application/json")


class KindCounter:
    """Serialises each output once (as an orjson Fragment) and keeps its size by kind."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def fragment(self, kind: str, value: Any) -> orjson.Fragment:
        raw = orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)
        self.bytes[kind] = self.bytes.get(kind, 0) + len(raw)
        return orjson.Fragment(raw)

    def array(self, kind: str, array: np.ndarray, fmt: str, dtype: str) -> orjson.Fragment:
        """An array output (floats or base64), serialised in chunks; its size counted under `kind`."""
        raw = array_json(array, fmt, dtype)
        self.bytes[kind] = self.bytes.get(kind, 0) + len(raw)
        return orjson.Fragment(raw)

    def report(self, call: Call) -> None:
        """Note the sizes on the call (service/front/finish.py adds the envelope as kind 'other')."""
        call.response_kinds = self.bytes
