"""make bench-int8: every int8 method against PyTorch fp32 (the gate's texts, a 0.999 floor) and its speed
beside fp32 and OpenVINO bf16, measured back to back in one run.

Models: all-MiniLM-L6-v2 (the default bundle: real weights) and the base shapes of benchmarks/families.py
(MPNet-base, ModernBERT-base) with seeded random weights. Random weights are a weak proxy for int8: a trained
model's activations have outliers (a few channels far larger than the rest) that random ones lack, so a
method that holds on a random shape may not hold on the trained model. The table is printed and written to
results/bench-int8.json; docs/performance.md's int8 section is written by hand from it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.bench import machine
from benchmarks.corpus import sentences

ROOT = Path("results/bench")


def _rate(session, feeds: list[dict]) -> float:
    """texts/s of `session` over `feeds` (one warm-up batch first)."""
    session.run(["sentence_embedding"], feeds[0])
    started = time.perf_counter()
    for feed in feeds:
        session.run(["sentence_embedding"], feed)
    return sum(len(f["input_ids"]) for f in feeds) / (time.perf_counter() - started)


def measure(name: str, checkpoint: str, bundle: Path, texts: list[str], batch: int, nncf: bool) -> list[dict]:
    """One model: each candidate's gate figures (floor 0.999) and texts/s, the rates measured back to back."""
    from bundle.contract import DEFAULT_MEAN_COSINE, ENCODINGS_OUTPUT_NAMES
    from bundle.manifest import load_bundle
    from export import optimize, quality
    from export.checkpoint import load_checkpoint
    from export.int8 import INT8_COSINE_FLOOR, STATIC_METHODS, calibration_feeds, quantize_nncf_int8, quantize_static_int8
    from export.sessions import OpenVinoSession, ort_session
    from tokenizers import Tokenizer

    ckpt = load_checkpoint(checkpoint)
    tokenizer = Tokenizer.from_file(str(ckpt.tokenizer_path))
    pad, max_tokens = ckpt.config.pad_token_id, ckpt.max_tokens
    fp32 = load_bundle(bundle).variant_path("fp32")
    feeds = calibration_feeds(tokenizer, max_tokens, pad)
    scratch = Path(tempfile.mkdtemp(prefix="bench-int8-"))
    candidates = {"onnxruntime fp32": ("fp32 (reference of speed)", lambda: ort_session(fp32)),
                  "OpenVINO bf16": ("the default on bf16 units", lambda: OpenVinoSession(fp32, ENCODINGS_OUTPUT_NAMES, "bf16"))}

    def dynamic():
        optimize.quantize_int8(fp32, scratch / "dynamic.onnx")
        return ort_session(scratch / "dynamic.onnx")
    candidates["onnxruntime dynamic int8"] = ("today's int8 (quantize_dynamic, per-channel)", dynamic)
    for method in STATIC_METHODS:
        def static(method=method):
            quantize_static_int8(fp32, scratch / f"{method.name}.onnx",
                                 calibration_feeds(tokenizer, max_tokens, pad, one_batch=method.histogram), method)
            return ort_session(scratch / f"{method.name}.onnx")
        candidates[f"onnxruntime static {method.name}"] = (method.describe(), static)
    if nncf:
        def nncf_int8():
            import openvino as ov

            ov.save_model(quantize_nncf_int8(fp32, feeds), str(scratch / "nncf.xml"))
            return OpenVinoSession(scratch / "nncf.xml", ENCODINGS_OUTPUT_NAMES, "fp32")
        candidates["OpenVINO NNCF int8"] = ("nncf.quantize, preset mixed, model type transformer; fp32 elsewhere", nncf_int8)

    timing = quality._batches(tokenizer, texts, max_tokens, pad, size=batch)
    timing = [{"input_ids": p.input_ids, "attention_mask": p.attention_mask, "token_type_ids": p.token_type_ids}
              for p in timing]
    rows, sessions = [], {}
    for label, (what, build) in candidates.items():
        started = time.perf_counter()
        try:
            session = build()
        except Exception as exc:  # a method the library refuses on this graph: its row says why
            rows.append(dict(model=name, variant=label, what=what, error=f"{type(exc).__name__}: {str(exc)[:160]}"))
            print(f"  {label}: {rows[-1]['error']}", flush=True)
            continue
        built = time.perf_counter() - started
        gate = quality.check_quality(ckpt.encoder, tokenizer, fp32, max_tokens, pad, DEFAULT_MEAN_COSINE,
                                     INT8_COSINE_FLOOR, session=session)
        sessions[label] = session
        rows.append(dict(model=name, variant=label, what=what, build_s=built, min_cosine=gate.min_cosine,
                         mean_cosine=gate.mean_cosine, top1=f"{gate.top1_agreement}/{gate.queries}",
                         holds=gate.passed, problems=gate.problems))
        print(f"  {label}: min {gate.min_cosine:.5f} mean {gate.mean_cosine:.5f} top-1 {rows[-1]['top1']} "
              f"{'HOLDS' if gate.passed else 'breaks'} 0.999 ({built:.1f}s to build)", flush=True)
    for row in rows:  # back to back, after every graph is built
        if row["variant"] in sessions:
            row["texts_s"] = _rate(sessions[row["variant"]], timing)
    base = next((r["texts_s"] for r in rows if r["variant"] == "onnxruntime fp32"), None)
    bf16 = next((r.get("texts_s") for r in rows if r["variant"] == "OpenVINO bf16"), None)
    for row in rows:
        if "texts_s" in row:
            row["vs_fp32"] = row["texts_s"] / base if base else None
            row["vs_bf16"] = row["texts_s"] / bf16 if bf16 else None
    return rows


