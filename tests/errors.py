"""What an error body says, whichever API's style it is in (service/front/errors.py ours, and the styles the
APIs declare): its message and its type."""

from __future__ import annotations

import httpx


def error_message(r: httpx.Response) -> str:
    """Ours and OpenAI's and vLLM's `{"error": {"message"}}`; KServe v2's and TEI's `{"error": message}`;
    Cohere's `{"message"}`."""
    body = r.json()
    if isinstance(body.get("error"), dict):
        return body["error"]["message"]
    return body["error"] if "error" in body else body["message"]


def error_type(r: httpx.Response) -> str:
    """Our error type: ours in `error.type`, KServe v2's beside its message (`type`), TEI's `error_type`."""
    body = r.json()
    if isinstance(body.get("error"), dict):
        return body["error"]["type"]
    return body.get("type") or body["error_type"]
