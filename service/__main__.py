"""python -m service: start Ray on loopback, deploy the app, serve until Ctrl-C or SIGTERM.

Settings come from the Serve config file (--config, default deploy/serve_config.yaml) and are
overridden by flags. Exit code 1 with a one-line reason when the service cannot start.

The terminal gets only what a user of the service needs: where it listens, where the metrics
and logs are, which model, precision and execution provider, and how to stop it. Ray's own
start-up and shutdown messages, and everything its processes print, go to a log file.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import yaml
from pydantic import ValidationError

from bundle.manifest import BundleError
from service.hosting import processes
from service.config import DEFAULT_INGRESS, INGRESS_ENV, ServiceSettings, serve_app_values
from service.grpc.protocol import SERVICER_FUNCTION
from service.grpc.serve_hooks import MAX_MESSAGE_ENV

APP_NAME = "encoder"
DEFAULT_GRPC_PORT = 9000  # KServe v2 over gRPC (Triton's and KServe's gRPC port is 8001; 9000 is KServe's Serve default)
DEFAULT_CONFIG = Path("deploy/serve_config.yaml")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m service", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None,
                   help="Serve config file whose first application's args are the settings")
    p.add_argument("--bundle", action="append", metavar="[NAME=]DIR",
                   help="model bundle directory, optionally with the name clients use for it; repeat it to serve "
                   "several models (every replica serves all; the first is the default)")
    p.add_argument("--models-dir", type=Path, metavar="DIR",
                   help="a model repository: every subdirectory holding a bundle is served by its name, loaded on "
                   "demand (docs/models.md); without --bundle its --default-model (or first by name) is the default")
    p.add_argument("--default-model", metavar="NAME", help="the repository's model loaded at start and used when a "
                   "request names none (with --models-dir and no --bundle)")
    p.add_argument("--model-memory-bytes", type=int, help="each replica's memory for on-demand models")
    p.add_argument("--keys-file", type=Path, help="API keys file: each key's name, the sha256 of its secret, the "
                   "models it may call (docs/access.md); re-read when it changes")
    p.add_argument("--rate-limit-storage", metavar="URI", help="where keys' limits are counted for the whole "
                   "service: memory:// (default, one Ray actor) or redis://HOST:PORT")
    p.add_argument("--eager-model", metavar="NAME", action="append", dest="eager_models",
                   help="a repository model loaded at start on every replica besides the default (repeat for more)")
    p.add_argument("--idle-unload-s", type=float, help="unload an on-demand model idle this long (0: never)")
    p.add_argument("--host", help="HTTP host (default from the config, else 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default from the config, else 8000)")
    p.add_argument("--grpc-port", type=int, help="KServe v2 gRPC port, on the HTTP host (default from the config, "
                   "else 9000; 0 turns gRPC off)")
    p.add_argument("--replicas", type=int, help="a fixed number of replicas (instead of the config's autoscaling)")
    p.add_argument("--replica-num-cpus", type=float, dest="num_cpus", help="Ray CPUs reserved per replica")
    p.add_argument("--threads", type=int, dest="intra_op_threads", help="onnxruntime intra-op threads per session")
    p.add_argument("--provider", choices=["auto", "cuda", "cpu"])
    p.add_argument("--replica-num-gpus", type=float, dest="num_gpus",
                   help="Ray GPUs per replica, a fraction to share one (default: 0.25 where CUDA is wanted and "
                   "the machine has GPUs, else 0)")
    p.add_argument("--runtime", choices=["auto", "onnxruntime", "openvino"],
                   help="what runs the encodings graph (default auto: OpenVINO bf16 on a CPU with bf16 units where it "
                   "measures faster at start-up, else onnxruntime)")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "int8", "fp16"],
                   help="encodings graph for requests without attention weights (default auto: fp16 on CUDA, "
                   "bf16 on a CPU with bf16 units, else fp32)")
    p.add_argument("--max-batch-tokens", type=int)
    p.add_argument("--batch-wait-timeout-s", type=float)
    p.add_argument("--sub-batch-tokens", type=int)
    p.add_argument("--max-ongoing-requests", type=int, help="requests a replica holds before it answers 503")
    p.add_argument("--max-queued-requests", type=int, help="requests Serve holds in front of a busy replica")
    p.add_argument("--request-timeout-s", type=float)
    p.add_argument("--num-cpus", type=int, dest="ray_num_cpus", help="CPUs Ray may use (default: all)")
    p.add_argument("--num-gpus", type=int, dest="ray_num_gpus",
                   help="GPUs Ray may hand to replicas (default: the GPUs it detects); on a machine without "
                   "GPUs a number declares logical ones, to see placement work (tests/test_gpu_placement.py)")
    p.add_argument("--ingress", choices=sorted(INGRESS_ENV), default=DEFAULT_INGRESS,
                   help=f"HTTP ingress of a local cluster: HAProxy (default, measured fastest) or Ray Serve's "
                   f"proxy actor (see docs/performance.md); default {DEFAULT_INGRESS}")
    p.add_argument("--metrics-port", type=int, default=8080,
                   help="Ray's Prometheus endpoint on 127.0.0.1 (every replica's metrics), for a local cluster")
    p.add_argument("--log-file", type=Path,
                   help="where Ray's own messages go (default: <tmp>/mha-encoder-service-<port>.log)")
    p.add_argument("--address", default="local",
                   help="Ray cluster: 'local' starts a private one on loopback (default); 'auto' joins a running one")
    return p.parse_args(argv)


def load_settings(args: argparse.Namespace) -> tuple[ServiceSettings, dict[str, Any], dict[str, Any]]:
    """Settings, HTTP options and gRPC options: the config file first, then command-line overrides."""
    settings: dict[str, Any] = {}
    http: dict[str, Any] = {"host": "127.0.0.1", "port": 8000}
    grpc: dict[str, Any] = {"port": DEFAULT_GRPC_PORT, "grpc_servicer_functions": [SERVICER_FUNCTION]}
    if args.config is not None:
        config = yaml.safe_load(args.config.read_text()) or {}
        http.update(config.get("http_options") or {})
        grpc.update(config.get("grpc_options") or {})
        apps = config.get("applications") or [{}]
        settings.update(serve_app_values(apps[0]))  # args, and what its deployments entry sets live
    batching = dict(settings.get("batching") or {})
    for key in ("max_batch_tokens", "batch_wait_timeout_s", "sub_batch_tokens"):
        if getattr(args, key) is not None:
            batching[key] = getattr(args, key)
    settings["batching"] = batching
    if args.bundle:  # the command line's list replaces the config's model(s)
        settings.pop("bundle", None)
        settings.pop("model_name", None)
        settings["bundles"] = args.bundle
    if args.models_dir is not None:
        settings["models_dir"] = args.models_dir
        if not args.bundle:  # the repository's default model, not the config's
            for key in ("bundle", "model_name", "bundles"):
                settings.pop(key, None)
    for key in ("keys_file", "rate_limit_storage", "default_model", "eager_models", "model_memory_bytes", "idle_unload_s", "replicas", "num_cpus", "num_gpus", "intra_op_threads", "provider", "runtime", "precision",
                "max_ongoing_requests", "max_queued_requests", "request_timeout_s"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.host:
        http["host"] = args.host
    if args.port:
        http["port"] = args.port
    if args.grpc_port is not None:
        grpc["port"] = args.grpc_port
    if args.replicas is not None:
        settings["autoscaling"] = None  # a fixed replica count asked for on the command line
    parsed = ServiceSettings.model_validate(settings).resolved()
    http.setdefault("request_timeout_s", parsed.request_timeout_s + 5)
    grpc.setdefault("request_timeout_s", http["request_timeout_s"])
    if not grpc["port"]:
        grpc = {}  # gRPC off: Serve starts no gRPC server
    return parsed, http, grpc


def free_the_port(port: int) -> str | None:
    """Before a local start: the port must be free. A HAProxy that Ray Serve started for an earlier
    cluster, which died without stopping it, still holds the port: stop it and say so. Anything
    else holding the port is a reason to refuse."""
    holders = processes.listening_pids(port)
    stale = {p for p in holders if processes.left_behind(p)}
    if holders - stale:
        pid = min(holders - stale)
        raise RuntimeError(f"port {port} is in use by pid {pid} ({' '.join(processes.cmdline(pid))[:80]}); "
                           "stop it or pass --port")
    if stale:
        processes.stop(stale)
        return f"stopped a HAProxy left behind by an earlier run on port {port} (pid {', '.join(map(str, sorted(stale)))})"
    return None


def quiet_std_streams(log_path: Path) -> tuple[TextIO, TextIO]:
    """Send this process's stdout and stderr (Ray's warnings, Serve's INFO lines, and what Ray's
    processes print, which Ray forwards here) to `log_path`; return streams to the terminal's."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    err = os.fdopen(os.dup(2), "w", buffering=1)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return out, err


