"""Cohere's API v2 (routes.py), so that a script written for Cohere (the `cohere` SDK's ClientV2) changes
only its base URL: POST /v2/embed and POST /v2/rerank; bodies in schemas.py, errors in Cohere's body."""

from service.front.policy import Api


def cohere_error_body(status: int, type_: str, message: str, request_id: str | None) -> tuple[int, dict]:
    """Cohere's `{"id", "message"}` (the id is the request's X-Request-Id), with our status."""
    return status, {"id": request_id, "message": message}


API = Api(
    name="cohere",
    routes=("service.apis.cohere.routes",),
    inference=frozenset({"POST /v2/embed", "POST /v2/rerank"}),
    error_style=cohere_error_body,
)
