"""The models one replica serves: each bundle with its tokenizer, onnxruntime sessions, batch runner
and its own batch queue (texts of different models never share an onnxruntime run).

Every replica holds every listed bundle: encoders are small (all-MiniLM-L6-v2's two graphs take
about 200 MB), so one pool of replicas serves all of them, and a request names its model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from ray import serve

from bundle.manifest import BundleManifest, ModelInfo, load_bundle
from service.batching import BatchRunner, EncodeJob, EncodeResult, batch_cost, intra_op_threads
from service.config import BatchingSettings, BundleRef, ServiceSettings
from service.errors import InvalidRequest, NotFound
from service.cuda import GpuAssignment
from service.runtime import CudaSettings, OrtEncoder
from service.tokenization import TextTokenizer


@dataclass
class ServedModel:
    """One bundle as a replica serves it."""

    name: str
    path: Path
    manifest: BundleManifest
    sha256: str
    tokenizer: TextTokenizer
    runtime: OrtEncoder
    runner: BatchRunner
    batched: Callable[[EncodeJob], Awaitable[EncodeResult]]  # the model's @serve.batch queue
    run_batch: Callable[[list[EncodeJob]], Awaitable[list[EncodeResult]]]  # where its batches go

    @property
    def model(self) -> ModelInfo:
        return self.manifest.model

    def reconfigure(self, batching: BatchingSettings) -> None:
        """New batching knobs, live (Serve's user_config). A new max_concurrent_batches needs a new
        queue (Serve fixes it when the queue is made): requests already in the old one finish there."""
        concurrency_changed = batching.max_concurrent_batches != self.runner.batching.max_concurrent_batches
        self.runner.batching = batching
        if concurrency_changed:
            self.batched = batch_queue(self.run_batch, self.runner)
        self.batched.set_max_batch_size(batching.max_batch_tokens)
        self.batched.set_batch_wait_timeout_s(batching.batch_wait_timeout_s)


RunBatch = Callable[["ServedModel", list[EncodeJob]], Awaitable[list[EncodeResult]]]


def load_model(ref: BundleRef, settings: ServiceSettings, run_batch: RunBatch,
               gpu: GpuAssignment | None = None) -> ServedModel:
    """Verify and load one bundle, create its sessions (on the GPU Ray gave the replica, where CUDA
    is used) and its batch queue, whose batches go to `run_batch(model, jobs)` (the deployment's,
    so that tests can hold a batch)."""
    bundle = load_bundle(ref.path)
    name = ref.name or bundle.manifest.model.name
    runtime = OrtEncoder(
        bundle, settings.provider, intra_op_threads(settings), settings.inter_op_threads, settings.allow_spinning,
        settings.precision, CudaSettings.from_settings(settings, gpu or GpuAssignment()),
    )
    runner = BatchRunner(runtime, bundle.manifest, settings.batching, name)
    served: ServedModel

    async def batch(jobs: list[EncodeJob]) -> list[EncodeResult]:
        return await run_batch(served, jobs)

    served = ServedModel(
        name=name,
        path=ref.path,
        manifest=bundle.manifest,
        sha256=bundle.sha256,
        tokenizer=TextTokenizer(bundle.tokenizer_path, bundle.manifest.model.max_tokens),
        runtime=runtime,
        runner=runner,
        batched=batch_queue(batch, runner),
        run_batch=batch,
    )
    return served


def batch_queue(run: Callable[[list[EncodeJob]], Awaitable[list[EncodeResult]]], runner: BatchRunner):
    """A @serve.batch queue in front of `run`, every knob from the runner's (live) batching settings.
    Wrapped here rather than decorated, so that max_concurrent_batches comes from the settings too."""
    batching = runner.batching
    return serve.batch(
        max_batch_size=batching.max_batch_tokens,
        batch_wait_timeout_s=batching.batch_wait_timeout_s,
        max_concurrent_batches=batching.max_concurrent_batches,
        batch_size_fn=lambda jobs: batch_cost(jobs, runner.batching),  # the live knobs (reconfigure)
    )(run)


async def compute(served: ServedModel, jobs: list[EncodeJob]) -> list[EncodeResult]:
    """A batch computed off the event loop (onnxruntime releases the GIL)."""
    return await asyncio.to_thread(served.runner.compute, jobs)


class ModelTable:
    """The served models by name; the first listed is the default of routes that allow leaving it out."""

    def __init__(self, models: list[ServedModel]) -> None:
        self.by_name = {m.name: m for m in models}
        if len(self.by_name) != len(models):
            names = [m.name for m in models]
            raise ValueError(f"two bundles are served under one name ({', '.join(names)}); name them: NAME=PATH")
        self.default = models[0]

    def __iter__(self):
        return iter(self.by_name.values())

    def __len__(self) -> int:
        return len(self.by_name)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def get(self, name: str | None, required: bool = False) -> ServedModel:
        """The model a request names; 404 naming the served ones if unknown. Leaving it out picks
        the default, unless several are served and the route requires a name (422)."""
        if name is None:
            if required and len(self.by_name) > 1:
                raise InvalidRequest(f"model: required when several models are served ({self.described()})")
            return self.default
        found = self.by_name.get(name)
        if found is None:
            raise NotFound(f"model {name!r} is not served here; served: {self.described()}")
        return found

    def described(self) -> str:
        return ", ".join(repr(n) for n in self.by_name)
