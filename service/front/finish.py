"""Where a finished call is recorded, whatever protocol it came in on: its metrics (requests, time,
failures by reason, response bytes by kind), its access log line and its span; and the count of the
calls Serve refused before any replica saw them.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from service.front.call import Call
from service.front.errors import RATE_LIMIT_TYPES, REASON_BY_STATUS
from service.observability.metrics import service_metrics, status_class

access_logger = logging.getLogger("service.access")
# route label of Serve's own refusals (queue full): no app route matched them yet
ROUTE_REFUSED_BY_SERVE = "serve_queue"


def finish(call: Call, status: int, sent_bytes: int, span: Any = None, span_name: str = "",
           span_attributes: dict[str, Any] | None = None, grpc_status: str | None = None) -> None:
    """Record a call that ended with `status` (a gRPC call's as HTTP would answer it, beside its
    `grpc_status`) after `sent_bytes` of response."""
    call.release()
    metrics = service_metrics()
    now = time.perf_counter()
    route, model, task, protocol = call.route, call.model, call.task, call.protocol
    tags = {"route": route, "model": model, "task": task, "protocol": protocol}
    metrics.requests.inc(tags={**tags, "status_class": status_class(status)})
    metrics.duration.observe(now - call.arrived, tags={**tags, "stage": "total"})
    if status >= 400:
        reason = call.failure_reason or REASON_BY_STATUS.get(status, "backend")
        metrics.failures.inc(tags={**tags, "reason": reason})
    kinds = call.response_kinds
    for kind, n in kinds.items():
        if n > 0:
            metrics.response_bytes.inc(n, tags={"route": route, "kind": kind, "model": model, "protocol": protocol})
    other = sent_bytes - sum(kinds.values())
    if other > 0:
        metrics.response_bytes.inc(other, tags={"route": route, "kind": "other", "model": model, "protocol": protocol})
    if call.key is not None:  # per tenant: its name (from the keys file: few label values), never its secret
        key = call.key.name
        metrics.key_requests.inc(tags={"key": key, "model": model, "status_class": status_class(status)})
        if call.tokens:
            metrics.key_tokens.inc(call.tokens, tags={"key": key, "model": model})
        if call.failure_reason in RATE_LIMIT_TYPES:
            metrics.key_rate_limited.inc(tags={"key": key, "limit": call.failure_reason, "model": model})
    log_access(call, status, now, grpc_status)
    if span is not None:
        span.finish(span_name, status, {**(span_attributes or {}), "encoder.model": model or None,
                                        "encoder.texts": call.texts, "encoder.tokens": call.tokens})


def count_serve_refusal(protocol: str = "http") -> None:
    """Serve refused a call for want of room: a request, and the failure the overload alert counts
    (its ratio divides by ray_encoder_requests_total, which these never reach otherwise)."""
    metrics = service_metrics()
    tags = {"route": ROUTE_REFUSED_BY_SERVE, "model": "", "task": "", "protocol": protocol}
    metrics.requests.inc(tags={**tags, "status_class": "5xx"})
    metrics.failures.inc(tags={**tags, "reason": "overloaded"})


def enable_access_log(enabled: bool) -> None:
    """One JSON line per call on stderr (the replica's log), or none. Its own handler: Ray's
    loggers and the root logger's level leave it alone."""
    access_logger.propagate = False
    access_logger.setLevel(logging.INFO if enabled else logging.CRITICAL + 1)
    if enabled and not access_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_logger.addHandler(handler)


def log_access(call: Call, status: int, now: float, grpc_status: str | None = None) -> None:
    """The access log line of one call: time (UTC), id, method (`gRPC` for a gRPC call), route template
    (a gRPC call's full method name), model, status (a gRPC call's as HTTP would answer it, beside its
    `grpc_status`), texts and tokens that reached inference, and milliseconds."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    access_logger.info(json.dumps({
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
        "id": call.id,
        "method": call.method,
        "route": call.route,
        "model": call.model or None,
        "key": call.key.name if call.key is not None else None,  # its name only, never its secret or hash
        "status": status,
        "texts": call.texts,
        "tokens": call.tokens,
        "ms": round((now - call.arrived) * 1000, 1),
        **({"grpc_status": grpc_status} if grpc_status is not None else {}),
    }, separators=(",", ":")))
