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
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

OUTPUTS = ("embedding", "sparse", "multivector")
REPRESENTATION = {"embedding": "dense", "sparse": "sparse", "multivector": "multivector"}
DEFAULT_BATCH = 2048  # rows per range: one shard, one actor call; what a crash costs at most per actor
# a cluster that does not answer within this is a wrong --address, not a slow one: Ray's own connection waits
# for minutes saying nothing (a GCS that is up answers in well under a second; a head pod still starting
# takes longer: raise it with --connect-timeout)
CONNECT_TIMEOUT_S = 60.0
CONNECT_QUIET_S = 5.0  # a connection that takes longer says what it waits for


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
    connect_timeout: float = CONNECT_TIMEOUT_S  # seconds to reach the cluster at `address` before giving up
    runtime: str = "auto"  # the runtime the actors load; run() pins it (and precision) to what the output ran

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
        if not self.connect_timeout > 0:
            raise ValueError("--connect-timeout: more than 0 seconds")


# where an actor's CPU goes, by stage of embed_range (the summary's actor_cpu_s): what a job spends beside the model
STAGES = ("checks", "tokenize", "model", "arrays", "shard")


@dataclass
class Tally:
    rows: int = 0
    failures: int = 0
    tokens: int = 0
    cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))


class Laps:
    """The actor process's CPU by stage: lap(stage) charges the CPU used since the last lap to that stage
    (process time: the tokenizer's own threads count where they ran)."""

    def __init__(self) -> None:
        self.cpu_s = dict.fromkeys(STAGES, 0.0)
        self.last = time.process_time()

    def lap(self, stage: str) -> None:
        now = time.process_time()
        self.cpu_s[stage] += now - self.last
        self.last = now


def run(spec: EmbedSpec | dict) -> dict:
    """Run the job to the end (or resume it) and return its summary (what _SUCCESS holds)."""
    from bundle.manifest import load_bundle
    from jobs import shards

    spec = spec if isinstance(spec, EmbedSpec) else EmbedSpec(**spec)
    shards.refuse_foreign(spec.output)  # someone else's directory: said first, and nothing in it touched
    bundle = load_bundle(spec.bundle)
    model = bundle.manifest.model
    if missing := [o for o in spec.outputs if REPRESENTATION[o] not in model.representations]:
        raise ValueError(f"model {model.name!r} gives {', '.join(model.representations)}, not "
                         f"{', '.join(REPRESENTATION[o] for o in missing)}: choose --outputs among those")
    if spec.normalize is not None and "dense" not in model.representations:
        raise ValueError(f"--normalize applies to the dense embedding, which model {model.name!r} has not")
    created = not spec.output.exists()
    fresh = created or (spec.output.is_dir() and not any(spec.output.iterdir()))
    # refuses someone else's directory untouched, and a directory another run is writing, before Ray starts
    with shards.OutputLock(spec.output):
        begun = False
        try:
            files, identity = _plan(spec, bundle)  # a wrong input is said before any wait for Ray
            connect(spec.address, spec.connect_timeout)
            shards.check_job(spec.output, identity)
            begun = True
        finally:
            if fresh and not begun:  # nothing of a job was recorded: leave nothing of ours behind
                _remove_new_output(spec.output, created)
        return _run_locked(spec, bundle, files)


