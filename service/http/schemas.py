"""Request and response schemas of every route, with limits and examples per field.

Requests are validated strictly (no silent coercion of "3" to 3, unknown fields refused on our
native routes); the OpenAI and v2 schemas ignore unknown fields, as their clients expect.
Response models document the shapes in OpenAPI; responses themselves are built as dicts and
serialised with orjson, since validating megabytes of floats on the way out buys nothing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

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


class Chunking(_Request):
    """Long texts as token windows: each chunk embedded, the text's embedding their normalised mean."""

    tokens: int = Field(ge=8, le=8192, description="tokens per chunk, special tokens included; at most the model's "
                        "limit (max_tokens in /info)", examples=[256])
    overlap: int = Field(0, ge=0, le=8192, description="tokens a chunk repeats from the one before", examples=[32])


PROMPT_NAME = Field(None, description="one of the model's prompts (GET /v1/models lists them), put before every "
                   "input as sentence-transformers' encode(prompt_name=...) does; default: the model's "
                   "default_prompt_name, if any")
INPUT_TYPE = Field(None, description="query or document (Cohere's convention): the model's prompt of that name, "
                   "where it has one; prompt_name wins")


class EncodeRequest(_Request):
    model: str | None = Field(None, description="which served model (GET /v1/models); default: the first listed")
    inputs: Texts = Field(description="a text or a list of texts", examples=["The cat sat on the mat."])
    prompt_name: str | None = PROMPT_NAME
    input_type: Literal["query", "document"] | None = INPUT_TYPE
    truncate: bool = Field(True, description="cut texts at the model's limit; false: refuse longer texts (413)")
    normalize: bool | None = Field(None, description="L2-normalise the embedding; null: as the model was trained")
    embedding: bool = Field(True, description="return the pooled sentence embedding")
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


class TokenizeRequest(_Request):
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


class EncodeItem(BaseModel):
    index: int
    n_tokens: int
    embedding: list[float] | str | None = Field(None, description="floats, or base64 (encoding_format)")
    token_embeddings: list[list[float]] | str | None = Field(None, description="floats, or base64 (encoding_format)")
    tokens: list[Token] | None = None
    attention: AttentionOut | None = None
    chunks: list[Chunk] | None = Field(None, description="with chunking: each chunk, in text order")


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


class AttentionRequest(_Request):
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


class SimilarityRequest(_Request):
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


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


# --- Open Inference Protocol v2 --------------------------------------------------------------


def _null_as_empty(value: Any) -> Any:
    """`"parameters": null` reads as no parameters, as it always has."""
    return {} if value is None else value


class _V2Parameters(BaseModel):
    """The v2 parameters this server reads, typed strictly: the binary tensor data extension's flags are
    JSON booleans (tritonclient sends `true`/`false`), so the string "false" is a 422 that names the
    parameter, never read as true. Parameters this server does not read (Triton's sequence_id,
    priority, timeout, a client's own) are ignored, as the protocol allows."""

    model_config = ConfigDict(extra="ignore", strict=True)


class V2InferParameters(_V2Parameters):
    truncate: bool = Field(True, description="Cut a text past the model's limit; false refuses it (413). "
                                             "This server's own parameter.")
    binary_data_output: bool = Field(False, description="Return every output as binary data, unless its own "
                                                        "`binary_data` says otherwise (binary tensor data extension).")
    prompt_name: str | None = Field(None, description="An embedding model's prompt, put before every text (GET "
                                    "/v1/models lists them); default: its default_prompt_name. This server's own.")
    input_type: Literal["query", "document"] | None = Field(
        None, description="query or document: the embedding model's prompt of that name, where it has one; "
        "prompt_name wins. This server's own.")


class V2InputParameters(_V2Parameters):
    binary_data_size: int | None = Field(None, ge=0, description="Bytes of this input in the binary tail after "
                                                                 "the JSON; left out, the input's `data` is JSON.")


class V2OutputParameters(_V2Parameters):
    binary_data: bool | None = Field(None, description="This output as binary data (true) or JSON (false); left "
                                                       "out, the request's `binary_data_output` decides.")


class V2Tensor(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    shape: list[int]
    datatype: str
    parameters: Annotated[V2InputParameters, BeforeValidator(_null_as_empty)] = Field(default_factory=V2InputParameters)
    data: list[Any] | None = None


class V2RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    parameters: Annotated[V2OutputParameters, BeforeValidator(_null_as_empty)] = Field(default_factory=V2OutputParameters)


class V2InferRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    parameters: Annotated[V2InferParameters, BeforeValidator(_null_as_empty)] = Field(default_factory=V2InferParameters)
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
                                   "or the logit itself with raw_scores")
    document: RerankDocument | None = None


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


