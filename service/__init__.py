"""The serving layer: one Ray Serve deployment whose replicas batch HTTP requests onto a runtime.

Three layers, composed by deployment.py (the Serve deployment) and nothing else:
http/ (routes, schemas, middleware, errors) -> engine/ (tokenize, batch, pool; no HTTP) ->
runtimes/ (onnxruntime on CUDA or CPU, behind one interface). A request passes, in order:

  http/middleware.py         metrics, bearer auth, in-flight count, body limit
  http/routes/<protocol>.py  validation (http/schemas.py); the route gets the replica's
                             EncoderService (http/context.py)
  engine/service.py          limits; tokenization (engine/tokenization.py); the job joins its
                             model's queue (engine/engine.py) within its deadline
  engine/batcher.py          a batch forms when a runner slot is free, up to the token budget
  engine/runner.py           texts length-sorted into padded sub-batches, pooled, scattered back
  runtimes/onnxruntime.py    the graph runs (runtimes/cuda.py: whether CUDA can be used, which GPU)
  http/responses.py          trimmed to real tokens, floats or base64 -> JSON

Ray Serve's own answers (queue full, its 408 and 404) pass http/ingress.py. Never imports torch.
"""
