"""vLLM's score API (routes.py): POST /v1/score and its alias POST /score, `text_1` against `text_2`, so
that a script written for a vLLM pooling server changes only its URL; bodies in schemas.py, errors in
vLLM's body (below)."""

from http import HTTPStatus

from service.front.policy import Api


def vllm_error_body(status: int, type_: str, message: str, request_id: str | None) -> tuple[int, dict]:
    """vLLM's `{"error": {"message", "type", "param", "code"}}` (its ErrorResponse): the type is the status's
    name as vLLM writes it (400 BadRequestError, 404 NotFoundError), the code the status; our statuses."""
    try:
        name = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:  # 499: the client left; nobody reads it
        name = type_.replace("_", " ").title().replace(" ", "")
    return status, {"error": {"message": message, "type": f"{name}Error", "param": None, "code": status}}


API = Api(
    name="vllm",
    routes=("service.apis.vllm.routes",),
    inference=frozenset({"POST /v1/score", "POST /score"}),
    error_style=vllm_error_body,
)
