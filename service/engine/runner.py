"""One batch of requests on a model's runtime: the work the batch queue (batcher.py) hands over.

Each request (one client call, one or more texts) is one item of the queue, counted by its tokens
(EncodeJob.cost), so a batch is bounded by a token budget, not a request count. Texts that need
only their pooled output (an embedding, a classifier's logits) run packed where the runtime has the
bundle's packed graph: several texts one after another in a row of up to `packed_tokens`, with no
padding at all (service/runtimes/packing.py). All other texts are sorted by length and cut into
sub-batches whose padded size stays under `sub_batch_tokens`: on a CPU, padding is the first cost.
Texts whose request wants attention weights run on the bundle's full graph; the rest on its fused
encodings-only graph of the configured precision (the `graph` label of the inference-runs metric
says which graph ran: full, encodings-<precision>, packed-<precision>).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from bundle.manifest import BundleManifest
from service.config import BatchingSettings, ServiceSettings
from service.metrics import service_metrics
from service.runtimes import Runtime
from service.runtimes.onnxruntime import available_cpus
from service.runtimes.packing import pack, plan_packs


@dataclass
class EncodeJob:
    """One request's work: token ids per text, and which outputs it needs."""

    route: str
    ids: list[np.ndarray]
    normalize: bool
    want_embedding: bool = True
    want_hidden: bool = False
    attention: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (layers, heads), resolved
    enqueued: float = 0.0  # perf_counter() when the job joined the batch queue
    type_ids: list[np.ndarray] | None = None  # token types per text: text pairs (rerank) set the second's

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
                       type_ids=self.type_ids[start:end] if self.type_ids is not None else None)

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


def pad_types(types: list[np.ndarray | None], longest: int) -> np.ndarray:
    """Token types of a sub-batch, right-padded with 0 (None: a single text, all 0)."""
    out = np.zeros((len(types), longest), dtype=np.int64)
    for row, a in enumerate(types):
        if a is not None:
            out[row, : a.shape[0]] = a
    return out


