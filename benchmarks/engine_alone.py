"""The engine alone, no HTTP and no Ray: what the service's own model path does with client batches.

    python -m benchmarks.engine_alone [--bundle DIR] [--seconds S] [--precision fp32,auto] [--texts N --seed S]
                                      [--corpus sentences|short] [--standin 0|h100|MS]

Four asyncio clients send random batches of 32 of the benchmark's texts straight into the engine
(tokenizer, batch queue, packed runs, pooling: EncoderService.tokenize and .infer, as a route
calls them), in one process, with the service's own threads and settings. Beside each
configuration, the in-process reference of `make bench` (onnxruntime fp32, sorted batches of 32)
is sampled before and after. It prints texts/s, this process's CPU per text, and the ratio to the
reference's median (`make bench` runs it too, and divides by its own median): the bound on
what a server around this engine can reach on the same machine, since anything the server adds
(HTTP, JSON, Ray's processes, the load generator) takes CPU from it.

The physical bound beside it (physical_bound): the CPU's peak FLOP/s at a precision (cores x clock x
FLOPs per cycle per core for its ISA, peak_flops) over the model's FLOPs per text (flops_per_text), so
that a page can say how far the service and the engine are from what the silicon allows.

--standin replaces the model with benchmarks/standin.py's stand-in runtime at a latency model (as
`make bench-request-path` does): the engine's own CPU cost, with no model.

Single texts are not measured here: with no network between them, 32 closed-loop clients all
land in one batch, so the second batch slot idles; that is not what the service sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

CLIENTS, PER_REQUEST = 4, 32


async def _client(svc, engine, texts: list[str], seed: int, until: float, counted: list[int]) -> None:
    from service.engine.runner import EncodeJob

    rng = random.Random(seed)
    while time.perf_counter() < until:
        batch = rng.sample(texts, min(PER_REQUEST, len(texts)))
        tokenized = await svc.tokenize(engine, batch, True, "bench")
        await svc.infer(engine, EncodeJob(route="bench", ids=[t.ids for t in tokenized], normalize=True), 60)
        counted[0] += len(batch)


async def measure(svc, engine, texts: list[str], seconds: float) -> dict:
    """1 s of warm-up, then `seconds` of load: texts/s, CPU ms per text, texts per batch and per run."""
    warm = [0]
    until = time.perf_counter() + 1
    await asyncio.gather(*(_client(svc, engine, texts, k, until, warm) for k in range(CLIENTS)))
    before = dict(engine.runner.counters)
    counted = [0]
    cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(_client(svc, engine, texts, k, started + seconds, counted) for k in range(CLIENTS)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    after = engine.runner.counters
    texts_done = after["texts"] - before["texts"]
    return {"texts_s": counted[0] / wall, "cpu_ms_per_text": cpu * 1000 / counted[0],
            "texts_per_batch": texts_done / max(1, after["batches"] - before["batches"]),
            "texts_per_run": texts_done / max(1, after["ort_runs"] - before["ort_runs"])}


@dataclass(frozen=True)
class Peak:
    """The CPU's peak FLOP/s at fp32 and bf16 (None: no bf16 units), and how they were reckoned."""

    fp32: float
    bf16: float | None
    how: str


# FLOPs per cycle per core (a fused multiply-add counts 2), by microarchitecture:
# - AMD Zen 4 (family 25 with AVX-512): two 256-bit FMA pipes; a 512-bit instruction runs as two halves
#   (AMD's Software Optimization Guide for Family 19h, section "Floating-Point Unit"): fp32 2 x 8 lanes x 2 = 32;
#   VDPBF16PS multiplies two bf16 pairs per fp32 lane: bf16 64.
# - AMD Zen 5 (family 26): four 512-bit pipes, two of them FMA (Family 1Ah guide): fp32 64, bf16 128.
# - Intel with AMX (amx_bf16: Sapphire Rapids and later): AMX's TMUL does 1,024 bf16 operations per cycle
#   per core (Intel's AMX overview); AVX-512 with two FMA ports: fp32 2 x 16 x 2 = 64.
# - Intel AVX-512 with AVX512_BF16 and no AMX (Cooper Lake): fp32 64, bf16 128 (VDPBF16PS on two ports).
# - AVX-512 without bf16 (Skylake-SP to Ice Lake; two FMA ports on Xeon Gold/Platinum): fp32 64.
# - AVX2 with FMA (two 256-bit FMA pipes: Haswell to Alder Lake, Zen 1-3): fp32 32.
# The hypervisor may hide the turbo clock: the clock is the kernel's "cpu MHz" (or lscpu's max MHz when
# present), so the peak is the base-clock one, and a core that turbos can pass it by its turbo ratio.


