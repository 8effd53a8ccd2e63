"""The request-body building blocks every JSON API shares (the limits on texts, the strict base,
prompts, chunking, token usage) and our error body. Each API's own bodies are in its schemas.py.

Requests are validated strictly (no silent coercion of "3" to 3, unknown fields refused on our
native routes); the OpenAI and v2 schemas ignore unknown fields, as their clients expect.
Response models document the shapes in OpenAPI; responses themselves are built as dicts and
serialised with orjson, since validating megabytes of floats on the way out buys nothing.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Schema-level caps; the configured (smaller) limits are checked in the routes, with 413.
SCHEMA_MAX_INPUTS = 4096
SCHEMA_MAX_INDEXES = 1024

Texts = str | list[str]


def check_text_list(value: Any, field: str) -> Any:
    """A list of texts must be non-empty and within the schema cap (the configured cap is a 413 later)."""
    if isinstance(value, list) and not value:
        raise ValueError(f"{field} must not be an empty list")
    if isinstance(value, list) and len(value) > SCHEMA_MAX_INPUTS:
        raise ValueError(f"at most {SCHEMA_MAX_INPUTS} {field}")
    return value


def strings_only(value: Any, note: str = "") -> Any:
    """`input` as a string or a list of strings (never token ids or other values), then as
    check_text_list checks it: the OpenAI and classify requests both take texts only."""
    if isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
        raise ValueError("input must be a string or a list of strings" + note)
    return check_text_list(value, "input")


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

class Chunking(StrictRequest):
    """Long texts as token windows: each chunk embedded, the text's embedding their normalised mean."""

    tokens: int = Field(ge=8, le=8192, description="tokens per chunk, special tokens included; at most the model's "
                        "limit (max_tokens in /info)", examples=[256])
    overlap: int = Field(0, ge=0, le=8192, description="tokens a chunk repeats from the one before", examples=[32])


PROMPT_NAME = Field(None, description="one of the model's prompts (GET /v1/models lists them), put before every "
                   "input as sentence-transformers' encode(prompt_name=...) does; default: the model's "
                   "default_prompt_name, if any")
INPUT_TYPE = Field(None, description="query or document (Cohere's convention): the model's prompt of that name, "
                   "where it has one; prompt_name wins")


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ErrorBody(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


ERROR_RESPONSES = {code: {"model": ErrorResponse} for code in (401, 404, 413, 422, 429, 503)}
