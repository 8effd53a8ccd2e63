"""One engine per served model: its tokenizer, its runtime (service/runtimes/), the runner that
computes a batch on it and the batch queue in front of that (texts of different models never share
a runtime run). The engine knows no HTTP and nothing of Ray Serve.

Every replica holds every listed bundle: encoders are small (all-MiniLM-L6-v2's two graphs take
about 200 MB), so one pool of replicas serves all of them, and a request names its model.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from bundle.manifest import HEADS_FILE, BundleError, BundleManifest, ModelInfo, load_bundle
from bundle.representations import Heads, HeadsError, load_heads
from service.engine.batcher import HOLDER, Batcher
from service.engine.runner import BatchRunner, EncodeJob, EncodeResult, intra_op_threads
from service.config import BatchingSettings, BundleRef, ServiceSettings
from service.engine.errors import InvalidRequest, NotFound
from service.runtimes.cuda import GpuAssignment
from service.runtimes import Runtime, RuntimeLoader, load_runtime
from service.engine.tokenization import TextTokenizer

SHOWN_CHARS = 100  # of a client's text, in an error message


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """What a client sent (a model or input name, a shape), as an error message shows it: in full when
    short, else its first `limit` characters and its length. An error's message goes into gRPC's
    status details, which travel in size-capped trailers, and into log lines: a 9,000-character model
    name must not turn NOT_FOUND into RESOURCE_EXHAUSTED."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}...({len(value)} characters)"
    if isinstance(value, (list, tuple)) and len(value) > limit // 4:  # never the whole list as text first
        return f"{list(value[:limit // 4])}...({len(value)} items)"
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


@dataclass
class Engine:
    """One bundle as a replica serves it."""

    name: str
    path: Path
    manifest: BundleManifest
    sha256: str
    tokenizer: TextTokenizer
    runtime: Runtime
    runner: BatchRunner
    batcher: Batcher[EncodeJob, EncodeResult]  # the model's batch queue
    aliases: tuple[str, ...] = ()  # other names requests may use for it (BundleRef.aliases)
    leases: int = 0  # calls in progress that named it (front/call.py Call.serves): never unloaded while above 0

    @property
    def model(self) -> ModelInfo:
        return self.manifest.model

    def reconfigure(self, batching: BatchingSettings) -> None:
        """New batching knobs, live (Serve's user_config): the batcher reads them for its next batch, and
        is woken now (a raised max_concurrent_batches frees a slot that nothing else would announce)."""
        self.runner.batching = batching
        self.batcher.knobs_changed()

    def sized_runtime(self, settings: ServiceSettings) -> Runtime:
        """The runtime sized for `settings`' threads and concurrent batches: a copy with new sessions that
        passed a smoke test, or the one in use when its sizes already match. Blocking: off the event loop."""
        runtime = self.runtime.resized(intra_op_threads(settings), settings.batching.max_concurrent_batches)
        if runtime is not self.runtime:
            runtime.smoke_test()  # never swap in sessions that do not compute
        return runtime

    def use_runtime(self, runtime: Runtime) -> None:
        """Serve from `runtime` from the next run on; runs in flight finish on the sessions they hold."""
        self.runtime = runtime
        self.runner.runtime = runtime

    async def compute(self, jobs: list[EncodeJob]) -> list[EncodeResult]:
        """One batch computed off the event loop (the runtime releases the GIL): where the batch
        queue sends its batches (its task holds the queue, which lends the batch's pieces the slots no
        batch holds: batcher.HOLDER), and where a request goes alone when batching is off (none lent)."""
        return await asyncio.to_thread(self.runner.compute, jobs, HOLDER.get())


