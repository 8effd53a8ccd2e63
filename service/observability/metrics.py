"""Every metric family of the service, defined once, with Ray Serve's metrics API.

Each replica is its own process, often on another node, so a prometheus_client registry in
one process would show one random replica. `ray.serve.metrics` families are exported by Ray
on every node's metrics port (with the `ray_` prefix, next to Ray Serve's own `ray_serve_*`
families), tagged with deployment, replica and application, so Prometheus sees all replicas.

Families (exported names; one question each). `protocol` is http or grpc (KServe v2 over gRPC,
service/grpc/), on the families a request records:
  ray_encoder_requests_total{route,status_class,protocol}     how many requests, and how they ended
  ray_encoder_request_failures_total{route,reason,protocol}   how many failed, and why
  ray_encoder_request_duration_seconds{route,stage,protocol}  time per stage: tokenization, queue, inference, total
  ray_encoder_in_flight_requests                        requests being handled right now (per ingress replica, sampled each second)
  ray_encoder_batch_queue_requests                      requests waiting for a batch (per replica and model)
  ray_encoder_response_bytes_total{route,kind,protocol}  bytes sent, by output kind
  ray_encoder_batch_size_requests                       requests per batch (batch fill)
  ray_encoder_batch_size_tokens                         real tokens per batch
  ray_encoder_batch_padding_ratio                       padded share of the tokens computed, per batch
  ray_encoder_tokens_total                              real tokens processed
  ray_encoder_padded_tokens_total                       tokens computed, padding included
  ray_encoder_inference_runs_total{graph}               onnxruntime runs, by graph: full (attention
                                                        weights) or encodings-fp32/-int8/-fp16
  ray_encoder_model_info{model,task,bundle_sha256,provider,runtime,precision,gpu_ids}  1 per encoder replica: what it
      serves, and where (gpu_ids: the Ray GPU ids the replica was given, empty without a GPU share)
  ray_encoder_metric_records_dropped_total              records dropped because the recorder fell behind (Recorder)
  ray_encoder_model_loads_total{model,outcome}          on-demand loads of a model repository's models (loaded, failed)
  ray_encoder_model_load_seconds{model}                 how long each load took
  ray_encoder_model_evictions_total{model,reason}       unloads, by reason: memory, idle, removed, unloaded (asked), moved (max_loaded)
  ray_encoder_model_loaded_bytes{model}                 each loaded on-demand model's measured bytes, per replica
  ray_encoder_model_budget_bytes                        the replica's budget for on-demand models (model_memory_bytes)
  ray_encoder_key_requests_total{key,model,status_class} each API key's requests (key: its name in the keys file)
  ray_encoder_key_tokens_total{key,model}               tokens each key's requests sent to inference
  ray_encoder_key_rate_limited_total{key,limit,model}   each key's requests refused at a limit (requests, tokens, concurrent)
  ray_encoder_keys_file_errors_total                    versions of the keys file that did not parse (last good keys kept)

Counters and histograms are recorded in Ray by a thread of the process (Recorder, each second), never by
the request path: Ray's record call releases the GIL, which an event loop then waits to take back.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from functools import cache

from ray.serve.metrics import Counter, Gauge, Histogram

PREFIX = "encoder_"
logger = logging.getLogger("ray.serve")

# Sub-millisecond tokenization to tens of seconds under overload.
LATENCY_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
REQUEST_BUCKETS = [float(2**i) for i in range(0, 11)]  # 1 .. 1024 requests
TOKEN_BUCKETS = [float(2**i) for i in range(4, 17)]  # 16 .. 65536 tokens
RATIO_BUCKETS = [0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]

FAILURE_REASONS = ("bad_request", "validation", "too_large", "not_found", "unauthorized", "forbidden", "overloaded", "not_ready", "timeout",
                   "cancelled", "backend", "requests", "tokens", "concurrent")


# Every family of a request or a batch carries the served model's name (empty on routes that run
# no model: /info, /health, the explorer page, unknown paths).
MODEL = ("model",)


# records queued at most (about 200 bytes each) before new ones are dropped, and counted: a flush thread that
# cannot keep up never grows the replica's memory without bound
PENDING_LIMIT = 100_000
FLUSH_PERIOD_S = 1.0


class Recorder:
    """Metric records queued by the request path and recorded in Ray by a thread of its own, every second.

    Why: Ray's Metric.record releases the GIL on every call, so a call made on the event loop waits to take it
    back whenever another thread runs Python (up to the 5 ms switch interval; measured in an actor: 6 us a call
    alone, 4.8 ms beside a busy thread). With a replica's runner and tokenizer threads busy, the 8-10 records of
    a single-text request cost it 0.94 ms of CPU (3.13 -> 2.19 ms a text without them) and 30% of its rate.
    Queued, a record is one deque append; the flush sums counters per tag set (one call each) and observes each
    histogram value in turn, off the request path. What Prometheus sees is the same, at most a second later.
    """

    def __init__(self, period_s: float = FLUSH_PERIOD_S) -> None:
        self.pending: collections.deque = collections.deque()
        self.dropped = 0  # records refused past PENDING_LIMIT, recorded by the next flush
        self.dropped_family: Counter | None = None  # set by ServiceMetrics
        self.period_s = period_s
        self.lock = threading.Lock()  # one flush at a time (the thread's, or a caller's)
        threading.Thread(target=self._loop, daemon=True, name="metrics-flush").start()

    def add(self, family, counter: bool, value: float, tags: dict | None) -> None:
        if len(self.pending) >= PENDING_LIMIT:
            self.dropped += 1
            return
        self.pending.append((family, counter, value, tags))

    def flush(self) -> None:
        """Record everything queued so far in Ray: counters summed per family and tag set, histograms value by value."""
        with self.lock:
            sums: dict[tuple, list] = {}
            for _ in range(len(self.pending)):
                family, counter, value, tags = self.pending.popleft()
                if counter:
                    key = (id(family), tuple(sorted(tags.items())) if tags else ())
                    entry = sums.setdefault(key, [family, tags, 0.0])
                    entry[2] += value
                else:
                    self._record(family.observe, value, tags)
            for family, tags, total in sums.values():
                self._record(family.inc, total, dict(tags) if tags else None)
            if self.dropped and self.dropped_family is not None:
                dropped, self.dropped = self.dropped, 0
                self._record(self.dropped_family.inc, dropped, None)

    @staticmethod
    def _record(call, value: float, tags: dict | None) -> None:
        try:
            call(value, tags=tags)
        except Exception:  # a bad tag set is a bug to see in the log, never a reason to stop recording the rest
            logger.exception("a metric record failed")

    def _loop(self) -> None:
        while True:
            time.sleep(self.period_s)
            self.flush()


class Deferred:
    """A Ray counter or histogram whose inc/observe queue the record in a Recorder instead of making it."""

    def __init__(self, family: Counter | Histogram, recorder: Recorder) -> None:
        self.family = family
        self.recorder = recorder

    def set_default_tags(self, tags: dict) -> None:
        self.family.set_default_tags(tags)

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.recorder.add(self.family, True, value, tags)

    def observe(self, value: float, tags: dict | None = None) -> None:
        self.recorder.add(self.family, False, value, tags)


class ServiceMetrics:
    """The families, created in the process that records them (metric objects do not pickle). Counters and
    histograms are Deferred: recorded in Ray by the process's Recorder thread, not by the caller."""

    def __init__(self) -> None:
        self.recorder = Recorder()
        self.recorder.dropped_family = Counter(
            PREFIX + "metric_records_dropped_total",
            f"Metric records dropped because more than {PENDING_LIMIT} waited to be recorded (the flush thread fell behind).",
        )
        self.requests = self._deferred(Counter(
            PREFIX + "requests_total", "HTTP requests by route and status class (2xx, 4xx, 5xx).",
            tag_keys=("route", "status_class", "model", "task", "protocol"),
        ))
        self.failures = self._deferred(Counter(
            PREFIX + "request_failures_total",
            f"Failed requests by reason ({', '.join(FAILURE_REASONS)}).",
            tag_keys=("route", "reason", "model", "task", "protocol"),
        ))
        self.duration = self._deferred(Histogram(
            PREFIX + "request_duration_seconds",
            "Request time by stage: tokenization, queue (waiting for a batch), inference, total.",
            boundaries=LATENCY_BUCKETS, tag_keys=("route", "stage", "model", "task", "protocol"),
        ))
        for family in (self.requests, self.failures, self.duration):
            family.set_default_tags({"protocol": "http"})  # (Serve's set_default_tags returns None)
        self.in_flight = Gauge(PREFIX + "in_flight_requests", "Requests being handled by this ingress replica.")
        self.batch_queue = Gauge(PREFIX + "batch_queue_requests",
                                 "Requests waiting in this replica's batch queue for a runner slot.", tag_keys=MODEL)
        self.response_bytes = self._deferred(Counter(
            PREFIX + "response_bytes_total",
            "Response body bytes by output kind (embedding, token_embeddings, tokens, attention, other).",
            tag_keys=("route", "kind", "model", "protocol"),
        ))
        self.response_bytes.set_default_tags({"protocol": "http"})
        self.batch_requests = self._deferred(Histogram(
            PREFIX + "batch_size_requests", "Requests per batch.", boundaries=REQUEST_BUCKETS, tag_keys=MODEL
        ))
        self.batch_tokens = self._deferred(Histogram(
            PREFIX + "batch_size_tokens", "Real (unpadded) tokens per batch.", boundaries=TOKEN_BUCKETS, tag_keys=MODEL
        ))
        self.padding_ratio = self._deferred(Histogram(
            PREFIX + "batch_padding_ratio", "Share of the tokens computed in a batch that were padding.",
            boundaries=RATIO_BUCKETS, tag_keys=MODEL,
        ))
        self.tokens = self._deferred(Counter(PREFIX + "tokens_total", "Real tokens processed by the encoder.",
                                             tag_keys=MODEL))
        self.padded_tokens = self._deferred(Counter(
            PREFIX + "padded_tokens_total", "Tokens computed by the encoder, padding included.", tag_keys=MODEL
        ))
        self.inference_runs = self._deferred(Counter(
            PREFIX + "inference_runs_total", "onnxruntime session runs, by graph.", tag_keys=("graph", "model")
        ))
        self.model_info = Gauge(
            PREFIX + "model_info",
            "1 for each encoder replica: the model, bundle, execution provider, runtime of the encodings graph "
            "(onnxruntime, openvino), precision and Ray GPU ids it serves with.",
            tag_keys=("model", "task", "bundle_sha256", "provider", "runtime", "precision", "gpu_ids"),
        )
        # the model repository (service/engine/repository.py)
        self.model_loads = self._deferred(Counter(
            PREFIX + "model_loads_total", "Loads of a model repository's models on demand, by outcome (loaded, failed).",
            tag_keys=("model", "outcome")))
        self.model_load_seconds = self._deferred(Histogram(
            PREFIX + "model_load_seconds", "Seconds each on-demand model load took.", boundaries=LATENCY_BUCKETS,
            tag_keys=MODEL))
        self.model_evictions = self._deferred(Counter(
            PREFIX + "model_evictions_total",
            "On-demand models unloaded, by reason: memory (room for another), idle (idle_unload_s), removed (its "
            "directory), unloaded (asked through the repository API), moved (given up for a replica refused it at its "
            "max_loaded).", tag_keys=("model", "reason")))
        self.model_loaded_bytes = Gauge(
            PREFIX + "model_loaded_bytes", "Each loaded on-demand model's measured memory on this replica.",
            tag_keys=MODEL)
        self.model_budget_bytes = Gauge(
            PREFIX + "model_budget_bytes", "This replica's memory budget for on-demand models (model_memory_bytes).")
        # per API key (service/front/keys.py): its name is the label, from the keys file only (bounded)
        self.key_requests = self._deferred(Counter(
            PREFIX + "key_requests_total", "Requests of each API key, by model and status class.",
            tag_keys=("key", "model", "status_class")))
        self.key_tokens = self._deferred(Counter(
            PREFIX + "key_tokens_total", "Tokens each API key's requests sent to inference, by model.",
            tag_keys=("key", "model")))
        self.keys_file_errors = self._deferred(Counter(
            PREFIX + "keys_file_errors_total", "Versions of the keys file that did not parse (the last good keys "
            "stay in use), per replica."))
        self.key_rate_limited = self._deferred(Counter(
            PREFIX + "key_rate_limited_total", "Requests of each API key refused at one of its limits (requests, "
            "tokens, concurrent), by model (empty when refused before it was known).", tag_keys=("key", "limit", "model")))


    def _deferred(self, family: Counter | Histogram) -> Deferred:
        return Deferred(family, self.recorder)


@cache
def service_metrics() -> ServiceMetrics:
    """One set of families per process."""
    return ServiceMetrics()


def status_class(status: int) -> str:
    return f"{status // 100}xx"


def refresh_periodically(update: Callable[[], None], period_s: float = 1.0) -> None:
    """Call `update` now and every period_s in a daemon thread.

    Ray exports a gauge only while it is being set: one set once (model info) or rarely (in
    flight, when idle) would vanish from the scrape. Re-setting it keeps it visible.
    """

    def loop() -> None:
        while True:
            update()
            time.sleep(period_s)

    threading.Thread(target=loop, daemon=True, name="gauge-refresh").start()


def node_metrics_url() -> str | None:
    """Ray's Prometheus endpoint on the node this process runs on: where every replica on the node
    exports its families (what `make run` prints, and what a PodMonitor scrapes on Kubernetes)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None
