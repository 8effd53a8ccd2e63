"""Runs sized for the device (issue 56): on a runtime whose `sizing` is "device" (onnxruntime on CUDA, the
benchmarks' stand-in) a batch of mixed-length texts is one padded run, its length a bucket, never cut in two
for a lent slot; on a CPU runtime the runs are plan_sub_batches' as before; each text's outputs are the same
either way (the stand-in's exactly, the real model's to float noise); texts that want attention weights stay
sized as on a CPU; and two batch slots are a pipeline of depth two: the next batch forms and starts its run
while the first one's run waits on the device. Real bundle, tokenizer, runner and batch queue throughout;
the stand-in replaces only the device."""

from __future__ import annotations

import asyncio
import copy
import time

import numpy as np
import pytest

from benchmarks.standin import ZERO, StandInLoader, latency_model
from service.config import BatchingSettings, BundleRef, ServiceSettings
from service.engine.encoder_service import EncoderService
from service.engine.engine import EngineTable, load_engine
from service.engine.runner import (DEVICE_SCORE_LENGTH, BatchRunner, EncodeJob, bucketed, plan_device_runs,
                                   plan_sub_batches)
from service.runtimes.cuda import CUDA
from service.runtimes.onnxruntime import CPU, sizing_for

# 64 texts of 3 to 120 words (about 5 to 250 tokens), in no order: what two client batches of 32 bring
TEXTS = [" ".join(f"word{(i * 7 + k) % 50}" for k in range(3 + (i * 37) % 118)) for i in range(64)]
SHORTER = [" ".join(f"word{(i * 7 + k) % 50}" for k in range(3 + (i * 37) % 40)) for i in range(32)]  # 5-85 tokens
DEFAULTS = BatchingSettings()


def service(bundle, loader=None, **batching) -> EncoderService:
    # fp32 on onnxruntime (the real model's rows), 1 thread per run; `loader`: the stand-in, bound as a benchmark does
    settings = ServiceSettings.model_validate({"bundle": str(bundle), "intra_op_threads": 1, "precision": "fp32",
                                               "runtime": "onnxruntime", "batching": batching})
    return EncoderService(settings, EngineTable([load_engine(BundleRef(path=bundle), settings, runtime_loader=loader)]))


def ids_of(svc: EncoderService, texts: list[str]) -> list[np.ndarray]:
    return [t.ids for t in asyncio.run(svc.tokenize(svc.engines.default, texts, True, "test"))]


def runs_of(runner: BatchRunner, jobs: list[EncodeJob], lender=None) -> tuple[list, int]:
    before = runner.counters["ort_runs"]
    results = runner.compute(jobs, lender)
    return results, runner.counters["ort_runs"] - before


# ---- the plan ----

def test_a_device_plan_is_one_run_where_it_fits_and_keeps_every_text_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 250, size=70).tolist()
    assert plan_device_runs(lengths, 32768, 16, 512) == [(sorted(range(70), key=lengths.__getitem__),
                                                          bucketed(max(lengths), 16, 512))]
    # a smaller budget cuts it, shortest first, each run within rows x bucketed length, its length its longest's bucket
    runs = plan_device_runs(lengths, 2048, 16, 512)
    assert len(runs) > 1 and sorted(i for r, _ in runs for i in r) == list(range(70))
    for run, length in runs:
        assert length == bucketed(max(lengths[i] for i in run), 16, 512)
        assert len(run) == 1 or len(run) * length <= 2048
    # past DEVICE_SCORE_LENGTH a row, attention's scores bound the run too: rows x length^2
    long = [4096] * 8
    runs = plan_device_runs(long, 32768, 16, 8192)
    assert all(len(r) * 4096**2 <= 32768 * DEVICE_SCORE_LENGTH for r, _ in runs) and len(runs) == 8
    assert plan_device_runs([9000], 16, 16, 8192) == [([0], 9000)]  # a text past every bound runs alone


def test_a_run_length_is_its_longest_text_rounded_up_to_the_bucket_never_past_the_model():
    assert [bucketed(n, 16, 512) for n in (1, 16, 17, 500, 512)] == [16, 16, 32, 512, 512]
    assert bucketed(23, 1, 512) == 23 and bucketed(600, 16, 512) == 600  # no bucket; a text past it is as long as it is