def summary(settings: ServiceSettings, http: dict, grpc: dict, info: dict, args: argparse.Namespace, log_path: Path,
            seconds: float) -> list[str]:
    """The start-up lines: what a user needs to call, watch and stop the service."""
    from service.front.gate import load_token

    url = f"http://{http['host']}:{http['port']}"
    scaling = settings.autoscaling
    replicas = (f"autoscaled {scaling.min_replicas}-{scaling.max_replicas}" if scaling
                else f"{settings.replicas} replica{'s' if settings.replicas != 1 else ''}")
    provider = f"{info['provider']}, {info['intra_op_threads']} onnxruntime thread(s) per session"
    if info.get("provider_note"):
        provider += f" (CUDA not used: {info['provider_note']})"
    access = (f"bearer keys required on the inference routes (keys file {settings.keys_file})"
              if settings.keys_file is not None else "bearer token required on the inference routes"
              if load_token(settings) is not None
              else f"open: no API token (set {settings.auth_token_env}, auth_token_file or --keys-file to require one)")
    metrics = (info.get("metrics") or {}).get("prometheus_url") or "see Ray's metrics export port"
    ingress = f" ({args.ingress} ingress)" if args.address == "local" else ""  # a running cluster has its own
    models = [
        f"  model      {name}: {state['precision']} encodings graph on {state['runtime']} ({state['precision_note']}), "
        f"{state['graphs']['attentions']} graph for attention; bundle {ref.path}"
        for ref, (name, state) in zip(settings.bundles, info["models"].items(), strict=True)
    ]
    gpu = info.get("gpu") or {}
    gpu_lines = [] if not gpu.get("num_gpus") else [
        f"  gpu        {gpu['num_gpus']:g} GPU per replica from Ray; this replica: id {', '.join(gpu['ray_gpu_ids']) or 'none'}, "
        f"CUDA_VISIBLE_DEVICES={gpu['cuda_visible_devices']!r}, session device {gpu['device_id']}"
        + (f" ({gpu['note']})" if gpu.get("note") else "")
    ]
    serving = ", ".join(info["models"])
    pick = f', \"model\": \"{next(iter(info["models"]))}\"' if len(info["models"]) > 1 else ""  # required then
    return [
        f"serving {serving} at {url}{ingress}, ready in {seconds:.1f}s",
        *models,
        f"  provider   {provider}",
        *gpu_lines,
        f"  replicas   {replicas}, each holds up to {settings.max_ongoing_requests} requests, Serve queues "
        f"{settings.max_queued_requests} more, then 503 + Retry-After",
        f"  metrics    {metrics} (Prometheus text, every replica on this node)",
        f"  access     {access}",
        f"  logs       {log_path} (Ray's own messages)",
        f"  try        curl -s {url}/v1/embeddings -H 'content-type: application/json' -d '{{\"input\": \"hello\"{pick}}}'",
        *([f"  grpc       {http['host']}:{grpc['port']}: KServe v2 (inference.GRPCInferenceService; tritonclient.grpc, "
            "perf_analyzer -i grpc)"] if grpc else []),
        f"  explore    {url}/explorer (attention and similarity in a browser)",
        f"  info       {url}/info   API docs: {url}/docs",
        "stop it with Ctrl-C or SIGTERM (in-flight requests finish first)",
    ]


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def local_cluster_environment(ingress: str) -> None:
    """The environment a local cluster's Ray processes inherit, set before anything imports ray."""
    # Ray picks the machine's network address for a local cluster and listens there (a
    # requested 127.0.0.1 is rewritten to it). This switch, read when ray is imported, makes
    # it use 127.0.0.1 instead, so GCS, raylet, agents, metrics and the proxy stay on loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray Serve reads its ingress switch at import, in every Ray process; they inherit it from here.
    os.environ.update(INGRESS_ENV[ingress])
    # Behind HAProxy a stopping replica stays open 30 s by default so that load balancers
    # outside the cluster can deregister it; here the whole cluster stops together, and the
    # node's own HAProxy is reconfigured in well under a second. In-flight requests still drain.
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
    # Ray Serve's fixed ports (HAProxy's stats and metrics, the fallback proxy, replicas' own
    # ports) made free ones, so two services on one machine never share them.
    for key, value in processes.local_cluster_ports().items():
        os.environ.setdefault(key, value)


