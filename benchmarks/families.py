"""make bench-families: the newer families at their real sizes, served against sentence-transformers
and infinity-emb on the same model directory, each peer at fp32 and at its best precision, in one run.

No such checkpoint ships and nothing may be downloaded, so each is built here from transformers' config
class at the real model's sizes (layers, widths, heads, local windows) with seeded random weights and
all-MiniLM-L6-v2's tokenizer (its 30522-token vocabulary: the real ones' larger tables cost memory, not
time per token). Their vectors mean nothing; their cost per text is the real models'. Per family: export
(fp32 through the parity gate, and the gated bf16 variant where the CPU has bf16 units),
sentence-transformers in-process at fp32 (the reference) and bf16, the service over HTTP (client
batches of 32 at 4 clients) at its default precision (bf16 where the gate passed: /info says what
served) and at fp32, the engine alone at the default on the same texts, the physical bound (the
CPU's peak over the model's FLOPs per text, benchmarks/engine_alone.py), and with `--peers infinity`
infinity-emb serving the same directory at fp32 and bf16. The tables (rows, then issue 49's targets
with verdicts) go into docs/performance.md between the families markers; the rows into
results/bench-families.json. `--tiny` runs the same steps on small shapes, in a minute (the tests' smoke).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from benchmarks.bench import machine, service_phase, write_readme
from benchmarks.corpus import sentences

PAGE_START = "<!-- families:start -->"
PAGE_END = "<!-- families:end -->"
ROOT = Path("results/bench/families")

# name -> (transformers config class, its arguments at the real model's sizes, model class, pooling, what it is)
SHAPES = {
    "mpnet-base": ("MPNetConfig", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                       intermediate_size=3072, max_position_embeddings=514,
                                       relative_attention_num_buckets=32, pad_token_id=1),
                   "MPNetModel", "mean", "all-mpnet-base-v2's shape: 12 layers, hidden 768, relative positions"),
    "modernbert-base": ("ModernBertConfig", dict(hidden_size=768, num_hidden_layers=22, num_attention_heads=12,
                                                 intermediate_size=1152, max_position_embeddings=8192,
                                                 global_attn_every_n_layers=3, local_attention=128, pad_token_id=0),
                        "ModernBertModel", "mean", "ModernBERT-base's shape: 22 layers, hidden 768, GeGLU 1152, "
                                                   "a 128-token window on 2 layers of 3"),
    "qwen3-0.6b": ("Qwen3Config", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                       max_position_embeddings=32768, rope_theta=1_000_000.0, pad_token_id=0,
                                       tie_word_embeddings=True),
                   "Qwen3Model", "lasttoken", "Qwen3-Embedding-0.6B's shape: 28 layers, hidden 1024, 16 query heads on 8"),
}
MAX_TOKENS = 512  # every shape's sentence-transformers max_seq_length here
# --tiny: the same families at test sizes (the steps, not the figures): hidden 64, 2 layers, 4 heads
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
TINY_EXTRA = {"qwen3-0.6b": {"num_key_value_heads": 2, "head_dim": 16}, "modernbert-base": {"global_attn_every_n_layers": 2}}
EQUAL_PRECISION_GOAL, FP32_GOAL, COSINE_GOAL = 1.3, 2.0, 0.9999  # issue 49's targets for the base shapes


def sizes(name: str, tiny: bool) -> dict:
    """The config arguments of `name`'s shape: the real model's, or --tiny's."""
    real = SHAPES[name][1]
    return {**real, **TINY, **TINY_EXTRA.get(name, {})} if tiny else real


def make_checkpoint(name: str, out: Path, tiny: bool = False, shape: tuple | None = None) -> Path:
    """A seeded random checkpoint of `name`'s shape (or of `shape`, a SHAPES-like entry at its own sizes)
    with the default model's tokenizer, as a sentence-transformers model (Transformer, Pooling,
    Normalize); once, kept in `out`."""
    if (out / "modules.json").exists():
        return out
    import torch
    import transformers

    from export.checkpoint import resolve_checkpoint

    config_class, own_sizes, model_class, pooling, _ = shape or SHAPES[name]
    source = resolve_checkpoint("default")[0]
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = getattr(transformers, config_class)(vocab_size=vocab, **(own_sizes if shape else sizes(name, tiny)))
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    for file in ("tokenizer.json", "vocab.txt", "special_tokens_map.json"):
        if (source / file).exists():
            shutil.copy(source / file, staging / file)
    (staging / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MAX_TOKENS, "padding_side": "right",
        "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]",
        "model_input_names": ["input_ids", "attention_mask"]}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (staging / "modules.json").write_text(json.dumps(modules))
    (staging / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_TOKENS}))
    (staging / "1_Pooling").mkdir()
    # the format before sentence-transformers 6 (a boolean per mode), which the peer's older one reads too
    (staging / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config.hidden_size, "pooling_mode_mean_tokens": pooling == "mean",
         "pooling_mode_cls_token": pooling == "cls", "pooling_mode_lasttoken": pooling == "lasttoken"}))
    (staging / "2_Normalize").mkdir()
    staging.rename(out)
    return out