def test_only_a_cuda_session_sizes_for_a_device(default_bundle):
    assert sizing_for(CUDA) == "device" and sizing_for(CPU) == "cpu"
    svc = service(default_bundle)
    runtime = svc.engines.default.runtime
    assert runtime.fast.provider == CPU and runtime.sizing == "cpu"
    assert runtime.resized(2, 2).sizing == "cpu"  # a resized copy keeps it
    assert svc.describe(svc.engines.default)["sizing"] == "cpu"


# ---- one run per batch on a device, the CPU's plan unchanged ----

@pytest.fixture(scope="module")
def standins(default_bundle) -> dict[str, EncoderService]:
    """The stand-in as a device (its default) and sized as a CPU runtime, same bundle and tokenizer."""
    return {"device": service(default_bundle, StandInLoader(ZERO)),
            "cpu": service(default_bundle, StandInLoader(ZERO, sizing="cpu"))}


def test_a_batch_of_mixed_length_texts_is_one_run_on_a_device(standins):
    """Four client batches of 16 mixed-length texts, one batch of the queue: one run of 64 rows on the
    device, its length the longest text's bucket; the CPU-sized stand-in cut the same batch into
    plan_sub_batches' runs, as before."""
    device, cpu = standins["device"], standins["cpu"]
    ids = ids_of(device, TEXTS)
    lengths = [len(a) for a in ids]
    jobs = lambda: [EncodeJob(route="test", ids=ids[k:k + 16], normalize=True) for k in range(0, 64, 16)]  # noqa: E731
    runtime, runner = device.engines.default.runtime, device.engines.default.runner
    assert runtime.sizing == "device" and runtime.packed is None
    padded = runner.counters["padded_tokens"]
    _, runs = runs_of(runner, jobs())
    assert runs == 1 and runtime.fast.shapes[-1] == (64, bucketed(max(lengths), 16, 512))
    assert runtime.fast.shapes[-1][1] % DEFAULTS.device_length_bucket == 0
    assert runner.counters["padded_tokens"] - padded == 64 * bucketed(max(lengths), 16, 512)  # the bucket's padding counted

    _, runs = runs_of(cpu.engines.default.runner, jobs())
    expected = plan_sub_batches(lengths, DEFAULTS.sub_batch_tokens, DEFAULTS.max_sub_batch_size, DEFAULTS.max_padding)
    assert runs == len(expected) > 4, (runs, len(expected))
    assert sorted(cpu.engines.default.runtime.fast.shapes[-runs:]) == \
        sorted((len(g), max(lengths[i] for i in g)) for g in expected)


def test_on_an_idle_device_a_batch_of_one_run_is_not_cut_for_a_free_slot(standins):
    """Through the batch queue with its second slot free: on a CPU a lone large piece is cut in two for it
    (service/engine/runner.py SPLIT_MIN_TOKENS); on a device the batch stays one run and nothing is lent."""
    svc = standins["device"]
    runner = svc.engines.default.runner
    before = dict(runner.counters)
    job = EncodeJob(route="test", ids=ids_of(svc, TEXTS), normalize=True)
    result = asyncio.run(svc.infer(svc.engines.default, job, 60))
    assert result.embeddings.shape[0] == 64
    assert runner.counters["ort_runs"] - before["ort_runs"] == 1 and runner.counters["lent_runs"] == before["lent_runs"]


def test_each_texts_outputs_are_the_same_sized_for_a_device_or_a_cpu(standins):
    """The stand-in's pooled vectors and token encodings per text, exactly, in one batch of a pooled-only job
    and a job that wants token encodings (two groups: two runs on the device, more on the CPU plan)."""
    outs = {}
    for name, svc in standins.items():
        ids = ids_of(svc, TEXTS)
        jobs = [EncodeJob(route="test", ids=ids[:40], normalize=True),
                EncodeJob(route="test", ids=ids[40:], normalize=True, want_hidden=True)]
        outs[name] = runs_of(svc.engines.default.runner, jobs)
    (device, device_runs), (cpu, cpu_runs) = outs["device"], outs["cpu"]
    assert device_runs == 2 < cpu_runs
    for a, b in zip(device, cpu, strict=True):
        assert np.array_equal(a.embeddings, b.embeddings)
    assert all(np.array_equal(a, b) for a, b in zip(device[1].hidden, cpu[1].hidden, strict=True))
    assert [h.shape[0] for h in device[1].hidden] == [len(a) for a in ids_of(standins["cpu"], TEXTS[40:])]