def preflight(args: argparse.Namespace) -> tuple[ServiceSettings, dict[str, Any], dict[str, Any]]:
    """The settings, checked before Ray starts: the token, the bundles, CUDA when asked for, and (on a
    local cluster) ports that are free or freed. Raises with the one-line reason to refuse with."""
    settings, http, grpc = load_settings(args)
    from service.front.gate import load_token
    from service.runtimes.cuda import check_cuda
    from service.runtimes.onnxruntime import check_bundles

    load_token(settings)  # an empty or unreadable token file refuses here
    if settings.keys_file is not None:
        from service.front.keys import read_keys

        read_keys(settings.keys_file)  # and a keys file that does not parse, saying where
    if args.address == "local":
        # the gRPC message limit of Serve's proxy actor, which has no settings (each replica
        # takes its own from the settings): the body limit, as HTTP's (service/grpc/serve_hooks.py)
        os.environ[MAX_MESSAGE_ENV] = str(settings.max_body_bytes)
    check_bundles(settings)
    if args.address == "local":
        if settings.provider == "cuda" and not check_cuda().usable:
            raise RuntimeError(f"provider 'cuda' was asked for, but CUDA cannot be used: {check_cuda().reason}")
        for port in [int(http["port"])] + ([int(grpc["port"])] if grpc else []):
            freed = free_the_port(port)
            if freed:
                print(freed, flush=True)
        metrics_holders = processes.listening_pids(args.metrics_port)
        if metrics_holders:  # else Ray's metrics agent dies and ray.init times out, saying nothing of why
            pid = min(metrics_holders)
            raise RuntimeError(f"metrics port {args.metrics_port} is in use by pid {pid} "
                               f"({' '.join(processes.cmdline(pid))[:80]}); stop it or pass --metrics-port")
    return settings, http, grpc


