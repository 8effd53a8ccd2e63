"""The serving layer: one Ray Serve deployment whose replicas batch HTTP requests onto a runtime.

Three layers, composed by deployment.py (the Serve deployment) and nothing else:
http/ (routes, schemas, middleware, errors) -> engine/ (tokenize, batch, pool; no HTTP) ->
runtimes/ (onnxruntime on CPU or CUDA, OpenVINO bf16 on CPU, behind one interface). Every module
a request passes through, in order:

  HAProxy, or Ray Serve's proxy actor (--ingress proxy): Serve's ingress, not our code
  deployment.py              the replica of the Encoder deployment that got the request: it built
                             the engines at start and serves the FastAPI app (serve.ingress)
  http/app.py                the app: its middleware stack and the mapping of every failure to
                             the JSON error body (http/errors.py)
  http/middleware.py         outermost first: metrics (observability/), bearer auth, in-flight count,
                             body limit
  http/routes/<protocol>.py  native, openai, v2, tei, cohere, attention, heads, explorer or ops; the body is
                             validated against http/schemas.py
  http/context.py            the route gets the replica's EncoderService and the named model;
                             the deadline header; a client that left is noticed
  engine/encoder_service.py  limits; tokenization (engine/tokenization.py); the job joins its
                             model's batch queue (engine/engine.py) and waits within its deadline
  engine/batcher.py          a batch forms when a runner slot is free, up to the token budget
  engine/runner.py           texts that need only their pooled output packed into rows
                             (runtimes/packing.py), the rest length-sorted into padded
                             sub-batches; pooled, scattered back
  runtimes/onnxruntime.py    the graph runs: the full graph for attention weights, the packed
    or runtimes/openvino.py  graph for packed rows, the encodings graph otherwise (which, chosen
                             at start by runtimes/choice.py;
                             runtimes/cuda.py: whether CUDA can be used, which GPU)
  engine/analysis.py         attention and similarity routes: rollout, entropy, top-k, the split
  engine/explain.py          of a cosine; rerank and classify with explain: occlusion, rollout
  http/responses.py          trimmed to real tokens, floats or base64, bytes counted -> JSON

Ray Serve's own answers (queue full, its 408 and 404) pass http/ingress.py, which Serve calls in
its proxy and in each replica's HTTP server when RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH names
it (config.py, INGRESS_ENV). Never imports torch.
"""
