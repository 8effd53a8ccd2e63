"""The rerank benchmark's model and reference: a MiniLM-L6 cross-encoder built locally and
sentence-transformers' CrossEncoder on the same pairs.

No cross-encoder checkpoint ships with the project and nothing may be downloaded, so the benchmark
builds one of a real size: all-MiniLM-L6-v2's encoder (the default checkpoint's weights) under a
seeded random one-label head, saved as transformers' BertForSequenceClassification. Its scores mean
nothing; its cost per pair is a MiniLM-L6 cross-encoder's (such as ms-marco-MiniLM-L-6-v2's).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from benchmarks.corpus import sentences

QUERIES = 16  # requests of one query each
DOCUMENTS = 32  # documents per request
EXPLAIN_DOCUMENTS = 4  # documents per request with explain (each word costs an inference)


def workload(seed: int = 3) -> tuple[list[str], list[list[str]]]:
    """QUERIES queries of 4-10 words, each with DOCUMENTS documents of 20-60 words."""
    queries = sentences(QUERIES, 4, 10, seed=seed)
    documents = sentences(QUERIES * DOCUMENTS, 20, 60, seed=seed + 1)
    return queries, [documents[i * DOCUMENTS : (i + 1) * DOCUMENTS] for i in range(QUERIES)]


def make_cross_encoder(out: Path) -> Path:
    """The default checkpoint's encoder under a seeded random one-label head (once; kept in `out`)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import BertForSequenceClassification

    from export.checkpoint import resolve_checkpoint

    source = resolve_checkpoint("default")[0]
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(str(source), num_labels=1)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, staging / name)
    staging.rename(out)
    return out


def cross_encoder_rate(checkpoint: Path, queries: list[str], documents: list[list[str]], precision: str = "fp32",
                       fp32_scores=None) -> dict:
    """sentence-transformers' CrossEncoder in-process on the same pairs, one query's documents per call; at
    bf16 with its weights loaded in bf16 (`model_kwargs={"dtype": torch.bfloat16}`), and then the lowest
    cosine between a query's scores and the fp32 scores (`fp32_scores`, this function's "scores" at fp32)."""
    import numpy as np
    import torch
    from sentence_transformers import CrossEncoder

    torch.set_num_threads(torch.get_num_threads())
    kwargs = {"model_kwargs": {"dtype": torch.bfloat16}} if precision == "bf16" else {}
    model = CrossEncoder(str(checkpoint), device="cpu", **kwargs)
    model.predict([(queries[0], d) for d in documents[0]], batch_size=DOCUMENTS)  # warm-up
    latencies, scores = [], []
    started = time.perf_counter()
    for q, docs in zip(queries, documents, strict=True):
        t = time.perf_counter()
        scores.append(np.asarray(model.predict([(q, d) for d in docs], batch_size=DOCUMENTS), dtype=np.float64))
        latencies.append(time.perf_counter() - t)
    wall = time.perf_counter() - started
    latencies.sort()
    out = {"requests_s": len(queries) / wall, "pairs_s": len(queries) * DOCUMENTS / wall,
           "p50": latencies[len(latencies) // 2] * 1000, "scores": scores}
    if fp32_scores is not None:
        out["cosine"] = min(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(scores, fp32_scores))
    return out