def start_ray(args: argparse.Namespace, log_path: Path, err: TextIO) -> bool:
    """Ray started (or joined) with SIGINT ignored by the processes it starts; False, said in one line,
    when it would not."""
    import ray

    local = args.address == "local"
    # Ctrl-C in a terminal signals the whole foreground process group, Ray's raylet and GCS
    # included; if they die first, shutting Serve down hangs. Ray's processes inherit an ignored
    # SIGINT from here; this process takes SIGINT/SIGTERM back afterwards and stops them in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ray.init(
            address=args.address,
            num_cpus=args.ray_num_cpus if local else None,
            num_gpus=args.ray_num_gpus if local else None,
            include_dashboard=False if local else None,  # no dashboard and no Ray client server
            _metrics_export_port=args.metrics_port if local else None,
            logging_level="WARNING",
            configure_logging=True,
        )
    except Exception as exc:  # noqa: BLE001 - Ray's reasons are many; the user gets one line and the log
        logging.getLogger("service").exception("ray.init failed")
        print(f"service failed to start: Ray did not start: {one_line(exc)} (details: {log_path})", file=err)
        ray.shutdown()
        processes.stop(processes.descendants(os.getpid()))  # whatever of Ray had started
        return False
    return True


def serve_until_signalled(settings: ServiceSettings, http: dict, grpc: dict, args: argparse.Namespace,
                          log_path: Path, out: TextIO, err: TextIO, started: float) -> int:
    """Deploy the application, print the summary, serve until SIGINT or SIGTERM, then drain and stop
    Serve, Ray and whatever they left behind. The exit code."""
    import ray
    from ray import serve

    from service.app import build_app

    # After ray.init: Ray installs its own SIGTERM handler there, which would abort the driver
    # without shutting Serve down. The handler only appends to a list: a handler that takes a
    # lock (threading.Event.set) deadlocks when the signal lands while the main thread holds it.
    signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: signals.append(signum))
    code = 0
    spawned: set[int] = set()
    try:
        serve.start(http_options=http, grpc_options=grpc or None, logging_config={"enable_access_log": False})
        serve.run(build_app(settings), name=APP_NAME, route_prefix="/", logging_config={"enable_access_log": False})
        info = serve.get_deployment_handle("Encoder", APP_NAME).info.remote().result(timeout_s=60)
        for line in summary(settings, http, grpc, info, args, log_path, time.perf_counter() - started):
            print(line, file=out)
        while not signals:
            time.sleep(0.2)
        print("stopping: draining in-flight requests ...", file=out)
        spawned = processes.descendants(os.getpid())
        # Deleting the application first lets its replicas finish what they accepted (up to
        # graceful_shutdown_timeout_s) while the HTTP proxy still delivers the responses;
        # serve.shutdown() alone would stop the proxy with them and cut those responses off.
        serve.delete(APP_NAME)
    except Exception as exc:  # deployment failed: say why in one line
        logging.getLogger("service").exception("the service failed")
        print(f"service failed to start: {one_line(exc)} (details: {log_path})", file=err)
        code = 1
    finally:
        spawned |= processes.descendants(os.getpid())
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        # Ray Serve's HAProxy can outlive ray.shutdown() and keep the port; nothing of ours stays.
        left = processes.stop({p for p in spawned if processes.alive(p)})
        if left:
            print(f"stopped {len(left)} process(es) Ray left behind", file=err)
    return code


