"""What Ray Serve 2.60's gRPC ingress does not hand a replica, added in the replica's own process.

- The client's deadline: Serve gives the method a copy of the call's context (RayServegRPCContext)
  without the real one's `time_remaining()`; the copy now keeps it (`encoder_time_remaining`),
  read when Serve makes it, so a call's deadline is the client's (service/grpc/servicer.py).
- A retry hint on Serve's own refusal: when a replica's slots and queue are full, Serve answers
  RESOURCE_EXHAUSTED itself, before any method runs; the answer now carries `retry-after` in its
  trailing metadata (the settings' retry_after_s, as HTTP's 503 carries Retry-After), and the
  refusal is counted where the overload alert looks.

- A message size cap and the token before the message: Serve builds every gRPC server (its proxy
  actor's, and each replica's own under direct ingress / HAProxy) with a 2 GiB receive limit and no
  interceptor, so a client without credentials could make a server read 2 GiB before the token was
  looked at. The servers are now built with the body limit as their receive limit (gRPC refuses a
  larger message from its length prefix, RESOURCE_EXHAUSTED, before reading it) and with an
  interceptor that refuses a ModelInfer without the bearer token from its metadata alone, before
  its message is read (service/grpc/servicer.py, `refusal_before_reading`). The send limit stays
  Serve's: responses are bounded by max_response_bytes before inference.

Each hook checks that what it wraps is there, and says so in the replica's log when it is not (a
Ray that changed them): the calls still work, without that addition.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import grpc

from service.front.errors import RETRY_AFTER_KEY

logger = logging.getLogger("ray.serve")
# The receive limit of a process that has no settings (Serve's proxy actor): python -m service sets
# it from max_body_bytes for every Ray process, the KubeRay manifests for the pods; unset, the
# settings' default body limit applies.
MAX_MESSAGE_ENV = "ENCODER_GRPC_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # ServiceSettings.max_body_bytes' default
RECEIVE_LIMIT = "grpc.max_receive_message_length"


def install(retry_after_s: int, max_message_bytes: int | None = None) -> None:
    """Every hook, once per process (a replica calls this when it starts, before Serve starts its
    gRPC server)."""
    _keep_time_remaining()
    _hint_retry_on_refusal(retry_after_s)
    limit_grpc_servers(max_message_bytes)
    TokenBeforeMessage.in_replica = True


def env_max_message_bytes() -> int:
    """The receive limit this process's environment names, else the default body limit."""
    value = os.environ.get(MAX_MESSAGE_ENV, "")
    return int(value) if value.strip().isdigit() and int(value) > 0 else DEFAULT_MAX_MESSAGE_BYTES


def limit_grpc_servers(max_message_bytes: int | None = None) -> None:
    """Every gRPC server Serve builds from now on in this process receives at most
    `max_message_bytes` (the environment's limit when None) and refuses an unauthenticated
    ModelInfer from its metadata. Serve's server class is replaced in its module by a subclass that
    changes only the arguments it hands gRPC's server (its own __init__ runs unchanged)."""
    from ray.serve._private import grpc_util

    limit = max_message_bytes or env_max_message_bytes()
    current = getattr(grpc_util, "gRPCGenericServer", None)
    if current is None or not isinstance(current, type):
        logger.warning("Ray Serve has no gRPCGenericServer: its gRPC servers keep Ray's 2 GiB message limit")
        return
    if getattr(current, "encoder_limit", None) is not None:  # done already in this process
        if max_message_bytes is not None:
            current.encoder_limit = limit  # a replica's settings win over the environment's default
        return

    from grpc.aio._server import Server

    class _Limited(Server):  # between Serve's class and gRPC's in the MRO
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            options = [(k, v) for k, v in kwargs.get("options") or () if k != RECEIVE_LIMIT]
            kwargs["options"] = [*options, (RECEIVE_LIMIT, type(self).encoder_limit)]
            kwargs["interceptors"] = (*(kwargs.get("interceptors") or ()), TokenBeforeMessage())
            super().__init__(*args, **kwargs)

    limited = type(current.__name__, (current, _Limited), {"encoder_limit": limit, "__module__": current.__module__})
    grpc_util.gRPCGenericServer = limited


class TokenBeforeMessage(grpc.aio.ServerInterceptor):
    """A ModelInfer without the bearer token is refused from its metadata: the handler it gets reads
    no message (gRPC receives a unary call's message before the handler runs; a client-streaming
    handler that never iterates leaves it unread, and gRPC resets the stream). Only in a replica,
    which knows the token: Serve's proxy actor has no settings, and its calls are checked by the
    replica they reach."""

    in_replica = False

    async def intercept_service(self, continuation, handler_call_details):
        if not self.in_replica:
            return await continuation(handler_call_details)
        from service.grpc.servicer import needs_refusal, refusal_before_reading

        if needs_refusal(handler_call_details.method, handler_call_details.invocation_metadata):
            return grpc.stream_unary_rpc_method_handler(refusal_before_reading(handler_call_details.method),
                                                        response_serializer=_serialized)
        return await continuation(handler_call_details)


def _serialized(reply: Any) -> bytes:
    return reply.SerializeToString()


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
            from service.front.finish import count_serve_refusal

            count_serve_refusal(protocol="grpc")
        original(context, status)

    set_code_and_details.hints_retry = True  # type: ignore[attr-defined]
    set_code_and_details.wrapped = original  # type: ignore[attr-defined]
    replica.set_grpc_code_and_details = set_code_and_details
