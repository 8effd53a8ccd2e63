"""FlagEmbedding's BGEM3FlagModel in-process, timed: run with the reference environment's python.

    .venv-reference/bin/python -P benchmarks/flag_embedding_rate.py < REQUEST.json   (prints one JSON line)

FlagEmbedding 1.4.2 cannot share .venv (it imports a module transformers 5.24 removed; see
tests/reference/requirements.txt), so `make bench` runs this file in .venv-reference, as the tests run
tests/reference/run.py: only the standard library, numpy, torch and FlagEmbedding are imported (-P: this
folder's profile.py would shadow the standard library's, which torch imports). The request:
{"model": DIR, "texts": [...], "batch": 32, "threads": N}. It times `encode` with all three outputs (dense,
lexical weights, ColBERT vectors) as its users call it, at each precision it can run on a CPU: fp32 (its
encode_single_device casts the model to float on "cpu", so use_fp16 does nothing there) and fp32 weights under
torch.autocast(bfloat16), which the library does not offer but a user can wrap around it (FlagEmbedding 1.4.2's
_convert_to_numpy then fails on bf16 outputs on a CPU: the failure is reported, not a rate).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
                  HF_HUB_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false")


def main() -> int:
    request = json.loads(sys.stdin.read())
    import torch
    from FlagEmbedding import BGEM3FlagModel

    torch.set_num_threads(int(request["threads"]))
    model = BGEM3FlagModel(request["model"], use_fp16=False, devices="cpu")
    texts, batch = request["texts"], int(request["batch"])

    def encode(chunk: list[str]) -> dict:
        return model.encode(chunk, batch_size=batch, return_dense=True, return_sparse=True, return_colbert_vecs=True)

    rates, failed = {}, {}
    for precision, scope in (("fp32", contextlib.nullcontext),
                             ("bf16 autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16))):
        try:
            with scope():
                encode(texts[:batch])  # warm-up
                started = time.perf_counter()
                for i in range(0, len(texts), batch):  # one call per client batch, as a server's request would
                    out = encode(texts[i : i + batch])
                rates[precision] = len(texts) / (time.perf_counter() - started)
        except (TypeError, RuntimeError) as exc:  # 1.4.2 turns bf16 outputs into numpy only off the CPU
            failed[precision] = f"{type(exc).__name__}: {exc}"
            continue
        if not (len(out["dense_vecs"]) and len(out["lexical_weights"]) and len(out["colbert_vecs"])):
            raise SystemExit("BGEM3FlagModel.encode returned an empty output")
    print(json.dumps({"rates": rates, "failed": failed, "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
