"""The callback Ray Serve imports in its proxy actor and in each replica before their ingress servers
start (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, set by service/config.py INGRESS_ENV and the KubeRay
manifests): the one moment our code runs in Serve's proxy. It prepares both transports there:

- the gRPC ingress moves off the wildcard address (service/hosting/listeners.py), and every gRPC
  server Serve builds receives at most the body limit and checks the token first
  (service/grpc/serve_hooks.py; a replica's own settings set it again there);
- the HTTP servers get their middlewares (service/http/ingress.py): Serve's own plain-text answers as
  our JSON errors, and headers Serve could not decode taken out before its code reads them; in the
  proxy, the model a request names becomes Serve's multiplexed model id, so that Serve routes it to a
  replica holding that model (service/hosting/model_routing.py).
"""

from __future__ import annotations

from starlette.middleware import Middleware


def before_ingress_starts() -> list[Middleware]:
    """Prepare this process's ingress servers; the HTTP middlewares Serve wraps its ASGI apps in."""
    from ray.serve.context import _get_internal_replica_context

    from service.grpc.serve_hooks import limit_grpc_servers
    from service.hosting.listeners import bind_grpc_ingress_to_node_address
    from service.hosting.model_routing import ModelIdFromRequest
    from service.http.ingress import RayAnswersAsJson, ServeHeaderGuard

    bind_grpc_ingress_to_node_address()
    limit_grpc_servers()
    middlewares = [Middleware(RayAnswersAsJson), Middleware(ServeHeaderGuard)]  # the last is the outermost
    if _get_internal_replica_context() is None:  # Serve's proxy, which routes: the model a request names
        middlewares.insert(1, Middleware(ModelIdFromRequest))
    return middlewares
