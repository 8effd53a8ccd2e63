"""Can onnxruntime use CUDA in this process? Four steps, each checked on its own, without creating a session.

1. build: this onnxruntime has the CUDA provider compiled in (onnxruntime-gpu).
2. libraries: the CUDA and cuDNN libraries the provider links against load. onnxruntime-gpu's
   `cuda` and `cudnn` extras install them as NVIDIA's wheels, in site-packages/nvidia/, where the
   dynamic loader never looks: `onnxruntime.preload_dlls()` loads them first (onnxruntime's own
   answer), after which the provider's needs resolve to the already loaded copies. Checked
   independently of the driver, so a machine without a GPU still proves the libraries.
3. driver: the NVIDIA driver's libcuda.so.1 loads and supports the CUDA version of the build.
4. device: the driver sees a GPU (the one this replica was given: Ray's CUDA_VISIBLE_DEVICES).

Also here: which GPU a replica was given by Ray (GpuAssignment), read from Ray's bookkeeping.
No session is created and onnxruntime prints nothing: a CPU-only machine gets one plain line.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import struct
import sys
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import onnxruntime as ort

CUDA = "CUDAExecutionProvider"
DRIVER = "libcuda.so.1"  # comes with the node's NVIDIA driver, never from a wheel
# The provider does not link cuDNN but loads it when a session starts, so it is needed all the same.
LAZY_LIBRARIES = ("libcudnn.so.9",)
EXTRA_HINT = "install the cuda extra: pip install '.[serve,cuda]'"


@dataclass(frozen=True)
class Step:
    """One step of the check: ok True/False, or None when it could not be checked (a step it needs failed)."""

    name: str
    ok: bool | None
    detail: str

    def line(self) -> str:
        state = {True: "ok", False: "FAILED", None: "not checked"}[self.ok]
        return f"{self.name:<10} {state:<11} {self.detail}"


@dataclass(frozen=True)
class Device:
    """The GPU a session would run on, as the driver describes it."""

    ordinal: int  # as this process numbers its visible devices
    name: str
    total_bytes: int
    capability: tuple[int, int]  # compute capability; 8.0 and newer (Ampere) have TF32

    def describe(self) -> str:
        return (f"device {self.ordinal}: {self.name}, {self.total_bytes / 2**30:.1f} GiB, "
                f"compute capability {self.capability[0]}.{self.capability[1]}")


@dataclass(frozen=True)
class CudaCheck:
    """Whether onnxruntime can use CUDA here and, if not, why (one plain line); every step's outcome."""

    usable: bool
    reason: str = ""
    steps: tuple[Step, ...] = ()
    device: Device | None = None

    def lines(self) -> list[str]:
        return [s.line() for s in self.steps]


@cache
def check_cuda(ordinal: int = 0) -> CudaCheck:
    """Build, libraries, driver and device, in that order, each on its own (see the module's docstring)."""
    build = build_step()
    if not build.ok:
        return _outcome([build, Step("libraries", None, "needs a CUDA build"), Step("driver", None, ""),
                         Step("device", None, "")])
    if not sys.platform.startswith("linux"):  # the checks below are written for Linux's loader
        return CudaCheck(True, "", (build,))
    libraries = library_step()
    driver, api = driver_step()
    device_step, device = _device_step(api, ordinal) if driver.ok else (Step("device", None, "needs the driver"), None)
    return _outcome([build, libraries, driver, device_step], device)


def _outcome(steps: list[Step], device: Device | None = None) -> CudaCheck:
    failed = [s for s in steps if s.ok is False]
    return CudaCheck(not failed, "; ".join(s.detail for s in failed), tuple(steps), device)


