"""What this machine's CPU decides about the lossy graphs, for tests that must expect the verdict of a
gate rather than assume it (bf16's is OpenVINO's own check: service.runtimes.openvino.check_openvino)."""

from __future__ import annotations

import functools

# onnxruntime's dynamic int8 MatMuls use VNNI (AVX512-VNNI, AVX-VNNI) or AMX where the CPU has them
INT8_DOT_PRODUCT_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}


@functools.cache
def int8_gate_passes_here() -> bool:
    """Whether all-MiniLM-L6-v2's int8 graph passes its quality gate on this CPU. Measured: with VNNI or
    AMX, mean cosine 0.991 and every text >= 0.95 (Xeon with AMX, EPYC with AVX512-VNNI); on a CPU with
    AVX2 only (no VNNI) the u8s8 kernels lose more: min 0.948 on the text 'OK', and quantizing with
    reduce_range raises that to 0.962 but the mean falls to 0.9896. So the export does not publish it."""
    with open("/proc/cpuinfo") as cpuinfo:
        flags = set(next(line for line in cpuinfo if line.startswith("flags")).split(":", 1)[1].split())
    return bool(flags & INT8_DOT_PRODUCT_FLAGS)
