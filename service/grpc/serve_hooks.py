"""What Ray Serve 2.60's gRPC ingress does not hand a replica, added in the replica's own process.

- The client's deadline: Serve gives the method a copy of the call's context (RayServegRPCContext)
  without the real one's `time_remaining()`; the copy now keeps it (`encoder_time_remaining`),
  read when Serve makes it, so a call's deadline is the client's (service/grpc/inference.py).
- A retry hint on Serve's own refusal: when a replica's slots and queue are full, Serve answers
  RESOURCE_EXHAUSTED itself, before any method runs; the answer now carries `retry-after` in its
  trailing metadata (the settings' retry_after_s, as HTTP's 503 carries Retry-After), and the
  refusal is counted where the overload alert looks.

Each hook checks that what it wraps is there, and says so in the replica's log when it is not (a
Ray that changed them): the calls still work, without that addition.
"""

from __future__ import annotations

import logging

import grpc

logger = logging.getLogger("ray.serve")
RETRY_AFTER_KEY = "retry-after"


def install(retry_after_s: int) -> None:
    """Both hooks, once per process (a replica calls this when it starts)."""
    _keep_time_remaining()
    _hint_retry_on_refusal(retry_after_s)


def _keep_time_remaining() -> None:
    from ray.serve import grpc_util

    context_class = grpc_util.RayServegRPCContext
    original = context_class.__init__
    if getattr(original, "keeps_time_remaining", False):
        return

    def __init__(self, grpc_context) -> None:  # noqa: N807
        original(self, grpc_context)
        try:
            self.encoder_time_remaining = grpc_context.time_remaining()
        except Exception:  # noqa: BLE001 - a context without a deadline API: the service's limit applies
            self.encoder_time_remaining = None

    __init__.keeps_time_remaining = True  # type: ignore[attr-defined]
    context_class.__init__ = __init__


def _hint_retry_on_refusal(retry_after_s: int) -> None:
    from ray.serve._private import replica

    original = getattr(replica, "set_grpc_code_and_details", None)
    if original is None:
        logger.warning("Ray Serve has no set_grpc_code_and_details in its replica: gRPC refusals carry no retry-after")
        return
    if getattr(original, "hints_retry", False):
        original = original.wrapped

    def set_code_and_details(context, status) -> None:
        if status.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not context.code():
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(retry_after_s)),))
            from service.http.ingress import count_refusal

            count_refusal(protocol="grpc")
        original(context, status)

    set_code_and_details.hints_retry = True  # type: ignore[attr-defined]
    set_code_and_details.wrapped = original  # type: ignore[attr-defined]
    replica.set_grpc_code_and_details = set_code_and_details
