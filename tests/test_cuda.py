"""The CUDA path, every part of it that runs without a GPU: the step-by-step check against this
machine's real loader, the libraries the provider needs, the device Ray assigns, the provider
options (against the option names this onnxruntime build knows), the memory split and the
precision chosen on CUDA."""

from __future__ import annotations

import ctypes
import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bundle.manifest import BundleError, load_bundle
from service.config import DEFAULT_GPU_SHARE, ServiceSettings
from service.runtimes.cuda import (
    DRIVER,
    CudaOptions,
    assign_gpu,
    check_cuda,
    elf_needed,
    loaded_from,
    needed_libraries,
    provider_library,
    session_memory_limit,
)
from service.runtimes.onnxruntime import CPU, CUDA, CudaSettings, OrtEncoder, cuda_options, resolve_precision, with_options
from tests.hardware import int8_gate_passes_here

ROOT = Path(__file__).resolve().parents[1]
GiB, MiB = 2**30, 2**20


def loadable(library: str) -> bool:
    try:
        ctypes.CDLL(library)
        return True
    except OSError:
        return False


def cuda_wheels_installed() -> bool:
    """The `cuda` extra's NVIDIA wheels (CUDA 13 consolidated, cuDNN 9) are in this environment."""
    try:
        importlib.metadata.version("nvidia-cudnn-cu13")
        importlib.metadata.version("nvidia-cublas")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_the_check_reports_build_libraries_driver_and_device_each_on_its_own():
    check = check_cuda()
    steps = {s.name: s for s in check.steps}
    assert list(steps) == ["build", "libraries", "driver", "device"]
    assert steps["build"].ok and "built for CUDA 13" in steps["build"].detail
    # the library step is decided by the real loader, whatever the driver: with the wheels every
    # needed library is mapped into this process from them; without, the first is named missing
    if cuda_wheels_installed():
        assert steps["libraries"].ok, steps["libraries"]
        for name in needed_libraries(provider_library()):
            path = loaded_from(name)
            assert path and "site-packages/nvidia/" in path, (name, path)
    else:
        assert steps["libraries"].ok is False
        assert "libcublasLt.so.13" in steps["libraries"].detail and ".[serve,cuda]" in steps["libraries"].detail
    if not loadable(DRIVER):
        assert steps["driver"].ok is False and f"{DRIVER} is not installed" in steps["driver"].detail
        assert steps["device"].ok is None  # cannot be asked without a driver
        assert not check.usable and check.device is None
    # one plain line naming every failed step
    failed = [s for s in check.steps if s.ok is False]
    assert check.reason == "; ".join(s.detail for s in failed) and "\n" not in check.reason
    assert check.usable == (not failed)


def test_the_needed_libraries_are_what_the_provider_links_against():
    needed = elf_needed(provider_library())
    if shutil.which("readelf"):  # binutils' own reading, where it is installed
        listed = subprocess.run(["readelf", "-d", str(provider_library())], capture_output=True, text=True).stdout
        assert needed == [line.split("[")[1].rstrip("]") for line in listed.splitlines() if "(NEEDED)" in line]
    assert {"libcublasLt.so.13", "libcublas.so.13", "libcudart.so.13", DRIVER} <= set(needed)
    ours = needed_libraries(provider_library())
    assert DRIVER not in ours and "libc.so.6" not in ours  # the driver is the node's; libc is everyone's
    assert "libcudnn.so.9" in ours  # loaded when a session starts, not linked


