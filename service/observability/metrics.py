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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import cache

from ray.serve.metrics import Counter, Gauge, Histogram

PREFIX = "encoder_"

# Sub-millisecond tokenization to tens of seconds under overload.
LATENCY_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
REQUEST_BUCKETS = [float(2**i) for i in range(0, 11)]  # 1 .. 1024 requests
TOKEN_BUCKETS = [float(2**i) for i in range(4, 17)]  # 16 .. 65536 tokens
RATIO_BUCKETS = [0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]

FAILURE_REASONS = ("bad_request", "validation", "too_large", "not_found", "unauthorized", "overloaded", "not_ready", "timeout",
                   "cancelled", "backend")


# Every family of a request or a batch carries the served model's name (empty on routes that run
# no model: /info, /health, the explorer page, unknown paths).
MODEL = ("model",)


class ServiceMetrics:
    """The families, created in the process that records them (metric objects do not pickle)."""

    def __init__(self) -> None:
        self.requests = Counter(
            PREFIX + "requests_total", "HTTP requests by route and status class (2xx, 4xx, 5xx).",
            tag_keys=("route", "status_class", "model", "task", "protocol"),
        )
        self.failures = Counter(
            PREFIX + "request_failures_total",
            f"Failed requests by reason ({', '.join(FAILURE_REASONS)}).",
            tag_keys=("route", "reason", "model", "task", "protocol"),
        )
        self.duration = Histogram(
            PREFIX + "request_duration_seconds",
            "Request time by stage: tokenization, queue (waiting for a batch), inference, total.",
            boundaries=LATENCY_BUCKETS, tag_keys=("route", "stage", "model", "task", "protocol"),
        )
        for family in (self.requests, self.failures, self.duration):
            family.set_default_tags({"protocol": "http"})  # (Serve's set_default_tags returns None)
        self.in_flight = Gauge(PREFIX + "in_flight_requests", "Requests being handled by this ingress replica.")
        self.batch_queue = Gauge(PREFIX + "batch_queue_requests",
                                 "Requests waiting in this replica's batch queue for a runner slot.", tag_keys=MODEL)
        self.response_bytes = Counter(
            PREFIX + "response_bytes_total",
            "Response body bytes by output kind (embedding, token_embeddings, tokens, attention, other).",
            tag_keys=("route", "kind", "model", "protocol"),
        )
        self.response_bytes.set_default_tags({"protocol": "http"})
        self.batch_requests = Histogram(
            PREFIX + "batch_size_requests", "Requests per batch.", boundaries=REQUEST_BUCKETS, tag_keys=MODEL
        )
        self.batch_tokens = Histogram(
            PREFIX + "batch_size_tokens", "Real (unpadded) tokens per batch.", boundaries=TOKEN_BUCKETS, tag_keys=MODEL
        )
        self.padding_ratio = Histogram(
            PREFIX + "batch_padding_ratio", "Share of the tokens computed in a batch that were padding.",
            boundaries=RATIO_BUCKETS, tag_keys=MODEL,
        )
        self.tokens = Counter(PREFIX + "tokens_total", "Real tokens processed by the encoder.", tag_keys=MODEL)
        self.padded_tokens = Counter(
            PREFIX + "padded_tokens_total", "Tokens computed by the encoder, padding included.", tag_keys=MODEL
        )
        self.inference_runs = Counter(
            PREFIX + "inference_runs_total", "onnxruntime session runs, by graph.", tag_keys=("graph", "model")
        )
        self.model_info = Gauge(
            PREFIX + "model_info",
            "1 for each encoder replica: the model, bundle, execution provider, runtime of the encodings graph "
            "(onnxruntime, openvino), precision and Ray GPU ids it serves with.",
            tag_keys=("model", "task", "bundle_sha256", "provider", "runtime", "precision", "gpu_ids"),
        )


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
