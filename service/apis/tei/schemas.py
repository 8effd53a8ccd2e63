"""text-embeddings-inference's bodies: its field names, defaults and types."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from service.front.schemas import PROMPT_NAME, SCHEMA_MAX_INPUTS


# ---- text-embeddings-inference's routes (service/apis/tei/routes.py): its field names, defaults and types ----


class _TEIRequest(BaseModel):
    """TEI ignores fields it does not read (huggingface_hub sends `encoding_format`, older clients a
    `parameters` object, which routes.py reads); the fields it reads are typed strictly."""

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


class TEIEmbedSparseRequest(_TEIRequest):
    model: str | None = TEI_MODEL
    inputs: str | list[str] = Field(examples=[["first text", "second text"]])
    truncate: bool | None = TEI_TRUNCATE
    truncation_direction: TruncationDirection = TEI_DIRECTION
    prompt_name: str | None = PROMPT_NAME


class TEISparseValue(BaseModel):
    index: int = Field(description="the vocabulary id")
    value: float = Field(description="its weight (zeros left out)")


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


class InferenceAPIClassifyRequest(_TEIRequest):
    """The Hugging Face Inference API's text-classification body on TEI's root route (huggingface_hub's
    text_classification), its `parameters` already joined to it."""

    model: str | None = TEI_MODEL
    inputs: str | list[str]
    top_k: int | None = Field(None, ge=1, description="the N best labels; null: all")
    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = Field(
        None, description="over the logits; null: as /predict reads them")
    truncate: bool | None = TEI_TRUNCATE
