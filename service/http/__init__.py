"""The HTTP layer: the FastAPI app and what only HTTP knows.

  app.py         the app, its middlewares, the mapping of every failure to the JSON error body
  middleware.py  metrics, bearer auth, in-flight count, body limit (pure ASGI)
  context.py     what a route gets (the replica's EncoderService), deadline header, disconnects
  routes/        one module per protocol: native, openai, v2 (KServe), attention, heads (rerank,
                 classify), explorer, ops
  schemas.py     request and response bodies (pydantic)
  responses.py   JSON bodies written fast and, when large, off the event loop
  errors.py      error type -> status, Retry-After, the JSON error body
  ingress.py     Ray Serve's own plain-text answers (queue full, 408, 404) as our JSON errors
"""