def peak_flops(cpus: int, cpuinfo: str | None = None) -> Peak:
    """cores used x clock x FLOPs per cycle per core (the table above), from /proc/cpuinfo."""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    first = text.split("\n\n")[0]
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    flags, vendor, family = set(field.get("flags", "").split()), field.get("vendor_id", ""), int(field.get("cpu family", 0))
    mhz = float(field.get("cpu MHz", 0) or 0)
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        mhz = max([mhz, *(float(line.split(":")[1]) for line in lscpu.splitlines() if line.startswith("CPU max MHz"))])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        pass
    if "amx_bf16" in flags:
        fp32, bf16, arch = 64, 1024, "Intel AMX (bf16 1,024/cycle), AVX-512 two FMA ports (fp32 64/cycle)"
    elif vendor == "AuthenticAMD" and "avx512f" in flags and family >= 26:
        fp32, bf16, arch = 64, (128 if "avx512_bf16" in flags else None), "AMD Zen 5: two 512-bit FMA pipes"
    elif vendor == "AuthenticAMD" and "avx512f" in flags:
        fp32, bf16, arch = 32, (64 if "avx512_bf16" in flags else None), "AMD Zen 4: two 256-bit FMA pipes, AVX-512 in halves"
    elif "avx512f" in flags:
        fp32, bf16, arch = 64, (128 if "avx512_bf16" in flags else None), "Intel AVX-512, two FMA ports"
    elif "fma" in flags:
        fp32, bf16, arch = 32, None, "AVX2 with two 256-bit FMA pipes"
    else:
        fp32, bf16, arch = 8, None, "SSE (no FMA)"
    clock = mhz * 1e6
    how = (f"{cpus} cores x {mhz / 1000:.2f} GHz x {fp32} fp32" + (f" / {bf16} bf16" if bf16 else "")
           + f" FLOPs per cycle ({arch})")
    return Peak(cpus * clock * fp32, cpus * clock * bf16 if bf16 else None, how)


def flops_per_text(matmul_parameters: int, layers: int, attention_width: int, tokens: list[int]) -> float:
    """A text's FLOPs, averaged over `tokens` (each text's length): 2 x the matmuls' parameters x tokens
    (every token through every weight matrix) + 4 x layers x tokens^2 x attention width (QK^T and the
    weighted sum of V, 2 FLOPs per multiply-add each). Softmax, norms and activations are left out."""
    return sum(2 * matmul_parameters * n + 4 * layers * n * n * attention_width for n in tokens) / max(1, len(tokens))


def model_cost(model, texts: list[str]) -> dict:
    """A sentence-transformers model's FLOPs per text on `texts`: the parameters of its Linear layers
    on the token path (a BERT pooler, run once per text on [CLS], left out), its layers and attention width."""
    import torch

    transformer = model[0].auto_model
    config = transformer.config
    parameters = sum(m.weight.numel() for name, m in transformer.named_modules()
                     if isinstance(m, torch.nn.Linear) and "pooler" not in name)
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    tokens = [int(n) for n in model.preprocess(texts)["attention_mask"].sum(1)]
    return {"matmul_parameters": parameters, "layers": config.num_hidden_layers, "attention_width": width,
            "mean_tokens": sum(tokens) / len(tokens),
            "flops_per_text": flops_per_text(parameters, config.num_hidden_layers, width, tokens)}


