"""The model repository extension of the v2 protocol (Triton's): the index of models with their state, and
load and unload by name, once for both transports (http.py, grpc.py). With a model repository
(models_dir, service/engine/repository.py) they act on the replica that takes the call: a load makes the model
ready there (others load it when a request names it), an unload frees it there once its requests are done.
Without one, every served model is READY, a load of one is a no-op, and an unload is refused: the
configuration loads them.
"""

from __future__ import annotations

from service.engine.encoder_service import EncoderService
from service.engine.engine import shown
from service.engine.errors import BadRequest, NotFound
from service.front.call import Call


def index(svc: EncoderService, ready_only: bool = False) -> list[dict]:
    """Every model, with its state on this replica: READY, LOADING or UNAVAILABLE (and why)."""
    if svc.repository is None:
        rows = [{"name": m.name, "version": "1", "state": "READY", "reason": ""} for m in svc.engines]
    else:
        rows = svc.repository.index()
    return [r for r in rows if r["state"] == "READY"] if ready_only else rows


async def load(svc: EncoderService, name: str, call: Call) -> None:
    """The model loaded on this replica within the call's deadline (404 when no such model)."""
    if svc.repository is None:
        svc.engines.get(name)  # a served model is loaded already; any other is a 404 naming them
        return
    await svc.repository.load(name, call.deadline(svc.settings.request_timeout_s))


def unload(svc: EncoderService, name: str) -> None:
    """The model unloaded on this replica, now or once its requests are done."""
    if svc.repository is None:
        engine = svc.engines.get(name)
        raise BadRequest(f"model {engine.name!r} is loaded by the service's configuration (`bundles`): it is not "
                         "unloaded on request; serve a model repository (models_dir) for models loaded on demand")
    if name not in svc.repository.entries:
        raise NotFound(f"model {shown(name)} is not in the model repository (POST /v2/repository/index lists them)")
    svc.repository.unload(name)
