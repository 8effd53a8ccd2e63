"""What operators, probes and people open: GET /health and GET /info (health.py); the landing page and
the attention and rerank explorers with their assets (explorer.py). All open: probes and browsers carry
no token (the explorers' own calls to the native API do)."""

from service.front.policy import Api

API = Api(
    name="ops",
    routes=("service.apis.ops.health", "service.apis.ops.explorer"),
    open=frozenset({"GET /health", "GET /info", "GET /", "GET /explorer", "GET /explorer/rerank",
                    "GET /explorer/assets/{name}"}),
)
