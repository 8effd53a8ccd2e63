"""Cohere's API v2 bodies (/v2/embed, /v2/rerank)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.front.schemas import SCHEMA_MAX_INPUTS


# ---- Cohere's API v2 (service/apis/cohere/routes.py) ----


class _CohereRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


CohereInputType = Literal["search_document", "search_query", "classification", "clustering", "image"]
CohereEmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class CohereEmbedRequest(_CohereRequest):
    model: str = Field(description="a served model's name, or one of its aliases (GET /v1/models)")
    input_type: CohereInputType = Field(
        description="the kind of text: onto the model's prompt of that name, else search_query (and classification, "
        "clustering) onto its `query` prompt and search_document onto `document`; image is refused (text only)")
    texts: list[str] | None = Field(None, max_length=SCHEMA_MAX_INPUTS, examples=[["hello", "goodbye"]])
    images: list[str] | None = Field(None, description="not served: this is a text encoder")
    inputs: list[Any] | None = Field(None, description="not served: send `texts`")
    embedding_types: list[CohereEmbeddingType] = Field(
        ["float"], min_length=1, max_length=6, description="float; base64 (little-endian float32 bytes); binary and "
        "ubinary (one bit per dimension, > 0, packed as sentence-transformers' quantize_embeddings packs them); int8 "
        "and uint8 need calibration ranges, which no bundle ships: refused")
    output_dimension: int | None = Field(None, ge=1, description="keep the first N dimensions (re-normalised); only "
                                         "for a model trained for it (matryoshka), else 400")
    truncate: Literal["NONE", "START", "END"] = Field("END", description="past the model's limit (or max_tokens): "
                                                      "cut the end, the start, or refuse (NONE)")
    max_tokens: int | None = Field(None, ge=1, description="cut each text to this many tokens first (truncate's end)")


class CohereRerankRequest(_CohereRequest):
    model: str = Field(description="a served cross-encoder's name, or one of its aliases (GET /v1/models)")
    query: str = Field(examples=["What is the capital of the United States?"])
    documents: list[str] = Field(max_length=SCHEMA_MAX_INPUTS, examples=[["Carson City is ...", "Washington, D.C. is ..."]])
    top_n: int | None = Field(None, ge=1, description="return the N most relevant documents; null: all")
    max_tokens_per_doc: int | None = Field(None, ge=1, description="cut each document to this many tokens first "
                                           "(default 4096, as Cohere's; the model's own limit still applies)")


class CohereRerankResult(BaseModel):
    index: int
    relevance_score: float = Field(description="CrossEncoder.predict's score: the logit through the model's saved "
                                   "activation (a sigmoid, in [0, 1], unless the model saved another)")


class CohereRerankResponse(BaseModel):
    id: str | None
    results: list[CohereRerankResult] = Field(description="most relevant first")
    meta: dict


class CohereEmbedResponse(BaseModel):
    id: str | None
    response_type: Literal["embeddings_by_type"] = "embeddings_by_type"
    embeddings: dict[str, list[Any]] = Field(description="one list per requested type, in the order of `texts`")
    texts: list[str]
    meta: dict
