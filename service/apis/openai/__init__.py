"""OpenAI's embeddings API (routes.py): POST /v1/embeddings and the model list, GET /v1/models and
/v1/models/{name}, so that the official `openai` client works unchanged; bodies in schemas.py."""

from service.front.policy import Api

API = Api(
    name="openai",
    routes=("service.apis.openai.routes",),
    inference=frozenset({"POST /v1/embeddings"}),
    open=frozenset({"GET /v1/models", "GET /v1/models/{name}"}),
)
