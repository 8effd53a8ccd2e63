"""One batch of requests on a model's runtime: the work the batch queue (batcher.py) hands over.

Each request (one client call, one or more texts) is one item of the queue, counted by its tokens
(EncodeJob.cost), so a batch is bounded by a token budget, not a request count. Texts that need
only their pooled output (an embedding, a classifier's logits) run packed where the runtime has the
bundle's packed graph: several texts one after another in a row of up to `packed_tokens`, with no
padding at all (service/runtimes/packing.py). All other texts are sorted by length and cut into runs
as the runtime's `sizing` says (service/runtimes' `Sizing`): on a CPU, into sub-batches whose padded
size stays under `sub_batch_tokens` and whose padding under `max_padding`, since there padding is the
first cost (`plan_sub_batches`); on a device (onnxruntime on CUDA), where a run costs about the same
whatever its size and a padded token next to nothing, into one run as large as the device takes
(`device_run_tokens`), its length rounded up to a bucket (`plan_device_runs`): cut by the CPU's padding
rule, a batch of 40-70 short texts runs as sub-batches of a few texts each, every one paying a device
run's fixed cost (about 1.4 ms on an H100).
Texts whose request wants attention weights run on the bundle's full graph; the rest on its fused
encodings-only graph of the configured precision (the `graph` label of the inference-runs metric
says which graph ran: full, encodings-<precision>, packed-<precision>). How a text's pooled output
is made for its job's `normalize` (the graph's as it is, L2-normalised here, or pooled again from
the token encodings) is decided in one place, `pooled_output`.

The runs of a batch (its pieces: packed rows, padded sub-batches) are independent. One after another
in the batch's worker thread under load; when the batch queue lends free runner slots (an otherwise
idle replica, batcher.py), they run on those slots at once, each in a thread of the runner's pool
(onnxruntime's run and OpenVINO's infer requests release the GIL), and a batch of one large piece is
cut in two first (on a CPU only: on a device the cut would add a run's fixed cost and save nothing). The
sessions stay as sized for the throughput configuration (intra_op_threads per slot): a lent slot is one
more run at once, never more threads per run.

On a device, `max_concurrent_batches` (2) is the pipeline: each batch runs in its own worker thread, and
a device run releases the GIL while it waits, so while one batch's run is on the device the batch queue
forms the next batch on the other slot (its requests were tokenized on the event loop as they arrived),
which pads its texts and hands its run to the device; meanwhile the first batch's outputs are scattered
to its jobs in its thread and its responses serialised on the event loop. A batch being one run is what
makes two slots a pipeline of depth two: cut into runs one after another, each batch would hold its slot
through all of them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, NamedTuple, Protocol

import numpy as np

from bundle.manifest import BundleManifest, ModelInfo
from bundle.representations import Heads, bge_m3_terms, kept_tokens, splade_terms, token_vectors
from service.observability import tracing
from service.config import BatchingSettings, ServiceSettings
from service.observability.metrics import service_metrics
from service.runtimes import PackedGraph, Runtime
from service.runtimes.onnxruntime import available_cpus
from service.runtimes.packing import pack, plan_packs


@dataclass
class EncodeJob:
    """One request's work: token ids per text, and which outputs it needs. `route` and `protocol` are
    the metrics' labels of the call it serves, passed in by its API (the engine knows no protocol)."""

    route: str
    ids: list[np.ndarray]
    normalize: bool  # L2-normalised pooled outputs; what that means per model: pooled_output()
    want_embedding: bool = True
    want_hidden: bool = False
    attention: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (layers, heads), resolved
    enqueued: float = 0.0  # perf_counter() when the job joined the batch queue
    type_ids: list[np.ndarray] | None = None  # token types per text: text pairs (rerank) set the second's
    # leading tokens of every text that pooling leaves out: a prompt's, on a model whose Pooling has
    # include_prompt false (sentence-transformers' prompt_length); 0: pooling reads every token
    pool_skip: int = 0
    trace: Any = None  # the request's OpenTelemetry context while tracing is on (service/observability/tracing.py)
    protocol: str = "http"
    sparse: bool = False  # each text's sparse vector (the model's SparseInfo says how it is made)
    multivector: bool = False  # each text's token vectors (the model's MultiVectorInfo)
    is_query: bool = False  # a ColBERT text is a query (its tokens all kept) or a document (its skiplist left out)
    # per text, how many leading tokens are attended to; the rest (a ColBERT query's expansion tokens) are
    # computed and returned but masked as keys. None: every token is attended to
    attended: list[int] | None = None
    # the caller's class (its API key's `priority`, or the Batch API's runner): batch jobs yield to interactive
    # ones in the batch queue, with a share of each batch kept for them (batcher.py)
    priority: str = "interactive"

    @property
    def n_tokens(self) -> int:
        return sum(int(a.shape[0]) for a in self.ids)

    @property
    def attention_values(self) -> int:
        """Attention probabilities this job keeps until its batch returns (layers x heads x tokens^2)."""
        if self.attention is None:
            return 0
        return len(self.attention[0]) * len(self.attention[1]) * sum(int(a.shape[0]) ** 2 for a in self.ids)

    def texts(self, start: int, end: int) -> EncodeJob:
        """The same work for texts start..end-1 only (a job too large for one batch, cut)."""
        return replace(self, ids=self.ids[start:end],
                       type_ids=self.type_ids[start:end] if self.type_ids is not None else None,
                       attended=self.attended[start:end] if self.attended is not None else None)

    def cost(self, batching: BatchingSettings) -> int:
        """Its share of a batch's budget: its tokens, plus its attention weights at the rate that makes
        max_batch_tokens worth max_batch_attention_values of them. A batch holds every text's
        attention until it returns, so many large requests in one batch must not add up past that."""
        values = self.attention_values
        return self.n_tokens + (-(-values * batching.max_batch_tokens // batching.max_batch_attention_values))


@dataclass
class EncodeResult:
    # the pooled output per text: the sentence embedding (n_texts, dim), or a classifier's logits (n_texts, labels)
    embeddings: np.ndarray | None
    hidden: list[np.ndarray] | None = None  # per text (n_tokens, hidden)
    attentions: list[np.ndarray] | None = None  # per text (layers, heads, n_tokens, n_tokens)
    stats: dict = field(default_factory=dict)
    sparse: list[tuple[np.ndarray, np.ndarray]] | None = None  # per text (indices, values), in index order
    multivectors: list[np.ndarray] | None = None  # per text (kept tokens, dim)


def replica_cpus(settings: ServiceSettings) -> int:
    """CPUs one replica may keep busy: its Ray CPU share rounded up, capped by what the process may
    run on (affinity, cgroup quota). Sized from the pod's CPUs instead, the shipped 4-CPU pods ran four
    replicas of four threads each on four CPUs. A share of 0 reserves nothing: the process's CPUs."""
    cpus = available_cpus()
    if settings.num_cpus > 0:
        cpus = min(cpus, max(1, math.ceil(settings.num_cpus)))
    return cpus


def intra_op_threads(settings: ServiceSettings) -> int:
    """onnxruntime threads per session: as set, or the replica's CPUs shared by the batches that can
    run at once, every served model's (measured on 2 CPUs with 2 concurrent batches of 1 thread each
    against 2 of 2 threads: +10 % client-batch and +12 % mixed-length throughput, single texts level)."""
    if settings.intra_op_threads:
        return settings.intra_op_threads
    running = settings.batching.max_concurrent_batches * len(settings.bundles)
    return max(1, replica_cpus(settings) // running)


def plan_sub_batches(lengths: list[int], token_budget: int, max_size: int, max_padding: float = 1.0) -> list[list[int]]:
    """Group text indexes, shortest first, so that len(group) * longest <= token_budget and the
    group's padding (1 - real / padded tokens) stays at most max_padding.

    A text longer than the budget runs alone. Sorting keeps texts of similar length together;
    the padding bound cuts a group where lengths jump (a 200-token text after twenty 20-token
    ones), since on a CPU every padded token costs what a real one does.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for index in order:
        longest = lengths[index]  # ascending order: the newcomer is the longest
        if current:
            n = len(current) + 1
            padding = 1 - (real + longest) / (n * longest)
            if n * longest > token_budget or len(current) >= max_size or padding > max_padding:
                groups.append(current)
                current, real = [], 0
        current.append(index)
        real += longest
    if current:
        groups.append(current)
    return groups


# past this length a row's attention scores (heads x length^2 per row and layer) outgrow its tokens' other
# activations, so a device run is bounded by rows x length^2 as well (plan_device_runs)
DEVICE_SCORE_LENGTH = 512


def bucketed(longest: int, bucket: int, max_length: int) -> int:
    """A device run's length: its longest text's rounded up to a multiple of `bucket`, never past
    `max_length` (the model's position limit) unless the text itself is longer."""
    return max(longest, min(-(-longest // bucket) * bucket, max_length))


def plan_device_runs(lengths: list[int], run_tokens: int, bucket: int, max_length: int) -> list[tuple[list[int], int]]:
    """Runs for a device, shortest first, each as (its text indexes, its padded length): one run for the
    whole batch where it fits, cut only where a run's padded tokens (rows x its bucketed length) would pass
    `run_tokens` or, past DEVICE_SCORE_LENGTH tokens a row, its attention scores (rows x length^2) would
    pass `run_tokens` x DEVICE_SCORE_LENGTH. A text that alone passes them runs alone.

    No padding rule: on a device a run's fixed cost (about 1.35 ms on an H100, benchmarks/standin.py) is
    worth some 27,000 padded tokens (0.05 us each), so cutting where lengths jump costs more than padding.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    runs: list[tuple[list[int], int]] = []
    current: list[int] = []
    current_length = 0
    for index in order:
        length = bucketed(lengths[index], bucket, max_length)  # ascending order: the newcomer is the longest
        # rows x length tokens, or past DEVICE_SCORE_LENGTH rows x length^2 scores, against the budget
        cost = (len(current) + 1) * length * max(length, DEVICE_SCORE_LENGTH)
        if current and cost > run_tokens * DEVICE_SCORE_LENGTH:
            runs.append((current, current_length))
            current = []
        current.append(index)
        current_length = length
    if current:
        runs.append((current, current_length))
    return runs


def halves(row: list[int], lengths: list[int]) -> list[list[int]]:
    """A packed row's texts in two rows of about equal tokens (longest first, each to the lighter row),
    each in the row's order: the two runs of a row cut for two slots take about the same time."""
    rows: tuple[list[int], list[int]] = ([], [])
    tokens = [0, 0]
    for index in sorted(row, key=lengths.__getitem__, reverse=True):
        lighter = tokens.index(min(tokens))
        rows[lighter].append(index)
        tokens[lighter] += lengths[index]
    return [sorted(r, key=row.index) for r in rows]


def pad_types(types: list[np.ndarray | None], longest: int) -> np.ndarray:
    """Token types of a sub-batch, right-padded with 0 (None: a single text, all 0)."""
    out = np.zeros((len(types), longest), dtype=np.int64)
    for row, a in enumerate(types):
        if a is not None:
            out[row, : a.shape[0]] = a
    return out


def pad(ids: list[np.ndarray], pad_id: int, attended: list[int | None] | None = None,
        length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id arrays into (batch, longest) ids and attention mask. `attended`: per text, the
    leading tokens the mask lets be attended to (None: all of them); the tokens after are computed like
    padding, which is what a ColBERT query's unattended expansion tokens are. `length`: pad to this many
    tokens instead of the longest text's (a device run's bucket; at least the longest)."""
    longest = max(int(a.shape[0]) for a in ids)
    longest = max(longest, length or 0)
    input_ids = np.full((len(ids), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(ids), longest), dtype=np.int64)
    for row, a in enumerate(ids):
        input_ids[row, : a.shape[0]] = a
        seen = a.shape[0] if attended is None or attended[row] is None else attended[row]
        mask[row, :seen] = 1
    return input_ids, mask


def pool(hidden: np.ndarray, mask: np.ndarray, how: str) -> np.ndarray:
    """Pooling over real tokens of right-padded rows, as the export's encoder does it (for
    Pooled.REPOOLED texts)."""
    if how == "cls":  # the first pooled token: the first one, or the first after a skipped prompt
        return hidden[np.arange(hidden.shape[0]), mask.argmax(axis=1)]
    keep = mask[:, :, None].astype(hidden.dtype)
    if how == "max":
        return np.where(keep > 0, hidden, np.finfo(hidden.dtype).min).max(axis=1)
    if how == "lasttoken":
        return hidden[np.arange(hidden.shape[0]), np.maximum(mask.sum(axis=1) - 1, 0)]
    if how == "weightedmean":
        keep = keep * np.arange(1, hidden.shape[1] + 1, dtype=hidden.dtype)[None, :, None]
    total = np.maximum(keep.sum(axis=1), 1e-9)
    return (hidden * keep).sum(axis=1) / (np.sqrt(total) if how == "mean_sqrt_len_tokens" else total)


def pool_skipping(encodings: np.ndarray, pooling: str, skip: int) -> np.ndarray:
    """One text's (tokens, hidden) encodings pooled without its first `skip` tokens, as
    sentence-transformers' Pooling leaves a prompt out (include_prompt false)."""
    mask = np.ones((1, encodings.shape[0]), dtype=np.int64)
    mask[0, :min(skip, encodings.shape[0])] = 0
    return pool(encodings[None], mask, pooling)[0]


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def mean_of_chunks(embeddings: np.ndarray, counts: list[int]) -> np.ndarray:
    """A chunked text's embedding: the normalised mean of its chunks' (rows in text order, `counts` per text)."""
    bounds = np.cumsum([0, *counts])
    means = np.stack([embeddings[a:b].mean(axis=0) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    return l2_normalize(means).astype(np.float32)


class Pooled(Enum):
    """How one text's pooled output is made from what the graph returns (pooled_output decides which)."""

    AS_IS = "the graph's pooled output, untouched"
    L2_HERE = "the graph's pooled output, L2-normalised here"
    REPOOLED = "pooled here again from the graph's token encodings (last_hidden_state)"

    def make(self, graph_pooled: np.ndarray, encodings: np.ndarray | None, pooling: str) -> np.ndarray:
        """The text's pooled output, from the graph's pooled row or, REPOOLED, from `encodings`: its
        real tokens' last_hidden_state (tokens, hidden), pooled as the graph pools (`pooling`)."""
        if self is Pooled.L2_HERE:
            return l2_normalize(graph_pooled)
        if self is Pooled.REPOOLED:
            return pool(encodings[None], np.ones((1, encodings.shape[0]), dtype=np.int64), pooling)[0]
        return graph_pooled


def pooled_output(model: ModelInfo, normalize: bool) -> Pooled:
    """What a job's `normalize` means for its texts' pooled outputs: the one place that decides it.

    `EncodeJob.normalize` is what the client asked for, or, where it did not say, the model's own
    `normalize` (the routes pass `engine.model.normalize`; classifier routes pass False). The model's
    `normalize` says whether its graphs already end in an L2 normalisation (sentence-transformers'
    Normalize module, exported into the graph). So:

    - a classifier's logits: as the graph computed them, whatever `normalize` says (the route reads them);
    - `normalize` as the model's: the graph's output as it is (normalised or raw, as the model was trained);
    - `normalize` true, the graph raw: the graph's output, L2-normalised here;
    - `normalize` false, the graph normalising: the raw vector is no output of the graph, so it is pooled
      again here from the token encodings, as the graph pools. Such a text needs last_hidden_state, so
      it runs padded, never packed. Past a Dense projection this would skip the Dense: /v1/encode
      refuses normalize false for such a model (engine/prompts.py `normalization`) before it queues.
    """
    if model.task == "classification" or normalize == model.normalize:
        return Pooled.AS_IS
    return Pooled.L2_HERE if normalize else Pooled.REPOOLED


TextRef = tuple[int, int]  # a text of a batch: (its job's index in the batch, its index in the job)


class Needs(NamedTuple):
    """What a text needs from a run besides its pooled output. A batch's texts are grouped by it, so
    the cheap ones never pay for the big outputs (and only texts that need nothing more run packed)."""

    attention: bool  # attention weights: the full graph
    hidden: bool  # token encodings: the job wants them, its pooled output is REPOOLED from them, or its
    # sparse or multi-vector output is made from them


@dataclass
class Tally:
    """What one batch ran, for its metrics, the runner's counters and each result's stats."""

    real: int = 0  # tokens of the texts
    padded: int = 0  # tokens computed, padding included
    runs: dict[str, int] = field(default_factory=dict)  # runs by graph label
    lent_runs: int = 0  # runs on a slot the batch queue lent (an otherwise idle replica)
    widest: int = 1  # the most runs of the batch that were computing at one moment

    def add(self, graph: str, real: int, padded: int) -> None:
        self.runs[graph] = self.runs.get(graph, 0) + 1
        self.real += real
        self.padded += padded

    @property
    def padding_ratio(self) -> float:
        return 1 - self.real / self.padded if self.padded else 0.0


@dataclass
class Batch:
    """One compute() call: its jobs, their results as they fill in, and what ran for them. The runtime
    and batching settings are read once, so a live change (reconfigure, a resized runtime) takes effect
    from the next batch and never half-way through one."""

    jobs: list[EncodeJob]
    results: list[EncodeResult]
    pooled: list[Pooled]  # per job: how its texts' pooled outputs are made (pooled_output)
    runtime: Runtime
    batching: BatchingSettings
    model: ModelInfo
    tally: Tally = field(default_factory=Tally)

    @property
    def n_texts(self) -> int:
        return sum(len(job.ids) for job in self.jobs)

    @property
    def packs(self) -> bool:
        """Whether texts that need only their pooled output run packed: packing on and served."""
        return self.runtime.packed is not None and bool(self.batching.packed_tokens)

    def device_sized(self, needs: Needs) -> bool:
        """Whether texts that need this run in device-sized runs (plan_device_runs): the runtime is on a
        device, and they want no attention weights. Those are sized as on a CPU: the full graph returns
        every row's (layers, heads, length, length) to the host, so padding there is memory the padding
        bound keeps near what max_batch_attention_values counted for the batch."""
        return self.runtime.sizing == "device" and not needs.attention

    def needs(self, j: int) -> Needs:
        job = self.jobs[j]
        # a text whose prompt pooling leaves out is pooled by weights on a packed row, else here from
        # its token encodings (the graph's own pooled row read the prompt)
        padded = not self.packs or job.attention is not None or job.want_hidden
        repool = self.pooled[j] is Pooled.REPOOLED or (job.pool_skip > 0 and padded)
        return Needs(attention=job.attention is not None,
                     hidden=job.want_hidden or repool or self.token_level(job) or job.attended is not None)

    def token_level(self, job: EncodeJob) -> bool:
        """Whether the job's sparse or multi-vector output is made from token encodings (a SPLADE sparse
        vector is the graph's pooled output)."""
        sparse = self.model.sparse
        return job.multivector or (job.sparse and sparse is not None and sparse.kind == "bge-m3")

    def ids(self, text: TextRef) -> np.ndarray:
        j, t = text
        return self.jobs[j].ids[t]

    def type_ids(self, text: TextRef) -> np.ndarray | None:
        j, t = text
        types = self.jobs[j].type_ids
        return types[t] if types else None

    def attended(self, text: TextRef) -> int | None:
        j, t = text
        attended = self.jobs[j].attended
        return attended[t] if attended else None


class Lender(Protocol):
    """What the batch queue (batcher.py) lends a running batch: free runner slots, while nothing else wants them."""

    def lend(self) -> bool: ...  # one more slot, or False (work queued, another model computing, none free)

    def give_back(self) -> None: ...

    def slot_wanted(self) -> bool: ...  # a lent slot must go back after its current piece


class Run(NamedTuple):
    """What one piece ran, for the batch's tally: its graph's label, real and padded tokens."""

    graph: str
    real: int
    padded: int


Piece = Callable[[], Run]  # one independent run of a batch (a packed row, a padded sub-batch): runs it, fills its texts in

# a batch of one piece is cut in two for a lent slot only from this many real tokens: below it, the second
# run's fixed cost (the session call, its kernels' dispatch: about 1 ms on MiniLM-L6) eats most of what the
# second core saves (half of a 128-token run: about 3 ms there on one thread)
SPLIT_MIN_TOKENS = 128
LENT_WORKERS = 16  # the runner's pool: threads that run pieces on lent slots (at most the free slots at once)


class BatchRunner:
    """Computes one batch of jobs on a replica's onnxruntime sessions, and counts what it did.

    Called in a worker thread (onnxruntime releases the GIL), up to max_concurrent_batches at
    once, so the counters are kept under a lock.
    """

    def __init__(self, runtime: Runtime, manifest: BundleManifest, batching: BatchingSettings,
                 model_name: str | None = None, heads: Heads | None = None) -> None:
        self.runtime = runtime
        self.heads = heads  # the token-level heads of sparse and multi-vector outputs (bundle/representations.py)
        self.model_name = model_name or manifest.model.name  # the served name: the metrics' model label
        self.manifest = manifest
        self.batching = batching
        self.metrics = service_metrics()
        # lent_runs: runs on a slot lent by an otherwise idle replica; wide_batches: batches whose runs
        # computed on more than one slot at once
        self.counters = {"batches": 0, "requests": 0, "texts": 0, "real_tokens": 0, "padded_tokens": 0, "ort_runs": 0,
                         "compute_ms": 0.0, "lent_runs": 0, "wide_batches": 0}
        self.runs_by_graph = {runtime.full.label: 0, runtime.fast.label: 0,
                              **({runtime.packed.label: 0} if runtime.packed is not None else {})}
        # what one text's pooled output is: a sentence embedding, or a classifier's logits
        self.task = manifest.model.task  # the request metrics' task label
        classifier = self.task == "classification"
        self.pooled = "logits" if classifier else "sentence_embedding"
        self.pooled_width = len(manifest.model.labels or []) if classifier else manifest.model.sentence_dim
        self.running = 0  # batches being computed now
        self._counters_lock = threading.Lock()
        self._lent_pool = ThreadPoolExecutor(LENT_WORKERS, thread_name_prefix="lent-slot")

    def warm_up(self) -> None:
        """Run the shapes traffic will bring, so the first real request does not pay for allocation."""
        self.runtime.smoke_test()
        token = 1000 % self.manifest.model.vocab_size  # an ordinary token of any vocabulary
        for length in (8, self.manifest.model.max_tokens):
            ids = np.full((4, length), token, dtype=np.int64)
            self.runtime.run(ids, np.ones_like(ids), [self.pooled])
        ids = np.full((2, 8), token, dtype=np.int64)
        self.runtime.run(ids, np.ones_like(ids), [self.pooled, "attentions"])
        if self.runtime.packed is not None:
            for lengths in ([8] * 4, [self.manifest.model.max_tokens]):
                self._run_packed(self.runtime.packed, [np.full(n, token, dtype=np.int64) for n in lengths], None)

    def compute(self, jobs: list[EncodeJob], lender: Lender | None = None) -> list[EncodeResult]:
        """List in, list out: each job's result, in order. The batch's texts are grouped by what they
        need; each group runs packed or in length-sorted padded sub-batches (the batch's pieces); each
        text's outputs go back to its job's result; then the batch is counted. `lender`: the batch
        queue, which lends free slots to the pieces (None: one after another, in this thread)."""
        with self._counters_lock:
            self.running += 1
        try:
            started = time.perf_counter()
            self._observe_queue(jobs, started)
            batch = self._new_batch(jobs)
            pieces = self._plan(batch)
            # a batch of one piece, on an otherwise idle replica: cut in two where it is large enough,
            # the second half on a slot taken before the cut (none free: it stays whole). Not on a device,
            # where the second run would add its fixed cost and save nothing
            held = lender is not None and len(pieces) == 1 and batch.runtime.sizing != "device" and lender.lend()
            if held:
                pieces = self._plan(batch, split=True)
                if len(pieces) == 1:
                    lender.give_back()
                    held = False
            for run in self._run_pieces(pieces, lender, batch.tally, held):
                batch.tally.add(*run)
            ended = time.perf_counter()
            self._count(batch, ended - started)
            if tracing.enabled():
                tracing.record_batch(jobs, started, ended, {
                    "encoder.model": self.model_name, "encoder.batch.requests": len(jobs),
                    "encoder.batch.texts": batch.n_texts, "encoder.batch.tokens": batch.tally.real,
                    "encoder.batch.padded_tokens": batch.tally.padded, "encoder.graphs": ",".join(sorted(batch.tally.runs)),
                })
            return batch.results
        finally:
            with self._counters_lock:
                self.running -= 1

    def _new_batch(self, jobs: list[EncodeJob]) -> Batch:
        """The batch, each job's result zeroed to be filled in."""
        results = [
            EncodeResult(
                embeddings=np.zeros((len(job.ids), self.pooled_width), dtype=np.float32),
                hidden=[None] * len(job.ids) if job.want_hidden else None,  # type: ignore[list-item]
                attentions=[None] * len(job.ids) if job.attention is not None else None,  # type: ignore[list-item]
                sparse=[None] * len(job.ids) if job.sparse else None,  # type: ignore[list-item]
                multivectors=[None] * len(job.ids) if job.multivector else None,  # type: ignore[list-item]
            )
            for job in jobs
        ]
        pooled = [pooled_output(self.manifest.model, job.normalize) for job in jobs]
        return Batch(jobs, results, pooled, self.runtime, self.batching, self.manifest.model)

    @staticmethod
    def _group(batch: Batch) -> dict[Needs, list[TextRef]]:
        """Every text of the batch under what it needs, in job order."""
        groups: dict[Needs, list[TextRef]] = {}
        for j, job in enumerate(batch.jobs):
            needs = batch.needs(j)
            groups.setdefault(needs, []).extend((j, t) for t in range(len(job.ids)))
        return groups

    def _plan(self, batch: Batch, split: bool = False) -> list[Piece]:
        """The batch's pieces in order: each group of texts (by what they need) in packed rows or padded
        sub-batches. `split`: a group of one large piece is cut in two (_packed_rows, _padded)."""
        pieces: list[Piece] = []
        for needs, texts in self._group(batch).items():
            if self._packs(batch, needs):
                pieces += self._packed_rows(batch, texts, split)
            else:
                pieces += self._padded(batch, needs, texts, split)
        return pieces

    @staticmethod
    def _packs(batch: Batch, needs: Needs) -> bool:
        """Whether texts that need this run packed: only the pooled output, and packing on and served."""
        return not (needs.attention or needs.hidden) and batch.packs

    def _packed_rows(self, batch: Batch, texts: list[TextRef], split: bool = False) -> list[Piece]:
        """Texts in rows of the packed graph, each row up to packed_tokens long, with no padding: a piece
        per row. `split`: a lone row of SPLIT_MIN_TOKENS or more is cut into two rows of about half each."""
        lengths = [int(batch.ids(text).shape[0]) for text in texts]
        rows = plan_packs(lengths, batch.batching.packed_tokens)
        if split and len(rows) == 1 and len(rows[0]) > 1 and sum(lengths) >= SPLIT_MIN_TOKENS:
            rows = halves(rows[0], lengths)
        return [lambda members=[texts[i] for i in row]: self._packed_row(batch, members) for row in rows]

    def _packed_row(self, batch: Batch, members: list[TextRef]) -> Run:
        packed = batch.runtime.packed
        pooled, width = self._run_packed(packed, [batch.ids(m) for m in members],
                                         [batch.type_ids(m) for m in members],
                                         [batch.jobs[j].pool_skip for j, _ in members])
        for (j, t), vector in zip(members, pooled, strict=True):
            batch.results[j].embeddings[t] = batch.pooled[j].make(vector, None, self.manifest.model.pooling)
            self._representations(batch, (j, t), None)
        return Run(packed.label, sum(int(batch.ids(m).shape[0]) for m in members), width)

    def _run_packed(self, packed: PackedGraph, ids: list[np.ndarray], types: list[np.ndarray | None] | None,
                    skip: list[int] | None = None) -> tuple[np.ndarray, int]:
        """One packed row through the packed graph: the texts' pooled outputs, and the row's length in
        tokens (padding to the runtime's multiple included, for the padding metric). `skip`: per text,
        the leading tokens its pooling leaves out."""
        feed = pack(ids, types, self.manifest.packed.position_offset, self.manifest.model.pooling, packed.multiple,
                    skip if skip and any(skip) else None)
        return packed.run_packed(feed), int(feed["input_ids"].shape[1])

    def _padded(self, batch: Batch, needs: Needs, texts: list[TextRef], split: bool = False) -> list[Piece]:
        """Texts length-sorted into padded runs, on the graph that has every output they need: a piece per
        run. On a device (Batch.device_sized) as few runs as the device takes, each padded to its length
        bucket (plan_device_runs); else sub-batches cut for a CPU's padding cost (plan_sub_batches), and
        with `split`, a lone sub-batch of SPLIT_MIN_TOKENS or more is cut into its shorter and its longer
        half (each padded less than the whole)."""
        outputs = [self.pooled, *(["last_hidden_state"] if needs.hidden else []),
                   *(["attentions"] if needs.attention else [])]
        graph = batch.runtime.graph_for(outputs)
        lengths = [int(batch.ids(text).shape[0]) for text in texts]
        settings = batch.batching
        if batch.device_sized(needs):
            runs = plan_device_runs(lengths, settings.device_run_tokens, settings.device_length_bucket,
                                    self.manifest.model.max_tokens)
            return [lambda members=[texts[i] for i in run], length=length:
                    self._padded_run(batch, graph, outputs, members, length)
                    for run, length in runs]
        groups = plan_sub_batches(lengths, settings.sub_batch_tokens, settings.max_sub_batch_size, settings.max_padding)
        if split and len(groups) == 1 and len(groups[0]) > 1 and sum(lengths) >= SPLIT_MIN_TOKENS:
            half = len(groups[0]) // 2
            groups = [groups[0][:half], groups[0][half:]]
        return [lambda members=[texts[i] for i in group]: self._padded_run(batch, graph, outputs, members)
                for group in groups]

    def _padded_run(self, batch: Batch, graph, outputs: list[str], members: list[TextRef],
                    length: int | None = None) -> Run:
        """One padded run of these texts (to their longest, or to `length`), its outputs scattered to their jobs."""
        attended = [batch.attended(m) for m in members]
        input_ids, mask = pad([batch.ids(m) for m in members], self.manifest.model.pad_token_id,
                              attended if any(a is not None for a in attended) else None, length)
        types = None
        if any(batch.jobs[j].type_ids is not None for j, _ in members):
            types = pad_types([batch.type_ids(m) for m in members], input_ids.shape[1])
        out = graph.run(input_ids, mask, outputs, types)
        self._scatter(batch, members, out)
        return Run(graph.label, sum(int(batch.ids(m).shape[0]) for m in members), int(mask.size))

    def _run_pieces(self, pieces: list[Piece], lender: Lender | None, tally: Tally, held: bool = False) -> list[Run]:
        """Every piece run, their Runs in plan order. With a lender, as many at once as it lends slots
        (each lent slot given back once its pieces are done, or after its current piece when work is
        queued); without, or when it lends none, one after another in this thread, as under load. `held`:
        one slot already lent (for a cut piece's second half). A failure stops the pieces not yet started
        and raises the first failed piece's error, as in order."""
        if lender is None:
            return [piece() for piece in pieces]
        runs: list[Run | None] = [None] * len(pieces)
        errors: dict[int, BaseException] = {}
        lock = threading.Lock()
        state = {"next": 0, "computing": 0}

        def work(lent: bool) -> None:
            while True:
                with lock:
                    k = state["next"]
                    if errors or k >= len(pieces):
                        return
                    state["next"] = k + 1
                    state["computing"] += 1
                    tally.widest = max(tally.widest, state["computing"])
                try:
                    runs[k] = pieces[k]()
                except BaseException as exc:  # noqa: BLE001 - raised in the batch's thread, in piece order
                    with lock:
                        errors[k] = exc
                    return
                finally:
                    with lock:
                        state["computing"] -= 1
                if lent:
                    with lock:
                        tally.lent_runs += 1
                    if lender.slot_wanted():
                        return

        def on_lent_slot() -> None:
            try:
                work(lent=True)
            finally:
                lender.give_back()

        helpers = [self._lent_pool.submit(on_lent_slot)] if held else []
        while lender is not None and len(helpers) < len(pieces) - 1 and lender.lend():
            helpers.append(self._lent_pool.submit(on_lent_slot))
        work(lent=False)
        for helper in helpers:
            helper.result()
        if errors:
            raise errors[min(errors)]
        return runs  # type: ignore[return-value]

    def _scatter(self, batch: Batch, members: list[TextRef], out: dict[str, np.ndarray]) -> None:
        """Copy each text's slice of a sub-batch's outputs (its real tokens only) into its job's result."""
        for row, (j, t) in enumerate(members):
            job, result = batch.jobs[j], batch.results[j]
            n = int(batch.ids((j, t)).shape[0])
            encodings = out["last_hidden_state"][row, :n] if "last_hidden_state" in out else None
            if job.pool_skip:  # its prompt left out of pooling: pooled here (no Dense: the routes see to it)
                vector = pool_skipping(encodings, self.manifest.model.pooling, job.pool_skip)
                result.embeddings[t] = l2_normalize(vector) if job.normalize else vector
            else:
                result.embeddings[t] = batch.pooled[j].make(out[self.pooled][row], encodings,
                                                            self.manifest.model.pooling)
            self._representations(batch, (j, t), encodings)
            if job.want_hidden:
                result.hidden[t] = np.ascontiguousarray(encodings)
            if job.attention is not None:
                layers, heads = job.attention
                a = out["attentions"][:, row]  # (layers, heads, T, T)
                result.attentions[t] = np.ascontiguousarray(a[np.ix_(layers, heads)][:, :, :n, :n])

    def _representations(self, batch: Batch, text: TextRef, encodings: np.ndarray | None) -> None:
        """A text's sparse and multi-vector outputs, made here in the batch's worker thread (never on the
        event loop) from its pooled output (SPLADE) or its token encodings (bundle/representations.py)."""
        j, t = text
        job, result, model = batch.jobs[j], batch.results[j], batch.model
        if job.sparse:
            if model.sparse.kind == "splade":
                result.sparse[t] = splade_terms(result.embeddings[t])
            else:
                result.sparse[t] = bge_m3_terms(encodings, batch.ids(text), self.heads, model.sparse.skip_ids)
        if job.multivector:
            keep = kept_tokens(batch.ids(text), model.multivector, job.is_query)
            result.multivectors[t] = token_vectors(encodings, self.heads, model.multivector, keep)

    def _observe_queue(self, jobs: list[EncodeJob], started: float) -> None:
        """Each job's time in the batch queue, until its batch started (observed first: a batch that
        fails has still waited)."""
        for job in jobs:
            self.metrics.duration.observe(started - job.enqueued, tags={"route": job.route, "stage": "queue",
                                                                        "model": self.model_name, "task": self.task,
                                                                        "protocol": job.protocol})

    def _count(self, batch: Batch, elapsed: float) -> None:
        """Everything the batch is counted in, from its tally: the metrics, the runner's counters (under
        the lock: two batches may finish at once, each in its own thread) and each result's stats."""
        tally, m, model = batch.tally, self.metrics, {"model": self.model_name}
        for job in batch.jobs:
            m.duration.observe(elapsed, tags={"route": job.route, "stage": "inference", "task": self.task,
                                              "protocol": job.protocol, **model})
        m.batch_requests.observe(len(batch.jobs), tags=model)
        m.batch_tokens.observe(tally.real, tags=model)
        m.padding_ratio.observe(tally.padding_ratio, tags=model)
        if tally.real:
            m.tokens.inc(tally.real, tags=model)
            m.padded_tokens.inc(tally.padded, tags=model)
        for label, n in tally.runs.items():
            m.inference_runs.inc(n, tags={"graph": label, **model})
        with self._counters_lock:
            for label, n in tally.runs.items():
                self.runs_by_graph[label] = self.runs_by_graph.get(label, 0) + n
            self.counters["batches"] += 1
            self.counters["requests"] += len(batch.jobs)
            self.counters["texts"] += batch.n_texts
            self.counters["real_tokens"] += tally.real
            self.counters["padded_tokens"] += tally.padded
            self.counters["ort_runs"] += sum(tally.runs.values())
            self.counters["compute_ms"] += elapsed * 1000
            self.counters["lent_runs"] += tally.lent_runs
            self.counters["wide_batches"] += tally.widest > 1
        stats = {"batch_requests": len(batch.jobs), "batch_texts": batch.n_texts, "ort_runs": sum(tally.runs.values()),
                 "padding_ratio": tally.padding_ratio}
        for result in batch.results:
            result.stats = dict(stats)
