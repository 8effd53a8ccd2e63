"""The characters bound in a job (issue 55, defect 8): a 10 MiB text cost a job 21.6 s and +1.36 GiB in the
tokenizer. Each text past max_tokens x 32 characters is tokenized by its prefix only: cut exactly where truncation
is on, and a text the bound cannot cut exactly (one word of 50k letters) is that row's error with the bound's
reason (TextTokenizer.refusal), never a failed range. With the session's Ray and the tiny model of
tests/test_jobs.py (64 tokens: a bound of 2,048 characters)."""

from __future__ import annotations

import json
import time

import numpy as np

from tests.test_jobs import cluster, shards_of, tiny  # noqa: F401 (fixtures)


def test_a_text_past_the_characters_bound_is_cut_or_one_bad_row_and_the_job_goes_on(tiny, cluster, tmp_path):
    from jobs.embed import run

    _, bundle = tiny
    texts = [f"sentence {i} about cats and the weather" for i in range(12)]
    texts[2] = "z" * 50_000  # one word: its first 2,048 characters cannot say what the whole word gives
    texts[5] = "word " * 400_000  # 2 MB, cut: its embedding is that of its first characters
    texts[6] = "word " * 1_000
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"id": f"t{i}", "text": t}) for i, t in enumerate(texts)))
    started = time.perf_counter()
    summary = run({"bundle": bundle, "inputs": [tmp_path / "in.jsonl"], "output": tmp_path / "out", "id_column": "id",
                   "batch_size": 16, "concurrency": 1, "precision": "fp32"})
    took = time.perf_counter() - started
    errors_file = next(p for p in (tmp_path / "out").rglob("*errors.jsonl"))
    errors = [json.loads(line) for line in errors_file.read_text().splitlines()]
    assert [e["id"] for e in errors] == ["t2"], errors
    assert "past the characters bound of 2048 (the model's 64 tokens x 32)" in errors[0]["reason"], errors
    assert summary["failures"] == 1 and summary["written"] == 11, summary
    table = shards_of(tmp_path / "out", "id")
    vectors = dict(zip(table.column("id").to_pylist(), table.column("embedding").to_pylist(), strict=True))
    np.testing.assert_allclose(vectors["t5"], vectors["t6"], atol=1e-5)  # both cut to their first 62 words
    assert took < 120, f"{took:.0f}s"
