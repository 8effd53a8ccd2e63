"""The embedding job: a corpus in, vectors out, on a Ray cluster, with the service's own engine.

The pipeline is Ray Data's: the planned row ranges (jobs/shards.py: the rows no earlier run finished) ->
`map_batches(read_range)` (tasks: each range's rows from its file) -> `map_batches(Embedder)` onto a pool
of actors, each holding one engine exactly as a replica loads it (service/engine/engine.py: the bundle's
tokenizer, the runtime choose_runtime picks, the BatchRunner), that tokenize, compute and write each
range's shard. The vectors are /v1/embeddings' (its prompt rule, the model's normalisation unless
--normalize says otherwise, its truncation), the sparse and token vectors /v1/encode's.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

OUTPUTS = ("embedding", "sparse", "multivector")
REPRESENTATION = {"embedding": "dense", "sparse": "sparse", "multivector": "multivector"}
DEFAULT_BATCH = 2048  # rows per range: one shard, one actor call; what a crash costs at most per actor


@dataclass
class EmbedSpec:
    """The job's arguments, as `python -m jobs embed` takes them (jobs/__main__.py)."""

    bundle: Path
    inputs: list[Path]
    output: Path
    text_column: str = "text"
    id_column: str | None = None
    outputs: tuple[str, ...] = ("embedding",)
    address: str | None = None  # a Ray cluster; None: the one this process is connected to, or a local one
    format: str | None = None  # parquet, jsonl or csv; None: by each file's suffix
    normalize: bool | None = None  # None: the model's own, as /v1/embeddings
    batch_size: int = DEFAULT_BATCH
    concurrency: int | None = None  # actors; None: one per GPU, else one per CPU free when the job starts
    truncate: bool = True  # as /v1/embeddings; False: a text past the model's limit is a bad row
    precision: str = "auto"  # the service's setting (auto: as a replica chooses)
    num_cpus: float | None = None  # per actor; None: 1 (with a GPU or not)
    nice: int = 0  # added to the actors' OS niceness: a job beside online replicas (the Batch API's) yields the CPU to them

    def __post_init__(self) -> None:
        self.bundle, self.output = Path(self.bundle), Path(self.output)
        self.inputs = [Path(p) for p in ([self.inputs] if isinstance(self.inputs, (str, Path)) else self.inputs)]
        if isinstance(self.outputs, str):
            self.outputs = tuple(o.strip() for o in self.outputs.split(",") if o.strip())
        if unknown := [o for o in self.outputs if o not in OUTPUTS]:
            raise ValueError(f"--outputs: unknown {', '.join(unknown)} (choose from {', '.join(OUTPUTS)})")
        if not self.outputs:
            raise ValueError("--outputs: name at least one of " + ", ".join(OUTPUTS))
        if self.batch_size < 1:
            raise ValueError("--batch-size: at least 1 row")
        if self.format not in (None, "parquet", "jsonl", "csv"):
            raise ValueError(f"--format: {self.format!r} is not parquet, jsonl or csv")


@dataclass
class Tally:
    rows: int = 0
    failures: int = 0
    tokens: int = 0