def _plan(spec: EmbedSpec, bundle):
    """The inputs planned (CSV and huge-group Parquet staged) and the output's identity: what makes
    another job's output different from this one's."""
    from jobs import inputs

    files = inputs.plan_inputs(spec.inputs, spec.format, spec.text_column, spec.id_column, spec.output / "_staging",
                               spec.batch_size)
    total = sum(f.rows for f in files)
    identity = {
        "bundle_sha256": bundle.sha256, "inputs": [str(p.resolve()) for p in spec.inputs], "rows": total,
        "text_column": spec.text_column, "id_column": spec.id_column, "outputs": list(spec.outputs),
        "normalize": spec.normalize, "truncate": spec.truncate, "precision": spec.precision,
        # a changed input (rewritten, appended to) is another job, though its rows may count the same
        "input_files": [{"path": str(p.resolve()), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                        for p, _ in inputs.expand(spec.inputs, spec.format)]}
    return files, identity


def _remove_new_output(output: Path, created: bool) -> None:
    """What this run put in a new or empty output (the lock, staged copies; the directory if it made it) when
    it failed before recording a job: a wrong --address or input leaves nothing behind."""
    import shutil

    from jobs.shards import PROGRESS

    for path in (output,) if created else (output / PROGRESS, output / "_staging"):
        shutil.rmtree(path, ignore_errors=True)


def _run_locked(spec: EmbedSpec, bundle, files) -> dict:
    from jobs import shards

    model = bundle.manifest.model
    total = sum(f.rows for f in files)
    todo = shards.gaps(shards.tidy(spec.output), total, spec.batch_size)
    started = time.perf_counter()
    done = Tally()
    precision = None
    if todo:
        # a resumed output keeps the runtime and precision it began with, whatever this machine would choose
        ran = shards.ran_with(spec.output)
        pinned = spec if not ran else EmbedSpec(**{**asdict(spec), "runtime": ran["runtime"],
                                                   "precision": ran["precision"]})
        precision, done = _pipeline(pinned, files, todo)
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
        # this run's actors' CPU by stage (model: the runner's runs; the rest is what the job adds around them)
        "actor_cpu_s": ({k: round(v, 3) for k, v in done.cpu_s.items()} if done.rows
                        else previous.get("actor_cpu_s", {})),
    }
    shards.finish(spec.output, records, summary)
    return summary


class ConnectError(RuntimeError):
    """The Ray cluster at --address could not be reached within the bound."""


def connect(address: str | None, timeout: float, say=None) -> None:
    """Connect this process to Ray (a local one without an address); an address that does not answer
    within `timeout` seconds is a ConnectError, said after probing its port (refused: at once) and with a
    line on stderr while it waits, instead of Ray's silent wait of minutes."""
    import os
    import sys

    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")  # where ray.init would go (a RayJob's submitter sets it)
    if not address or address == "local":  # a Ray of our own: nothing to wait for but its start
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        return
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    deadline = time.monotonic() + timeout
    if address != "auto":
        _probe(address, deadline, timeout, say)
    failure: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failure.append(exc)

    thread = threading.Thread(target=init, name="ray-init", daemon=True)
    thread.start()
    thread.join(min(CONNECT_QUIET_S, max(0.0, deadline - time.monotonic())))
    if thread.is_alive() and deadline > time.monotonic():
        say(f"python -m jobs embed: waiting for the Ray cluster at {address} to answer (giving up after "
            f"{timeout:.0f} s: --connect-timeout)")
        thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        raise ConnectError(f"the Ray cluster at {address} did not answer within {timeout:.0f} s "
                           "(--connect-timeout); check --address")
    if failure:
        exc = failure[0]
        raise ConnectError(f"cannot connect to the Ray cluster at {address}: {type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:300]}") from None


def _probe(address: str, deadline: float, timeout: float, say) -> None:
    """Wait until the address's port accepts a connection; refused is an answer (nothing listens there)."""
    import socket

    hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConnectError(f"--address {address!r}: not host:port (or ray://host:port)")
    said = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConnectError(f"the Ray cluster at {address} did not answer within {timeout:.0f} s "
                               "(--connect-timeout); check --address")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(left, 5.0)):
                return
        except ConnectionRefusedError:
            raise ConnectError(f"cannot connect to the Ray cluster at {address}: connection refused (nothing "
                               "listens there); check --address") from None
        except socket.gaierror as exc:
            raise ConnectError(f"cannot connect to the Ray cluster at {address}: {exc.strerror or exc}") from None
        except OSError:  # timed out, unreachable: a cluster may still be starting
            if not said:
                say(f"python -m jobs embed: waiting for the Ray cluster at {address} (giving up after "
                    f"{timeout:.0f} s: --connect-timeout)")
                said = True
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _read_success(output: Path) -> dict:
    try:
        return json.loads((output / "_SUCCESS").read_text())
    except (OSError, ValueError):
        return {}


