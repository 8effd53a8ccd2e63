"""Which runtime and precision a replica serves, and why (one line, shown in /info and at start-up).

- CUDA usable (and not runtime openvino): onnxruntime, as service/runtimes/onnxruntime.py decides
  (fp16 where gated).
- On CPU, `runtime: auto, precision: auto`: if the CPU has bf16 units and the bundle's bf16 gate
  passed, both OpenVINO bf16 and onnxruntime fp32 run the same probe batch and the faster serves
  (per replica: machines differ). Otherwise onnxruntime fp32. int8 is never picked by `auto`: its
  cosine loss is two orders of magnitude above bf16's (docs/performance.md).
- `precision: bf16`: OpenVINO bf16; on a CPU without bf16 units, fp32 (OpenVINO's with runtime
  openvino, else onnxruntime's), with one warning line.
- OpenVINO that cannot start (not installed, a graph it cannot compile) falls back to onnxruntime
  fp32 with one warning line; a cache directory that cannot be written costs a compile, not the replica.
A precision the bundle does not have (its gate failed, or the export CPU had no bf16 units) is
never served: asked for explicitly, it is an error, as for int8 and fp16.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from bundle.manifest import Bundle, BundleError
from service.config import ServiceSettings
from service.runtimes import Runtime
from service.runtimes.cuda import GpuAssignment
from service.runtimes.onnxruntime import CUDA, CudaSettings, OrtEncoder
from service.runtimes.openvino import OvEncoder, check_openvino, usable_cache_dir

logger = logging.getLogger("service.runtimes.choice")

PROBE_SHAPE = (8, 32)  # the batch both candidates run at start-up: 8 texts of 32 tokens, a typical batch


def choose_runtime(bundle: Bundle, settings: ServiceSettings, threads: int, gpu: GpuAssignment,
                   streams: int = 1) -> Runtime:
    """The replica's runtime for one bundle (threads: per batch; streams: batches that run at once)."""
    variants = bundle.manifest.variants
    wanted = settings.precision
    if wanted == "bf16" and "bf16" not in variants:
        raise BundleError(
            f"{bundle.root}: no gated bf16 graph in this bundle (has {', '.join(variants)}); export it again on a "
            "CPU with bf16 units (the export log says why it was not published)")
    ort_precision = "auto" if wanted == "bf16" or settings.runtime == "openvino" else wanted
    encoder = OrtEncoder(bundle, settings.provider, threads, settings.inter_op_threads, settings.allow_spinning,
                         ort_precision, CudaSettings.from_settings(settings, gpu))
    encoder.precision_requested = wanted
    if (settings.runtime == "onnxruntime" or encoder.provider == CUDA or wanted in ("int8", "fp16")
            or (settings.runtime == "auto" and wanted == "fp32")):
        if wanted == "bf16":  # CUDA was usable: bf16 is OpenVINO's, on CPU
            encoder.precision_note = f"bf16 runs on OpenVINO (CPU); this replica runs on CUDA: {encoder.precision_note}"
            logger.warning("precision bf16: %s", encoder.precision_note)
        return encoder

    check = check_openvino()
    gated_bf16 = variants.get("bf16")
    if settings.runtime == "auto" and wanted == "auto":
        if not check.installed or not check.bf16_units or gated_bf16 is None:
            why = check.reason or "this bundle has no gated bf16 graph (exported on a CPU without bf16 units, or " \
                                  "before bf16 existed: export it again)"
            encoder.precision_note = f"{encoder.precision_note}; not OpenVINO bf16: {why}"
            return encoder
        candidate = _openvino(bundle, settings, threads, streams, encoder, "bf16", "auto", "")
        if candidate is None:
            return encoder
        return _faster(candidate, encoder, gated_bf16.quality)

    # runtime openvino, or precision bf16 on runtime auto
    if wanted == "fp32":
        precision, note = "fp32", "fp32 as configured, on OpenVINO"
    elif not check.bf16_units or gated_bf16 is None:  # bf16 asked for, or auto on runtime openvino
        why = check.reason or "this bundle has no gated bf16 graph (export it again on a CPU with bf16 units)"
        if wanted == "bf16":
            logger.warning("precision bf16: %s; serving fp32", why)
        if settings.runtime == "auto":
            encoder.precision_note = f"bf16 asked for, fp32 on onnxruntime: {why}"
            return encoder
        precision, note = "fp32", f"fp32 on OpenVINO: {why}"
    else:
        precision = "bf16"
        note = ("bf16 as configured" if wanted == "bf16" else "auto on runtime openvino: bf16") + (
            f" (its gate: min cosine {gated_bf16.quality.min_cosine:.5f} vs PyTorch fp32)" if gated_bf16.quality else "")
    return _openvino(bundle, settings, threads, streams, encoder, precision, wanted, note) or encoder


