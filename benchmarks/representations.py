"""make bench-representations (and make bench): dense, sparse and multi-vector outputs from one pass, measured.

    python -m benchmarks.representations [--size base|tiny] [--texts 128] [--precisions auto,fp32]

Issue 48's rows, on models built here at base size with seeded random weights (nothing may be downloaded;
their vectors mean nothing, their cost per text is the real shapes'), with all-MiniLM-L6-v2's tokenizer (its
30522-token vocabulary, as make bench-families; BGE-M3's 250002 rows cost memory, not time per token):
- BGE-M3's shape: an XLM-R base (12 layers, hidden 768) with FlagEmbedding's colbert_linear.pt and
  sparse_linear.pt. The service's one /v1/encode pass giving dense + sparse + multi-vector, against three
  requests for one representation each, and against FlagEmbedding's BGEM3FlagModel.encode in-process (all
  three outputs; in the reference environment, benchmarks/flag_embedding_rate.py), fp32 and its best.
- SPLADE: a BERT base masked-LM saved by sentence-transformers' SparseEncoder (SpladePooling max), served
  against SparseEncoder.encode in-process (fp32, and under torch.autocast bf16: its best).
- what the sparse vocabulary projection costs: the masked-LM head's share of a BERT base forward (torch,
  in-process), and which exported graphs hold a vocabulary-sized matrix product (SPLADE's does; BGE-M3's and
  a dense model's do not, so they never run it).
The service rows: client batches of 32 at 4 clients (httpx, /v1/encode, base64), at the default config (auto:
OpenVINO bf16 where the CPU has bf16 units and it measures faster) and fp32. Checkpoints and bundles are
kept under results/bench/representations/; the rows go to results/bench-representations.json and the table
into docs/performance.md between the representations markers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from benchmarks.bench import machine, service_phase, write_readme
from benchmarks.corpus import sentences
from benchmarks.families import export

PAGE_START = "<!-- representations:start -->"
PAGE_END = "<!-- representations:end -->"
ROOT = Path("results/bench/representations")
REFERENCE_ENV = Path(os.environ.get("REFERENCE_ENV", ".venv-reference"))  # the Makefile's REF_ENV
MAX_TOKENS = 512
SIZES = {  # --size: base is the issue's; tiny only checks that the rows run (a smoke run, its figures mean nothing)
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
}
ONE_PASS = {"embedding": True, "sparse": True, "multivector": True}
SEPARATE = ({"embedding": True}, {"embedding": False, "sparse": True}, {"embedding": False, "multivector": True})


def splade_export_missing() -> str | None:
    """Why the SPLADE rows cannot run on this checkout (the SPLADE export is not merged), or None."""
    try:
        from export.heads import SpladeEncoder  # noqa: F401  (the SPLADE export's encoder, issue 48)
    except ImportError:
        return "export.heads.SpladeEncoder is missing: the SPLADE export (issue 48) is not on this branch"
    return None


def _tokenizer_files(staging: Path) -> None:
    """all-MiniLM-L6-v2's WordPiece tokenizer, its specials named as FlagEmbedding and the export read them."""
    from export.checkpoint import resolve_checkpoint

    source = resolve_checkpoint("default")[0]
    for file in ("tokenizer.json", "vocab.txt"):
        shutil.copy(source / file, staging / file)
    (staging / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MAX_TOKENS, "padding_side": "right",
        "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]", "eos_token": "[SEP]",
        "mask_token": "[MASK]", "model_input_names": ["input_ids", "attention_mask"]}))


def _vocab_size() -> int:
    from export.checkpoint import resolve_checkpoint

    return json.loads((resolve_checkpoint("default")[0] / "config.json").read_text())["vocab_size"]


def make_bge_m3(out: Path, size: str) -> Path:
    """An XLM-R of `size` (seeded random weights) as BAAI/bge-m3 lays it out: sentence-transformers' CLS
    pooling and Normalize, and colbert_linear.pt (hidden -> hidden) and sparse_linear.pt (hidden -> 1) beside
    it (tests/late_interaction_models.py's make_bge_m3 at this size); once, kept in `out`."""
    if (out / "sparse_linear.pt").exists():
        return out
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    config = XLMRobertaConfig(vocab_size=_vocab_size(), max_position_embeddings=MAX_TOKENS + 2, type_vocab_size=1,
                              pad_token_id=0, bos_token_id=101, eos_token_id=102, **SIZES[size])
    torch.manual_seed(0)
    model = XLMRobertaModel(config, add_pooling_layer=False).eval()
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    _tokenizer_files(staging)
    (staging / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (staging / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_TOKENS}))
    (staging / "1_Pooling").mkdir()
    (staging / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": config.hidden_size, "pooling_mode_cls_token": True,
         "pooling_mode_mean_tokens": False}))
    (staging / "2_Normalize").mkdir()
    hidden = config.hidden_size
    colbert, sparse = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 1)
    torch.save(colbert.state_dict(), staging / "colbert_linear.pt")
    torch.save(sparse.state_dict(), staging / "sparse_linear.pt")
    staging.rename(out)
    return out


