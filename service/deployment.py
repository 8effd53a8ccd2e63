"""The one Serve deployment: a replica parses the request, tokenizes it, batches it with others
and runs the model itself, with no second Ray hop (measured: the hop cost more CPU per
single-text request than the model).

It composes the layers and maps Serve's hooks onto them; nothing calls back into it:

  http/, grpc/  the transports: the FastAPI app with every API's routes (service/http/server.py), and
                every API's gRPC methods, which the deployment inherits (service/grpc/servicer.py)
  apis/         one folder per client API; its routes get the replica's EncoderService as a
                dependency (service/front/deps.py, `serve_with`)
  front/        the call record, the gate (token, in-flight counts), the deadline, the record of a call
  engine/       per model an Engine: tokenizer, batch queue, runner (length-sorted sub-batches)
  runtimes/     onnxruntime on CUDA or CPU, OpenVINO, behind the runner

The request path, in order, is in service/__init__.py.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time

from ray import serve

from service.observability import tracing
from service.config import BatchingSettings, ServiceSettings
from service.engine.engine import EngineTable, load_engine, resize_runtimes
from service.engine.encoder_service import EncoderService
from service.engine.repository import ModelRepository, default_model_budget
from service.apis.ops.health import replica_info
from jobs.batch import BatchJobs
from service.apis.openai_batch.runner import BatchRunner
from service.front.deps import serve_with
from service.front.gate import Gate
from service.front.quotas import Quotas, store_name
from service.grpc import serve_hooks
from service.grpc.servicer import grpc_methods
from service.http.server import app, configure
from service.hosting.listeners import bind_grpc_ingress_to_node_address, bind_replica_grpc_to_node_address
from service.hosting.model_routing import tell_serve_models_held
from service.hosting.placement import NAMESPACE, Placement, board_name
from service.observability.metrics import node_metrics_url, refresh_periodically, service_metrics
from service.runtimes import RuntimeLoader
from service.runtimes.cuda import ray_gpu_assignment

logger = logging.getLogger("ray.serve")
# How long a replica's graceful stop waits for its last spans to be exported (within Serve's
# graceful_shutdown_timeout_s, whose drain comes first; the exporter process is killed past it)
TRACING_CLOSE_S = 10.0
APP_STATUS_S = 5.0  # the longest a stopping replica waits to learn whether its application is being deleted


@serve.deployment(name="Encoder")
@serve.ingress(app)
class Encoder(grpc_methods()):
    """A replica: every API's HTTP routes (service/http/server.py) and gRPC methods (inherited), and per
    served model an engine."""

    def __init__(self, settings: ServiceSettings, runtime_loader: RuntimeLoader | None = None) -> None:
        """`runtime_loader`: bound only by code (benchmarks' stand-in runtime, service/app.py `compose`);
        None, as every production app binds it, loads each model's runtime from the settings."""
        started = time.perf_counter()
        bind_replica_grpc_to_node_address()  # before Serve starts that server, after this returns
        bind_grpc_ingress_to_node_address()  # the same for its gRPC ingress server, when gRPC is on
        serve_hooks.install(settings.retry_after_s, settings.max_body_bytes)  # before Serve starts its gRPC server
        tracing.configure(settings.tracing)  # OpenTelemetry traces, when the settings or OTEL_* ask
        # the GPU share this replica asked Ray for (fixed in app.compose) and the device Ray gave it
        self.gpu = ray_gpu_assignment(settings.num_gpus or 0.0)
        self.engines = EngineTable([load_engine(ref, settings, self.gpu, runtime_loader) for ref in settings.bundles])
        self.svc = EncoderService(settings, self.engines)
        if settings.models_dir is not None:  # a model repository: the rest of its models loaded on demand
            self.svc.repository = self.engines.repository = ModelRepository(
                settings.models_dir, self.engines, lambda ref: load_engine(ref, settings, self.gpu, runtime_loader),
                settings.model_memory_bytes or default_model_budget(settings.num_cpus), settings.max_concurrent_loads,
                settings.idle_unload_s, on_held=tell_serve_models_held(serve.get_replica_context().replica_id),
                placement=Placement(serve.get_replica_context().app_name,
                                    serve.get_replica_context().replica_id.unique_id, settings.model_placement)
                if settings.model_placement else None)
        Gate.configure(settings)
        Quotas.configure(settings, serve.get_replica_context().app_name)  # keys' limits, for the whole service
        configure(settings)
        if Gate.keyring is None:
            logger.warning("no API token configured (%s / auth_token_file): inference routes are open", settings.auth_token_env)
        if settings.warmup:
            self.svc.warm_up()
        node_id = _node_id()
        self.svc.replica = {
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "node_id": node_id,
            "pid": os.getpid(),
            "gpu": self.gpu.describe(),
            "metrics": {"prometheus_url": node_metrics_url(), "node_id": node_id},
        }
        serve_with(self.svc)
        # OpenAI's Batch API: this replica's runner of unfinished batches, given the embedding job's entry points
        self.batches = BatchRunner(settings, app, jobs=BatchJobs)
        self.batches.start()
        metrics = service_metrics()
        gpu_ids = ",".join(self.gpu.ray_gpu_ids)
        repository = self.svc.repository
        reported: set[str] = set()  # on-demand models whose bytes the gauge showed last time

        infos: dict[str, dict] = {}  # the model_info tags set last time, by model: an unloaded one is set to 0

        def refresh() -> None:  # Ray drops gauges that are not set again
            served = {}
            for m in self.engines:  # (a copy: the repository adds and removes models meanwhile)
                served[m.name] = {"model": m.name, "task": m.model.task, "bundle_sha256": m.sha256,
                                  "provider": m.runtime.provider, "runtime": m.runtime.runtime,
                                  "precision": m.runtime.precision, "gpu_ids": gpu_ids}
                metrics.batch_queue.set(m.batcher.queued, tags={"model": m.name})
            for name in infos.keys() - served.keys():
                metrics.model_info.set(0, tags=infos[name])
            for tags in served.values():
                metrics.model_info.set(1, tags=tags)
            infos.clear()
            infos.update(served)
            metrics.in_flight.set(Gate.in_flight)
            if repository is not None:
                loaded = repository.loaded_bytes()
                for name in reported - loaded.keys():
                    metrics.model_loaded_bytes.set(0, tags={"model": name})
                for name, size in loaded.items():
                    metrics.model_loaded_bytes.set(size, tags={"model": name})
                reported.clear()
                reported.update(loaded)
                metrics.model_budget_bytes.set(repository.budget_bytes)

        refresh_periodically(refresh)
        # What start-up made (Ray, FastAPI, the runtimes' Python objects) lives as long as the replica:
        # out of the cyclic collector's sight, so that its full collections under load walk only what
        # requests make (measured in a micro-benchmark: a span-heavy request path took 56 us beside a
        # heap of 2M objects, 32 us with that heap frozen).
        gc.freeze()
        for m in self.engines:
            logger.info(
                "replica ready: model %s, %s %s (%s), provider %s, graphs %s and %s, %d intra-op threads, %s, bundle %s "
                "(%.1fs)", m.name, m.runtime.runtime, m.runtime.precision, m.runtime.precision_note, m.runtime.provider,
                m.runtime.full.label, m.runtime.fast.label, m.runtime.threads,
                self.gpu.line(), m.path, time.perf_counter() - started,
            )

    # ---- Serve's hooks ----

    async def reconfigure(self, user_config: dict) -> None:
        """The batching knobs of the Serve config's user_config, applied without a restart. A new
        max_concurrent_batches changes each batch's share of the CPUs: the sessions are rebuilt with
        that many threads off the event loop first, then knobs and sessions apply to the next batch."""
        merged = self.svc.settings.batching.model_dump() | (user_config or {})
        batching = BatchingSettings(**merged)
        await resize_runtimes(self.engines, self.svc.settings.model_copy(update={"batching": batching}))
        self.svc.reconfigure(batching)

    async def __del__(self) -> None:
        """Serve's graceful stop of this replica, after its requests drained: the spans of its last
        requests exported (Ray kills a worker's child processes when it exits, the span exporter
        with what it held). Off the event loop; bounded, however the exporter process behaves. The Batch API's
        runner stops first: a batch it ran is resumed from its records by the next runner. The metric records
        of its last requests are recorded in Ray now, not left queued (service/observability/metrics.py Recorder)."""
        await self.batches.stop()
        try:
            await asyncio.wait_for(asyncio.to_thread(end_app_actors_if_deleted, serve.get_replica_context().app_name),
                                   APP_STATUS_S)
        except asyncio.TimeoutError:
            logger.warning("the application's status not known within %s s: its actors are left as they are",
                           APP_STATUS_S)
        await asyncio.to_thread(service_metrics().recorder.flush)
        await asyncio.to_thread(tracing.shutdown, TRACING_CLOSE_S)

    def check_health(self) -> None:
        """Called by Serve periodically: a tiny real inference per model, so a broken session restarts the replica."""
        self.svc.check_health()

    def info(self) -> dict:
        """What this replica runs and has done (as /info's `replica`), callable by handle."""
        return replica_info(self.svc)


def end_app_actors_if_deleted(app: str) -> None:
    """The application's detached actors (the placement board, the limits' memory store) killed when Serve is
    deleting the application, not when it only stops this replica (a scale-down, a redeploy: the next replicas
    find them by name, with their counts): detached, they would otherwise outlive it, a process each. Every
    replica of a deleted app tries; the first kills them. Bounded: the controller asked within APP_STATUS_S."""
    import ray

    try:
        status = serve.status().applications.get(app)
    except Exception:  # noqa: BLE001 - the controller gone (serve.shutdown): nothing to decide by
        return
    if status is not None and status.status != "DELETING":  # (ApplicationStatus, a str enum)
        return
    for name in (board_name(app), store_name(app)):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE))
            logger.info("application %s deleted: its actor %s ended", app, name)
        except ValueError:  # never started, or another replica ended it first
            pass


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
