"""The Open Inference Protocol v2 (KServe, Triton), its semantics once (semantics.py) and mounted on
both transports: over HTTP with JSON or binary tensors (http.py) and over gRPC (grpc.py: the service
kserve_v2.proto defines, which messages.py compiles); bodies in schemas.py, errors in our body over
HTTP and as status codes over gRPC."""

from service.apis.kserve_v2.messages import SERVICE
from service.front.policy import Api

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
    grpc="service.apis.kserve_v2.grpc",
    grpc_inference=frozenset(f"/{SERVICE}/{m}" for m in ("ModelInfer", "RepositoryModelLoad", "RepositoryModelUnload")),
    grpc_open=frozenset(f"/{SERVICE}/{m}" for m in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                                                     "ModelMetadata", "RepositoryIndex")),
)