def physical_bound(cost: dict, precision: str, cpus: int | None = None) -> dict:
    """texts/s at the CPU's peak for `precision` (fp32, or bf16 where it has the units) on a model of `cost`."""
    peak = peak_flops(cpus or len(os.sched_getaffinity(0)))
    flops = peak.bf16 if precision == "bf16" and peak.bf16 else peak.fp32
    return {"texts_s": flops / cost["flops_per_text"], "peak_flops": flops,
            "precision": "bf16" if precision == "bf16" and peak.bf16 else "fp32", "how": peak.how,
            "gflops_per_text": cost["flops_per_text"] / 1e9, "mean_tokens": cost["mean_tokens"]}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_alone", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    p.add_argument("--seconds", type=float, default=8, help="seconds of load per configuration, after 1 s of warm-up")
    p.add_argument("--precision", default="fp32,auto",
                   help="the service's precision setting per configuration, comma-separated (auto: the default config)")
    p.add_argument("--json", type=Path, help="also write the rows there, as JSON (make bench reads them)")
    p.add_argument("--texts", type=int, default=512, help="the benchmark's texts (benchmarks/corpus.py) to sample from")
    p.add_argument("--seed", type=int, default=0, help="their seed (make bench-families: 11)")
    p.add_argument("--corpus", choices=["sentences", "short"], default="sentences",
                   help="sentences: 8-40 English words; short: short multilingual texts (benchmarks/corpus.py short_texts)")
    p.add_argument("--standin", help="the model replaced by the stand-in runtime at this latency model "
                                     "(benchmarks/standin.py: 0, h100, or ms per run)")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="sample the in-process onnxruntime fp32 reference before and after each configuration")
    args = p.parse_args()

    from benchmarks.bench import ReferenceSamples
    from benchmarks.corpus import sentences, short_texts
    from bundle.manifest import load_bundle
    from service.config import ServiceSettings
    from service.engine.engine import EngineTable, load_engine
    from service.engine.encoder_service import EncoderService
    from service.runtimes.onnxruntime import available_cpus

    texts = (short_texts if args.corpus == "short" else sentences)(args.texts, seed=args.seed)
    loader = None
    if args.standin is not None:
        from benchmarks.standin import StandInLoader, latency_model

        loader = StandInLoader(latency_model(args.standin))
    reference = ReferenceSamples(load_bundle(args.bundle), texts, 32, available_cpus()) if args.reference else None
    if reference:
        reference.sample(after="start-up")
    rows = []
    for precision in [p.strip() for p in args.precision.split(",") if p.strip()]:
        settings = ServiceSettings(bundle=str(args.bundle.resolve()), precision=precision)
        engine = load_engine(settings.bundles[0], settings, runtime_loader=loader)
        svc = EncoderService(settings, EngineTable([engine]))
        svc.warm_up()
        got = asyncio.run(measure(svc, engine, texts, args.seconds))
        versus = ""
        if reference:
            reference.sample(after=f"the engine, {precision}")
            versus = f" = {got['texts_s'] / reference.median():.2f}x the reference's median ({reference.median():.0f})"
        print(f"engine alone, {engine.runtime.runtime} {engine.runtime.precision} ({precision}), {CLIENTS} clients x "
              f"{PER_REQUEST} texts: {got['texts_s']:.1f} texts/s{versus}; {got['cpu_ms_per_text']:.2f} ms of CPU per text; "
              f"{got['texts_per_batch']:.1f} texts per batch, {got['texts_per_run']:.1f} per run", flush=True)
        rows.append({"engine": f"the engine alone, {engine.runtime.runtime} {engine.runtime.precision} ({precision} "
                               f"setting): no HTTP, no Ray, a bound, not the service", "engine_alone": True, "bound": True,
                     "setting": precision, "runtime": engine.runtime.runtime, "precision": engine.runtime.precision,
                     "per_request": PER_REQUEST, "concurrency": CLIENTS, "texts_s": got["texts_s"],
                     "texts_per_batch": got["texts_per_batch"], "cpu_ms_per_text": {"engine": got["cpu_ms_per_text"]}})
        del svc, engine
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