def test_the_real_model_gives_each_text_the_same_outputs_in_one_bucketed_run(default_bundle):
    """The real fp32 graph on onnxruntime, its texts padded (packing off): the CPU's sub-batches, then one run
    padded to a bucket (the same sessions, sized as a device would size them): each text's embedding and
    token encodings agree to float noise, since padding is masked out either way."""
    svc = service(default_bundle, packed_tokens=0)
    engine = svc.engines.default
    ids = ids_of(svc, SHORTER)
    jobs = lambda: [EncodeJob(route="test", ids=ids[:24], normalize=True),  # noqa: E731
                    EncodeJob(route="test", ids=ids[24:], normalize=True, want_hidden=True)]
    cpu, cpu_runs = runs_of(engine.runner, jobs())
    as_device = copy.copy(engine.runtime)
    as_device.sizing = "device"
    runner = BatchRunner(as_device, engine.manifest, engine.runner.batching, engine.name)
    device, device_runs = runs_of(runner, jobs())
    assert device_runs == 2 < cpu_runs
    for a, b in zip(device, cpu, strict=True):
        assert np.allclose(a.embeddings, b.embeddings, atol=1e-5)
    assert all(np.allclose(a, b, atol=1e-4) for a, b in zip(device[1].hidden, cpu[1].hidden, strict=True))


def test_texts_that_want_attention_weights_stay_sized_as_on_a_cpu(standins):
    svc = standins["device"]
    ids = ids_of(svc, TEXTS[:24])
    job = EncodeJob(route="test", ids=ids, normalize=True, attention=((0,), (0,)))
    [result], runs = runs_of(svc.engines.default.runner, [job])
    lengths = [len(a) for a in ids]
    assert runs == len(plan_sub_batches(lengths, DEFAULTS.sub_batch_tokens, DEFAULTS.max_sub_batch_size,
                                        DEFAULTS.max_padding)) > 1
    assert [a.shape for a in result.attentions] == [(1, 1, n, n) for n in lengths]


def test_info_says_how_a_device_runtime_batches(standins):
    svc = standins["device"]
    info = svc.describe(svc.engines.default)
    assert info["sizing"] == "device" and info["batches"].startswith("padded, sized for a device")
    assert str(DEFAULTS.device_run_tokens) in info["batches"]


# ---- two slots: a pipeline of depth two ----

@pytest.mark.parametrize("slots", [2, 1])
def test_the_next_batch_runs_while_the_first_waits_on_the_device(default_bundle, slots):
    """A stand-in whose runs wait 1 s on the device. With two slots (the default), a request that arrives
    while the first batch's run waits forms its own batch, pads it and starts its run before the first
    returns: the device always has the next run. With one slot it waits for the first batch to end."""
    svc = service(default_bundle, StandInLoader(latency_model("1000")), max_concurrent_batches=slots)
    engine = svc.engines.default
    graph = engine.runtime.fast
    ids = ids_of(svc, TEXTS[:8])

    async def scenario() -> tuple[bool, float]:
        async def until(condition, what: str, limit: float = 30) -> None:
            ends = time.monotonic() + limit
            while not condition():
                assert time.monotonic() < ends, what
                await asyncio.sleep(0.002)

        start = graph.runs
        first = asyncio.ensure_future(svc.infer(engine, EncodeJob(route="test", ids=ids, normalize=True), 60))
        await until(lambda: graph.runs == start + 1, "the first batch's run")
        second = asyncio.ensure_future(svc.infer(engine, EncodeJob(route="test", ids=ids, normalize=True), 60))
        await until(lambda: graph.runs == start + 2 or first.done(), "the second batch's run, or the first's end")
        overlapped = not first.done()
        await asyncio.gather(first, second)
        return overlapped, graph.runs - start

    overlapped, runs = asyncio.run(scenario())
    assert runs == 2 and overlapped == (slots == 2)
