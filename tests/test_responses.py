"""How responses are written: large arrays are serialised in chunks (so a worker thread building a
60 MB response lets the event loop run between them), byte for byte what one call would write."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from service.front.responses import CHUNK_VALUES, array_json, encode_array


@pytest.mark.parametrize("shape", [(3,), (1, 1), (CHUNK_VALUES + 1,), (5, 7, 300, 300), (6, 12, 256, 256)])
@pytest.mark.parametrize("fmt", ["float", "base64"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_chunked_arrays_are_byte_for_byte_what_one_call_writes(shape, fmt, dtype):
    array = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    whole = orjson.dumps(encode_array(array, fmt, dtype), option=orjson.OPT_SERIALIZE_NUMPY)
    assert array_json(array, fmt, dtype) == whole