def make_splade(out: Path, size: str) -> Path:
    """A BERT masked-LM of `size` (seeded random weights) saved by SparseEncoder with SpladePooling max, as
    naver/splade-v3 is laid out; once, kept in `out`."""
    if (out / "modules.json").exists():
        return out
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from transformers import BertConfig, BertForMaskedLM

    mlm = out.with_name(out.name + "-mlm")
    if not (mlm / "config.json").exists():
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(vocab_size=_vocab_size(), max_position_embeddings=MAX_TOKENS,
                                           **SIZES[size])).eval()
        shutil.rmtree(mlm, ignore_errors=True)
        mlm.mkdir(parents=True)
        model.save_pretrained(str(mlm))
        _tokenizer_files(mlm)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    SparseEncoder(modules=[MLMTransformer(str(mlm), max_seq_length=MAX_TOKENS), SpladePooling("max")],
                  device="cpu").save(str(staging))
    staging.rename(out)
    return out


def batches(texts: list[str], batch: int) -> list[list[str]]:
    return [texts[i : i + batch] for i in range(0, len(texts), batch)]


def flag_embedding_rates(model: Path, texts: list[str], batch: int) -> tuple[dict, dict]:
    """BGEM3FlagModel.encode's texts/s in the reference environment ({"fp32": ..}), and why a precision did not
    run ({"bf16 autocast": "TypeError: .."})."""
    python = REFERENCE_ENV / "bin" / "python"
    if not (REFERENCE_ENV / ".built-stamp").exists():
        raise SystemExit(f"the reference environment {REFERENCE_ENV} (FlagEmbedding) is not built: make reference-envs")
    done = subprocess.run([str(python), "-P", str(Path(__file__).with_name("flag_embedding_rate.py"))], text=True,
                          input=json.dumps({"model": str(model), "texts": texts, "batch": batch,
                                            "threads": os.cpu_count() or 1}),
                          capture_output=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"FlagEmbedding in-process failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for precision, why in result["failed"].items():
        print(f"  FlagEmbedding {precision} did not run: {why}", flush=True)
    if not result["rates"]:
        raise SystemExit(f"FlagEmbedding in-process ran at no precision: {result['failed']}")
    return result["rates"], result["failed"]


# the mean number of non-zero terms per text of the benchmark's SPLADE (set by sparse_encoder_rates)
TERMS: dict[str, float] = {}
# a trained SPLADE's vectors hold on the order of a hundred terms (naver/splade-v3's documents: about 100-200);
# the top_k row asks for this many, so the response is the size a trained model's would be
TRAINED_TERMS = 256


def sparse_encoder_rates(model: Path, texts: list[str], batch: int) -> dict:
    """SparseEncoder.encode's texts/s in-process, one call per client batch: fp32, and under bf16 autocast."""
    import contextlib

    import torch
    from sentence_transformers import SparseEncoder

    torch.set_num_threads(os.cpu_count() or 1)
    encoder = SparseEncoder(str(model), device="cpu")
    with torch.inference_mode():  # how sparse its vectors are: random weights give far more terms than a trained SPLADE
        vectors = encoder.encode(texts[:batch], batch_size=batch, convert_to_tensor=True).to_dense()
    TERMS["mean"] = float((vectors != 0).sum(dim=1).float().mean())
    rates = {}
    for precision, scope in (("fp32", contextlib.nullcontext),
                             ("bf16 autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16))):
        with torch.inference_mode(), scope():
            encoder.encode(texts[:batch], batch_size=batch)
            started = time.perf_counter()
            for chunk in batches(texts, batch):
                encoder.encode(chunk, batch_size=batch)
            rates[precision] = len(texts) / (time.perf_counter() - started)
    return rates


def head_share(mlm: Path, texts: list[str], batch: int, repeats: int = 3) -> dict:
    """The masked-LM head's share of a forward (torch fp32, in-process): BertForMaskedLM against its encoder
    alone on the same client batches, the better of `repeats` passes each; and the two's multiply-adds per
    token from the shapes."""
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = AutoTokenizer.from_pretrained(str(mlm))
    model = AutoModelForMaskedLM.from_pretrained(str(mlm)).eval()
    inputs = [tokenizer(chunk, padding=True, truncation=True, return_tensors="pt") for chunk in batches(texts, batch)]

    def best(run) -> float:
        times = []
        with torch.inference_mode():
            run(inputs[0])
            for _ in range(repeats):
                started = time.perf_counter()
                for x in inputs:
                    run(x)
                times.append(time.perf_counter() - started)
        return min(times)

    whole = best(lambda x: model(**x).logits)
    encoder = best(lambda x: model.base_model(**x).last_hidden_state)
    c = model.config
    head_macs = c.hidden_size * c.hidden_size + c.hidden_size * c.vocab_size  # transform, then the decoder
    encoder_macs = c.num_hidden_layers * (4 * c.hidden_size ** 2 + 2 * c.hidden_size * c.intermediate_size)
    return {"whole_s": whole, "encoder_s": encoder, "share": 1 - encoder / whole,
            "macs_share": head_macs / (head_macs + encoder_macs), "vocab": c.vocab_size, "hidden": c.hidden_size}


def vocabulary_products(bundle: Path, vocab: int) -> int:
    """How many matrix products of the bundle's fp32 graph have a vocabulary-sized side (the masked-LM decoder);
    the word-embedding table itself is a Gather, not a product."""
    import onnx

    from bundle.manifest import load_bundle

    graph = onnx.load(str(load_bundle(bundle).variant_path("fp32")), load_external_data=False).graph
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    products = 0
    for node in graph.node:
        if node.op_type in ("MatMul", "Gemm", "FusedMatMul"):
            if any(vocab in shapes.get(name, []) for name in node.input):
                products += 1
    return products


def service_rows(label: str, bundle: Path, texts: list[str], batch: int, precision: str,
                 scenarios: list[dict]) -> list[dict]:
    settings = {"bundle": str(bundle.resolve()), "request_timeout_s": 600,
                **({} if precision == "auto" else {"precision": precision})}
    rows = service_phase({"label": f"{label}, {precision if precision != 'auto' else 'default config'}",
                          "ingress": "haproxy", "settings": settings, "texts": [], "scenarios": scenarios})
    for row in rows:
        row["setting"] = precision
    failed = sum(r["failures"] for r in rows)
    if failed:
        raise SystemExit(f"{label}: {failed} requests failed; their texts/s would mean nothing")
    return rows


def bge_m3_scenarios(texts: list[str], batch: int) -> list[dict]:
    fmt = {"encoding_format": "base64"}
    one = [{"inputs": chunk, **ONE_PASS, **fmt} for chunk in batches(texts, batch)]
    three = [{"inputs": chunk, **asked, **fmt} for chunk in batches(texts, batch) for asked in SEPARATE]
    return [{"label": f"one pass: dense + sparse + multi-vector, client batches of {batch} (httpx, /v1/encode)",
             "bodies": one, "texts": len(texts), "passes": 1, "representations": 3, "concurrency": 4},
            {"label": f"three passes: one request per representation, client batches of {batch} (httpx, /v1/encode)",
             "bodies": three, "texts": len(texts), "passes": 3, "representations": 3, "concurrency": 4}]


def render(run: dict) -> str:
    m3, splade, head = run["bge_m3"], run.get("splade"), run.get("head")

    def served(rows: list[dict], setting: str, passes: int = 1) -> dict | None:
        return next((r for r in rows if r["setting"] == setting and r["passes"] == passes), None)

    def precision(rows: list[dict], setting: str) -> str:
        row = served(rows, setting)
        return f"{row['runtime']} {row['precision']}" if row and row.get("runtime") else setting

    lines = [f"Measured {run['date']} on {run['machine']} by `make bench-representations` (also part of `make bench`): "
             f"{run['texts']} texts of 8-40 words, client batches of {run['batch']} at 4 clients (httpx, /v1/encode, "
             f"base64), models of the {run['size']} size with random weights and all-MiniLM-L6-v2's tokenizer; the "
             f"in-process references one call per client batch, every core.", "",
             "| measure | target | measured | met |", "| --- | --- | --- | --- |"]
    best_ref = max(m3["flag_embedding"].values())
    best_ref_name = max(m3["flag_embedding"], key=m3["flag_embedding"].get)
    for setting in run["precisions"]:
        one, three = served(m3["rows"], setting), served(m3["rows"], setting, 3)
        if not (one and three):
            continue
        ratio = one["texts_s"] / three["texts_s"]
        name = "default config" if setting == "auto" else setting
        lines.append(f"| BGE-M3 shape, dense + sparse + multi-vector: one pass vs three ({name}: "
                     f"{precision(m3['rows'], setting)}) | >= 2.5x | {one['texts_s']:.1f} vs {three['texts_s']:.1f} "
                     f"texts/s = {ratio:.2f}x | {'yes' if ratio >= 2.5 else 'no'} |")
        vs = one["texts_s"] / best_ref
        target = ">= 2x (bf16 default, CPU with bf16 units)" if setting == "auto" else "reported"
        met = ("yes" if vs >= 2 else "no") if setting == "auto" and one.get("precision") == "bf16" else (
            "not judged (the default served fp32)" if setting == "auto" else "reported")
        refs = ", ".join([f"{k} {v:.1f} texts/s" for k, v in m3["flag_embedding"].items()]
                         + [f"{k}: fails ({why.split(':')[0]})" for k, why in m3.get("flag_embedding_failed", {}).items()])
        lines.append(f"| BGE-M3 shape, all three: the service's one pass vs FlagEmbedding BGEM3FlagModel.encode "
                     f"in-process ({name}) | {target} | {one['texts_s']:.1f} texts/s = {vs:.2f}x FlagEmbedding's best "
                     f"({best_ref_name}; {refs}) | {met} |")
    if splade is None or splade.get("missing"):
        lines.append(f"| SPLADE (BERT {run['size']} MLM, SpladePooling max) vs SparseEncoder in-process | >= 2x | not measured: "
                     f"{splade['missing'] if splade else 'not run'} | - |")
    else:
        best = max(splade["sparse_encoder"].values())
        refs = ", ".join(f"{k} {v:.1f}" for k, v in splade["sparse_encoder"].items())
        terms = splade.get("terms")
        for setting in run["precisions"]:
            for row in (r for r in splade["rows"] if r["setting"] == setting):
                vs = row["texts_s"] / best
                name = "default config" if setting == "auto" else setting
                judged = setting == "auto" and row.get("precision") == "bf16"
                what = (f"sparse, top_k {TRAINED_TERMS} (a trained SPLADE's size of response)" if "top_k" in row["engine"]
                        else f"sparse, every term ({terms:.0f} per text with random weights)" if terms else "sparse")
                lines.append(f"| SPLADE (BERT {run['size']} MLM, SpladePooling max), {what}: the service vs "
                             f"SparseEncoder.encode in-process ({name}: {row.get('runtime', '')} {row.get('precision', '')}) | "
                             f"{'>= 2x (bf16 default)' if setting == 'auto' else 'reported'} | {row['texts_s']:.1f} texts/s "
                             f"= {vs:.2f}x SparseEncoder's best ({refs} texts/s) | "
                             f"{('yes' if vs >= 2 else 'no') if judged else 'reported'} |")
    if head:
        lines.append(f"| the sparse vocabulary projection (SPLADE's masked-LM head: hidden {head['hidden']} -> "
                     f"{head['vocab']} per token) | reported | {head['share']:.0%} of a BERT {run['size']} forward in torch fp32 "
                     f"({head['whole_s'] * 1000 / run['texts']:.1f} ms per text with it, "
                     f"{head['encoder_s'] * 1000 / run['texts']:.1f} without); {head['macs_share']:.0%} of the "
                     f"multiply-adds per token | reported |")
    products = ", ".join(f"{k}: {v}" for k, v in run.get("vocabulary_products", {}).items())
    if products:
        lines.append(f"| graphs that run a vocabulary-sized product | only SPLADE's | matrix products with a "
                     f"{run['vocab']}-wide side per bundle graph: {products} | "
                     f"{'yes' if all(v == 0 for k, v in run['vocabulary_products'].items() if k != 'splade') else 'no'} |")
    lines += ["", "All rows:", "", "| engine | texts/s | p50 ms | p95 ms | requests |", "| --- | --- | --- | --- | --- |"]
    for k, v in m3["flag_embedding"].items():
        lines.append(f"| BGE-M3 shape: FlagEmbedding BGEM3FlagModel.encode in-process, all three outputs, {k} | "
                     f"{v:.1f} | | | |")
    for r in m3["rows"] + (splade or {}).get("rows", []):
        lines.append(f"| {r['engine']} ({r.get('runtime', '')} {r.get('precision', '')}) | {r['texts_s']:.1f} | "
                     f"{r['p50']:.0f} | {r['p95']:.0f} | {r['requests']} |")
    for k, v in (splade or {}).get("sparse_encoder", {}).items():
        lines.append(f"| SPLADE: SparseEncoder.encode in-process, {k} | {v:.1f} | | | |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.representations", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="base", help="tiny: a smoke run whose figures mean nothing")
    p.add_argument("--texts", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--precisions", default="auto,fp32",
                   help="the service's precision setting per phase, comma-separated (auto: the default config)")
    p.add_argument("--json", type=Path, default=Path("results/bench-representations.json"))
    p.add_argument("--page", type=Path, default=Path("docs/performance.md"))
    p.add_argument("--no-page", action="store_true", help="print only")
    args = p.parse_args()
    texts = sentences(args.texts, seed=13)
    precisions = [s for s in args.precisions.replace(" ", "").split(",") if s]
    root = (ROOT / args.size).resolve()
    run = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "size": args.size, "texts": len(texts),
           "batch": args.batch, "precisions": precisions, "vocab": _vocab_size()}

    print(f"BGE-M3 shape ({args.size}): XLM-R with colbert_linear.pt and sparse_linear.pt", flush=True)
    m3 = make_bge_m3(root / "bge-m3", args.size)
    m3_bundle = export(m3, root / "bge-m3-bundle", lossy=("bf16",))
    flag, flag_failed = flag_embedding_rates(m3, texts, args.batch)
    print("  FlagEmbedding BGEM3FlagModel.encode in-process: "
          + ", ".join(f"{k} {v:.1f} texts/s" for k, v in flag.items()), flush=True)
    rows = [row for setting in precisions
            for row in service_rows("BGE-M3 shape", m3_bundle, texts, args.batch, setting,
                                    bge_m3_scenarios(texts, args.batch))]
    run["bge_m3"] = {"flag_embedding": flag, "flag_embedding_failed": flag_failed, "rows": rows}
    run["vocabulary_products"] = {"bge-m3": vocabulary_products(m3_bundle, run["vocab"])}
    default = Path("bundles/all-MiniLM-L6-v2")
    if default.exists():
        run["vocabulary_products"]["all-MiniLM-L6-v2 (dense)"] = vocabulary_products(default, run["vocab"])

    print(f"SPLADE ({args.size}): BERT masked-LM, SparseEncoder with SpladePooling max", flush=True)
    splade = make_splade(root / "splade", args.size)
    run["head"] = head_share(splade.with_name(splade.name + "-mlm"), texts, args.batch)
    print(f"  the masked-LM head: {run['head']['share']:.0%} of a forward in torch fp32 "
          f"({run['head']['macs_share']:.0%} of the multiply-adds per token)", flush=True)
    missing = splade_export_missing()
    if missing:  # the guard: the SPLADE export lands separately; until then its rows say what is missing
        print(f"  SPLADE rows not measured: {missing}", flush=True)
        run["splade"] = {"missing": missing}
    else:
        splade_bundle = export(splade, root / "splade-bundle", lossy=("bf16",))
        encoder = sparse_encoder_rates(splade, texts, args.batch)
        print("  SparseEncoder.encode in-process: " + ", ".join(f"{k} {v:.1f} texts/s" for k, v in encoder.items()),
              flush=True)
        print(f"  its vectors: {TERMS['mean']:.0f} non-zero terms per text on average (random weights)", flush=True)
        bodies = [{"inputs": chunk, "sparse": True} for chunk in batches(texts, args.batch)]
        scenario = {"label": f"sparse, client batches of {args.batch} (httpx, /v1/encode)", "bodies": bodies,
                    "texts": len(texts), "passes": 1, "representations": 1, "concurrency": 4}
        trimmed = {"label": f"sparse top_k {TRAINED_TERMS}, client batches of {args.batch} (httpx, /v1/encode)",
                   "bodies": [{**b, "top_k": TRAINED_TERMS} for b in bodies], "texts": len(texts), "passes": 1,
                   "representations": 1, "concurrency": 4, "top_k": TRAINED_TERMS}
        run["splade"] = {"sparse_encoder": encoder, "terms": TERMS.get("mean"),
                         "rows": [row for setting in precisions
                                  for row in service_rows("SPLADE", splade_bundle, texts, args.batch, setting,
                                                          [scenario, trimmed])]}
        run["vocabulary_products"]["splade"] = vocabulary_products(splade_bundle, run["vocab"])
    table = render(run)
    print()
    print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(run, indent=2))
    if not args.no_page:
        write_readme(args.page, table, PAGE_START, PAGE_END)
        print(f"\nwrote {args.page} and {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
