"""The one Serve deployment: a replica parses the request, tokenizes it, batches it with others
and runs the model itself, with no second Ray hop (measured: the hop cost more CPU per
single-text request than the model).

HTTP -> middlewares (metrics, auth, in-flight count, body limit) -> route (routes_*.py) -> validation
-> tokenization -> `@serve.batch` queue (token budget) -> BatchRunner (length-sorted sub-batches,
onnxruntime in a worker thread) -> response.

Everything the routes call is defined in modules imported above the deployment class: serve.ingress
snapshots the FastAPI app (with its routes' globals) when the class is decorated.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from fastapi import Request
from ray import serve

from service.batching import EncodeJob, EncodeResult
from service.config import BatchingSettings, ServiceSettings
from service.cuda import ray_gpu_assignment
from service.errors import BackendError, ClientGone, InvalidRequest, NotReady, ServiceError, Timeout, TooLarge
from service.http_app import app
from service.metrics import node_metrics_url, refresh_periodically, service_metrics
from service.listeners import bind_replica_grpc_to_node_address
from service.middleware import InFlightMiddleware, BearerAuthMiddleware, MetricsMiddleware, configure
from service.models import ModelTable, ServedModel, compute, load_model
from service.routes_attention import AttentionRoutes
from service.routes_explorer import ExplorerRoutes
from service.routes_native import NativeRoutes
from service.routes_openai import OpenAIRoutes
from service.routes_ops import OpsRoutes
from service.routes_v2 import V2Routes
from service.schemas import as_list
from service.tokenization import TokenizedText

logger = logging.getLogger("ray.serve")

# Requests up to this many characters are tokenized on the event loop: a hop to a worker thread
# costs more than tokenizing a few sentences does (one sentence: 28 us inline, 196 us of CPU with
# asyncio.to_thread, measured).
INLINE_TOKENIZE_CHARS = 2048
# A client's own deadline, in seconds (the header Ray Serve's proxy also reads).
TIMEOUT_HEADER = "x-request-timeout-seconds"
HEADER_DEADLINE_MARGIN_S = 0.05


@serve.deployment(name="Encoder")
@serve.ingress(app)
class Encoder(NativeRoutes, AttentionRoutes, OpenAIRoutes, V2Routes, OpsRoutes, ExplorerRoutes):
    """A replica: the FastAPI routes and, per served model, the tokenizer, the batch queue and the
    onnxruntime sessions."""

    def __init__(self, settings: ServiceSettings) -> None:
        started = time.perf_counter()
        bind_replica_grpc_to_node_address()  # before Serve starts that server, after this returns
        self.settings = settings
        self.batching = settings.batching
        # the GPU share this replica asked Ray for (fixed in app.compose) and the device Ray gave it
        self.gpu = ray_gpu_assignment(settings.num_gpus or 0.0)
        self.models = ModelTable([load_model(ref, settings, self._run_batch, self.gpu) for ref in settings.bundles])
        self.healthy = True
        configure(settings)
        if BearerAuthMiddleware.token is None:
            logger.warning("no API token configured (%s / auth_token_file): inference routes are open", settings.auth_token_env)
        if settings.warmup:
            for served in self.models:
                served.runner.warm_up()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.node_id = _node_id()
        self.metrics_url = node_metrics_url()
        metrics = service_metrics()
        gpu_ids = ",".join(self.gpu.ray_gpu_ids)
        info_tags = [{"model": m.name, "bundle_sha256": m.sha256, "provider": m.runtime.provider,
                      "precision": m.runtime.precision, "gpu_ids": gpu_ids} for m in self.models]

        def refresh() -> None:  # Ray drops gauges that are not set again
            for tags in info_tags:
                metrics.model_info.set(1, tags=tags)
            metrics.in_flight.set(MetricsMiddleware.in_flight)

        refresh_periodically(refresh)
        for m in self.models:
            logger.info(
                "replica ready: model %s, provider %s, graphs %s and %s, %d intra-op threads, %s, bundle %s (%.1fs)",
                m.name, m.runtime.provider, m.runtime.full.label, m.runtime.fast.label, m.runtime.threads,
                self.gpu.line(), m.path, time.perf_counter() - started,
            )

    # ---- Serve's hooks ----

    def reconfigure(self, user_config: dict) -> None:
        """Apply batching knobs from the Serve config's user_config without a restart."""
        merged = self.settings.batching.model_dump() | (user_config or {})
        self.batching = BatchingSettings(**merged)
        for served in self.models:
            served.reconfigure(self.batching)

    def check_health(self) -> None:
        """Called by Serve periodically: a tiny real inference per model, so a broken session restarts the replica."""
        try:
            for served in self.models:
                served.runtime.smoke_test()
        except Exception:
            self.healthy = False  # readiness says so until a check passes again, or Serve replaces it
            raise
        # Readiness follows the last check: Serve replaces a replica only after several failed checks
        # in a row, so one that recovered must not stay unready (its pod would flap) while it serves.
        self.healthy = True

    def info(self) -> dict:
        """What this replica runs and has done, per model (counters are per replica); also callable by handle."""
        return {
            "replica_id": self.replica_id,
            "node_id": self.node_id,
            "pid": os.getpid(),
            "models": {m.name: model_state(m) for m in self.models},
            **model_state(self.models.default),  # the default model's, at the top as before several were served
            "gpu": self.gpu.describe(),
            "batching": self.batching.model_dump(),
            "load": {
                "requests_in_flight": MetricsMiddleware.in_flight,
                "inference_requests": InFlightMiddleware.pending,
                "inference_requests_admitted": InFlightMiddleware.admitted,
                "batches_running": sum(m.runner.running for m in self.models),
            },
            "metrics": {"prometheus_url": self.metrics_url, "node_id": self.node_id},
        }

    # ---- the request path's shared steps ----

    def _check_ready(self) -> None:
        if not self.healthy:
            raise NotReady("this replica's onnxruntime session failed its health check; it is being replaced",
                           headers={"Retry-After": str(self.settings.retry_after_s)})

    def _texts(self, inputs: str | list[str]) -> list[str]:
        texts = as_list(inputs)
        if len(texts) > self.settings.max_inputs:
            raise TooLarge(f"{len(texts)} inputs; at most {self.settings.max_inputs} per request")
        for i, text in enumerate(texts):
            if len(text) > self.settings.max_text_chars:
                raise TooLarge(f"input {i} has {len(text)} characters; the limit is {self.settings.max_text_chars}")
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON allows "\ud800"; the tokenizer does not
                raise InvalidRequest(f"input {i} is not valid Unicode: {exc.reason} at character {exc.start}") from None
        return texts

    def _model(self, name: str | None, request: Request, required: bool = False) -> ServedModel:
        """The model a request names (404 naming the served ones), noted for the metrics' model label."""
        served = self.models.get(name, required)
        request.scope["model"] = served.name
        return served

    async def _tokenize(self, served: ServedModel, texts: list[str], truncate: bool, route: str,
                        limit_tokens: bool = True) -> list[TokenizedText]:
        """The whole request in one batch call of the tokenizer; off the event loop when it is large."""
        started = time.perf_counter()
        if sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS:
            tokenized = served.tokenizer.encode(texts, truncate)
        else:
            tokenized = await asyncio.to_thread(served.tokenizer.encode, texts, truncate)
        service_metrics().duration.observe(time.perf_counter() - started,
                                           tags={"route": route, "stage": "tokenization", "model": served.name})
        total = sum(t.n_tokens for t in tokenized)
        limit = self.batching.max_batch_tokens  # the live knob (reconfigure), the one the batch queue uses
        if limit_tokens and total > limit:
            raise TooLarge(f"request has {total} tokens; at most {limit} per request (split it into smaller requests)")
        return tokenized

    def _check_attention_size(self, served: ServedModel, tokenized: list[TokenizedText]) -> None:
        """Attention grows with n^2: refuse before inference what would fill the replica's memory."""
        model = served.model
        values = sum(model.num_layers * model.num_heads * t.n_tokens**2 for t in tokenized)
        if values > self.settings.max_attention_values:
            raise TooLarge(
                f"the attention of this request is {values} values ({model.num_layers} layers x "
                f"{model.num_heads} heads x tokens^2, summed over {len(tokenized)} texts); the limit is "
                f"{self.settings.max_attention_values} (send fewer or shorter texts)"
            )

    def _check_response_size(self, n_bytes: int) -> None:
        if n_bytes > self.settings.max_response_bytes:
            raise TooLarge(
                f"the response would be about {n_bytes} bytes; the limit is {self.settings.max_response_bytes} "
                "(ask for fewer texts, layers or heads, or encoding_format/format base64, float16 for attention)"
            )

    def _indexes(self, requested: list[int] | None, count: int, what: str) -> tuple[int, ...]:
        if requested is None:
            return tuple(range(count))
        bad = [i for i in requested if not 0 <= i < count]
        if bad:
            raise InvalidRequest(f"{what}s: unknown {what} index {bad[0]}: the model has {count} {what}s (0..{count - 1})")
        if len(set(requested)) != len(requested):
            raise InvalidRequest(f"{what}s: duplicate {what} indexes in {requested}")
        if not requested:
            raise InvalidRequest(f"{what}s: an empty list selects nothing; leave it out (or null) for all {count}")
        return tuple(requested)

    async def _infer(self, served: ServedModel, job: EncodeJob, request: Request) -> EncodeResult:
        """One request's job through the batch queue, within its deadline.

        The deadline is request_timeout_s, or the client's own `X-Request-Timeout-Seconds` when
        shorter (a client that gives up after 2 s says so, and its work is dropped when it would).
        A request past its deadline, or whose client is seen to leave, is cancelled; Serve's batch
        queue drops cancelled requests before a batch runs, so nothing is computed for nobody. Ray's
        proxy actor cancels the handler of a client that left; HAProxy closes the connection to the
        replica only for some of them, so the disconnect is also watched for here.
        """
        timeout = self._deadline(request)
        cost = job.cost(self.batching)
        if cost > self.batching.max_batch_tokens:  # Serve would refuse it from its queue with a 500
            raise TooLarge(
                f"this request's {job.n_tokens} tokens and {job.attention_values} attention values count as "
                f"{cost} of one batch's {self.batching.max_batch_tokens} (attention at "
                f"{self.batching.max_batch_attention_values} values per batch): send fewer or shorter texts, or "
                "fewer layers or heads"
            )
        job.enqueued = time.perf_counter()
        result = asyncio.ensure_future(served.batched(job) if self.batching.enabled else self._run_one(served, job))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({result, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()  # timed out, client gone, or this handler cancelled by Serve
        if result not in done:
            if gone in done:
                raise ClientGone("the client closed the connection before the result was ready")
            raise Timeout(f"inference did not finish within {timeout:g}s",
                          headers={"Retry-After": str(self.settings.retry_after_s)})
        try:
            return result.result()
        except ServiceError:
            raise
        except Exception as exc:  # the batch failed (a broken session): one error for its requests
            logger.warning("batch failed: %s: %s", type(exc).__name__, exc)
            raise BackendError(f"inference failed ({type(exc).__name__}); the request can be retried") from None

    def _deadline(self, request: Request) -> float:
        """Seconds this request may take: the service's limit, or the client's when it is shorter."""
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return self.settings.request_timeout_s
        try:
            asked = float(raw)
        except ValueError:
            asked = float("nan")
        if not asked > 0 or asked == float("inf"):
            raise InvalidRequest(f"{TIMEOUT_HEADER} must be a positive number of seconds, got {raw!r}")
        # Ray Serve reads this header too and, when it passes, answers 408 in plain text; its clock
        # starts a little before ours, so ours ends a little earlier and the error stays ours (JSON)
        return min(max(asked - HEADER_DEADLINE_MARGIN_S, 0.001), self.settings.request_timeout_s)

    async def _run_one(self, served: ServedModel, job: EncodeJob) -> EncodeResult:
        return (await self._run_batch(served, [job]))[0]

    async def _run_batch(self, served: ServedModel, jobs: list[EncodeJob]) -> list[EncodeResult]:
        """Where every model's batches run: list in, list out, off the event loop."""
        return await compute(served, jobs)


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the request's body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def model_state(m: ServedModel) -> dict:
    """One served model's execution state in a replica: provider, precision, graphs, counters."""
    return {
        "provider": m.runtime.provider,
        "provider_note": m.runtime.provider_note,
        "intra_op_threads": m.runtime.threads,
        "precision": m.runtime.precision,
        "precision_requested": m.runtime.precision_requested,
        "precision_note": m.runtime.precision_note,
        "cuda": m.runtime.describe_cuda(),
        "graphs": {"attentions": m.runtime.full.label, "encodings": m.runtime.fast.label},
        "ort_runs_by_graph": dict(m.runner.runs_by_graph),
        "counters": dict(m.runner.counters),
    }


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
