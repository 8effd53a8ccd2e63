"""make bench-families: the newer families at their real sizes, served against sentence-transformers
and infinity-emb on the same model directory, in one run.

No such checkpoint ships and nothing may be downloaded, so each is built here from transformers' config
class at the real model's sizes (layers, widths, heads, local windows) with seeded random weights and
all-MiniLM-L6-v2's tokenizer (its 30522-token vocabulary: the real ones' larger tables cost memory, not
time per token). Their vectors mean nothing; their cost per text is the real models'. Per family: export
(fp32, through the parity gate), sentence-transformers in-process, the service over HTTP (client batches
of 32 at 4 clients, fp32), and with `--peers infinity` infinity-emb serving the same directory. The
table goes into docs/performance.md between the families markers; the rows into results/bench-families.json.
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


def make_checkpoint(name: str, out: Path) -> Path:
    """A seeded random checkpoint of `name`'s shape with the default model's tokenizer, as a
    sentence-transformers model (Transformer, Pooling, Normalize); once, kept in `out`."""
    if (out / "modules.json").exists():
        return out
    import torch
    import transformers

    from export.checkpoint import resolve_checkpoint

    config_class, sizes, model_class, pooling, _ = SHAPES[name]
    source = resolve_checkpoint("default")[0]
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = getattr(transformers, config_class)(vocab_size=vocab, **sizes)
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
    """The bundle, once: fp32 and the `lossy` variants (none here: the targets are fp32; make
    bench-representations asks for bf16, which the default config serves on a CPU with bf16 units)."""
    from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL
    from bundle.manifest import BundleError, load_bundle
    from export.pipeline import ExportOptions, build_bundle

    try:
        load_bundle(bundle)
        return bundle
    except BundleError:
        pass
    started = time.perf_counter()
    build_bundle(ExportOptions(str(checkpoint), bundle, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL, lossy=lossy, force=True),
                 progress=lambda line: print(f"    {line}", flush=True))
    print(f"  exported {bundle} in {time.perf_counter() - started:.0f} s", flush=True)
    return bundle


def sentence_transformers_rate(checkpoint: Path, texts: list[str], batch: int) -> tuple[float, np.ndarray]:
    """texts/s of SentenceTransformer.encode in batches of `batch` (torch fp32, every core), and its vectors."""
    import os

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(os.cpu_count() or 1)
    model = SentenceTransformer(str(checkpoint), device="cpu")
    model.encode(texts[:batch], batch_size=batch)  # warm-up
    started = time.perf_counter()
    embeddings = model.encode(texts, batch_size=batch)
    return len(texts) / (time.perf_counter() - started), embeddings


def render(rows: list[dict], where: str) -> str:
    lines = [f"Measured {where}: {rows[0]['texts']} texts of 8-40 words, client batches of {rows[0]['batch']} at "
             "4 clients (httpx, /v1/embeddings, base64), fp32; random weights at the real models' sizes "
             "(`make bench-families`).", "",
             "| shape | sentence-transformers in-process | service | vs sentence-transformers | infinity-emb | vs infinity-emb | min cosine vs sentence-transformers |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        peer = f"{r['infinity_s']:.1f} texts/s" if r.get("infinity_s") else "not measured" + (
            f" ({r['infinity_note']})" if r.get("infinity_note") else "")
        vs_peer = f"{r['service_s'] / r['infinity_s']:.2f}x" if r.get("infinity_s") else "-"
        lines.append(f"| {r['shape']}: {r['what']} | {r['st_s']:.1f} texts/s | {r['service_s']:.1f} texts/s | "
                     f"{r['service_s'] / r['st_s']:.2f}x | {peer} | {vs_peer} | {r['cosine']:.5f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--texts", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--peers", default="", help="infinity: also measure infinity-emb on each model directory")
    p.add_argument("--peer-start-s", type=float, default=900, help="how long infinity-emb may take to answer")
    p.add_argument("--json", type=Path, default=Path("results/bench-families.json"))
    p.add_argument("--page", type=Path, default=Path("docs/performance.md"))
    p.add_argument("--no-page", action="store_true", help="print only")
    args = p.parse_args()
    texts = sentences(args.texts, seed=11)
    where = machine()
    # a run of some shapes keeps the other shapes' rows of the last run on this machine
    last = json.loads(args.json.read_text()) if args.json.exists() else {}
    kept = [r for r in last.get("rows", []) if last.get("machine") == where and r["texts"] == len(texts)]
    rows: list[dict] = []
    for name in [s for s in args.shapes.replace(" ", "").split(",") if s]:
        print(f"{name}: {SHAPES[name][4]}", flush=True)
        checkpoint = make_checkpoint(name, (ROOT / name).resolve())
        bundle = export(checkpoint, (ROOT / f"{name}-bundle").resolve())
        st_rate, reference = sentence_transformers_rate(checkpoint, texts, args.batch)
        print(f"  sentence-transformers in-process: {st_rate:.1f} texts/s", flush=True)
        scenario = {"label": f"client batches of {args.batch} (httpx, /v1/embeddings)", "per_request": args.batch,
                    "concurrency": 4, "loadgen": "httpx"}
        served = service_phase({"label": f"{name} fp32, haproxy", "ingress": "haproxy", "texts": texts,
                                "mixed_texts": texts, "short_text": "A short text.", "encoding_format": "base64",
                                "route": "openai", "wrk": {"duration_s": 0, "warmup_s": 0},
                                # a 0.6B model on a few cores takes longer per batch than the default deadline
                                "settings": {"bundle": str(bundle), "precision": "fp32", "request_timeout_s": 600},
                                "reference": reference.tolist(), "scenarios": [scenario]})[0]
        if served["failures"]:
            raise SystemExit(f"{name}: {served['failures']} requests failed; their texts/s would mean nothing")
        row = {"shape": name, "what": SHAPES[name][4], "texts": len(texts), "batch": args.batch, "st_s": st_rate,
               "service_s": served["texts_s"], "cosine": served["cosine"], "service_p50_ms": served["p50"]}
        if "infinity" in args.peers:
            from benchmarks.peers import ensure_infinity, measure_infinity

            try:  # infinity-emb times every batch size at start: minutes for a 0.6B model on a few cores
                peer = measure_infinity(texts, "A short text.", args.batch, {"duration_s": 0, "warmup_s": 0}, "base64",
                                        model=str(checkpoint), batches_only=True, start_timeout_s=args.peer_start_s)
                row["infinity_s"] = peer[0]["texts_s"] if not peer[0]["failures"] else None
            except SystemExit as exc:  # the peer did not start: the row says so, the service's figures stay
                print(f"  {name}: infinity-emb not measured: {exc}", flush=True)
                row["infinity_note"] = str(exc)
        rows.append(row)
        kept = [r for r in kept if r["shape"] != name]
        print(f"  {name}: service {row['service_s']:.1f} texts/s = {row['service_s'] / st_rate:.2f}x "
              f"sentence-transformers", flush=True)
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
