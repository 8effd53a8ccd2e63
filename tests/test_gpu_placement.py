"""GPU placement proven with Ray's own GPU bookkeeping, on a machine without a GPU: `python -m service`
starts a local cluster that declares 2 logical GPUs (--num-gpus 2), and its replicas ask Ray for a
share of one. Ray places them by it and sets each replica's CUDA_VISIBLE_DEVICES; each replica's
/info, its start-up line and its model_info metric show the device it was given, while its sessions
stay on CPU and say why (no driver here)."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from service.config import DEFAULT_GPU_SHARE
from service.hosting.processes import free_port
from service.runtimes.openvino import check_openvino
from tests.metrics_scrape import poll
from tests.test_multinode import replicas_info
from tests.test_service_cli import start_service, stop_with_sigterm, wait_for_health


BF16 = check_openvino().bf16_units


def run_service(default_bundle: Path, replicas: int, *flags: str):
    """python -m service on a cluster with two logical GPUs; yields (url, metrics url, output lines)."""
    port, metrics_port = free_port(), free_port()
    proc, lines = start_service(default_bundle, port, "--num-cpus", "4", "--num-gpus", "2", "--replicas",
                                str(replicas), "--metrics-port", str(metrics_port), *flags)
    return proc, lines, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"


def check_replica(info: dict, share: float) -> str:
    """One replica's own account of its GPU: the share asked for, the one id Ray gave it, that id as
    its only visible device, session device 0; sessions on CPU with every CUDA step and the reason."""
    gpu = info["replica"]["gpu"]
    assert gpu["num_gpus"] == share, gpu
    assert len(gpu["ray_gpu_ids"]) == 1 and gpu["ray_gpu_ids"][0] in {"0", "1"}, gpu
    assert gpu["cuda_visible_devices"] == gpu["ray_gpu_ids"][0], gpu  # Ray's assignment, not ours
    assert gpu["device_id"] == 0 and gpu["note"] == "", gpu
    assert info["provider"] == "CPUExecutionProvider" and info["provider_note"], info["provider_note"]
    assert [s["step"] for s in info["cuda"]["steps"]] == ["build", "libraries", "driver", "device"]
    assert info["cuda"]["provider_options"] is None  # no CUDA session, so no CUDA options in use
    assert (info["runtime"], info["precision"]) == expected_on_cpu(info), info
    return gpu["ray_gpu_ids"][0]


def expected_on_cpu(info: dict) -> tuple[str, str]:
    """runtime and precision auto on a CPU: onnxruntime fp32 where OpenVINO bf16 cannot run (saying why),
    else whichever of OpenVINO bf16 and onnxruntime fp32 ran the probe batch faster, by the replica's
    own figures: one answer, not either."""
    note = info["precision_note"]
    if not BF16:
        assert "not OpenVINO bf16: " in note and check_openvino().reason in note, note
        return ("onnxruntime", "fp32")
    found = re.fullmatch(r"auto: (?:bf16 on OpenVINO|fp32 on onnxruntime), a probe batch of 8x32 tokens in ([\d.]+) ms "
                         r"on OpenVINO bf16 and ([\d.]+) ms on onnxruntime fp32(?:; its gate: .*)?", note)
    assert found, note
    ov_ms, ort_ms = map(float, found.groups())
    return ("openvino", "bf16") if ov_ms < ort_ms else ("onnxruntime", "fp32")


def gpu_ids_in_metrics(families: dict) -> collections.Counter:
    family = families.get("ray_encoder_model_info")
    return collections.Counter(s.labels["gpu_ids"] for s in (family.samples if family else []))


@pytest.mark.slow
@pytest.mark.serial  # a Ray cluster of its own: Serve's proxy start timed out at load 15-17 beside the workers
def test_two_replicas_with_a_whole_gpu_each_get_one_device_each(default_bundle):
    proc, lines, url, metrics = run_service(default_bundle, 2, "--replica-num-gpus", "1")
    try:
        wait_for_health(url, proc, lines, timeout=180)
        infos = replicas_info(url, 2, timeout=120)
        assert sorted(check_replica(info, 1.0) for info in infos.values()) == ["0", "1"]  # one GPU each
        families = poll(metrics, lambda f: sum(gpu_ids_in_metrics(f).values()) == 2,
                        what="model_info of both replicas")
        assert gpu_ids_in_metrics(families) == {"0": 1, "1": 1}
        summary = "".join(lines)
        assert "  gpu        1 GPU per replica from Ray; this replica: id " in summary, summary
        assert "CUDA_VISIBLE_DEVICES=" in summary and "session device 0" in summary
    finally:
        stop_with_sigterm(proc)


@pytest.mark.slow
@pytest.mark.serial  # a Ray cluster of its own: Serve's proxy start timed out at load 15-17 beside the workers
def test_four_replicas_share_the_two_gpus_by_the_default_share(default_bundle):
    """No --replica-num-gpus: provider auto on a cluster that has GPUs asks for the default share
    (a quarter), so four replicas fit, every one with a device and no GPU given past its capacity."""
    proc, lines, url, metrics = run_service(default_bundle, 4)
    try:
        wait_for_health(url, proc, lines, timeout=240)
        infos = replicas_info(url, 4, timeout=120)
        per_gpu = collections.Counter(check_replica(info, DEFAULT_GPU_SHARE) for info in infos.values())
        assert sum(per_gpu.values()) == 4
        assert all(n * DEFAULT_GPU_SHARE <= 1 for n in per_gpu.values()), per_gpu  # Ray's own bookkeeping
        families = poll(metrics, lambda f: sum(gpu_ids_in_metrics(f).values()) == 4,
                        what="model_info of the four replicas")
        assert gpu_ids_in_metrics(families) == per_gpu
    finally:
        stop_with_sigterm(proc)