def run(spec: EmbedSpec | dict) -> dict:
    """Run the job to the end (or resume it) and return its summary (what _SUCCESS holds)."""
    from bundle.manifest import load_bundle
    from jobs import inputs, shards

    spec = spec if isinstance(spec, EmbedSpec) else EmbedSpec(**spec)
    bundle = load_bundle(spec.bundle)
    model = bundle.manifest.model
    if missing := [o for o in spec.outputs if REPRESENTATION[o] not in model.representations]:
        raise ValueError(f"model {model.name!r} gives {', '.join(model.representations)}, not "
                         f"{', '.join(REPRESENTATION[o] for o in missing)}: choose --outputs among those")
    if spec.normalize is not None and "dense" not in model.representations:
        raise ValueError(f"--normalize applies to the dense embedding, which model {model.name!r} has not")
    spec.output.mkdir(parents=True, exist_ok=True)
    files = inputs.plan_inputs(spec.inputs, spec.format, spec.text_column, spec.id_column, spec.output / "_staging")
    total = sum(f.rows for f in files)
    shards.check_job(spec.output, {
        "bundle_sha256": bundle.sha256, "inputs": [str(p.resolve()) for p in spec.inputs], "rows": total,
        "text_column": spec.text_column, "id_column": spec.id_column, "outputs": list(spec.outputs),
        "normalize": spec.normalize, "truncate": spec.truncate, "precision": spec.precision})
    todo = shards.gaps(shards.tidy(spec.output), total, spec.batch_size)
    started = time.perf_counter()
    done = Tally()
    precision = None
    if todo:
        precision, done = _pipeline(spec, files, todo)
    wall = time.perf_counter() - started
    records = shards.tidy(spec.output)
    covered = sum(r.last - r.first + 1 for r in records)
    if covered != total:
        raise RuntimeError(f"{spec.output}: {covered} of {total} rows recorded done after the run; run it again to "
                           "finish the rest")
    previous = _read_success(spec.output)
    summary = {
        "rows": total, "written": sum(r.written for r in records),
        "failures": sum(len(r.failures) for r in records), "rows_this_run": done.rows,
        "texts_s": done.rows / wall if done.rows else previous.get("texts_s", 0.0),
        "tokens_s": done.tokens / wall if done.rows else previous.get("tokens_s", 0.0),
        "seconds": wall, "model": model.name, "bundle_sha256": bundle.sha256,
        "precision": precision or previous.get("precision"), "output": str(spec.output.resolve()),
        "outputs": list(spec.outputs), "rows_by_node": shards.rows_by_node(records),
    }
    shards.finish(spec.output, records, summary)
    return summary


def _read_success(output: Path) -> dict:
    try:
        return json.loads((output / "_SUCCESS").read_text())
    except (OSError, ValueError):
        return {}


