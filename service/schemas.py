"""Request and response schemas of every route, with limits and examples per field.

Requests are validated strictly (no silent coercion of "3" to 3, unknown fields refused on our
native routes); the OpenAI and v2 schemas ignore unknown fields, as their clients expect.
Response models document the shapes in OpenAPI; responses themselves are built as dicts and
serialised with orjson, since validating megabytes of floats on the way out buys nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Schema-level caps; the configured (smaller) limits are checked in the routes, with 413.
SCHEMA_MAX_INPUTS = 4096
SCHEMA_MAX_INDEXES = 1024

Texts = str | list[str]


def as_list(inputs: Texts) -> list[str]:
    return [inputs] if isinstance(inputs, str) else list(inputs)


def check_text_list(value: Any, field: str) -> Any:
    """A list of texts must be non-empty and within the schema cap (the configured cap is a 413 later)."""
    if isinstance(value, list) and not value:
        raise ValueError(f"{field} must not be an empty list")
    if isinstance(value, list) and len(value) > SCHEMA_MAX_INPUTS:
        raise ValueError(f"at most {SCHEMA_MAX_INPUTS} {field}")
    return value


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class AttentionSpec(_Request):
    """Which attention weights to return, and how."""

    layers: list[int] | None = Field(
        None, max_length=SCHEMA_MAX_INDEXES, description="layer indexes (0-based); null: all", examples=[[0, 5]]
    )
    heads: list[int] | None = Field(
        None, max_length=SCHEMA_MAX_INDEXES, description="head indexes (0-based); null: all", examples=[[0]]
    )
    format: Literal["float", "base64"] = Field(
        "float", description="nested JSON floats, or base64 of little-endian bytes with shape and dtype"
    )
    dtype: Literal["float32", "float16"] = "float32"


class EncodeRequest(_Request):
    inputs: Texts = Field(description="a text or a list of texts", examples=["The cat sat on the mat."])
    truncate: bool = Field(True, description="cut texts at the model's limit; false: refuse longer texts (413)")
    normalize: bool | None = Field(None, description="L2-normalise the embedding; null: as the model was trained")
    embedding: bool = Field(True, description="return the pooled sentence embedding")
    token_embeddings: bool = Field(False, description="return one vector per real token")
    tokens: bool = Field(False, description="return tokens with ids and character offsets")
    attention: AttentionSpec | None = Field(None, description="return attention weights (trimmed to real tokens)")
    encoding_format: Literal["float", "base64"] = Field(
        "float",
        description="embedding and token_embeddings as JSON floats, or base64 of little-endian float32 "
        "(shape [hidden] and [n_tokens, hidden]): about a third of the bytes, and no float parsing",
    )

    @field_validator("inputs")
    @classmethod
    def _non_empty(cls, value: Texts) -> Texts:
        return check_text_list(value, "inputs")


class TokenizeRequest(_Request):
    inputs: Texts = Field(examples=[["Hello world", "Grüße"]])
    truncate: bool = True

    @field_validator("inputs")
    @classmethod
    def _non_empty(cls, value: Texts) -> Texts:
        return check_text_list(value, "inputs")


class Token(BaseModel):
    id: int
    token: str
    start: int = Field(description="character offset of the token's first character in the text")
    end: int = Field(description="character offset one past its last character")
    special: bool


class AttentionOut(BaseModel):
    layers: list[int]
    heads: list[int]
    shape: list[int] = Field(description="[layers, heads, tokens, tokens]")
    dtype: Literal["float32", "float16"]
    format: Literal["float", "base64"]
    data: Any = Field(description="nested lists, or a base64 string of little-endian values in C order")


class EncodeItem(BaseModel):
    index: int
    n_tokens: int
    embedding: list[float] | str | None = Field(None, description="floats, or base64 (encoding_format)")
    token_embeddings: list[list[float]] | str | None = Field(None, description="floats, or base64 (encoding_format)")
    tokens: list[Token] | None = None
    attention: AttentionOut | None = None


class Usage(BaseModel):
    tokens: int


class EncodeResponse(BaseModel):
    model: str
    data: list[EncodeItem]
    usage: Usage


class TokenizeItem(BaseModel):
    index: int
    tokens: list[Token]
    truncated: bool


class TokenizeResponse(BaseModel):
    model: str
    data: list[TokenizeItem]


# --- OpenAI-compatible /v1/embeddings -------------------------------------------------------


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: Texts = Field(examples=[["first text", "second text"]])
    model: str | None = Field(None, description="must be the served model's name when given")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first N dimensions, re-normalised")
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _texts_only(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not all(isinstance(v, str) for v in value):
            raise ValueError("input must be a string or a list of strings (token arrays are not accepted)")
        return check_text_list(value, "input")


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


# --- Open Inference Protocol v2 --------------------------------------------------------------


class V2Tensor(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class V2RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    parameters: dict[str, Any] | None = None


class V2InferRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[V2Tensor] = Field(min_length=1, max_length=8)
    outputs: list[V2RequestedOutput] | None = Field(None, max_length=16)


class V2TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class V2ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[V2TensorMetadata]
    outputs: list[V2TensorMetadata]


class ErrorBody(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody
