"""What operators and probes ask: GET /health and GET /info.

No `from __future__ import annotations` (see service/apis/native/encode.py).
"""

from fastapi import Depends

from service.engine.prompts import describe
from service.engine.encoder_service import EncoderService
from service.front.deps import api_router, service
from service.front.gate import Gate
from service.front.replica import serve_config_now
from service.front.responses import JSONResponse
from service.front.schemas import ERROR_RESPONSES

router = api_router()


@router.get("/health", responses=ERROR_RESPONSES)
async def health(svc: EncoderService = Depends(service)) -> JSONResponse:
    """Ready when this replica's sessions (every model's) passed their last health check: 200, else 503."""
    svc.check_ready()
    default = svc.engines.default
    return JSONResponse({"status": "ok", "model": default.name, "models": svc.engines.names,
                         "provider": default.runtime.provider})


@router.get("/info")
async def info_route(svc: EncoderService = Depends(service)) -> JSONResponse:
    """Every served model (dims, pooling, where it runs, its bundle and parity report), how requests
    are batched and limited, where the metrics are, and what the replica that answered has done.
    The default model's description is also at the top level (the first listed)."""
    s = svc.settings
    live = serve_config_now()
    replica = replica_info(svc)
    models = [describe_model(m, replica["models"][m.name]) for m in svc.engines]
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


def replica_info(svc: EncoderService) -> dict:
    """What this replica runs and has done, per model (counters are per replica); the deployment's
    `info()` (callable by handle) answers the same."""
    return {
        **svc.replica,  # replica_id, node_id, pid, gpu, metrics: what the deployment knows of its replica
        "models": {m.name: svc.describe(m) for m in svc.engines},
        **svc.describe(svc.engines.default),  # the default model's, at the top as before several were served
        "batching": svc.batching.model_dump(),
        "load": {
            "requests_in_flight": Gate.in_flight,
            "inference_requests": Gate.pending,
            "inference_requests_admitted": Gate.admitted,
            "batches_running": sum(m.runner.running for m in svc.engines),
            "requests_queued": sum(m.batcher.queued for m in svc.engines),
        },
    }


def describe_model(m, state: dict) -> dict:
    """One served model as /info describes it; `state` is the replica's (provider, graphs, counters)."""
    model, manifest = m.model, m.manifest
    return {
        "model": m.name,
        "task": model.task,  # embedding, or classification (/v1/classify, /v1/rerank)
        "labels": model.labels,
        "problem_type": model.problem_type,
        "score_activation": model.score_activation,  # what /v1/rerank applies to the logit (CrossEncoder.predict's)
        "architecture": model.architecture,
        "hidden_size": model.hidden_size,
        "embedding_dim": model.sentence_dim,  # the sentence embedding's size (a Dense projection may change it)
        "num_layers": model.num_layers,
        "num_heads": model.num_heads,
        "max_tokens": model.max_tokens,
        "pooling": model.pooling,
        "normalize": model.normalize,
        **describe(model),  # prompts, default_prompt_name, include_prompt, dimensions (matryoshka sizes)
        "runtime": state["runtime"],  # what runs the encodings graph: onnxruntime or openvino
        "provider": state["provider"],
        "provider_note": state["provider_note"],
        "intra_op_threads": state["intra_op_threads"],
        "precision": state["precision"],
        "precision_requested": state["precision_requested"],
        "precision_note": state["precision_note"],
        "precisions": output_precisions(state, manifest),  # per output: pooled, token encodings, attention
        "runtime_choice": state["runtime_choice"],  # why this runtime and precision: the matched row of the table
        "cuda": state["cuda"],  # each check step, the device, the provider options of the sessions
        "graphs": state["graphs"],
        "graph_providers": state["graph_providers"],
        "encoder_counters": state["counters"],  # of the replica that answered
        "bundle": {"path": str(m.path), "sha256": m.sha256, "opset": manifest.graph.opset},
        "parity": manifest.parity.model_dump(mode="json"),
        "variants": {
            p: {"file": v.file, "runtime": v.runtime, "fusions": v.fusions, "providers": v.providers,
                "gate": (v.head_gate or v.quality or v.parity).model_dump(mode="json"),
                "attention_gate": v.attention_gate.model_dump(mode="json") if v.attention_gate else None,
                "served_by_auto": v.auto_verdict[0], "auto_note": v.auto_verdict[1]}
            for p, v in manifest.variants.items()
        },
        "versions": manifest.versions,
    }


def output_precisions(state: dict, manifest) -> dict:
    """The precision each kind of output is served at, and the gate that let it: pooled outputs (embeddings,
    logits) and token encodings come from the encodings graph, attention weights from the full graph (at bf16
    only where its attention gate passed)."""
    precision = state["precision"]
    variant = manifest.variants.get(precision)
    tokens = variant.quality.tokens if variant is not None and variant.quality is not None else None
    attention = "bf16" if "bf16" in state["graphs"]["attentions"] else "fp32"
    attention_gate = manifest.variants["bf16"].attention_gate if attention == "bf16" else None
    return {
        "pooled": precision,
        "token_encodings": precision,
        "token_encodings_gate": None if precision == "fp32" or tokens is None else
        f"min cosine per token {tokens.min_cosine:.5f} vs PyTorch fp32 over {tokens.tokens} tokens (>= "
        f"{tokens.min_cosine_required:g}: {'PASS' if tokens.passed else 'FAIL'})",
        "attention": attention,
        "attention_gate": None if attention_gate is None else
        f"max abs diff {attention_gate.outputs[0].max_abs_diff:.2e} vs PyTorch fp32 (<= {attention_gate.outputs[0].atol:g})",
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