def load_engine(ref: BundleRef, settings: ServiceSettings, gpu: GpuAssignment | None = None,
                runtime_loader: RuntimeLoader | None = None) -> Engine:
    """Verify and load one bundle, create its runtime (on the GPU Ray gave the replica, where CUDA
    is used), its runner and its batch queue. `runtime_loader`: what creates the runtime, load_runtime
    unless code passes another (benchmarks/standin.py's stand-in; no setting selects one)."""
    bundle = load_bundle(ref.path)
    name = ref.name or bundle.manifest.model.name
    runtime = (runtime_loader or load_runtime)(bundle, settings, intra_op_threads(settings), gpu or GpuAssignment(),
                                               settings.batching.max_concurrent_batches)
    runner = BatchRunner(runtime, bundle.manifest, settings.batching, name, heads=read_heads(bundle.root, bundle.manifest))
    engine: Engine

    async def compute(jobs: list[EncodeJob]) -> list[EncodeResult]:
        return await engine.compute(jobs)

    engine = Engine(
        name=name,
        path=ref.path,
        manifest=bundle.manifest,
        sha256=bundle.sha256,
        tokenizer=TextTokenizer(bundle.tokenizer_path, bundle.manifest.model.max_tokens),
        runtime=runtime,
        runner=runner,
        batcher=Batcher(compute, lambda: runner.batching, lambda job: job.cost(runner.batching),
                        lambda job: job.priority),
        aliases=tuple(ref.aliases),
    )
    return engine


def read_heads(root: Path, manifest: BundleManifest) -> Heads | None:
    """The token-level heads of the model's sparse and multi-vector outputs, where it has them (checked
    against the manifest when the bundle loads, so a request never meets a head that does not fit)."""
    model = manifest.model
    if not model.needs_heads:
        return None
    try:
        return load_heads(root / HEADS_FILE, model.hidden_size, model.sparse, model.multivector)
    except HeadsError as exc:
        raise BundleError(str(exc)) from None


async def resize_runtimes(engines: EngineTable, settings: ServiceSettings) -> None:
    """Every engine's sessions sized for `settings` (a live max_concurrent_batches: each batch's share of
    the replica's CPUs changes): built in a worker thread while the old ones serve, then swapped in
    together on the event loop. The caller applies the new knobs right after, in the same loop step,
    so that no batch forms between the new concurrency and the new threads. A failure swaps nothing."""
    sized = await asyncio.to_thread(lambda: [engine.sized_runtime(settings) for engine in engines])
    for engine, runtime in zip(engines, sized, strict=True):
        if runtime is not engine.runtime:
            engine.use_runtime(runtime)


class EngineTable:
    """The models loaded on this replica by name; the first listed is the default of routes that allow leaving
    it out. A model repository (service/engine/repository.py) adds and removes the models it loads on demand."""

    def __init__(self, models: list[Engine]) -> None:
        self.by_name: dict[str, Engine] = {}
        self.by_alias: dict[str, Engine] = {}
        self.default = models[0]
        self.repository = None  # the replica's ModelRepository, when it serves one: named in a 404
        for m in models:
            self.add(m)

    def add(self, m: Engine) -> None:
        if m.name in self.by_name:
            raise ValueError(f"two bundles are served under one name ({m.name!r}); name them: NAME=PATH")
        for alias in m.aliases:
            if alias in self.by_name or alias in self.by_alias or alias == m.name:
                raise ValueError(f"model alias {alias!r} is a served name or another model's alias: an alias "
                                 "names one model")
        self.by_name[m.name] = m
        for alias in m.aliases:
            self.by_alias[alias] = m
        self._neighbours()

    def remove(self, name: str) -> None:
        m = self.by_name.pop(name)
        for alias in m.aliases:
            self.by_alias.pop(alias, None)
        self._neighbours()

    def _neighbours(self) -> None:
        models = list(self.by_name.values())
        for m in models:  # a batch is lent free slots only while the replica's other models compute nothing
            m.batcher.neighbours = [other.batcher for other in models if other is not m]

    def __iter__(self):
        return iter(list(self.by_name.values()))  # a copy: models are added and removed while others iterate

    def __len__(self) -> int:
        return len(self.by_name)

    @property
    def names(self) -> list[str]:
        return list(self.by_name)

    def get(self, name: str | None, required: bool = False) -> Engine:
        """The model a request names; 404 naming the served ones if unknown. Leaving it out picks
        the default, unless several are served and the route requires a name (422)."""
        if name is None:
            if required and len(self.by_name) > 1:
                raise InvalidRequest(f"model: required when several models are served ({self.described()})")
            return self.default
        found = self.by_name.get(name) or self.by_alias.get(name)
        if found is None:
            listed = "GET /v1/models or POST /v2/repository/index lists them" if self.repository is not None else \
                f"served: {self.described()}"
            raise NotFound(f"model {shown(name)} is not served here; {listed} (a bundle's `aliases` "
                           "setting lets clients that send another model name, such as Cohere's, reach it)")
        return found

    def described(self) -> str:
        return ", ".join(repr(n) for n in self.by_name)
