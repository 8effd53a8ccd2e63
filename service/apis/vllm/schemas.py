"""vLLM's score bodies (its entrypoints/pooling/score/protocol.py): field names, defaults and types."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from service.front.schemas import SCHEMA_MAX_INPUTS

ScoreTexts = str | list[str]


class VLLMScoreRequest(BaseModel):
    """vLLM accepts (and logs) fields it does not read; so does this."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="a served model's name; left out, the default model")
    text_1: ScoreTexts = Field(examples=["What is the capital of France?"],
                               description="one text (scored against every text_2) or as many as text_2 (pairwise)")
    text_2: ScoreTexts = Field(examples=[["Paris is the capital of France.", "The cat sat on the mat."]])
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="-1: cut each input at the model's limit; null (vLLM's default): an input past it "
        "is refused; a number: the model's limit itself (other cuts are not served here)")
    use_activation: bool | None = Field(None, description="a cross-encoder's score through its activation (default "
                                        "true: CrossEncoder.predict's); false: the logit")
    activation: bool | None = Field(None, description="vLLM's older name of use_activation")
    softmax: bool | None = Field(None, description="vLLM's older name of use_activation")
    priority: int = Field(0, description="vLLM's scheduling priority: only 0 (no priority scheduling here)")

    @field_validator("text_1", "text_2", mode="before")
    @classmethod
    def _within_the_schema_cap(cls, value: Any) -> Any:
        """At most SCHEMA_MAX_INPUTS texts a side (the configured cap is a 413 later); an empty list is
        vLLM's 400, said by the route."""
        if isinstance(value, list) and len(value) > SCHEMA_MAX_INPUTS:
            raise ValueError(f"at most {SCHEMA_MAX_INPUTS} texts")
        return value

    def lists(self) -> tuple[list[str], list[str]]:
        return ([self.text_1] if isinstance(self.text_1, str) else self.text_1,
                [self.text_2] if isinstance(self.text_2, str) else self.text_2)


class VLLMScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class VLLMUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int | None = 0
    prompt_tokens_details: dict | None = None


class VLLMScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[VLLMScoreData]
    usage: VLLMUsage


class VLLMErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class VLLMError(BaseModel):
    error: VLLMErrorInfo