# ---- text-embeddings-inference's routes (routes/tei.py): its field names, defaults and types ----


class _TEIRequest(BaseModel):
    """TEI ignores fields it does not read (huggingface_hub sends `encoding_format`, older clients a
    `parameters` object, which routes/tei.py reads); the fields it reads are typed strictly."""

    model_config = ConfigDict(extra="ignore", strict=True)


TruncationDirection = Literal["right", "left", "Right", "Left"]
TEI_MODEL = Field(None, description="not TEI's (it serves one model): which served model; left out, the first of "
                  "the route's task, as TEI's one model")
TEI_TRUNCATE = Field(None, description="cut inputs past the model's limit (TEI's auto-truncate, on by default "
                     "here); false: refuse them")
TEI_DIRECTION = Field("right", description="which end truncation cuts: right (the end) or left (the start)")


class TEIEmbedRequest(_TEIRequest):
    model: str | None = TEI_MODEL
    inputs: str | list[str] = Field(examples=[["first text", "second text"]])
    normalize: bool = Field(True, description="L2-normalise each embedding (TEI's default: true)")
    truncate: bool | None = TEI_TRUNCATE
    truncation_direction: TruncationDirection = TEI_DIRECTION
    prompt_name: str | None = PROMPT_NAME
    dimensions: int | None = Field(None, ge=1, description="keep the first N dimensions (then normalise); only "
                                   "for a model trained for it (matryoshka), else 422")


class TEIEmbedAllRequest(_TEIRequest):
    model: str | None = TEI_MODEL
    inputs: str | list[str] = Field(examples=["The cat sat on the mat."])
    truncate: bool | None = TEI_TRUNCATE
    truncation_direction: TruncationDirection = TEI_DIRECTION
    prompt_name: str | None = PROMPT_NAME


class TEIRerankRequest(_TEIRequest):
    model: str | None = TEI_MODEL
    query: str = Field(examples=["What is Deep Learning?"])
    texts: list[str] = Field(max_length=SCHEMA_MAX_INPUTS, examples=[["Deep Learning is ...", "Paris is ..."]])
    truncate: bool | None = TEI_TRUNCATE
    truncation_direction: TruncationDirection = TEI_DIRECTION
    raw_scores: bool = Field(False, description="the logit itself instead of the model's score activation")
    return_text: bool = Field(False, description="include each text in its result")


class TEIPredictRequest(_TEIRequest):
    model: str | None = TEI_MODEL
    inputs: str | list[str] | list[list[str]] = Field(
        description="a text; [text] or [text, text_pair] (one input: TEI reads a list of two strings as one "
        "pair); or a batch, [[text], [text, text_pair], ...]", examples=["I like you. I love you"])
    truncate: bool | None = TEI_TRUNCATE
    truncation_direction: TruncationDirection = TEI_DIRECTION
    raw_scores: bool = Field(False, description="the logits themselves instead of the label scores")


class TEITokenizeRequest(_TEIRequest):
    model: str | None = TEI_MODEL
    inputs: str | list[str] = Field(examples=["test"])
    add_special_tokens: bool = True
    prompt_name: str | None = PROMPT_NAME


class TEIDecodeRequest(_TEIRequest):
    model: str | None = TEI_MODEL
    ids: list[int] | list[list[int]] = Field(max_length=SCHEMA_MAX_INPUTS, examples=[[101, 7592, 102]])
    skip_special_tokens: bool = True


class TEIRerankResult(BaseModel):
    index: int
    score: float
    text: str | None = None


class TEILabelScore(BaseModel):
    label: str
    score: float


class TEIToken(BaseModel):
    id: int
    text: str
    special: bool
    start: int | None = Field(description="character offset of the token's first character; null for special tokens")
    stop: int | None = Field(description="character offset one past its last character; null for special tokens")


class TEIError(BaseModel):
    error: str
    error_type: str = Field(description="Validation, Empty, Overloaded, Unhealthy or Backend, as TEI names them")


# ---- Cohere's API v2 (routes/cohere.py) ----


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


class InferenceAPIClassifyRequest(_TEIRequest):
    """The Hugging Face Inference API's text-classification body on TEI's root route (huggingface_hub's
    text_classification), its `parameters` already joined to it."""

    model: str | None = TEI_MODEL
    inputs: str | list[str]
    top_k: int | None = Field(None, ge=1, description="the N best labels; null: all")
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = Field(
        None, description="over the logits; null: as /predict reads them")
    truncate: bool | None = TEI_TRUNCATE
