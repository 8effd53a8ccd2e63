"""A real replica whose first batch waits for the test's `release()`: a queue is certain to form
behind it, however fast or busy the machine is, so tests of batching and cancellation wait for
exactly the state they assert on instead of sleeping and hoping."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from ray import cloudpickle, serve

from service.deployment import Encoder


class HoldsTheFirstBatch(Encoder.func_or_class):  # type: ignore[misc]
    async def __init__(self, settings) -> None:  # the ingress wrapper's __init__ is async
        await super().__init__(settings)
        self._gate = asyncio.Event()
        self._held = 0

    async def release(self) -> None:
        self._gate.set()

    async def held(self) -> int:
        """Requests in the batch that waits for release()."""
        return self._held

    async def _run_batch(self, served, jobs):
        if not self._gate.is_set():
            self._held += len(jobs)
            await self._gate.wait()
        return await super()._run_batch(served, jobs)


def deploy_holding(name: str, route_prefix: str, bundle: Path, **settings):
    """Deploy the holding replica as application `name`; returns its handle."""
    from service.app import compose
    from service.config import ServiceSettings

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    parsed = ServiceSettings.model_validate({"bundle": str(bundle), **settings})
    serve.run(compose(parsed, serve.deployment(HoldsTheFirstBatch, name="Encoder")), name=name,
              route_prefix=route_prefix, logging_config={"enable_access_log": False})
    return serve.get_deployment_handle("Encoder", name)
