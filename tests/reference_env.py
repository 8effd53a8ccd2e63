"""PyLate and FlagEmbedding as judges: run in the reference environment `make test` builds.

    from tests.reference_env import run_reference, make_bge_m3, make_pylate_colbert
    colbert = make_pylate_colbert(make_checkpoint("bert", tmp_path / "base"), tmp_path / "colbert")
    vectors = run_reference("pylate-encode", model=colbert, texts=["a query"], is_query=True)  # [array]
    m3 = make_bge_m3(tmp_path / "m3")
    scores = run_reference("bge-m3-score", model=m3, pairs=[["a query", "a passage"]])

Their pins clash with .venv's (tests/reference/requirements.txt says how), so a test never imports
them: run_reference runs tests/reference/run.py (its docstring lists the subcommands and what each
returns) with .venv-reference's python, one process per call: 5 to 15 s, mostly imports, so ask for
many texts at once, or give several calls to run_references, which runs them in one process. When the environment is missing the test fails with one line saying how to build it;
it is never skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "reference" / "run.py"
# REFERENCE_ENV points elsewhere (a shared build); the Makefile's REF_ENV by default
ENV = Path(os.environ.get("REFERENCE_ENV", ROOT / ".venv-reference"))
STAMP = ENV / ".built-stamp"  # written last by tests/reference/build_env.py
TIMEOUT_S = 300


def reference_python() -> Path:
    """The reference environment's python; fails the test, in one line, when it is not built."""
    python = ENV / "bin" / "python"
    if not STAMP.exists() or not python.exists():
        pytest.fail(f"the reference environment {ENV} is missing or unfinished (no {STAMP.name}): "
                    "build it with `make reference-envs` (make test does)", pytrace=False)
    return python


def _unpack(value, arrays):
    if isinstance(value, dict):
        if set(value) == {"__array__"}:
            return arrays[value["__array__"]]
        return {k: _unpack(v, arrays) for k, v in value.items()}
    if isinstance(value, list):
        return [_unpack(v, arrays) for v in value]
    return value


def run_reference(subcommand: str, **args):
    """tests/reference/run.py SUBCOMMAND with `args` (paths may be Path) in the reference environment:
    its result, arrays as numpy arrays. A failure of the library fails the test with its last lines."""
    python = reference_python()
    request = json.dumps(args, default=lambda v: str(v) if isinstance(v, Path) else v.tolist())
    with tempfile.TemporaryDirectory(prefix="reference-") as scratch:
        out = Path(scratch) / "result.npz"
        done = subprocess.run([str(python), str(RUNNER), subcommand, "--out", str(out)], input=request,
                              capture_output=True, text=True, timeout=TIMEOUT_S, cwd=scratch)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            pytest.fail(f"tests/reference/run.py {subcommand} failed (exit {done.returncode}):\n{tail}", pytrace=False)
        with np.load(out, allow_pickle=False) as result:
            arrays = {name: result[name] for name in result.files if name != "result.json"}
            return _unpack(json.loads(str(result["result.json"])), arrays)


def run_references(calls: list[tuple[str, dict]]) -> list:
    """Several (subcommand, arguments) calls in one process of the reference environment (each model
    directory loaded once): their results, in order."""
    return run_reference("batch", calls=[[subcommand, args] for subcommand, args in calls])


def make_pylate_colbert(base: Path, out: Path, seed: int = 0, **options) -> Path:
    """A ColBERT checkpoint in the layout PyLate saves: ColBERT(base, **options).save(out), run by PyLate
    itself (its Dense projection drawn from `seed`). base: a transformers or sentence-transformers
    checkpoint (tests/families.py's make_checkpoint). Returns `out`."""
    run_reference("pylate-save", base=base, out=out, seed=seed, options=options)
    return Path(out)


def make_bge_m3(out: Path, seed: int = 0, colbert_dim: int | None = None) -> Path:
    """A small random checkpoint in BAAI/bge-m3's layout: an XLM-R (tests/families.py's, CLS pooling and
    Normalize as sentence-transformers modules) with colbert_linear.pt (hidden -> colbert_dim, default
    hidden, with bias) and sparse_linear.pt (hidden -> 1, with bias) beside it: the `torch.save`d state
    dicts ({"weight", "bias"}) FlagEmbedding's BGEM3FlagModel loads. Needs .venv's torch. Returns `out`."""
    import torch

    from tests.families import make_checkpoint

    out = make_checkpoint("xlm-roberta", Path(out), pooling="cls", normalize=True, seed=seed)
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        colbert = torch.nn.Linear(hidden, colbert_dim or hidden)
        sparse = torch.nn.Linear(hidden, 1)
        # wider than nn.Linear's init, so that about half the tokens get a positive weight through the relu
        # and the colbert vectors differ clearly from the hidden states they project
        for linear in (colbert, sparse):
            torch.nn.init.normal_(linear.weight, std=0.3)
            torch.nn.init.normal_(linear.bias, std=0.1)
    torch.save(colbert.state_dict(), out / "colbert_linear.pt")
    torch.save(sparse.state_dict(), out / "sparse_linear.pt")
    return out