def _openvino(bundle: Bundle, settings: ServiceSettings, threads: int, streams: int, encoder: OrtEncoder,
              precision: str, wanted: str, note: str) -> OvEncoder | None:
    """OpenVINO for the encodings graph (the full graph stays the onnxruntime encoder's), or None and one
    warning line when it cannot start: the replica serves on onnxruntime then."""
    check = check_openvino()
    if not check.installed:
        logger.warning("OpenVINO not used: %s; serving on onnxruntime", check.reason)
        encoder.precision_note += f"; OpenVINO not used: {check.reason}"
        return None
    cache_dir, why = usable_cache_dir(settings.openvino_cache_dir)
    if why and settings.openvino_cache_dir is not None:
        logger.warning("OpenVINO: %s", why)
    try:
        return OvEncoder(bundle, precision, threads * streams, streams, cache_dir, encoder.full, encoder.provider,
                         wanted, note, encoder.provider_note, encoder.describe_cuda())
    except Exception as exc:  # noqa: BLE001 - any failure to start means: serve on onnxruntime
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        logger.warning("OpenVINO %s could not start (%s); serving onnxruntime fp32", precision, reason)
        encoder.precision_note += f"; OpenVINO {precision} could not start: {reason}"
        return None


def probe_ms(runtimes: list[Runtime], repeats: int = 7) -> list[float]:
    """Median milliseconds of each runtime's encodings graph on the probe batch, after two warm-up runs;
    their runs alternate, so that a replica starting beside others (a busy CPU) slows all of them alike."""
    rng = np.random.default_rng(0)
    vocab = runtimes[0].manifest.model.vocab_size
    ids = rng.integers(min(1000, vocab - 1), min(vocab, 20000), PROBE_SHAPE, dtype=np.int64)
    mask = np.ones_like(ids)
    times: list[list[float]] = [[] for _ in runtimes]
    for i in range(repeats + 2):
        for runtime, own in zip(runtimes, times, strict=True):
            started = time.perf_counter()
            runtime.fast.run(ids, mask, ["sentence_embedding"])
            if i >= 2:
                own.append((time.perf_counter() - started) * 1000)
    return [float(np.median(t)) for t in times]


def _faster(openvino: OvEncoder, ort: OrtEncoder, gate) -> Runtime:
    """auto: the candidate that ran the probe batch faster, with both figures in its note."""
    ov_ms, ort_ms = probe_ms([openvino, ort])
    shape = "x".join(map(str, PROBE_SHAPE))
    figures = f"a probe batch of {shape} tokens in {ov_ms:.1f} ms on OpenVINO bf16 and {ort_ms:.1f} ms on onnxruntime fp32"
    if ov_ms < ort_ms:
        openvino.precision_note = (f"auto: bf16 on OpenVINO, {figures}"
                                   + (f"; its gate: min cosine {gate.min_cosine:.5f} vs PyTorch fp32" if gate else ""))
        return openvino
    ort.precision_note = f"auto: fp32 on onnxruntime, {figures}"
    return ort
