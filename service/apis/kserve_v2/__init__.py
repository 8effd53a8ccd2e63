"""The Open Inference Protocol v2 (KServe, Triton), its semantics once (semantics.py) and mounted on
both transports: over HTTP with JSON or binary tensors (http.py) and over gRPC (grpc.py: the service
kserve_v2.proto defines, which messages.py compiles); bodies in schemas.py, errors in the protocol's body over
HTTP (`{"error": message}`, with our type and request id beside it) and as status codes over gRPC."""

from service.apis.kserve_v2.messages import SERVICE
from service.front.policy import Api


def v2_error_body(status: int, type_: str, message: str, request_id: str | None) -> tuple[int, dict]:
    """The protocol's `{"error": message}` (tritonclient.http raises its exception with that string and formats
    it into its message: a dict there breaks the client), with our error type and the call's id beside it."""
    body = {"error": message, "type": type_}
    if request_id is not None:
        body["request_id"] = request_id
    return status, body


_MODEL = "/v2/models/{name}"
API = Api(
    name="kserve_v2",
    routes=("service.apis.kserve_v2.http",),
    # loading and unloading a model: the token when authentication is on, as inference
    inference=frozenset({f"POST {_MODEL}/infer", f"POST {_MODEL}/versions/{{version}}/infer",
                         "POST /v2/repository/models/{name}/load", "POST /v2/repository/models/{name}/unload"}),
    open=frozenset({"GET /v2", "GET /v2/health/live", "GET /v2/health/ready", f"GET {_MODEL}",
                    f"GET {_MODEL}/versions/{{version}}", f"GET {_MODEL}/ready", f"GET {_MODEL}/versions/{{version}}/ready",
                    "POST /v2/repository/index"}),
    error_style=v2_error_body,
    grpc="service.apis.kserve_v2.grpc",
    grpc_inference=frozenset(f"/{SERVICE}/{m}" for m in ("ModelInfer", "RepositoryModelLoad", "RepositoryModelUnload")),
    grpc_open=frozenset(f"/{SERVICE}/{m}" for m in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                                                     "ModelMetadata", "RepositoryIndex")),
)
