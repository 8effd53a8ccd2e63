"""The service's own HTTP app and engines under plain uvicorn, with no Ray at all: the bound that
`make bench` measures Ray Serve's share of a request against (same routes, middlewares, engine,
runtime and settings; no proxy, no replica wrapper, no Ray processes).

    python -m benchmarks.plain_server SETTINGS_JSON PORT

Not a way to run the service: no health checks, no autoscaling, no metrics endpoint (Ray's node
exports the metrics, and there is no Ray node here), one process.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    import uvicorn

    from service.config import ServiceSettings
    from service.engine.engine import EngineTable, load_engine
    from service.engine.encoder_service import EncoderService
    from service.front.deps import serve_with
    from service.front.gate import Gate
    from service.http.server import app, configure

    settings = ServiceSettings.model_validate(json.loads(argv[0]))
    svc = EncoderService(settings, EngineTable([load_engine(ref, settings) for ref in settings.bundles]))
    Gate.configure(settings)
    configure(settings)
    if settings.warmup:
        svc.warm_up()
    # what the deployment would know of its replica (/info reads it); no Ray here, so no ids and no metrics
    svc.replica = {"replica_id": None, "node_id": None, "pid": os.getpid(), "gpu": None,
                   "metrics": {"prometheus_url": None, "node_id": None}}
    serve_with(svc)
    print(f"serving on 127.0.0.1:{argv[1]} (plain uvicorn, no Ray)", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=int(argv[1]), log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
