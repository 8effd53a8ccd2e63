"""Delete what the serving image installs but never loads, in the same RUN step as `pip install` (a
later step could not make the image smaller), and print what each cut saved.

    python prune.py cpu|cuda [SITE_PACKAGES]

Measured with `podman history` and `du` on the images (docs/images.md, "Image size"). Each entry is
something the service cannot reach: the CPU image never loads onnxruntime-gpu's CUDA provider (271 MB;
service/runtimes/cuda.py then says the image has none), OpenVINO's GPU and NPU plugins and its
non-ONNX frontends are never asked for (the service compiles ONNX on "CPU"), Ray's Java jars and RLlib
are for other Ray libraries, NVIDIA's wheels carry headers and static libraries for building, not
running, and cuFFT serves FFT operators a Transformer encoder does not have. Standard library only: it runs in the image before anything else is there.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

COMMON = [
    "openvino/libs/libopenvino_intel_gpu_plugin.so",
    "openvino/libs/libopenvino_intel_npu_plugin.so",
    "openvino/libs/libopenvino_tensorflow_frontend.so.*",
    "openvino/libs/libopenvino_tensorflow_lite_frontend.so.*",
    "openvino/libs/libopenvino_pytorch_frontend.so.*",
    "openvino/libs/libopenvino_paddle_frontend.so.*",
    "openvino/libs/libopenvino_jax_frontend.so.*",
    "openvino/libs/libopenvino_gguf_frontend.so.*",
    "openvino/include",
    "openvino/cmake",
    "ray/jars",
    "ray/rllib",
    "hf_xet",  # huggingface_hub's Xet downloads: nothing is downloaded at run time
]
BY_VARIANT = {
    "cpu": [
        "onnxruntime/capi/libonnxruntime_providers_cuda.so",
        "onnxruntime/capi/libonnxruntime_providers_tensorrt.so",
    ],
    "cuda": [
        "onnxruntime/capi/libonnxruntime_providers_tensorrt.so",  # TensorRT is not used (docs/gpu.md)
        "nvidia/*/include",
        "nvidia/*/lib/*.a",
        # cuFFT (227 MB): onnxruntime's CUDA provider does not link it (its DT_NEEDED: cuBLASLt, cuBLAS, cuRAND,
        # cudart, the driver), and onnxruntime.preload_dlls() lists it as optional: only FFT operators use it
        "nvidia/cu13/lib/libcufft.so.*",
        "nvidia/cu13/lib/libcufftw.so.*",
        "nvidia/cu13/lib/libnvblas.so.*",  # a BLAS drop-in for CPU programs
    ],
}


def size(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
    return path.lstat().st_size


def prune(variant: str, site: Path) -> int:
    total = 0
    for pattern in COMMON + BY_VARIANT[variant]:
        matches = sorted(site.glob(pattern))
        freed = sum(size(p) for p in matches)
        for path in matches:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        total += freed
        print(f"prune: {pattern}: {freed / 1e6:.1f} MB" + ("" if matches else " (not installed)"))
    print(f"prune: {variant} image: {total / 1e6:.1f} MB removed from {site}")
    return total


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in BY_VARIANT:
        sys.exit("usage: python prune.py cpu|cuda [SITE_PACKAGES]")
    prune(sys.argv[1], Path(sys.argv[2] if len(sys.argv) == 3 else sysconfig.get_paths()["purelib"]))
