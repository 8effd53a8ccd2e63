"""The reference libraries, called as their users call them, in the reference environment.

    .venv-reference/bin/python tests/reference/run.py SUBCOMMAND --out RESULT.npz < REQUEST.json

Run with the reference environment's python (tests/reference/build_env.py builds it), never .venv's:
only the standard library, numpy and that environment's libraries are imported. The request is one
JSON object of the subcommand's arguments (paths as strings); the result is one .npz file: its entry
`result.json` is the result as JSON, in which every array stands as {"__array__": NAME}, NAME being the
.npz entry that holds it (tests/reference_env.py's run_reference puts them back). Nothing is
downloaded: checkpoints are local directories and the Hugging Face hub is off.

Subcommands (arguments, then what comes back):
  versions        -> {library: version}
  pylate-save     base, out, seed=0, options={} (pylate.models.ColBERT's keyword arguments: embedding_size,
                  query_prefix, document_prefix, query_length, document_length, attend_to_expansion_tokens,
                  skiplist_words, do_query_expansion, ...) -> ColBERT(base, device="cpu", **options).save(out);
                  {"files", "modules", "config_sentence_transformers", "added_tokens"}: the layout saved
  pylate-encode   model, texts, is_query, batch_size=32 -> [array (tokens, dim) per text], as
                  ColBERT(model, device="cpu").encode(texts, is_query=...) gives them
  pylate-rerank   model, documents_ids, and either queries + documents (texts, encoded by PyLate as queries
                  and documents) or queries_embeddings + documents_embeddings (nested lists) ->
                  pylate.rank.rerank(documents_ids, queries_embeddings, documents_embeddings):
                  [[{"id", "score"}, ...] per query], best first
  bge-m3-encode   model, texts, max_length=None, batch_size=32 -> BGEM3FlagModel(model, use_fp16=False,
                  devices="cpu").encode(texts, return_dense=True, return_sparse=True, return_colbert_vecs=True):
                  {"dense_vecs": array (texts, hidden), "lexical_weights": [{token id (str): weight}],
                  "colbert_vecs": [array (tokens - 1, dim) per text]}
  bge-m3-score    model, pairs ([[query, passage], ...]), weights_for_different_modes=None (the library's
                  default), max_query_length=None, max_passage_length=None -> compute_score(pairs, ...):
                  {"colbert", "sparse", "dense", "sparse+dense", "colbert+sparse+dense": [score per pair]}
  batch           calls ([[subcommand, arguments], ...]) -> [result per call]: one process, so the imports
                  (most of a call's time) are paid once, and each model directory is loaded once
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

# before any Hugging Face library is imported: local directories only, no telemetry, no progress bars
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                  HF_HUB_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false")

import numpy as np  # noqa: E402


def _torch():
    import torch

    torch.set_num_threads(1)  # tiny models; the suite runs two workers on two cores
    return torch


def versions(_: dict) -> dict:
    import importlib.metadata as metadata

    names = ("torch", "transformers", "sentence-transformers", "pylate", "FlagEmbedding")
    return {name: metadata.version(name) for name in names}


def pylate_save(args: dict) -> dict:
    torch = _torch()
    from pylate import models

    torch.manual_seed(int(args.get("seed", 0)))  # the Dense projection's random weights
    model = models.ColBERT(str(args["base"]), device="cpu", **args.get("options", {}))
    out = Path(args["out"])
    model.save(str(out))
    read = lambda name: json.loads((out / name).read_text()) if (out / name).exists() else None  # noqa: E731
    return {
        "files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()),
        "modules": read("modules.json"),
        "config_sentence_transformers": read("config_sentence_transformers.json"),
        "added_tokens": model.tokenizer.get_added_vocab(),
    }


@functools.cache
def _colbert(path: str):
    _torch()
    from pylate import models

    return models.ColBERT(path, device="cpu")


def pylate_encode(args: dict) -> list:
    model = _colbert(str(args["model"]))
    embeddings = model.encode(list(args["texts"]), is_query=bool(args["is_query"]),
                              batch_size=int(args.get("batch_size", 32)), convert_to_numpy=True,
                              show_progress_bar=False)
    return [np.asarray(e, dtype=np.float32) for e in embeddings]


def pylate_rerank(args: dict) -> list:
    from pylate import rank

    if "queries_embeddings" in args:
        queries = [np.asarray(q, dtype=np.float32) for q in args["queries_embeddings"]]
        documents = [[np.asarray(d, dtype=np.float32) for d in docs] for docs in args["documents_embeddings"]]
    else:
        model = _colbert(str(args["model"]))
        queries = model.encode(list(args["queries"]), is_query=True, convert_to_numpy=True, show_progress_bar=False)
        documents = [model.encode(list(docs), is_query=False, convert_to_numpy=True, show_progress_bar=False)
                     for docs in args["documents"]]
    ranked = rank.rerank(documents_ids=args["documents_ids"], queries_embeddings=queries,
                         documents_embeddings=documents)
    return [[{"id": hit["id"], "score": float(hit["score"])} for hit in hits] for hits in ranked]


@functools.cache
def _bge_m3(path: str):
    _torch()
    from FlagEmbedding import BGEM3FlagModel

    return BGEM3FlagModel(path, use_fp16=False, devices="cpu")


def bge_m3_encode(args: dict) -> dict:
    model = _bge_m3(str(args["model"]))
    output = model.encode(list(args["texts"]), batch_size=int(args.get("batch_size", 32)),
                          max_length=args.get("max_length"), return_dense=True, return_sparse=True,
                          return_colbert_vecs=True)
    return {
        "dense_vecs": np.asarray(output["dense_vecs"], dtype=np.float32),
        "lexical_weights": [{token: float(weight) for token, weight in weights.items()}
                            for weights in output["lexical_weights"]],
        "colbert_vecs": [np.asarray(v, dtype=np.float32) for v in output["colbert_vecs"]],
    }


def bge_m3_score(args: dict) -> dict:
    model = _bge_m3(str(args["model"]))
    scores = model.compute_score([tuple(pair) for pair in args["pairs"]],
                                 max_query_length=args.get("max_query_length"),
                                 max_passage_length=args.get("max_passage_length"),
                                 weights_for_different_modes=args.get("weights_for_different_modes"))
    return {mode: [float(s) for s in values] for mode, values in scores.items()}


def batch(args: dict) -> list:
    return [SUBCOMMANDS[subcommand](arguments) for subcommand, arguments in args["calls"]]


SUBCOMMANDS = {
    "versions": versions,
    "pylate-save": pylate_save,
    "pylate-encode": pylate_encode,
    "pylate-rerank": pylate_rerank,
    "bge-m3-encode": bge_m3_encode,
    "bge-m3-score": bge_m3_score,
    "batch": batch,
}


def _pack(value, arrays: dict):
    """`value` as JSON, each numpy array moved into `arrays` and replaced by {"__array__": its name}."""
    if isinstance(value, np.ndarray):
        name = f"a{len(arrays)}"
        arrays[name] = value
        return {"__array__": name}
    if isinstance(value, dict):
        return {str(k): _pack(v, arrays) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_pack(v, arrays) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a reference library (tests/reference/run.py's docstring).")
    parser.add_argument("subcommand", choices=sorted(SUBCOMMANDS))
    parser.add_argument("--out", type=Path, required=True, help="the result's .npz file")
    parser.add_argument("--request", type=Path, help="the request's JSON file (default: standard input)")
    args = parser.parse_args(argv)
    request = json.loads(args.request.read_text() if args.request else sys.stdin.read() or "{}")
    arrays: dict = {}
    result = _pack(SUBCOMMANDS[args.subcommand](request), arrays)
    np.savez(args.out, **{"result.json": np.array(json.dumps(result))}, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
