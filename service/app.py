"""The composition root: binds the encoder and ingress deployments from one ServiceSettings.

`build_app` is a typed application builder: `serve run deploy/serve_config.yaml` (and KubeRay's
serveConfigV2) pass the config's `args` here, and Ray validates them into ServiceSettings.
"""


from ray.serve import Application
from ray.serve.config import BackpressureConfig

from bundle.manifest import load_bundle
from service.api import Ingress
from service.batching import Encoder
from service.config import ServiceSettings
from service.runtime import preflight


def build_app(args: ServiceSettings) -> Application:
    """Ingress -> Encoder, every option taken from the settings. Fails fast on a bad bundle."""
    # Ray validates `args` into ServiceSettings from this annotation (so no postponed
    # annotations in this module; and exactly one parameter, as Ray requires of builders);
    # a plain dict is accepted too for direct callers.
    return compose(args if isinstance(args, ServiceSettings) else ServiceSettings.model_validate(args))


def compose(settings: ServiceSettings, encoder_class=Encoder) -> Application:
    """Bind the deployments; `encoder_class` lets fault tests deploy an encoder that breaks."""
    settings = settings.resolved()
    preflight(load_bundle(settings.bundle), settings.precision)  # refuse here, in one line, before any replica starts
    backpressure = BackpressureConfig(status_code=503, retry_after_s=settings.retry_after_s)
    if settings.encoder_autoscaling is not None:
        replicas: dict = {"autoscaling_config": settings.encoder_autoscaling.model_dump()}
    else:
        replicas = {"num_replicas": settings.encoder_replicas}
    encoder = encoder_class.options(
        **replicas,
        max_ongoing_requests=settings.encoder_max_ongoing_requests,
        max_queued_requests=settings.encoder_max_queued_requests,
        backpressure_config=backpressure,
        ray_actor_options={"num_cpus": settings.encoder_num_cpus},
        user_config=settings.batching.model_dump(),
        graceful_shutdown_timeout_s=settings.graceful_shutdown_timeout_s,
        health_check_period_s=settings.health_check_period_s,
        health_check_timeout_s=30,
    ).bind(settings)
    return Ingress.options(
        num_replicas=settings.ingress_replicas,
        max_ongoing_requests=settings.ingress_max_ongoing_requests,
        max_queued_requests=settings.ingress_max_queued_requests,
        backpressure_config=backpressure,
        ray_actor_options={"num_cpus": settings.ingress_num_cpus},
        graceful_shutdown_timeout_s=settings.graceful_shutdown_timeout_s,
    ).bind(encoder, settings)