def pad(ids: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id arrays into (batch, longest) ids and attention mask."""
    longest = max(int(a.shape[0]) for a in ids)
    input_ids = np.full((len(ids), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(ids), longest), dtype=np.int64)
    for row, a in enumerate(ids):
        input_ids[row, : a.shape[0]] = a
        mask[row, : a.shape[0]] = 1
    return input_ids, mask


def pool(hidden: np.ndarray, mask: np.ndarray, how: str) -> np.ndarray:
    """Pooling over real tokens, as the export's encoder does it (for normalize=false requests)."""
    if how == "cls":
        return hidden[:, 0]
    keep = mask[:, :, None].astype(hidden.dtype)
    if how == "max":
        return np.where(keep > 0, hidden, np.finfo(hidden.dtype).min).max(axis=1)
    return (hidden * keep).sum(axis=1) / np.maximum(keep.sum(axis=1), 1e-9)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def mean_of_chunks(embeddings: np.ndarray, counts: list[int]) -> np.ndarray:
    """A chunked text's embedding: the normalised mean of its chunks' (rows in text order, `counts` per text)."""
    bounds = np.cumsum([0, *counts])
    means = np.stack([embeddings[a:b].mean(axis=0) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    return l2_normalize(means).astype(np.float32)


class BatchRunner:
    """Computes one batch of jobs on a replica's onnxruntime sessions, and counts what it did.

    Called in a worker thread (onnxruntime releases the GIL), up to max_concurrent_batches at
    once, so the counters are kept under a lock.
    """

    def __init__(self, runtime: Runtime, manifest: BundleManifest, batching: BatchingSettings,
                 model_name: str | None = None) -> None:
        self.runtime = runtime
        self.model_name = model_name or manifest.model.name  # the served name: the metrics' model label
        self.manifest = manifest
        self.batching = batching
        self.metrics = service_metrics()
        self.counters = {"batches": 0, "requests": 0, "texts": 0, "real_tokens": 0, "padded_tokens": 0, "ort_runs": 0,
                         "compute_ms": 0.0}
        self.runs_by_graph = {runtime.full.label: 0, runtime.fast.label: 0,
                              **({runtime.packed.label: 0} if runtime.packed is not None else {})}
        # what one text's pooled output is: a sentence embedding, or a classifier's logits
        self.task = manifest.model.task  # the request metrics' task label
        classifier = self.task == "classification"
        self.pooled = "logits" if classifier else "sentence_embedding"
        self.pooled_width = len(manifest.model.labels or []) if classifier else manifest.model.sentence_dim
        self.running = 0  # batches being computed now
        self._counters_lock = threading.Lock()

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
                self._run_packed([np.full(n, token, dtype=np.int64) for n in lengths], None)

    def compute(self, jobs: list[EncodeJob]) -> list[EncodeResult]:
        """List in, list out: every job's texts, length-sorted into sub-batches."""
        with self._counters_lock:
            self.running += 1
        try:
            return self._compute(jobs)
        finally:
            with self._counters_lock:
                self.running -= 1

    def _compute(self, jobs: list[EncodeJob]) -> list[EncodeResult]:
        started = time.perf_counter()
        for job in jobs:
            self.metrics.duration.observe(started - job.enqueued, tags={"route": job.route, "stage": "queue",
                                                                        "model": self.model_name, "task": self.task})
        model = self.manifest.model
        # Flatten texts; texts that need attention or hidden states run apart from those that
        # need only the embedding, so the cheap ones never pay for the big outputs. Texts that
        # need attention weights run on the full graph, all others on the fused encodings graph.
        texts = [(j, t) for j, job in enumerate(jobs) for t in range(len(job.ids))]
        needs = lambda j: (jobs[j].attention is not None, self._needs_hidden(jobs[j]))  # noqa: E731
        results = [
            EncodeResult(
                embeddings=np.zeros((len(job.ids), self.pooled_width), dtype=np.float32),
                hidden=[None] * len(job.ids) if job.want_hidden else None,  # type: ignore[list-item]
                attentions=[None] * len(job.ids) if job.attention is not None else None,  # type: ignore[list-item]
            )
            for job in jobs
        ]
        by_need: dict[tuple[bool, bool], list[tuple[int, int]]] = {}
        for j, t in texts:
            by_need.setdefault(needs(j), []).append((j, t))
        real = padded = 0
        runs: dict[str, int] = {}
        for (want_attention, want_hidden), members in by_need.items():
            lengths = [int(jobs[j].ids[t].shape[0]) for j, t in members]
            if self.runtime.packed is not None and self.batching.packed_tokens and not (want_attention or want_hidden):
                for group in plan_packs(lengths, self.batching.packed_tokens):
                    rows = [members[g] for g in group]
                    types = [jobs[j].type_ids[t] if jobs[j].type_ids else None for j, t in rows]
                    pooled, width = self._run_packed([jobs[j].ids[t] for j, t in rows], types)
                    runs[self.runtime.packed.label] = runs.get(self.runtime.packed.label, 0) + 1
                    real += sum(lengths[g] for g in group)
                    padded += width
                    for (j, t), embedding in zip(rows, pooled, strict=True):
                        results[j].embeddings[t] = self._normalized(jobs[j], embedding)
                continue
            outputs = [self.pooled] + (["last_hidden_state"] if want_hidden else []) + (["attentions"] if want_attention else [])
            for group in plan_sub_batches(lengths, self.batching.sub_batch_tokens, self.batching.max_sub_batch_size,
                                          self.batching.max_padding):
                rows = [members[g] for g in group]
                input_ids, mask = pad([jobs[j].ids[t] for j, t in rows], model.pad_token_id)
                types = None
                if any(jobs[j].type_ids is not None for j, _ in rows):
                    types = pad_types([jobs[j].type_ids[t] if jobs[j].type_ids else None for j, t in rows],
                                      input_ids.shape[1])
                graph = self.runtime.graph_for(outputs)
                out = graph.run(input_ids, mask, outputs, types)
                runs[graph.label] = runs.get(graph.label, 0) + 1
                real += int(mask.sum())
                padded += int(mask.size)
                self._scatter(jobs, results, rows, mask, out)
        elapsed = time.perf_counter() - started
        m, model = self.metrics, {"model": self.model_name}
        for job in jobs:
            m.duration.observe(elapsed, tags={"route": job.route, "stage": "inference", "task": self.task, **model})
        m.batch_requests.observe(len(jobs), tags=model)
        m.batch_tokens.observe(real, tags=model)
        m.padding_ratio.observe(1 - real / padded if padded else 0.0, tags=model)
        if real:
            m.tokens.inc(real, tags=model)
            m.padded_tokens.inc(padded, tags=model)
        for label, n in runs.items():
            m.inference_runs.inc(n, tags={"graph": label, **model})
        with self._counters_lock:  # two batches may finish at once, each in its own thread
            for label, n in runs.items():
                self.runs_by_graph[label] = self.runs_by_graph.get(label, 0) + n
            self.counters["batches"] += 1
            self.counters["requests"] += len(jobs)
            self.counters["texts"] += len(texts)
            self.counters["real_tokens"] += real
            self.counters["padded_tokens"] += padded
            self.counters["ort_runs"] += sum(runs.values())
            self.counters["compute_ms"] += elapsed * 1000
        for result, job in zip(results, jobs, strict=True):
            result.stats = {"batch_requests": len(jobs), "batch_texts": len(texts), "ort_runs": sum(runs.values()),
                            "padding_ratio": 1 - real / padded if padded else 0.0}
        return results

    def _run_packed(self, ids: list[np.ndarray], types: list[np.ndarray | None] | None) -> tuple[np.ndarray, int]:
        """One packed row through the runtime's packed graph: the texts' pooled outputs, and the row's
        length in tokens (padding to the runtime's multiple included, for the padding metric)."""
        packed = self.runtime.packed
        feed = pack(ids, types, self.manifest.packed.position_offset, self.manifest.model.pooling, packed.multiple)
        return packed.run_packed(feed), int(feed["input_ids"].shape[1])

    def _needs_hidden(self, job: EncodeJob) -> bool:
        return job.want_hidden or (self.manifest.model.normalize and not job.normalize)

    def _normalized(self, job: EncodeJob, embedding: np.ndarray) -> np.ndarray:
        """A text's pooled output as its job asks for it: L2-normalised where the job wants that and the
        graph does not do it; logits are returned as they are (the route reads them)."""
        if self.pooled == "sentence_embedding" and job.normalize and not self.manifest.model.normalize:
            return l2_normalize(embedding)
        return embedding

    def _scatter(self, jobs, results, rows, mask, out) -> None:
        """Copy each text's slice of a sub-batch's outputs into its job's result."""
        model = self.manifest.model
        for row, (j, t) in enumerate(rows):
            job, result = jobs[j], results[j]
            n = int(mask[row].sum())
            embedding = self._normalized(job, out[self.pooled][row])
            if self.pooled == "sentence_embedding" and model.normalize and not job.normalize:
                # the graph normalises: pool its hidden states again
                embedding = pool(out["last_hidden_state"][row : row + 1, :n], mask[row : row + 1, :n], model.pooling)[0]
            result.embeddings[t] = embedding
            if job.want_hidden:
                result.hidden[t] = np.ascontiguousarray(out["last_hidden_state"][row, :n])
            if job.attention is not None:
                layers, heads = job.attention
                a = out["attentions"][:, row]  # (layers, heads, T, T)
                result.attentions[t] = np.ascontiguousarray(a[np.ix_(layers, heads)][:, :, :n, :n])