def export(checkpoint: Path, bundle: Path, lossy: tuple[str, ...] = ()) -> Path:
    """The bundle, once: fp32 and the `lossy` variants (bf16 where the CPU has bf16 units, which the
    default config serves where its gate passed); a bundle kept from a run without them is built again."""
    from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
    from bundle.manifest import BundleError, load_bundle
    from export.pipeline import ExportOptions, build_bundle

    try:
        # a variant asked for but absent was never tried (a failed gate is in the manifest too)
        if all(v in load_bundle(bundle).manifest.variants or v in tried_variants(bundle) for v in lossy):
            return bundle
    except BundleError:
        pass
    started = time.perf_counter()
    build_bundle(ExportOptions(str(checkpoint), bundle, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, lossy=lossy, force=True),
                 progress=lambda line: print(f"    {line}", flush=True))
    bundle.with_name(bundle.name + ".lossy.json").write_text(json.dumps(list(lossy)))
    print(f"  exported {bundle} in {time.perf_counter() - started:.0f} s", flush=True)
    return bundle


def tried_variants(bundle: Path) -> set[str]:
    """The lossy variants an export of `bundle` gated, published or not (a failed gate leaves no variant in
    bundle.json: export() notes what it asked for beside the bundle)."""
    try:
        return set(json.loads(bundle.with_name(bundle.name + ".lossy.json").read_text()))
    except (OSError, ValueError):
        return set()


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def verdicts(r: dict) -> list[dict]:
    """Issue 49's targets for one shape, computed from its row: the default precision against each peer
    at bf16 (>= 1.3x) and at fp32 (>= 2x), and its min cosine (>= 0.9999). None: not measured."""
    checks = [("sentence-transformers bf16", ratio(r["service_s"], r.get("st_bf16_s")), EQUAL_PRECISION_GOAL),
              ("infinity-emb bf16", ratio(r["service_s"], r.get("infinity_bf16_s")), EQUAL_PRECISION_GOAL),
              ("sentence-transformers fp32", ratio(r["service_s"], r["st_s"]), FP32_GOAL),
              ("infinity-emb fp32", ratio(r["service_s"], r.get("infinity_s")), FP32_GOAL),
              ("min cosine", r["cosine"], COSINE_GOAL)]
    return [{"what": what, "measured": value, "goal": goal, "met": None if value is None else value >= goal}
            for what, value, goal in checks]


