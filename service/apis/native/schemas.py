"""The native API's bodies: /v1/encode and /v1/tokenize, the attention product (/v1/attention,
/v1/similarity), and the heads (/v1/rerank, /v1/classify)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.front.schemas import (PROMPT_NAME, SCHEMA_MAX_INDEXES, SCHEMA_MAX_INPUTS, Chunking, OpenAIUsage, StrictRequest, Texts, check_text_list, strings_only)


class AttentionSpec(StrictRequest):
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


class EncodeRequest(StrictRequest):
    model: str | None = Field(None, description="which served model (GET /v1/models); default: the first listed")
    inputs: Texts = Field(description="a text or a list of texts", examples=["The cat sat on the mat."])
    prompt_name: str | None = PROMPT_NAME
    input_type: Literal["query", "document"] | None = Field(
        None, description="query or document (Cohere's convention): the model's prompt of that name, where it has one "
        "(prompt_name wins); on a ColBERT model, its query or document marker and a query's expansion (null: "
        "document)")
    truncate: bool = Field(True, description="cut texts at the model's limit; false: refuse longer texts (413)")
    normalize: bool | None = Field(None, description="L2-normalise the embedding; null: as the model was trained")
    embedding: bool | None = Field(None, description="return the pooled sentence embedding; null: where the model "
                                   "has one (a SPLADE or ColBERT model has none)")
    sparse: bool = Field(False, description="return the sparse vector (SPLADE, BGE-M3): vocabulary ids and weights, "
                         "zeros left out, from the same forward pass")
    sparse_tokens: bool = Field(False, description="with sparse: the token string of each index")
    top_k: int | None = Field(None, ge=1, description="with sparse: only the k largest weights (in index order)")
    multivector: bool = Field(False, description="return one vector per kept token (ColBERT, BGE-M3), for MaxSim")
    token_embeddings: bool = Field(False, description="return one vector per real token")
    tokens: bool = Field(False, description="return tokens with ids and character offsets")
    attention: AttentionSpec | None = Field(None, description="return attention weights (trimmed to real tokens)")
    chunking: Chunking | None = Field(
        None, description="texts past the model's limit as overlapping token windows: each chunk's embedding with "
        "its character span, the text's embedding the normalised mean of its chunks (embeddings only)")
    encoding_format: Literal["float", "base64"] = Field(
        "float",
        description="embedding and token_embeddings as JSON floats, or base64 of little-endian float32 "
        "(shape [hidden] and [n_tokens, hidden]): about a third of the bytes, and no float parsing",
    )

    @field_validator("inputs")
    @classmethod
    def _non_empty(cls, value: Texts) -> Texts:
        return check_text_list(value, "inputs")


class TokenizeRequest(StrictRequest):
    model: str | None = Field(None, description="which served model (GET /v1/models); default: the first listed")
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


class Chunk(BaseModel):
    start: int = Field(description="character offset of the chunk's first real token in the text")
    end: int = Field(description="character offset one past its last real token")
    n_tokens: int
    embedding: list[float] | str = Field(description="floats, or base64 (encoding_format)")


class SparseVector(BaseModel):
    indices: list[int] = Field(description="vocabulary ids, ascending")
    values: list[float] = Field(description="their weights (none is 0)")
    tokens: list[str] | None = Field(None, description="with sparse_tokens: each id's token")


class MultiVector(BaseModel):
    shape: list[int] = Field(description="[kept tokens, dim]")
    data: list[list[float]] | str = Field(description="one vector per kept token: floats, or base64 of little-endian "
                                          "float32 in C order (encoding_format)")


class EncodeItem(BaseModel):
    index: int
    n_tokens: int
    embedding: list[float] | str | None = Field(None, description="floats, or base64 (encoding_format)")
    token_embeddings: list[list[float]] | str | None = Field(None, description="floats, or base64 (encoding_format)")
    tokens: list[Token] | None = None
    attention: AttentionOut | None = None
    chunks: list[Chunk] | None = Field(None, description="with chunking: each chunk, in text order")
    sparse: SparseVector | None = None
    multivector: MultiVector | None = None


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


# --- The attention product: /v1/attention and /v1/similarity ---------------------------------

Summary = Literal["rollout", "entropy", "top_k"]
Level = Literal["token", "word"]


class AttentionRequest(StrictRequest):
    model: str | None = Field(None, description="which served model (GET /v1/models); default: the first listed")
    inputs: Texts = Field(description="a text or a list of texts", examples=["The cat sat on the mat."])
    layers: list[int] | None = Field(
        None, max_length=SCHEMA_MAX_INDEXES, description="layer indexes (0-based, any order; used in model order); null: all"
    )
    heads: list[int] | None = Field(
        None, max_length=SCHEMA_MAX_INDEXES, description="head indexes (0-based); null: all"
    )
    level: Level = Field("token", description="units: tokens, or words (a word's pieces joined; special tokens alone)")
    weights: bool = Field(False, description="also return the selected layers' and heads' matrices")
    format: Literal["float", "base64", "bertviz"] = Field(
        "float",
        description="weights as nested floats, base64 (with shape and dtype), or bertviz's own input: "
        "`tokens` and `attention` (one [1, heads, n, n] list per layer; implies weights)",
    )
    dtype: Literal["float32", "float16"] = Field("float32", description="of base64 weights")
    summaries: list[Summary] = Field(
        ["rollout", "entropy", "top_k"], max_length=3, description="which summaries to compute (may be empty)"
    )
    top_k: int = Field(3, ge=1, le=SCHEMA_MAX_INDEXES, description="units per query unit in top_k")
    truncate: bool = Field(True, description="cut texts at the model's limit; false: refuse longer texts (413)")

    @field_validator("inputs")
    @classmethod
    def _non_empty(cls, value: Texts) -> Texts:
        return check_text_list(value, "inputs")

    @field_validator("summaries")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"duplicate summaries in {value}")
        return value


class Unit(BaseModel):
    text: str = Field(description="the token, or the word as written in the text (special tokens as tokens)")
    start: int = Field(description="character offset of its first character")
    end: int = Field(description="character offset one past its last character")
    special: bool
    tokens: list[int] = Field(description="the token positions it is made of")


class AttentionItem(BaseModel):
    index: int
    n_tokens: int
    n_units: int
    units: list[Unit]
    rollout: list[list[float]] | None = Field(
        None, description="[n_units, n_units]: row i says how much unit i's final representation draws from each unit"
    )
    entropy: list[list[float]] | None = Field(None, description="[layers, heads]: mean attention entropy in nats")
    top_k: list[list[list[float]]] | None = Field(None, description="per query unit, [unit index, rollout weight] pairs")
    attention: AttentionOut | list[Any] | None = Field(
        None, description="the weights (with weights: true); with format bertviz, one [1, heads, n, n] list per layer"
    )
    tokens: list[str] | None = Field(None, description="with format bertviz: the units' texts, as bertviz takes them")


class AttentionResponse(BaseModel):
    model: str
    level: Level
    layers: list[int]
    heads: list[int]
    data: list[AttentionItem]
    usage: Usage


class SimilarityRequest(StrictRequest):
    model: str | None = Field(None, description="which served model (GET /v1/models); default: the first listed")
    pairs: list[list[str]] = Field(
        min_length=1, max_length=SCHEMA_MAX_INPUTS, description="pairs of texts, [[a, b], ...]",
        examples=[[["A man is eating food.", "A man is eating a piece of bread."]]],
    )
    explain: bool = Field(False, description="also return each unit's contribution to the score")
    level: Level = Field("token", description="contributions per token, or per word (the sum of its pieces)")
    truncate: bool = True

    @field_validator("pairs")
    @classmethod
    def _two_texts(cls, value: list[list[str]]) -> list[list[str]]:
        for i, pair in enumerate(value):
            if len(pair) != 2:
                raise ValueError(f"pair {i} has {len(pair)} texts; a pair is [text_a, text_b]")
        return value


class ExplainedUnit(Unit):
    contribution: float = Field(description="this unit's share of the score; a text's shares sum to it")


class ExplainedText(BaseModel):
    units: list[ExplainedUnit]


class SimilarityItem(BaseModel):
    index: int
    score: float = Field(description="cosine similarity of the two texts' pooled embeddings")
    texts: list[ExplainedText] | None = Field(None, description="with explain: the two texts' units and contributions")


class SimilarityResponse(BaseModel):
    model: str
    pooling: str
    level: Level
    note: str | None = None
    data: list[SimilarityItem]
    usage: Usage


# ---- heads: rerank and classify (sequence-classification bundles) ----


class RerankRequest(BaseModel):
    """The Jina/Cohere rerank shape that vLLM and infinity accept."""

    model_config = ConfigDict(extra="ignore")

    query: str = Field(examples=["How do I reset my password?"])
    documents: list[str] = Field(examples=[["Click 'Forgot password' on the sign-in page.", "Paris is in France."]])
    model: str | None = Field(None, description="a served classification model (GET /v1/models); left out: the first")
    top_n: int | None = Field(None, ge=1, description="return the N best documents; null: all")
    return_documents: bool = Field(False, description="include each document's text in its result")
    raw_scores: bool = Field(False, description="the logit itself instead of the model's score activation "
                             "(score_activation in GET /info; a sigmoid unless the model saved another)")
    truncate: bool = Field(True, description="cut the longer side of a pair past the model's limit; false: 413")
    explain: bool = Field(False, description="per result, every word of query and document with its occlusion "
                          "(the score minus the score without it) and its share of the first token's attention "
                          "rollout; each word costs an inference (max_explain_words)")

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, value: Any) -> Any:
        if isinstance(value, list) and not all(isinstance(v, str) for v in value):
            raise ValueError("documents must be a list of strings")
        return check_text_list(value, "documents")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float = Field(description="what sentence-transformers' CrossEncoder.predict gives: the logit "
                                   "through the activation saved with the model (score_activation in GET /info), "
                                   "or the logit itself with raw_scores; on a ColBERT, PyLate's MaxSim; on BGE-M3, "
                                   "FlagEmbedding's colbert+sparse+dense")
    document: RerankDocument | None = None
    explanation: dict[str, Any] | None = Field(
        None, description="with explain: a cross-encoder's words (occlusion, rollout); a late-interaction model's "
        "maxsim (each query token's best document token, its similarity and share), and for BGE-M3 its three "
        "scores, their weights and the terms query and document share")


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    model: str
    results: list[RerankResult] = Field(description="sorted by relevance_score, best first")
    usage: RerankUsage


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: Texts = Field(examples=[["I loved it", "It broke after a day"]])
    model: str | None = Field(None, description="a served classification model (GET /v1/models); left out: the first")
    truncate: bool = Field(True, description="cut texts past the model's limit; false: 413")
    explain: bool = Field(False, description="per input, every word with its occlusion (the top label's score "
                          "minus its score without the word) and its share of the first token's attention rollout")

    @field_validator("input", mode="before")
    @classmethod
    def _texts_only(cls, value: Any) -> Any:
        return strings_only(value)


class LabelScore(BaseModel):
    label: str
    score: float


class Classification(BaseModel):
    index: int
    labels: list[LabelScore] = Field(description="every label, best first: softmax, sigmoid per label, or the value "
                                     "(regression), as the checkpoint's problem_type says")


class ClassifyResponse(BaseModel):
    model: str
    data: list[Classification]
    usage: OpenAIUsage