def build_step() -> Step:
    if CUDA not in ort.get_available_providers():
        return Step("build", False, f"this onnxruntime build ({ort.__version__}) has no CUDA provider "
                                    "(install onnxruntime-gpu)")
    if not provider_library().exists():  # the CPU image leaves it out (deploy/image/prune.py): 271 MB
        return Step("build", False, f"this installation has no CUDA provider library ({provider_library().name}): "
                                    "a CPU image; use the CUDA image")
    return Step("build", True, f"onnxruntime-gpu {ort.__version__}, built for CUDA {built_cuda_version() or '?'}")


def built_cuda_version() -> str:
    """The CUDA version this onnxruntime-gpu was built with ('13.0'), or '' when it does not say."""
    try:
        from onnxruntime.capi import build_and_package_info
    except ImportError:
        return ""
    return getattr(build_and_package_info, "cuda_version", "") or ""


def provider_library() -> Path:
    return Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"


@cache
def preload_libraries() -> str:
    """onnxruntime.preload_dlls() once per process, before any session: loads the CUDA and cuDNN
    libraries from the NVIDIA wheels in site-packages. What it prints (a failure per library it
    cannot find) is kept, not shown: the library step reports what is missing in one line."""
    printed = io.StringIO()
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return "this onnxruntime has no preload_dlls"
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            preload(cuda=True, cudnn=True, msvc=False)
        except Exception as exc:  # an odd layout must not stop a CPU replica from starting
            printed.write(f"preload_dlls failed: {exc}")
    return printed.getvalue()


def needed_libraries(path: Path) -> list[str]:
    """The CUDA and cuDNN libraries `path` needs: its ELF DT_NEEDED entries, less the driver and
    the C runtime, plus the ones it loads later (cuDNN)."""
    needed = [n for n in elf_needed(path) if n.startswith(("libcu", "libnv")) and n != DRIVER]
    return needed + [n for n in LAZY_LIBRARIES if n not in needed]


def library_step() -> Step:
    """Preload, then load each library the provider needs by its name, as the loader will when
    onnxruntime creates a CUDA session: each must resolve, from the wheels or the loader path."""
    preload_libraries()
    try:
        needed = needed_libraries(provider_library())
    except (OSError, ValueError) as exc:
        return Step("libraries", False, f"cannot read onnxruntime's CUDA provider library: {exc}")
    missing = []
    for name in needed:
        try:
            ctypes.CDLL(name)
        except OSError:
            missing.append(name)
    if missing:
        return Step("libraries", False, f"CUDA libraries missing: {', '.join(missing)} ({EXTRA_HINT})")
    where = sorted({str(Path(p).parent) for n in needed if (p := loaded_from(n))})
    return Step("libraries", True, f"{len(needed)} load: {', '.join(needed)} (from {', '.join(where) or 'the loader path'})")