def test_python_m_service_cuda_proves_the_libraries_and_names_the_driver():
    libraries = subprocess.run([sys.executable, "-m", "service.runtimes.cuda", "--libraries"], capture_output=True,
                               text=True, cwd=ROOT, timeout=120)
    assert libraries.stdout.splitlines()[0].startswith("build      ok")
    assert libraries.returncode == (0 if cuda_wheels_installed() else 1), libraries.stdout
    full = subprocess.run([sys.executable, "-m", "service.runtimes.cuda"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    if not loadable(DRIVER):
        assert full.returncode == 1
        assert full.stdout.splitlines()[-1].startswith("CUDA cannot be used: ") and f"{DRIVER} is not installed" in full.stdout
    assert full.stderr == ""  # no onnxruntime noise, no warnings


@pytest.mark.parametrize(
    ("share", "ray_ids", "visible", "device", "noted"),
    [
        (0.5, ["1"], "1", 0, False),  # Ray set CUDA_VISIBLE_DEVICES to its assignment: device 0
        (1.0, ["1"], None, 1, False),  # nothing hides devices: Ray's id is the ordinal
        (1.0, ["3"], "2,3", 1, False),  # narrowed by someone else: the id's place in the list
        (0.25, ["2"], "0,1", 0, True),  # an id the variable does not list: said, device 0
        (0.25, [], None, 0, True),  # asked for a share, got none: said
        (0.0, [], None, 0, False),  # no share: device 0 of what the process sees
    ],
)
def test_the_session_device_is_the_gpu_ray_assigned(share, ray_ids, visible, device, noted):
    gpu = assign_gpu(share, ray_ids, visible)
    assert gpu.device_id == device and bool(gpu.note) == noted
    assert gpu.describe()["ray_gpu_ids"] == ray_ids and gpu.describe()["cuda_visible_devices"] == visible


def test_each_session_arena_gets_its_part_of_the_replica_gpu_share():
    # an 80 GiB GPU shared by four replicas, each with two sessions (one model)
    per_session = session_memory_limit(80 * GiB, 0.25, 2)
    assert per_session == (20 * GiB - 768 * MiB) // 2
    assert 4 * 2 * per_session + 4 * 768 * MiB == 80 * GiB  # four replicas fit the device exactly
    assert session_memory_limit(16 * GiB, 0.0, 2) == (16 * GiB - 768 * MiB) // 2  # no share: the whole device
    with pytest.raises(ValueError, match=r"a 0.05 share of this GPU .* raise num_gpus or set gpu_mem_limit_mb"):
        session_memory_limit(16 * GiB, 0.05, 4)


def test_cuda_provider_options_are_options_this_onnxruntime_build_knows():
    """Each option name (and the arena strategy's value) is a string the CUDA provider parses: a
    typo would be an error at session creation on the first GPU node."""
    known = set(subprocess.run(["strings", str(provider_library())], capture_output=True, text=True).stdout.split()) \
        if shutil.which("strings") else set(_printable_words(provider_library().read_bytes()))
    options = CudaOptions(device_id=1, gpu_mem_limit=3 * GiB).provider_options()
    assert options == {"device_id": "1", "arena_extend_strategy": "kSameAsRequested", "use_tf32": "0",
                       "gpu_mem_limit": str(3 * GiB)}
    assert set(options) <= known and options["arena_extend_strategy"] in known
    assert CudaOptions(use_tf32=True).provider_options()["use_tf32"] == "1"
    assert "gpu_mem_limit" not in CudaOptions().provider_options()  # 0: onnxruntime's default
    assert with_options([CUDA, CPU], CudaOptions()) == [(CUDA, CudaOptions().provider_options()), CPU]
    assert with_options([CPU], CudaOptions()) == [CPU]


def _printable_words(data: bytes) -> list[str]:
    import re

    return [m.decode() for m in re.findall(rb"[\x20-\x7e]{4,}", data)]


def test_the_options_follow_the_settings_the_device_and_the_share():
    from service.runtimes.cuda import CudaCheck, Device, GpuAssignment

    gpu = GpuAssignment(0.5, ("1",), "1", 0)
    h100 = CudaCheck(True, device=Device(0, "NVIDIA H100", 80 * GiB, (9, 0)))
    settings = ServiceSettings(bundles=["a", "b"], gpu_mem_limit_mb=0, cuda_tf32=False)
    derived = cuda_options(h100, CudaSettings.from_settings(settings, gpu))
    assert derived.gpu_mem_limit == session_memory_limit(80 * GiB, 0.5, 4)  # two models: four sessions
    assert (derived.device_id, derived.use_tf32) == (0, False)
    fixed = cuda_options(h100, CudaSettings.from_settings(ServiceSettings(gpu_mem_limit_mb=2048, cuda_tf32=True), gpu))
    assert (fixed.gpu_mem_limit, fixed.use_tf32) == (2048 * MiB, True)


def test_replicas_ask_ray_for_a_gpu_share_only_where_cuda_is_wanted():
    assert ServiceSettings(provider="cuda").gpu_share(cluster_gpus=0) == DEFAULT_GPU_SHARE
    assert ServiceSettings(provider="auto").gpu_share(cluster_gpus=2) == DEFAULT_GPU_SHARE
    assert ServiceSettings(provider="auto").gpu_share(cluster_gpus=0) == 0
    assert ServiceSettings(provider="cpu").gpu_share(cluster_gpus=8) == 0
    assert ServiceSettings(provider="auto", num_gpus=0.5).gpu_share(cluster_gpus=0) == 0.5
    assert ServiceSettings(runtime="openvino").gpu_share(cluster_gpus=8) == 0  # runs on CPU, its attention graph too
    assert ServiceSettings(num_gpus=2).num_gpus == 2
    with pytest.raises(ValueError, match="num_gpus: 1.5 is neither a fraction of one GPU"):
        ServiceSettings(num_gpus=1.5)


def test_auto_precision_is_the_gated_fp16_graph_on_cuda_and_fp32_elsewhere(default_bundle):
    bundle = load_bundle(default_bundle)
    precision, note = resolve_precision(bundle, "auto", CUDA)
    gate = bundle.manifest.variants["fp16"].quality
    assert precision == "fp16" and gate.passed and f"{gate.mean_cosine:.5f}" in note
    assert resolve_precision(bundle, "auto", CPU) == ("fp32", "auto: fp32 on CPUExecutionProvider")
    assert resolve_precision(bundle, "fp16", CPU)[0] == "fp32"  # meant for CUDA: fp32 on a CPU replica
    if int8_gate_passes_here():
        assert resolve_precision(bundle, "int8", CPU)[0] == "int8"
    else:  # its gate failed on this CPU, so it was not published: asked for, it is an error, never fp32 instead
        with pytest.raises(BundleError, match="no int8 encodings graph in this bundle"):
            resolve_precision(bundle, "int8", CPU)


def test_an_encoder_on_a_machine_without_a_gpu_shows_every_step_and_no_cuda_options(default_bundle):
    encoder = OrtEncoder(load_bundle(default_bundle), "auto", intra_op_threads=1)
    described = encoder.describe_cuda()
    if check_cuda().usable:
        assert encoder.provider == CUDA and described["provider_options"]["use_tf32"] == "0"
        return
    assert encoder.provider == CPU and encoder.precision == "fp32" and encoder.cuda_options is None
    assert [s["step"] for s in described["steps"]] == ["build", "libraries", "driver", "device"]
    assert described["usable"] is False and described["provider_options"] is None
