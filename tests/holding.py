"""A real replica whose first batch waits for the test's `release()`: a queue is certain to form
behind it, however fast or busy the machine is, so tests of batching and cancellation wait for
exactly the state they assert on instead of sleeping and hoping."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from ray import cloudpickle, serve

from service.deployment import Encoder


def hold_batches(encoder, wait) -> None:
    """Every engine's batches wait for `wait(jobs)` first: the batch queue's runner, replaced."""
    for engine in encoder.engines:
        def holding(run):
            async def held(jobs):
                await wait(jobs)
                return await run(jobs)
            return held
        engine.batcher.run = holding(engine.batcher.run)


class HoldsTheFirstBatch(Encoder.func_or_class):  # type: ignore[misc]
    async def __init__(self, settings) -> None:  # the ingress wrapper's __init__ is async
        await super().__init__(settings)
        self._gate = asyncio.Event()
        self._held = 0
        hold_batches(self, self._hold)

    async def release(self) -> None:
        self._gate.set()

    async def held(self) -> int:
        """Requests in the batch that waits for release()."""
        return self._held

    async def _hold(self, jobs) -> None:
        if not self._gate.is_set():
            self._held += len(jobs)
            await self._gate.wait()


def deploy_holding(name: str, route_prefix: str, bundle: Path, **settings):
    """Deploy the holding replica as application `name`; returns its handle."""
    from service.app import compose
    from service.config import ServiceSettings

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    parsed = ServiceSettings.model_validate({"bundle": str(bundle), **settings})
    serve.run(compose(parsed, serve.deployment(HoldsTheFirstBatch, name="Encoder")), name=name,
              route_prefix=route_prefix, logging_config={"enable_access_log": False})
    return serve.get_deployment_handle("Encoder", name)


class Gate:
    """A plain Ray actor (not a Serve deployment, so it answers while every replica is full) that
    replicas of GatedEncoder wait on before each batch, until the test opens it."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def wait(self) -> None:
        await self.opened.wait()

    async def open(self) -> None:
        self.opened.set()


GATE_NAMESPACE = "tests"


class GatedEncoder(Encoder.func_or_class):  # type: ignore[misc]
    """Every batch waits for the named Gate: the replicas fill up and stay full until it opens."""

    gate_name = ""

    async def __init__(self, settings) -> None:
        await super().__init__(settings)
        hold_batches(self, self._wait_for_gate)

    async def _wait_for_gate(self, jobs) -> None:
        import ray

        await ray.get_actor(self.gate_name, namespace=GATE_NAMESPACE).wait.remote()


def deploy_gated(name: str, route_prefix: str, bundle: Path, **settings):
    """Deploy `name` with GatedEncoder replicas behind a new closed Gate; returns the gate's handle."""
    import ray

    from service.app import compose
    from service.config import ServiceSettings

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    gate = ray.remote(Gate).options(name=f"gate-{name}", namespace=GATE_NAMESPACE).remote()
    gated = type("Gated", (GatedEncoder,), {"gate_name": f"gate-{name}"})
    parsed = ServiceSettings.model_validate({"bundle": str(bundle), **settings})
    serve.run(compose(parsed, serve.deployment(gated, name="Encoder")), name=name,
              route_prefix=route_prefix, logging_config={"enable_access_log": False})
    return gate