def _pipeline(spec: EmbedSpec, files, todo: list[tuple[int, int]]) -> tuple[str | None, Tally]:
    """The ranges through Ray Data; returns the runtime and precision the actors ran and what they did."""
    import ray

    if not ray.is_initialized():
        ray.init(address=spec.address, logging_level="WARNING", log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    cpus = ray.cluster_resources().get("CPU", 1)
    # one engine per CPU, each on one intra-op thread: the service's throughput sizing. Measured on 2 cores,
    # 30,000 short texts, OpenVINO bf16: two 1-CPU actors 550-633 texts/s between first and last shard, one
    # 2-CPU actor (two threads in each run) 396
    num_cpus = spec.num_cpus if spec.num_cpus is not None else 1
    # actors for the CPUs free now, not the cluster's total: beside a serving application, actors asked for
    # past what its replicas leave would wait for ever
    free = ray.available_resources().get("CPU", cpus)
    concurrency = spec.concurrency or (gpus or max(1, int(free // max(num_cpus, 1))))
    ranges = [{"first": a, "last": b} for a, b in todo]
    ds = ray.data.from_items(ranges, override_num_blocks=len(ranges))
    ds = ds.map_batches(read_ranges, fn_kwargs={"files": [asdict(f) for f in files], "text_column": spec.text_column,
                                                "id_column": spec.id_column},
                        # no CPU slot: reading is light, and actors holding every CPU of a node (the
                        # default) would otherwise leave the reads unscheduled for ever; at most one read in
                        # flight per actor: unbounded, Ray started a worker process per queued read (20 for
                        # 100,000 rows), whose start-up took CPU from the actors (30,000 texts on 2 cores:
                        # 444-473 texts/s from the start against 413-432, noisy)
                        batch_size=1, batch_format="pyarrow", num_cpus=0,
                        compute=ray.data.TaskPoolStrategy(size=concurrency))
    ds = ds.map_batches(Embedder, fn_constructor_kwargs={"spec": _plain(spec), "threads": max(1, math.floor(num_cpus))},
                        batch_size=None, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=concurrency),
                        num_cpus=num_cpus, num_gpus=1 if gpus else 0)
    tally, precision = Tally(), None
    for row in ds.iter_rows():
        tally.rows += row["rows"]
        tally.failures += row["failures"]
        tally.tokens += row["tokens"]
        precision = row["precision"]
    return precision, tally


def _plain(spec: EmbedSpec) -> dict:
    return {**asdict(spec), "bundle": str(spec.bundle.resolve()), "output": str(spec.output.resolve()),
            "inputs": [str(p) for p in spec.inputs], "outputs": list(spec.outputs)}


def read_ranges(batch, files: list[dict], text_column: str, id_column: str | None):
    """The rows of each planned range from its input files (a Ray Data task stage: reading overlaps the
    actors' compute); a range may cross from one file into the next."""
    import pyarrow as pa

    from jobs.inputs import InputFile, read_rows

    parts = []
    for first, last in zip(batch.column("first").to_pylist(), batch.column("last").to_pylist(), strict=True):
        for f in (InputFile(**f) for f in files):
            a, b = max(first, f.first), min(last, f.first + f.rows - 1)
            if a <= b:
                parts.append(read_rows(f, a, b, text_column, id_column))
    return pa.concat_tables(parts, promote_options="permissive")


class Embedder:
    """One engine in a Ray actor, as a replica loads it; each call embeds whole ranges and writes their shards."""

    def __init__(self, spec: dict, threads: int) -> None:
        import os

        import ray

        from service.config import ServiceSettings
        from service.engine.engine import load_engine
        from service.runtimes.cuda import ray_gpu_assignment

        self.spec = EmbedSpec(**spec)
        if self.spec.nice > 0:  # before the runtime's threads start: they inherit it
            os.nice(self.spec.nice)
        gpu = ray_gpu_assignment(1.0) if os.environ.get("CUDA_VISIBLE_DEVICES") else None
        self.settings = ServiceSettings(bundle=self.spec.bundle, precision=self.spec.precision,
                                        intra_op_threads=threads, num_cpus=threads)
        self.engine = load_engine(self.settings.bundles[0], self.settings, gpu)
        self.engine.runner.warm_up()
        self.pid = os.getpid()
        self.node = ray.get_runtime_context().get_node_id()  # in each record: which node did which rows
        model = self.engine.model
        self.metadata = {"model": self.engine.name, "bundle_sha256": self.engine.sha256,
                         "runtime": self.engine.runtime.runtime, "precision": self.engine.runtime.precision,
                         "outputs": list(self.spec.outputs), "normalize": self.normalize(model)}

    def normalize(self, model) -> bool:
        from service.engine.prompts import normalization

        if "dense" not in model.representations:
            return model.normalize
        return normalization(self.spec.normalize, model)

    def __call__(self, batch):
        import numpy as np
        import pyarrow as pa

        rows = batch.column("_row").to_numpy()
        order = np.argsort(rows, kind="stable")
        batch, rows = batch.take(pa.array(order)), rows[order]
        cuts = np.flatnonzero(np.diff(rows) != 1) + 1  # contiguous runs: one shard each
        out = []
        for start, stop in zip([0, *cuts], [*cuts, len(rows)], strict=True):
            out.append(self.embed_range(batch.slice(start, stop - start)))
        return pa.Table.from_pylist(out)

    def embed_range(self, table) -> dict:
        import pyarrow as pa

        from jobs.shards import Record, write_shard

        spec, engine = self.spec, self.engine
        rows = table.column("_row").to_pylist()
        texts = table.column("_text").to_pylist()
        errors = table.column("_error").to_pylist()
        ids = table.column(spec.id_column).to_pylist() if spec.id_column else rows
        for i, text in enumerate(texts):
            if errors[i] is None:  # the characters bound's refusal is this row's, never the range's
                errors[i] = bad_text(text) or engine.tokenizer.refusal(
                    text, spec.truncate, advice="; truncate is off: run without --no-truncate to cut it")
        good = [i for i, e in enumerate(errors) if e is None]
        tokens, columns = 0, {}
        if good:
            result, n_tokens, too_long = self.compute([texts[i] for i in good])
            for k, i in enumerate(good):
                if too_long[k]:
                    errors[i] = (f"more than the model's limit of {engine.model.max_tokens} tokens (truncate is off: "
                                 "run without --no-truncate to cut it)")
            kept = [k for k, i in enumerate(good) if errors[i] is None]
            good = [good[k] for k in kept]
            tokens = int(sum(n_tokens[k] for k in kept))
            if "embedding" in spec.outputs:
                columns["embedding"] = pa.array([result.embeddings[k] for k in kept], pa.list_(pa.float32()))
            if "sparse" in spec.outputs:
                columns["sparse_indices"] = pa.array([result.sparse[k][0].astype("int32") for k in kept],
                                                     pa.list_(pa.int32()))
                columns["sparse_values"] = pa.array([result.sparse[k][1].astype("float32") for k in kept],
                                                    pa.list_(pa.float32()))
            if "multivector" in spec.outputs:
                columns["multivector"] = pa.array([list(result.multivectors[k].astype("float32")) for k in kept],
                                                  pa.list_(pa.list_(pa.float32())))
        table_out = self.shard_table(table, good, texts, columns)
        failures = [{"row": rows[i], "id": ids[i], "reason": errors[i]} for i in range(len(rows)) if errors[i]]
        record = Record(rows[0], rows[-1], len(good), failures, tokens, self.pid, self.node)
        write_shard(Path(spec.output), table_out, record, self.metadata)
        return {"first": rows[0], "last": rows[-1], "rows": len(rows), "failures": len(failures), "tokens": tokens,
                "actor": self.pid, "node": self.node, "precision": f"{self.metadata['runtime']} {self.metadata['precision']}"}

    def shard_table(self, table, good: list[int], texts: list, columns: dict):
        import pyarrow as pa

        spec = self.spec
        index = pa.array(good, pa.int64())
        key = spec.id_column or "row"
        keys = table.column(spec.id_column or "_row").take(index)
        digests = pa.array([hashlib.sha256(texts[i].encode()).hexdigest() for i in good], pa.string())
        out = pa.table({key: keys, "text_sha256": digests})
        for name, arrow_type in columns_of(spec.outputs).items():  # empty where no row of the range was good
            out = out.append_column(name, columns.get(name, pa.array([], arrow_type)))
        return out

    def compute(self, texts: list[str]):
        """Each text through the engine as /v1/embeddings (and /v1/encode for sparse and token vectors)
        sends it: the same prompt rule, tokenization and job; returns the result, each text's tokens and
        whether it was cut (a bad row when truncate is off)."""
        from bundle.representations import colbert_cut, colbert_ids
        from service.engine.prompts import prompt_for
        from service.engine.runner import EncodeJob

        spec, engine = self.spec, self.engine
        model = engine.model
        prompt = prompt_for(model, engine.name, None, None)
        skip = 0
        if prompt is not None:
            texts, skip = prompt.apply(texts), prompt.pool_skip
        multivector = model.multivector
        attended = None
        if multivector is not None and multivector.kind == "colbert":  # a document, as /v1/encode tokenizes one
            tokenized = engine.tokenizer.encode_within(texts, colbert_cut(multivector, False) or model.max_tokens, True,
                                                       "document")
            made = [colbert_ids(t.ids, multivector, False) for t in tokenized]
            ids, attended = [m[0] for m in made], [m[1] for m in made]
            if all(a >= len(i) for a, i in zip(attended, ids, strict=True)):
                attended = None
        else:
            tokenized = engine.tokenizer.encode(texts, True)
            ids = [t.ids for t in tokenized]
        job = EncodeJob(route="job", ids=ids, normalize=self.metadata["normalize"],
                        want_embedding="embedding" in spec.outputs, pool_skip=skip,
                        sparse="sparse" in spec.outputs, multivector="multivector" in spec.outputs, attended=attended)
        result = engine.runner.compute([job])[0]
        return result, [len(i) for i in ids], [t.truncated and not spec.truncate for t in tokenized]


def bad_text(text) -> str | None:
    """Why a row's text cannot be embedded, or None."""
    if text is None:
        return "no text"
    if not text.strip():
        return "empty text"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"not valid Unicode: {exc.reason} at character {exc.start}"
    return None


def columns_of(outputs) -> dict:
    """The output columns of each asked representation, with their Arrow types."""
    import pyarrow as pa

    types = {"embedding": {"embedding": pa.list_(pa.float32())},
             "sparse": {"sparse_indices": pa.list_(pa.int32()), "sparse_values": pa.list_(pa.float32())},
             "multivector": {"multivector": pa.list_(pa.list_(pa.float32()))}}
    return {name: t for o in OUTPUTS if o in outputs for name, t in types[o].items()}


def summary_line(summary: dict) -> str:
    return (f"embedded {summary['rows']} rows ({summary['written']} written, {summary['failures']} failed, "
            f"{summary['rows_this_run']} this run) with {summary['model']} ({summary['precision']}): "
            f"{summary['texts_s']:.0f} texts/s, {summary['tokens_s']:.0f} tokens/s -> {summary['output']}")
