"""What operators and probes ask: GET /health and GET /info.

No `from __future__ import annotations` (see routes_native.py).
"""

from service.http_app import ERROR_RESPONSES, app
from service.middleware import serve_config_now
from service.responses import JSONResponse


class OpsRoutes:
    @app.get("/health", responses=ERROR_RESPONSES)
    async def health(self) -> JSONResponse:
        """Ready when this replica's sessions (every model's) passed their last health check: 200, else 503."""
        self._check_ready()
        default = self.models.default
        return JSONResponse({"status": "ok", "model": default.name, "models": self.models.names,
                             "provider": default.runtime.provider})

    @app.get("/info")
    async def info_route(self) -> JSONResponse:
        """Every served model (dims, pooling, where it runs, its bundle and parity report), how requests
        are batched and limited, where the metrics are, and what the replica that answered has done.
        The default model's description is also at the top level (the first listed)."""
        s = self.settings
        live = serve_config_now()
        replica = self.info()
        models = [describe_model(m, replica["models"][m.name]) for m in self.models]
        return JSONResponse(
            {
                **models[0],
                "models": models,
                "batching": replica["batching"],
                "metrics": replica["metrics"],
                "replica": {k: replica[k] for k in ("replica_id", "node_id", "pid", "gpu", "load")},
                "replicas": replicas_now(live, s),
                "limits": {
                    "max_inputs": s.max_inputs,
                    "max_text_chars": s.max_text_chars,
                    "max_body_bytes": s.max_body_bytes,
                    "max_response_bytes": s.max_response_bytes,
                    "max_attention_values": s.max_attention_values,
                    "max_request_tokens": replica["batching"]["max_batch_tokens"],  # live (user_config)
                    "request_timeout_s": s.request_timeout_s,
                    "max_ongoing_requests": live.max_ongoing_requests if live else s.max_ongoing_requests,  # live
                    "max_queued_requests": live.max_queued_requests if live else s.max_queued_requests,  # live
                },
            }
        )


def describe_model(m, state: dict) -> dict:
    """One served model as /info describes it; `state` is the replica's (provider, graphs, counters)."""
    model, manifest = m.model, m.manifest
    return {
        "model": m.name,
        "architecture": model.architecture,
        "hidden_size": model.hidden_size,
        "embedding_dim": model.sentence_dim,  # the sentence embedding's size (a Dense projection may change it)
        "num_layers": model.num_layers,
        "num_heads": model.num_heads,
        "max_tokens": model.max_tokens,
        "pooling": model.pooling,
        "normalize": model.normalize,
        "provider": state["provider"],
        "provider_note": state["provider_note"],
        "intra_op_threads": state["intra_op_threads"],
        "precision": state["precision"],
        "precision_requested": state["precision_requested"],
        "precision_note": state["precision_note"],
        "cuda": state["cuda"],  # each check step, the device, the provider options of the sessions
        "graphs": state["graphs"],
        "encoder_counters": state["counters"],  # of the replica that answered
        "bundle": {"path": str(m.path), "sha256": m.sha256, "opset": manifest.graph.opset},
        "parity": manifest.parity.model_dump(mode="json"),
        "variants": {
            p: {"file": v.file, "fusions": v.fusions, "providers": v.providers,
                "gate": (v.quality or v.parity).model_dump(mode="json")}
            for p, v in manifest.variants.items()
        },
        "versions": manifest.versions,
    }


def replicas_now(live, settings) -> dict:
    """How many replicas, as Serve runs them now (else as the settings say)."""
    if live is None:
        return {"autoscaling": settings.autoscaling.model_dump()} if settings.autoscaling else {"replicas": settings.replicas}
    if live.autoscaling_config is not None:
        a = live.autoscaling_config
        return {"autoscaling": {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
                                "target_ongoing_requests": a.target_ongoing_requests,
                                "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s}}
    return {"replicas": live.num_replicas}
