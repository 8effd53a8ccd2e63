"""python -m service: start Ray on loopback, deploy the app, serve until Ctrl-C or SIGTERM.

Settings come from the Serve config file (--config, default deploy/serve_config.yaml) and are
overridden by flags. Exit code 1 with a one-line reason when the service cannot start.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from bundle.manifest import BundleError, load_bundle
from service.config import INGRESS_ENV, ServiceSettings

APP_NAME = "encoder"
DEFAULT_CONFIG = Path("deploy/serve_config.yaml")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None,
                   help="Serve config file whose first application's args are the settings")
    p.add_argument("--bundle", type=Path, help="model bundle directory")
    p.add_argument("--host", help="HTTP host (default from the config, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default from the config, else 8000)")
    p.add_argument("--replicas", type=int, dest="encoder_replicas", help="encoder replicas")
    p.add_argument("--ingress-replicas", type=int)
    p.add_argument("--encoder-num-cpus", type=float)
    p.add_argument("--threads", type=int, dest="intra_op_threads", help="onnxruntime intra-op threads per replica")
    p.add_argument("--provider", choices=["auto", "cuda", "cpu"])
    p.add_argument("--precision", choices=["fp32", "int8", "fp16"],
                   help="encodings graph for requests without attention weights (default fp32)")
    p.add_argument("--max-batch-tokens", type=int)
    p.add_argument("--batch-wait-timeout-s", type=float)
    p.add_argument("--sub-batch-tokens", type=int)
    p.add_argument("--max-queued-requests", type=int, dest="encoder_max_queued_requests")
    p.add_argument("--max-ongoing-requests", type=int, dest="encoder_max_ongoing_requests")
    p.add_argument("--request-timeout-s", type=float)
    p.add_argument("--num-cpus", type=int, help="CPUs Ray may use (default: all)")
    p.add_argument("--ingress", choices=sorted(INGRESS_ENV), default="proxy",
                   help="HTTP ingress of a local cluster: Ray Serve's proxy actor (default) or HAProxy "
                   "(measured faster for small requests; see README, Performance)")
    p.add_argument("--metrics-port", type=int, default=8080,
                   help="Ray's Prometheus endpoint on 127.0.0.1 (every replica's metrics), for a local cluster")
    p.add_argument("--address", default="local",
                   help="Ray cluster: 'local' starts a private one on loopback (default); 'auto' joins a running one")
    return p.parse_args(argv)


def load_settings(args: argparse.Namespace) -> tuple[ServiceSettings, dict[str, Any]]:
    """Settings and HTTP options: the config file first, then command-line overrides."""
    settings: dict[str, Any] = {}
    http: dict[str, Any] = {"host": "127.0.0.1", "port": 8000}
    if args.config is not None:
        config = yaml.safe_load(args.config.read_text()) or {}
        http.update(config.get("http_options") or {})
        apps = config.get("applications") or [{}]
        settings.update(apps[0].get("args") or {})
    batching = dict(settings.get("batching") or {})
    for key in ("max_batch_tokens", "batch_wait_timeout_s", "sub_batch_tokens"):
        if getattr(args, key) is not None:
            batching[key] = getattr(args, key)
    settings["batching"] = batching
    for key in ("bundle", "encoder_replicas", "ingress_replicas", "encoder_num_cpus", "intra_op_threads",
                "provider", "precision", "encoder_max_queued_requests", "encoder_max_ongoing_requests", "request_timeout_s"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.host:
        http["host"] = args.host
    if args.port:
        http["port"] = args.port
    if args.encoder_replicas is not None:
        settings["encoder_autoscaling"] = None  # a fixed replica count asked for on the command line
    parsed = ServiceSettings.model_validate(settings).resolved()
    http.setdefault("request_timeout_s", parsed.request_timeout_s + 5)
    return parsed, http


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ingress != "proxy" and args.address != "local":
        print("service refused to start: --ingress applies to a local cluster; on a running one set "
              "RAY_SERVE_ENABLE_HA_PROXY=1 in the environment of its Ray processes", file=sys.stderr)
        return 2
    try:
        settings, http = load_settings(args)
        from service.runtime import preflight

        preflight(load_bundle(settings.bundle), settings.precision)
    except (ValidationError, BundleError, OSError, RuntimeError, yaml.YAMLError) as exc:
        reason = str(exc).splitlines()[0] if not isinstance(exc, ValidationError) else str(exc).replace("\n", " ")
        print(f"service refused to start: {reason}", file=sys.stderr)
        return 1

    if args.address == "local":
        # Ray picks the machine's network address for a local cluster and listens there (a
        # requested 127.0.0.1 is rewritten to it). This switch, read when ray is imported, makes
        # it use 127.0.0.1 instead, so GCS, raylet, agents, metrics and the proxy stay on loopback.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        # Ray Serve reads its ingress switch at import, in every Ray process; they inherit it from here.
        os.environ.update(INGRESS_ENV[args.ingress])
    import ray
    from ray import serve

    from service.app import build_app

    started = time.perf_counter()
    print(f"starting Ray and the service (bundle {settings.bundle}) ...", flush=True)
    # No dashboard and no Ray client server; the rest of Ray is on loopback (see above).
    local = args.address == "local"
    # Ctrl-C in a terminal signals the whole foreground process group, Ray's raylet and GCS
    # included; if they die first, shutting Serve down hangs. Ray's processes inherit an ignored
    # SIGINT from here; this process takes SIGINT/SIGTERM back below and stops them in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ray.init(
        address=args.address,
        num_cpus=args.num_cpus if local else None,
        include_dashboard=False if local else None,
        _metrics_export_port=args.metrics_port if local else None,
        logging_level="WARNING",
        configure_logging=True,
    )
    # After ray.init: Ray installs its own SIGTERM handler there, which would abort the driver
    # without shutting Serve down.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    code = 0
    try:
        serve.start(http_options=http, logging_config={"enable_access_log": False})
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/", logging_config={"enable_access_log": False})
        info = serve.get_deployment_handle("Encoder", APP_NAME).info.remote().result(timeout_s=60)
        scaling = settings.encoder_autoscaling
        replicas = (
            f"encoder replicas autoscaled {scaling.min_replicas}-{scaling.max_replicas}"
            if scaling else f"{settings.encoder_replicas} encoder replica(s)"
        )
        print(
            f"serving {load_bundle(settings.bundle).manifest.model.name} at http://{http['host']}:{http['port']} "
            f"on {info['provider']} ({info['precision']} encodings graph, {info['intra_op_threads']} intra-op "
            f"threads, {replicas}) "
            f"in {time.perf_counter() - started:.1f}s; Ctrl-C or SIGTERM stops it",
            flush=True,
        )
        if local:
            print(f"metrics (Prometheus text, every replica): http://127.0.0.1:{args.metrics_port}/metrics", flush=True)
        while not stop.wait(1.0):
            pass
        print("stopping: draining in-flight requests ...", flush=True)
        # Deleting the application first lets its replicas finish what they accepted (up to
        # graceful_shutdown_timeout_s) while the HTTP proxy still delivers the responses;
        # serve.shutdown() alone would stop the proxy with them and cut those responses off.
        serve.delete(APP_NAME)
    except Exception as exc:  # deployment failed: say why in one line
        print(f"service failed to start: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        code = 1
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print("stopped", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