def render(rows: list[dict], where: str, texts: int, batch: int) -> str:
    lines = [f"Measured {where}: {texts} texts of 8-40 words in batches of {batch}, in-process, every core; gate "
             "figures on export/quality.py's 50 texts vs PyTorch fp32, floor 0.999 (`make bench-int8`).", "",
             "| model | variant | min cosine | mean cosine | top-1 | holds 0.999 | texts/s | vs fp32 | vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | {r['error']} | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['variant']} | {r['min_cosine']:.5f} | {r['mean_cosine']:.5f} | {r['top1']} | "
                     f"{'yes' if r['holds'] else 'no'} | {r.get('texts_s', 0):.1f} | {r.get('vs_fp32') or 0:.2f}x | "
                     f"{r.get('vs_bf16') or 0:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=Path("bundles/all-MiniLM-L6-v2"))
    parser.add_argument("--shapes", nargs="*", default=["mpnet-base", "modernbert-base"],
                        help="base shapes of benchmarks/families.py (random weights)")
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--no-nncf", action="store_true", help="leave OpenVINO NNCF out")
    args = parser.parse_args()
    from benchmarks import families
    from export.checkpoint import resolve_checkpoint

    texts = sentences(args.texts)
    models = [("all-MiniLM-L6-v2 (trained)", str(resolve_checkpoint("default")[0]), args.bundle)]
    for shape in args.shapes:
        checkpoint = families.make_checkpoint(shape, families.ROOT / shape / "checkpoint")
        models.append((f"{shape} (random weights)", str(checkpoint), families.export(checkpoint, families.ROOT / shape / "bundle")))
    rows = []
    for name, checkpoint, bundle in models:
        print(f"{name}:", flush=True)
        rows += measure(name, checkpoint, bundle, texts, args.batch, nncf=not args.no_nncf)
    where = machine()
    print(render(rows, where, len(texts), args.batch))
    ROOT.mkdir(parents=True, exist_ok=True)
    (ROOT / "int8.json").write_text(json.dumps({"machine": where, "rows": rows}, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