def main(argv: list[str] | None = None) -> int:
    """python -m service: refuse in one line, or start quietly, serve, and stop in order."""
    args = parse_args(argv)
    if args.ingress != DEFAULT_INGRESS and args.address != "local":
        print("service refused to start: --ingress applies to a local cluster; on a running one set the ingress "
              "in the environment of its Ray processes (docs/serving.md, 'The ingress')", file=sys.stderr)
        return 2
    if args.address == "local":
        local_cluster_environment(args.ingress)  # before anything below imports ray
    try:
        settings, http, grpc = preflight(args)
    except (ValidationError, BundleError, OSError, RuntimeError, ValueError, yaml.YAMLError) as exc:
        reason = str(exc).splitlines()[0] if not isinstance(exc, ValidationError) else str(exc).replace("\n", " ")
        print(f"service refused to start: {reason}", file=sys.stderr)
        return 1

    log_path = args.log_file or Path(tempfile.gettempdir()) / f"mha-encoder-service-{http['port']}.log"
    listed = ", ".join(str(ref.path) for ref in settings.bundles)
    print(f"starting Ray and the service (bundle{'s' if len(settings.bundles) > 1 else ''} {listed}) ...", flush=True)
    out, err = quiet_std_streams(log_path)
    started = time.perf_counter()
    if not start_ray(args, log_path, err):
        return 1
    code = serve_until_signalled(settings, http, grpc, args, log_path, out, err, started)
    print("stopped", file=out)
    return code


if __name__ == "__main__":
    sys.exit(main())
