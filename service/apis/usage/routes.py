"""GET /v1/usage: the calling key's limits and its windows now, counted for the whole service
(service/front/quotas.py).

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

from fastapi import Request

from service.engine.errors import NotFound
from service.front.deps import api_router, call_of
from service.front.quotas import Quotas, duration
from service.front.responses import JSONResponse
from service.front.schemas import ERROR_RESPONSES

router = api_router()


@router.get("/v1/usage", responses=ERROR_RESPONSES)
async def usage(request: Request) -> JSONResponse:
    """The key's name, models, priority and limits, and for each limit what is left now and when it refills
    (the x-ratelimit-* figures); the counts over time are Prometheus' (ray_encoder_key_*_total)."""
    key = call_of(request).key
    if key is None:
        raise NotFound("usage is per API key, and this service has none (no keys_file or token): nothing is "
                       "limited")
    now = await Quotas.usage(key)
    return JSONResponse({
        "key": key.name,
        "models": list(key.models) if key.models is not None else None,
        "priority": key.priority,
        "limits": {"requests_per_minute": key.requests_per_minute, "tokens_per_minute": key.tokens_per_minute,
                   "concurrent": key.concurrent},
        "now": {kind: {"limit": w.limit, "remaining": w.remaining, "reset": duration(w.reset_s)}
                for kind, w in now.items()},
    })
