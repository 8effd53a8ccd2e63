"""`make gpu-check`, the command for the day a GPU is there: here it must stop after the library
line naming the missing driver, and its later steps (parity, throughput, the service end to end)
must run, with the CPU standing in for the GPU, so that the script cannot rot before that day."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from service.runtimes.cuda import check_cuda
from tests.test_service_cli import service_env

ROOT = Path(__file__).resolve().parents[1]


def gpu_check(bundle: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--bundle", str(bundle), *flags],
                          cwd=ROOT, env=service_env(), capture_output=True, text=True, timeout=600)


def test_without_a_gpu_it_stops_after_the_steps_naming_what_is_missing(default_bundle):
    if check_cuda().usable:
        return  # a GPU machine runs the whole check (make gpu-check), not this
    result = gpu_check(default_bundle)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert [line.split()[0] for line in lines[:4]] == ["build", "libraries", "driver", "device"]
    assert lines[-1] == f"gpu-check: CUDA cannot be used here: {check_cuda().reason}"
    assert not any(line.startswith(("parity", "throughput", "service")) for line in lines)


def test_every_later_step_runs_with_the_cpu_in_place_of_the_gpu(default_bundle):
    # step 5 at 1 connection for 10 s: on this CPU a round of 64 connections would outlast the window, and in the
    # clean-clone make test (2 workers) 2 connections for 3 s answered no client batch of 32 at all; 2 replicas,
    # as --service-replicas runs them on a GPU (sharing it there)
    result = gpu_check(default_bundle, "--dry-run-on-cpu", "--repeats", "2", "--rate-seconds", "10",
                       "--rate-connections", "1", "--service-replicas", "2")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    for graph in ("full", "encodings-fp32", "encodings-fp16"):  # every graph the bundle has for CUDA
        assert any(line.startswith(f"parity     ok          {graph} on ") for line in out.splitlines()), out
    for graph in ("encodings-fp32", "encodings-fp16"):
        row = next(line for line in out.splitlines() if line.startswith(f"throughput {graph} on "))
        assert all(f"{size}: " in row and "texts/s" in row for size in (1, 8, 32, 128)), row
    assert "service    2 replicas\n" in out and "service    1 replica\n" not in out
    assert "service    ok          --provider cpu: CPUExecutionProvider" in out
    # step 5: each scenario's rate, no failure, beside the engine's rate at batches of 128 on the served graph
    for scenario in ("client batches of 32", "single texts"):
        line = next(line for line in out.splitlines() if line.startswith(f"rate       ok          {scenario}, 1 "))
        rate = float(line.split("): ")[1].split(" texts/s")[0].replace(",", ""))
        assert rate > 0 and "failures 0" in line and "x the engine's encodings-fp32 at batches of 128" in line, line
    assert "service    ok          SIGTERM: exit 0" in out
    assert out.splitlines()[-1] == "gpu-check: PASSED (dry run on CPU)"