def x(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def render(rows: list[dict], where: str) -> str:
    first = rows[0]
    lines = [f"Measured {where}: {first['texts']} texts of 8-40 words, client batches of {first['batch']} at "
             "4 clients (httpx, /v1/embeddings, base64); random weights at the real models' sizes "
             f"(`make bench-families`{', --tiny: test sizes, the figures mean nothing' if first.get('tiny') else ''}). "
             "sentence-transformers runs in-process (bf16: `model_kwargs={'dtype': torch.bfloat16}`), infinity-emb "
             "with `--dtype float32` and `--dtype bfloat16`; min cosines are against sentence-transformers fp32. The "
             "service's default precision is what its /info says served (bf16 where the export's gate passed). "
             "The bound: the CPU's peak FLOP/s at that precision over the model's FLOPs per text "
             f"({first.get('bound_how', 'not computed')}). Figures of one run, on a machine shared with other work: noisy.",
             "",
             "| shape | service, default | vs ST fp32 | vs ST bf16 | vs infinity bf16 | min cosine | service fp32 | "
             "ST fp32 | ST bf16 (min cosine) | infinity fp32 | infinity bf16 (min cosine) | engine alone, default | "
             "bound at the default's precision |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def rate(value: float | None, cosine: float | None = None, note: str = "") -> str:
        if not value:
            return "not measured" + (f" ({note})" if note else "")
        return f"{value:.1f}" + (f" ({cosine:.5f})" if cosine is not None else "")

    for r in rows:
        bound = (f"{r['bound_s']:.0f} texts/s (service at {r['service_s'] / r['bound_s']:.1%} of peak)"
                 if r.get("bound_s") else "-")
        lines.append(
            f"| {r['shape']}: {r['what']} | {r['service_s']:.1f} texts/s ({r['served']}) | {x(ratio(r['service_s'], r['st_s']))} | "
            f"{x(ratio(r['service_s'], r.get('st_bf16_s')))} | {x(ratio(r['service_s'], r.get('infinity_bf16_s')))} | "
            f"{r['cosine']:.5f} | {rate(r.get('service_fp32_s'))} | {r['st_s']:.1f} | "
            f"{rate(r.get('st_bf16_s'), r.get('st_bf16_cosine'), r.get('bf16_note', ''))} | "
            f"{rate(r.get('infinity_s'), r.get('infinity_cosine'), r.get('infinity_note', ''))} | "
            f"{rate(r.get('infinity_bf16_s'), r.get('infinity_bf16_cosine'), r.get('infinity_note', r.get('bf16_note', '')))} | "
            f"{rate(r.get('engine_alone_s'))} | {bound} |")
    lines += ["", "Issue 49's targets at the default precision, computed from the rows above (never asserted by a test):", "",
              "| shape | target | measured | met |", "|---|---|---|---|"]
    for r in rows:
        for v in verdicts(r):
            measured = "not measured" if v["measured"] is None else (
                f"{v['measured']:.5f}" if v["what"] == "min cosine" else f"{v['measured']:.2f}x")
            goal = f">= {v['goal']}" if v["what"] == "min cosine" else f">= {v['goal']}x {v['what']}"
            met = "not measured" if v["met"] is None else ("yes" if v["met"] else f"no ({v['measured'] / v['goal']:.0%} of it)")
            lines.append(f"| {r['shape']} | {goal} | {measured} | {met} |")
    return "\n".join(lines)


def serve(name: str, bundle: Path, texts: list[str], batch: int, reference: np.ndarray, precision: str | None) -> dict:
    """The service's client-batch row on `bundle` at `precision` (None: the default, what auto picks)."""
    scenario = {"label": f"client batches of {batch} (httpx, /v1/embeddings)", "per_request": batch,
                "concurrency": 4, "loadgen": "httpx"}
    settings = {"bundle": str(bundle), "request_timeout_s": 600,  # a 0.6B model on a few cores: long batches
                **({"precision": precision} if precision else {})}
    served = service_phase({"label": f"{name} {precision or 'default'}, haproxy", "ingress": "haproxy", "texts": texts,
                            "mixed_texts": texts, "short_text": "A short text.", "encoding_format": "base64",
                            "route": "openai", "wrk": {"duration_s": 0, "warmup_s": 0}, "settings": settings,
                            "reference": reference.tolist(), "scenarios": [scenario]})[0]
    if served["failures"]:
        raise SystemExit(f"{name}: {served['failures']} requests failed; their texts/s would mean nothing")
    return served


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--peers", default="", help="infinity: also measure infinity-emb on each model directory")
    p.add_argument("--peer-start-s", type=float, default=900, help="how long infinity-emb may take to answer")
    p.add_argument("--engine-seconds", type=float, default=8, help="seconds of load on the engine alone per shape")
    p.add_argument("--tiny", action="store_true",
                   help="the same steps on test-sized shapes (hidden 64, 2 layers): a smoke run, its figures mean nothing")
    p.add_argument("--json", type=Path, default=Path("results/bench-families.json"))
    p.add_argument("--page", type=Path, default=Path("docs/performance.md"))
    p.add_argument("--no-page", action="store_true", help="print only")
    args = p.parse_args()
    if args.tiny:  # a smoke run's figures never go on the page or over a real run's rows
        args.no_page = True
        if args.json == Path("results/bench-families.json"):
            args.json = Path("results/bench-families-tiny.json")
    from benchmarks.bench import bench_sentence_transformers, bf16_units, engine_alone, min_cosine
    from benchmarks.engine_alone import model_cost, physical_bound
    from service.runtimes.onnxruntime import available_cpus

    texts = sentences(args.texts, seed=11)
    where = machine()
    root = ROOT / "tiny" if args.tiny else ROOT
    peers_bf16 = bf16_units()
    no_bf16 = "" if peers_bf16 else "this CPU has no bf16 units"
    # a run of some shapes keeps the other shapes' rows of the last run on this machine (this format's)
    last = json.loads(args.json.read_text()) if args.json.exists() else {}
    kept = [r for r in last.get("rows", []) if last.get("machine") == where and r["texts"] == len(texts)
            and "served" in r and bool(r.get("tiny")) == args.tiny]
    rows: list[dict] = []
    for name in [s for s in args.shapes.replace(" ", "").split(",") if s]:
        print(f"{name}: {SHAPES[name][4]}{' (tiny)' if args.tiny else ''}", flush=True)
        checkpoint = make_checkpoint(name, (root / name).resolve(), args.tiny)
        bundle = export(checkpoint, (root / f"{name}-bundle").resolve(), ("bf16",) if peers_bf16 else ())
        st_rate, reference, model = bench_sentence_transformers(texts, args.batch, checkpoint=checkpoint)
        cost = model_cost(model, texts)
        del model
        print(f"  sentence-transformers fp32 in-process: {st_rate:.1f} texts/s", flush=True)
        row = {"shape": name, "what": SHAPES[name][4], "texts": len(texts), "batch": args.batch, "tiny": args.tiny,
               "st_s": st_rate, "bf16_note": no_bf16}
        if peers_bf16:
            rate, vectors, _ = bench_sentence_transformers(texts, args.batch, "bf16", checkpoint=checkpoint)
            row.update(st_bf16_s=rate, st_bf16_cosine=min_cosine(vectors, reference))
            print(f"  sentence-transformers bf16 in-process: {rate:.1f} texts/s, min cosine {row['st_bf16_cosine']:.5f}",
                  flush=True)
        default = serve(name, bundle, texts, args.batch, reference, None)
        fp32 = serve(name, bundle, texts, args.batch, reference, "fp32")
        row.update(service_s=default["texts_s"], cosine=default["cosine"], service_p50_ms=default["p50"],
                   served=f"{default['runtime']} {default['precision']}", served_precision=default["precision"],
                   service_fp32_s=fp32["texts_s"], service_fp32_cosine=fp32["cosine"])
        alone = engine_alone(bundle, ["auto"], args.engine_seconds,
                             ("--texts", str(args.texts), "--seed", "11", "--no-reference"))[0]
        bound = physical_bound(cost, default["precision"], available_cpus())
        row.update(engine_alone_s=alone["texts_s"], bound_s=bound["texts_s"], bound_how=bound["how"],
                   gflops_per_text=bound["gflops_per_text"], mean_tokens=bound["mean_tokens"])
        if "infinity" in args.peers:
            from benchmarks.peers import measure_infinity

            for precision in ("fp32", "bf16") if peers_bf16 else ("fp32",):
                key = "infinity_s" if precision == "fp32" else "infinity_bf16_s"
                try:  # infinity-emb times every batch size at start: minutes for a 0.6B model on a few cores
                    peer = measure_infinity(texts, "A short text.", args.batch, {"duration_s": 0, "warmup_s": 0}, "base64",
                                            model=str(checkpoint), batches_only=True, start_timeout_s=args.peer_start_s,
                                            precision=precision, reference=reference)[0]
                    row[key] = peer["texts_s"] if not peer["failures"] else None
                    row[key.replace("_s", "_cosine")] = peer.get("cosine")
                except SystemExit as exc:  # the peer did not start: the row says so, the service's figures stay
                    print(f"  {name}: infinity-emb {precision} not measured: {exc}", flush=True)
                    row["infinity_note"] = str(exc)
        rows.append(row)
        kept = [r for r in kept if r["shape"] != name]
        print(f"  {name}: service {row['service_s']:.1f} texts/s ({row['served']}) = {row['service_s'] / st_rate:.2f}x "
              f"sentence-transformers fp32" + (f", {row['service_s'] / row['st_bf16_s']:.2f}x bf16" if peers_bf16 else "")
              + f"; engine alone {row['engine_alone_s']:.1f}; bound {row['bound_s']:.0f}", flush=True)
        # after each shape: a later one that fails leaves the earlier rows written
        publish(sorted(kept + rows, key=lambda r: list(SHAPES).index(r["shape"])), where, args)
    print(render(sorted(kept + rows, key=lambda r: list(SHAPES).index(r["shape"])), where))
    return 0


def publish(rows: list[dict], where: str, args) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": where, "rows": rows}, indent=2))
    if not args.no_page:
        write_readme(args.page, render(rows, where), PAGE_START, PAGE_END)
        print(f"  wrote {args.page} and {args.json}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
