"""The native API: /v1/encode and /v1/tokenize (encode.py), the attention product /v1/attention and
/v1/similarity (attention.py), and the heads /v1/rerank and /v1/classify (heads.py); bodies in
schemas.py, errors in our body (`{"error": {"type", "message", "request_id"}}`)."""

from service.front.policy import Api

API = Api(
    name="native",
    routes=("service.apis.native.encode", "service.apis.native.attention", "service.apis.native.heads"),
    inference=frozenset({"POST /v1/encode", "POST /v1/tokenize", "POST /v1/attention", "POST /v1/similarity",
                         "POST /v1/rerank", "POST /v1/classify"}),
)
