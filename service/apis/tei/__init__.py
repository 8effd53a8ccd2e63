"""text-embeddings-inference's API (routes.py), so that clients written for TEI change only their URL:
POST /embed, /embed_sparse, /embed_all, /rerank, /predict, /tokenize, /decode and POST / ; bodies in schemas.py, errors
in TEI's body with TEI's statuses (below)."""

from service.front.policy import Api

# text-embeddings-inference's error types and statuses (its router's server.rs), which its clients read
# (Haystack's TEI ranker raises on `error_type`); kinds TEI does not have keep our status
TEI_ERRORS = {
    "validation": ("Validation", 422),
    "bad_request": ("Validation", 422),
    "empty": ("Empty", 400),
    "too_large": ("Validation", 413),
    "overloaded": ("Overloaded", 429),
    "timeout": ("Overloaded", 429),  # past its deadline in the queue: overloaded, worth a retry later
    "not_ready": ("Unhealthy", 503),
    "backend": ("Backend", 424),
    "requests": ("Overloaded", 429),  # a key past its limits (TEI's own 429 is its queue's)
    "tokens": ("Overloaded", 429),
    "concurrent": ("Overloaded", 429),
}


def tei_error_body(status: int, type_: str, message: str, request_id: str | None) -> tuple[int, dict]:
    """TEI's `{"error": message, "error_type"}`, with TEI's status for the type."""
    tei_type, tei_status = TEI_ERRORS.get(type_, (type_.replace("_", " ").title().replace(" ", ""), status))
    return tei_status, {"error": message, "error_type": tei_type}


API = Api(
    name="tei",
    routes=("service.apis.tei.routes",),
    inference=frozenset(f"POST {path}" for path in ("/", "/embed", "/embed_sparse", "/embed_all", "/rerank", "/predict", "/tokenize",
                                                     "/decode")),
    error_style=tei_error_body,
)
