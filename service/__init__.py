"""The serving layer: one Ray Serve deployment whose replicas take HTTP and gRPC calls in the
protocols clients speak (OpenAI, KServe v2, TEI, Cohere, our own) and run them on a runtime in the
same process.

Rooms, composed by deployment.py (the Serve deployment) and nothing else; each imports only what is
below it (tests/test_layout.py):

  http/, grpc/   transports: each builds a call's record, passes it through the gate and mounts the
                 APIs; they never import each other
  apis/          one folder per client API: its routes, bodies, error style and declared policy
  front/         protocol-neutral: the call record, the gate, the deadline rule, the record of a
                 finished call, the error taxonomy (HTTP statuses, gRPC codes)
  engine/        knows no protocol: prompts, tokenization, the batch queue, pooling, scoring
  runtimes/      onnxruntime on CPU or CUDA, OpenVINO bf16 on CPU, behind one interface
  observability/ metrics, tracing; hosting/ listeners and processes; composition at the top
                 (app.py, deployment.py, config.py, __main__.py, ingress_callback.py)

Every module an HTTP request passes through, in order:

  HAProxy, or Ray Serve's proxy actor (--ingress proxy): Serve's ingress, not our code
  deployment.py              the replica of the Encoder deployment that got the request: it built
                             the engines at start and serves the FastAPI app (serve.ingress)
  http/middleware.py         the call's record (front/call.py) with the policy its route's API
                             declared (front/policy.py); the gate (front/gate.py): the token of an
                             inference route before the body is read, the in-flight count; the
                             body limit
  http/server.py             the app routes it to its API; any failure becomes a JSON error in
                             that API's style (http/errors.py, front/errors.py)
  apis/<api>/<module>.py     native, openai, kserve_v2, tei, cohere, vllm, openai_batch, ops or usage; the body is validated
                             against apis/<api>/schemas.py
  front/deps.py              the route gets the replica's EncoderService and the named model;
                             the call's deadline (front/call.py); a client that left is noticed
  engine/encoder_service.py  limits; prompts (engine/prompts.py); tokenization
                             (engine/tokenization.py); the job joins its model's batch queue
                             (engine/engine.py) and waits within its deadline
  engine/batcher.py          a batch forms when a runner slot is free, up to the token budget
  engine/runner.py           texts that need only their pooled output packed into rows
                             (runtimes/packing.py), the rest length-sorted into padded
                             sub-batches; pooled, scattered back
  runtimes/onnxruntime.py    the graph runs: the full graph for attention weights, the packed
    or runtimes/openvino.py  graph for packed rows, the encodings graph otherwise (which, chosen
                             at start by runtimes/choice.py;
                             runtimes/cuda.py: whether CUDA can be used, which GPU)
  engine/scoring.py          rerank and classify: what a score means (logits read as the
                             reference libraries read them), best first
  engine/analysis.py         attention and similarity routes: rollout, entropy, top-k, the split
  engine/explain.py          of a cosine; rerank and classify with explain: occlusion, rollout
  front/responses.py         trimmed to real tokens, floats or base64, bytes counted -> JSON
  front/finish.py            the call recorded: metrics (observability/metrics.py), its access log
                             line, its span (observability/tracing.py)

A gRPC call takes grpc/servicer.py (its record, gate and status codes) to apis/kserve_v2/grpc.py,
then the same semantics as HTTP's (apis/kserve_v2/semantics.py) and the engine.
Ray Serve's own answers (queue full, its 408 and 404) pass http/ingress.py, which Serve calls in
its proxy and in each replica's HTTP server (ingress_callback.py, named by
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in config.py INGRESS_ENV). Never imports torch.
"""