def _pipeline(spec: EmbedSpec, files, todo: list[tuple[int, int]]) -> tuple[str | None, Tally]:
    """The ranges through Ray Data; returns the runtime and precision the actors ran and what they did."""
    import ray

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
        for stage in STAGES:
            tally.cpu_s[stage] += row[f"cpu_{stage}_s"]
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
        from jobs.shards import claim_runtime

        gpu = ray_gpu_assignment(1.0) if os.environ.get("CUDA_VISIBLE_DEVICES") else None

        def load(runtime: str, precision: str):
            self.settings = ServiceSettings(bundle=self.spec.bundle, runtime=runtime, precision=precision,
                                            intra_op_threads=threads, num_cpus=threads)
            return load_engine(self.settings.bundles[0], self.settings, gpu)

        self.engine = load(self.spec.runtime, self.spec.precision)
        # one output, one runtime and precision: the first actor to load records what it runs; an actor that
        # chose another (`auto` on another node's hardware) runs the recorded one instead, or fails saying so
        mine = {"runtime": self.engine.runtime.runtime, "precision": self.engine.runtime.precision}
        recorded = claim_runtime(Path(self.spec.output), mine)
        if recorded != mine:
            try:
                self.engine = load(recorded["runtime"], recorded["precision"])
            except Exception as exc:
                raise RuntimeError(f"this node cannot run the job's {recorded['runtime']} {recorded['precision']} "
                                   f"(its output was begun at it): {exc}") from None
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
        laps = Laps()
        rows = table.column("_row").to_pylist()
        texts = table.column("_text").to_pylist()
        errors = table.column("_error").to_pylist()
        ids = table.column(spec.id_column).to_pylist() if spec.id_column else rows
        max_tokens = engine.model.max_tokens
        for i, text in enumerate(texts):
            if errors[i] is None:  # the characters bound's refusal is this row's, never the range's
                errors[i] = bad_text(text) or engine.tokenizer.refusal(
                    text, spec.truncate, advice="; truncate is off: run without --no-truncate to cut it")
        good = [i for i, e in enumerate(errors) if e is None]
        tokens, columns = 0, {}
        laps.lap("checks")
        if good:
            result, n_tokens, truncated = self.compute([texts[i] for i in good], laps)
            for k, i in enumerate(good):
                if truncated[k] and not spec.truncate:
                    errors[i] = (f"more than the model's limit of {max_tokens} tokens (truncate is off: "
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
        laps.lap("arrays")
        table_out = self.shard_table(table, good, texts, columns)
        failures = [{"row": rows[i], "id": ids[i], "reason": errors[i]} for i in range(len(rows)) if errors[i]]
        record = Record(rows[0], rows[-1], len(good), failures, tokens, self.pid, self.node)
        write_shard(Path(spec.output), table_out, record, self.metadata)
        laps.lap("shard")
        return {"first": rows[0], "last": rows[-1], "rows": len(rows), "failures": len(failures), "tokens": tokens,
                "actor": self.pid, "node": self.node, "precision": f"{self.metadata['runtime']} {self.metadata['precision']}",
                **{f"cpu_{stage}_s": laps.cpu_s[stage] for stage in STAGES}}

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

    def compute(self, texts: list[str], laps: Laps | None = None):
        """Each text through the engine as /v1/embeddings (and /v1/encode for sparse and token vectors)
        sends it: the same prompt rule, tokenization and job; returns the result, each text's tokens and
        whether it was cut at the model's limit (a bad row when truncate is off). `laps`: charged with the
        tokenizing and the model's runs."""
        laps = laps or Laps()
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
        laps.lap("tokenize")
        result = engine.runner.compute([job])[0]
        laps.lap("model")
        return result, [len(i) for i in ids], [t.truncated for t in tokenized]


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
