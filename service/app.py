"""The composition root: binds the one deployment from one ServiceSettings.

`build_app` is a typed application builder: `serve run deploy/serve_config.yaml` (and KubeRay's
serveConfigV2) pass the config's `args` here, and Ray validates them into ServiceSettings.
"""


from ray.serve import Application
from ray.serve.config import BackpressureConfig

from service.config import ServiceSettings
from service.deployment import Encoder
from service.runtimes import RuntimeLoader
from service.runtimes.onnxruntime import check_bundles


def build_app(args: ServiceSettings) -> Application:
    """The one deployment, Encoder, every option taken from the settings. Fails fast on a bad bundle."""
    # Ray validates `args` into ServiceSettings from this annotation (so no postponed
    # annotations in this module; and exactly one parameter, as Ray requires of builders);
    # a plain dict is accepted too for direct callers.
    return compose(args if isinstance(args, ServiceSettings) else ServiceSettings.model_validate(args))


def compose(settings: ServiceSettings, deployment=Encoder, runtime_loader: RuntimeLoader | None = None) -> Application:
    """Bind the deployment; `deployment` lets fault tests deploy a replica that breaks. `runtime_loader`
    (code only, never a setting: build_app passes none) is bound into every replica in place of
    load_runtime: benchmarks/request_path.py serves benchmarks/standin.py's stand-in runtime this way."""
    settings = settings.resolved()
    check_bundles(settings)  # refuse here, in one line, before any replica starts
    # the share each replica asks Ray for, fixed here so that every replica knows its own
    settings = settings.model_copy(update={"num_gpus": settings.gpu_share(cluster_gpus())})
    if settings.autoscaling is not None:
        replicas: dict = {"autoscaling_config": settings.autoscaling.model_dump()}
    else:
        replicas = {"num_replicas": settings.replicas}
    return deployment.options(
        **replicas,
        # Serve's limit is the replica's: Serve routes only to replicas with room, queues what none
        # has room for (bounded), and refuses the rest with 503 + Retry-After, which
        # service/http/ingress.py writes as our JSON error.
        max_ongoing_requests=settings.max_ongoing_requests,
        max_queued_requests=settings.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=settings.retry_after_s),
        ray_actor_options={"num_cpus": settings.num_cpus, "num_gpus": settings.num_gpus},
        max_replicas_per_node=settings.max_replicas_per_node,
        user_config=settings.batching.model_dump(),
        graceful_shutdown_timeout_s=settings.graceful_shutdown_timeout_s,
        health_check_period_s=settings.health_check_period_s,
        health_check_timeout_s=30,
    ).bind(settings, **({"runtime_loader": runtime_loader} if runtime_loader is not None else {}))



def cluster_gpus() -> float:
    """GPUs in the Ray cluster the application is being deployed to (0 when Ray is not running).

    Only what the cluster has now: a cluster that adds GPU nodes on demand asks for them when its
    config sets num_gpus (the GPU Serve config does)."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0
