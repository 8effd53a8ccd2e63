"""Requests naming a model go to a replica that holds it (issue 57; docs/models.md, "Routing").

Behind HAProxy (the default ingress) service/bin/haproxy hashes the model's name onto a ring of the replicas
with bounded load. Behind Ray Serve's proxy, its router already sends a request that carries a multiplexed
model id to the replicas that said they hold that model, else to those holding the fewest (what
`@serve.multiplexed` is built on): two halves make it work for clients that send no header.

- In Serve's proxy, `ModelIdFromRequest` (an ASGI middleware, service/ingress_callback.py) reads the model a
  request names, from v2's path or the JSON body's top-level "model", and sets Serve's multiplexed-model-id
  header from it. Only a body whose Content-Length is at most ROUTING_PEEK_BYTES is read for it (HAProxy's
  tune.bufsize, for the same reason: the router must not hold a large upload); a larger one is routed by load.
- In each replica, `tell_serve_models_held` is the model repository's `on_held`: the controller is told the
  models held or loading there each time they change, as Serve's own multiplexer tells it. Ray has no public
  call for this outside `@serve.multiplexed`, whose cache counts models rather than bytes; this is the call
  that decorator makes (ray.serve.multiplex, Ray 2.60), pinned with Ray.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from service.config import valid_model_name

ROUTING_PEEK_BYTES = 16384
MODEL_ID_HEADER = b"serve_multiplexed_model_id"  # ray.serve._private.constants.SERVE_MULTIPLEXED_MODEL_ID
_V2_MODEL_PATH = re.compile(r"/v2/(?:repository/)?models/([^/]+)(?:/|$)")


def tell_serve_models_held(replica_id: Any) -> Callable[[list[str]], None]:
    """The model repository's `on_held` in a Serve replica: tells the controller, which tells every router."""
    from ray.serve._private.common import RequestRoutingInfo
    from ray.serve.context import _get_global_client

    client = _get_global_client()

    def tell(names: list[str]) -> None:
        client.record_request_routing_info(RequestRoutingInfo(replica_id=replica_id, multiplexed_model_ids=names))

    return tell


def model_in_path(path: str) -> str | None:
    match = _V2_MODEL_PATH.search(path)
    return match.group(1) if match else None


def model_in_body(body: bytes) -> str | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON (the app says so), or nested past Python's stack
        return None
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) else None


class ModelIdFromRequest:
    """ASGI middleware in Serve's proxy: the model a request names, as Serve's multiplexed model id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        model = model_in_path(scope.get("path", ""))
        if model is None and scope.get("method") == "POST":
            length = content_length(scope.get("headers") or [])
            if length is not None and 0 < length <= ROUTING_PEEK_BYTES:
                messages, body = await read_body(receive, length)
                receive = replay(messages, receive)
                model = model_in_body(body)
        if model is not None and valid_model_name(model):
            headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower().replace(b"-", b"_") != MODEL_ID_HEADER]
            scope = {**scope, "headers": headers + [(MODEL_ID_HEADER, model.encode())]}
        await self.app(scope, receive, send)


def content_length(headers: list) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def read_body(receive: Any, length: int) -> tuple[list[dict], bytes]:
    """The request's messages up to its whole body (at most `length` bytes, the Content-Length the server
    holds it to), and that body."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if not message.get("more_body", False) or size >= length:
            break
    return messages, b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")


def replay(messages: list[dict], receive: Any) -> Any:
    """A `receive` that gives the messages read already, then the rest of the request's."""
    pending = list(messages)

    async def receive_again() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return receive_again
