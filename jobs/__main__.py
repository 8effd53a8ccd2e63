"""python -m jobs embed --bundle DIR --input PATH [PATH...] --output DIR [options]: see docs/jobs.md.

Prints Ray Data's progress while it runs, one summary line on stdout at the end and exits 0 (rows that
could not be embedded are in DIR/_errors.jsonl and still succeed); on failure, one line on stderr and 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("embed", help="embed every row of Parquet, JSONL or CSV files into Parquet shards")
    e.add_argument("--bundle", type=Path, required=True, help="the model bundle (python -m export's output)")
    e.add_argument("--input", type=Path, nargs="+", required=True, dest="inputs",
                   help="input files (or directories of them), numbered in this order")
    e.add_argument("--output", type=Path, required=True, help="the output directory (run again to resume)")
    e.add_argument("--text-column", default="text")
    e.add_argument("--id-column", default=None, help="kept under its own name in the output; default: `row`, the "
                                                     "row's position in the inputs")
    e.add_argument("--outputs", default="embedding", help="embedding[,sparse,multivector]")
    e.add_argument("--address", default=None, help="a Ray cluster's address; default: a local Ray for the job")
    e.add_argument("--format", choices=("parquet", "jsonl", "csv"), default=None, help="default: by suffix")
    e.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="L2-normalise embeddings; default: the model's own, as /v1/embeddings")
    e.add_argument("--truncate", action=argparse.BooleanOptionalAction, default=True,
                   help="cut texts past the model's limit, as /v1/embeddings (default); --no-truncate: a bad row")
    e.add_argument("--batch-size", type=int, default=None, help="rows per shard and per actor call (default 2048)")
    e.add_argument("--concurrency", type=int, default=None, help="actors (default: one per GPU, else per CPU)")
    e.add_argument("--precision", default="auto", help="the service's precision setting (default auto: as a "
                                                       "replica chooses; a resumed output keeps what it ran)")
    e.add_argument("--connect-timeout", type=float, default=None, metavar="SECONDS",
                   help="give up on a cluster (--address) that does not answer within this (default 60)")
    p.epilog = e.format_help()  # python -m jobs --help lists embed's flags too
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from jobs.embed import CONNECT_TIMEOUT_S, DEFAULT_BATCH, ConnectError, EmbedSpec, run, summary_line

    try:
        spec = EmbedSpec(bundle=args.bundle, inputs=args.inputs, output=args.output, text_column=args.text_column,
                         id_column=args.id_column, outputs=args.outputs, address=args.address, format=args.format,
                         normalize=args.normalize, batch_size=args.batch_size or DEFAULT_BATCH,
                         concurrency=args.concurrency, truncate=args.truncate, precision=args.precision,
                         connect_timeout=args.connect_timeout or CONNECT_TIMEOUT_S)
        summary = run(spec)
    except KeyboardInterrupt:
        print("python -m jobs embed: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except ConnectError as exc:
        print(f"python -m jobs embed: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # Ray's connection may still be waiting on a thread, and its exit hooks with it
    except Exception as exc:  # one line a user can act on, not a traceback
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"python -m jobs embed: {type(exc).__name__}: {message}", file=sys.stderr)
        return 1
    print(summary_line(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
