"""OpenAI's Batch API: POST/GET/DELETE /v1/files, POST/GET /v1/batches, POST /v1/batches/{id}/cancel
(routes.py), so that the `openai` SDK's `client.files` and `client.batches` work unchanged. Files and
batches live in settings.jobs_dir (store.py); a batch's lines are run by runner.py beside the online
requests, and answered as the routes they name answer. Every route needs the token (a token sees only its
own files and batches), so all are declared inference routes: the gate refuses a request without it before
its body is read (an upload included); errors in our body, as /v1/embeddings'.
"""

from service.front.policy import Api

API = Api(
    name="openai_batch",
    routes=("service.apis.openai_batch.routes",),
    inference=frozenset({
        "POST /v1/files", "GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content", "DELETE /v1/files/{file_id}",
        "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{batch_id}", "POST /v1/batches/{batch_id}/cancel",
    }),
)

UPLOAD_PATH = "/v1/files"


def body_limits(max_body_bytes: int, batch_max_file_bytes: int) -> dict[str, int]:
    """The body limit of the upload route (the file's limit plus what multipart adds), where it exceeds the
    service's body limit; the route itself counts the file's bytes exactly as they stream in."""
    from service.apis.openai_batch.routes import UPLOAD_ALLOWANCE

    return {UPLOAD_PATH: max(max_body_bytes, batch_max_file_bytes + UPLOAD_ALLOWANCE)}
