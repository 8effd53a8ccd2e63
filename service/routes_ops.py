"""What operators and probes ask: GET /health and GET /info.

No `from __future__ import annotations` (see routes_native.py).
"""

from service.http_app import ERROR_RESPONSES, app
from service.responses import JSONResponse


class OpsRoutes:
    @app.get("/health", responses=ERROR_RESPONSES)
    async def health(self) -> JSONResponse:
        """Ready when this replica's sessions passed their last health check: 200, else 503."""
        self._check_ready()
        return JSONResponse({"status": "ok", "model": self.name, "provider": self.runtime.provider})

    @app.get("/info")
    async def info_route(self) -> JSONResponse:
        """The served model, where it runs, how requests are batched and limited, where the metrics
        are, its parity report, and what the replica that answered has done."""
        s = self.settings
        replica = self.info()
        return JSONResponse(
            {
                "model": self.name,
                "hidden_size": self.model.hidden_size,
                "num_layers": self.model.num_layers,
                "num_heads": self.model.num_heads,
                "max_tokens": self.model.max_tokens,
                "pooling": self.model.pooling,
                "normalize": self.model.normalize,
                "provider": replica["provider"],
                "provider_note": replica["provider_note"],
                "intra_op_threads": replica["intra_op_threads"],
                "precision": replica["precision"],
                "precision_requested": replica["precision_requested"],
                "graphs": replica["graphs"],
                "batching": replica["batching"],
                "metrics": replica["metrics"],
                "replica": {k: replica[k] for k in ("replica_id", "node_id", "pid", "load")},
                "encoder_counters": replica["counters"],  # of the replica that answered
                "replicas": (
                    {"autoscaling": s.autoscaling.model_dump()} if s.autoscaling else {"replicas": s.replicas}
                ),
                "limits": {
                    "max_inputs": s.max_inputs,
                    "max_text_chars": s.max_text_chars,
                    "max_body_bytes": s.max_body_bytes,
                    "max_response_bytes": s.max_response_bytes,
                    "max_request_tokens": s.batching.max_batch_tokens,
                    "request_timeout_s": s.request_timeout_s,
                    "max_ongoing_requests": s.max_ongoing_requests,
                    "max_queued_requests": s.max_queued_requests,
                },
                "bundle": {"path": str(s.bundle), "sha256": self.bundle_sha256, "opset": self.manifest.graph.opset},
                "parity": self.manifest.parity.model_dump(mode="json"),
                "variants": {
                    p: {"file": v.file, "fusions": v.fusions, "providers": v.providers,
                        "gate": (v.quality or v.parity).model_dump(mode="json")}
                    for p, v in self.manifest.variants.items()
                },
                "versions": self.manifest.versions,
            }
        )
