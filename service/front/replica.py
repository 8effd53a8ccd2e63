"""What the front knows of the Serve replica it runs in: the deployment config as Serve last applied
it (replicas, autoscaling and request limits change on a running replica)."""

from __future__ import annotations


def serve_config_now():
    """This replica's deployment config as Serve last applied it, or None outside a replica (unit tests)."""
    try:
        from ray import serve

        return serve.get_replica_context()._deployment_config
    except Exception:  # noqa: BLE001 - not in a replica, or a Ray without it
        return None
