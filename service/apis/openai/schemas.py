"""OpenAI's embeddings API bodies (/v1/embeddings)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.front.schemas import INPUT_TYPE, PROMPT_NAME, Chunking, OpenAIUsage, Texts, strings_only


# --- OpenAI-compatible /v1/embeddings -------------------------------------------------------


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: Texts = Field(examples=[["first text", "second text"]])
    model: str | None = Field(None, description="a served model's name (GET /v1/models); required when several are served")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first N dimensions, re-normalised; only for a "
                                   "model trained for it (matryoshka: GET /v1/models lists its sizes), else 400")
    user: str | None = None
    prompt_name: str | None = PROMPT_NAME
    input_type: Literal["query", "document"] | None = INPUT_TYPE
    chunking: Chunking | None = Field(
        None, description="not OpenAI's: texts past the model's limit as overlapping token windows, the embedding "
        "the normalised mean of the chunks' (see /v1/encode for each chunk's)")

    @field_validator("input", mode="before")
    @classmethod
    def _texts_only(cls, value: Any) -> Any:
        return strings_only(value, " (token arrays are not accepted)")


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage
