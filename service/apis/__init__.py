"""One folder per client API, each with its routes, its bodies (schemas.py) and its declaration in its
`__init__.py`: which routes run inference (token, in-flight count) and which are open, its error
style, its gRPC methods. The transports mount every API listed here; adding an API is adding a folder
and a line below.

  native/     /v1/encode, /v1/tokenize, /v1/attention, /v1/similarity, /v1/rerank, /v1/classify
  openai/     /v1/embeddings, /v1/models (the `openai` client)
  kserve_v2/  the Open Inference Protocol v2 over HTTP and gRPC (tritonclient, KServe)
  tei/        text-embeddings-inference's routes (huggingface_hub and the frameworks over it)
  cohere/     Cohere's API v2 /v2/embed, /v2/rerank (the `cohere` SDK)
  vllm/       vLLM's POST /v1/score (and /score): text_1 against text_2 on every model that scores
  openai_batch/  OpenAI's Batch API: /v1/files, /v1/batches (the `openai` client's files and batches)
  ops/        /health, /info, the landing page and the explorers
  usage/      /v1/usage: the calling key's limits and where it stands now

APIs import only the front (service/front) and the engine (service/engine), never a transport or
another API (tests/test_layout.py keeps it so).
"""

from functools import cache

from service.apis import cohere, kserve_v2, native, openai, openai_batch, ops, tei, usage, vllm
from service.front.policy import Api, PathPolicies

APIS: tuple[Api, ...] = (native.API, openai.API, kserve_v2.API, tei.API, cohere.API, vllm.API, openai_batch.API, ops.API, usage.API)


@cache
def path_policies() -> PathPolicies:
    """Every declared HTTP route's policy, built once per process from the declarations."""
    return PathPolicies.of_apis(APIS)