def loaded_from(soname: str) -> str | None:
    """The file this process has mapped for `soname` (from /proc/self/maps), if any."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith("/") and Path(path).name == soname:
                return path
    except OSError:
        pass
    return None


def driver_step() -> tuple[Step, ctypes.CDLL | None]:
    try:
        api = ctypes.CDLL(DRIVER)
    except OSError:
        # in a container, the NVIDIA runtime mounts the driver only where a GPU is given to it
        return Step("driver", False, f"no GPU visible: no NVIDIA driver ({DRIVER} is not installed; a node with a GPU "
                                     f"and a driver for CUDA {built_cuda_version() or '13'} or newer)"), None
    version = ctypes.c_int(0)
    if api.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return Step("driver", False, f"{DRIVER} loads but does not report its CUDA version"), None
    supports = f"{version.value // 1000}.{version.value % 1000 // 10}"
    built = built_cuda_version()
    if built and version.value // 1000 < int(built.split(".")[0]):
        return Step("driver", False, f"the NVIDIA driver supports CUDA {supports}; onnxruntime-gpu "
                                     f"{ort.__version__} needs CUDA {built} (update the driver)"), None
    return Step("driver", True, f"NVIDIA driver for CUDA {supports}"), api


def _device_step(api: ctypes.CDLL, ordinal: int) -> tuple[Step, Device | None]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
    count = ctypes.c_int(0)
    status = api.cuInit(0)
    if status == 0:
        status = api.cuDeviceGetCount(ctypes.byref(count))
    if status != 0 or count.value == 0:
        return Step("device", False, f"no GPU visible to this process (CUDA driver error {status}, "
                                     f"{count.value} devices{shown})"), None
    if ordinal >= count.value:
        return Step("device", False, f"device {ordinal} was assigned, but this process sees {count.value}{shown}"), None
    device = describe_device(api, ordinal)
    return Step("device", True, f"{device.describe()} ({count.value} visible{shown})"), device


def describe_device(api: ctypes.CDLL, ordinal: int) -> Device:
    handle, name = ctypes.c_int(0), ctypes.create_string_buffer(256)
    total, major, minor = ctypes.c_size_t(0), ctypes.c_int(0), ctypes.c_int(0)
    api.cuDeviceGet(ctypes.byref(handle), ordinal)
    api.cuDeviceGetName(name, len(name), handle)
    api.cuDeviceTotalMem_v2(ctypes.byref(total), handle)
    api.cuDeviceGetAttribute(ctypes.byref(major), 75, handle)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    api.cuDeviceGetAttribute(ctypes.byref(minor), 76, handle)  # ..._MINOR
    return Device(ordinal, name.value.decode(errors="replace"), total.value, (major.value, minor.value))


def elf_needed(path: Path) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared library (what `readelf -d` lists),
    read without binutils, which slim images lack."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strtab_offset = sections[link][4]
        names = []
        for pos in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab_offset + value)
                names.append(data[strtab_offset + value:end].decode())
        return names
    raise ValueError(f"{path} has no dynamic section")


@dataclass(frozen=True)
class GpuAssignment:
    """The GPU share a replica asked Ray for and the device Ray gave it.

    Ray sets CUDA_VISIBLE_DEVICES of a replica that asked for GPUs to the ids it assigned, so the
    replica numbers its device 0; where something else set the variable, the assigned id's place in
    it is the ordinal. Without a Ray GPU share (num_gpus 0) nothing is assigned: device 0 of what
    the process sees.
    """

    share: float = 0.0
    ray_gpu_ids: tuple[str, ...] = ()
    visible_devices: str | None = None
    device_id: int = 0
    note: str = ""

    def describe(self) -> dict:
        return {"num_gpus": self.share, "ray_gpu_ids": list(self.ray_gpu_ids),
                "cuda_visible_devices": self.visible_devices, "device_id": self.device_id, "note": self.note}

    def line(self) -> str:
        """For the start-up summary."""
        if not self.share:
            return "no Ray GPU share (num_gpus 0): device 0 of those the process sees"
        return (f"{self.share:g} GPU from Ray: id {', '.join(self.ray_gpu_ids) or '?'}, "
                f"CUDA_VISIBLE_DEVICES={self.visible_devices!r}, session device {self.device_id}")


def assign_gpu(share: float, ray_gpu_ids: list[str], visible: str | None) -> GpuAssignment:
    """The CUDA ordinal a replica's sessions use, from Ray's assignment and CUDA_VISIBLE_DEVICES."""
    ids = tuple(str(i) for i in ray_gpu_ids)
    if not ids:
        note = "" if not share else f"asked Ray for {share:g} GPU but Ray assigned none"
        return GpuAssignment(share, ids, visible, 0, note)
    if visible is None:  # nothing hides devices: Ray's id is the driver's ordinal
        return GpuAssignment(share, ids, visible, int(ids[0]) if ids[0].isdigit() else 0)
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    if ids[0] in entries:
        return GpuAssignment(share, ids, visible, entries.index(ids[0]))
    return GpuAssignment(share, ids, visible, 0,
                         f"Ray assigned GPU {ids[0]}, which CUDA_VISIBLE_DEVICES={visible!r} does not list; using device 0")


def ray_gpu_assignment(share: float) -> GpuAssignment:
    """This replica's assignment, read from Ray's runtime context (inside a Ray worker)."""
    import ray

    ids = ray.get_runtime_context().get_accelerator_ids().get("GPU", []) if ray.is_initialized() else []
    return assign_gpu(share, ids, os.environ.get("CUDA_VISIBLE_DEVICES"))


# ---- session options: every CUDA provider option in one place ----

# Outside onnxruntime's arena each process holds the CUDA context and cuBLAS/cuDNN workspaces:
# a few hundred MB on recent GPUs (an estimate from NVIDIA's and onnxruntime's docs, not measured
# here: no GPU). Kept out of the arenas' limit so that replicas sharing a GPU fit beside each other.
PROCESS_RESERVE_BYTES = 768 * 2**20
MIN_ARENA_BYTES = 256 * 2**20


@dataclass(frozen=True)
class CudaOptions:
    """What a replica's CUDA sessions are created with; shown in /info as `provider_options`."""

    device_id: int = 0
    gpu_mem_limit: int = 0  # bytes per session arena; 0: onnxruntime's default (the whole device)
    # Grow the arena by what a run asks for, not the next power of two: batch shapes vary with every
    # request, and doubling would make each replica's arena up to twice the largest run it has seen.
    arena_extend_strategy: str = "kSameAsRequested"
    use_tf32: bool = False  # TF32 matrix products (Ampere+) break fp32 parity at 1e-4; opt in for speed

    def provider_options(self) -> dict[str, str]:
        """The provider options as onnxruntime takes them (strings)."""
        options = {
            "device_id": str(self.device_id),
            "arena_extend_strategy": self.arena_extend_strategy,
            "use_tf32": "1" if self.use_tf32 else "0",
        }
        if self.gpu_mem_limit:
            options["gpu_mem_limit"] = str(self.gpu_mem_limit)
        return options


def session_memory_limit(total_bytes: int, share: float, sessions: int, reserve: int = PROCESS_RESERVE_BYTES) -> int:
    """Bytes each of a replica's `sessions` CUDA arenas may take: the replica's share of the
    device, less the process's own reserve, split evenly. A share with no room is an error that
    says so, never an arena that would fail at the first large batch."""
    share = share if 0 < share <= 1 else 1.0  # no share (or whole GPUs): the device it runs on
    room = int(total_bytes * share) - reserve
    per_session = room // max(1, sessions)
    if per_session < MIN_ARENA_BYTES:
        raise ValueError(
            f"a {share:g} share of this GPU ({total_bytes * share / 2**30:.2f} GiB) leaves "
            f"{max(room, 0) / 2**20:.0f} MiB for {sessions} sessions after {reserve / 2**20:.0f} MiB for the "
            f"process; each needs at least {MIN_ARENA_BYTES / 2**20:.0f} MiB: raise num_gpus or set gpu_mem_limit_mb"
        )
    return per_session


def main(argv: list[str] | None = None) -> int:
    """`python -m service.runtimes.cuda`: one line per step; exit 0 when CUDA is usable (or, with
    --libraries, when the build and the libraries are: what a machine without a GPU can prove)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m service.runtimes.cuda", description=main.__doc__)
    p.add_argument("--libraries", action="store_true", help="pass when the build and libraries steps pass")
    p.add_argument("--device", type=int, default=0, help="CUDA ordinal to describe (default 0)")
    a = p.parse_args(argv)
    check = check_cuda(a.device)
    for line in check.lines():
        print(line)
    needed = ("build", "libraries") if a.libraries else tuple(s.name for s in check.steps)
    failed = [s for s in check.steps if s.name in needed and s.ok is not True]
    if failed:
        print(f"CUDA cannot be used: {'; '.join(s.detail for s in failed if s.ok is False)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
