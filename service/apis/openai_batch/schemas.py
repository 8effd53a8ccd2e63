"""The bodies of OpenAI's Batch API that arrive as JSON (POST /v1/batches); the file upload is multipart,
read by routes.py as it streams in."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# The routes a batch's lines may call: OpenAI's embeddings, and the scoring routes of this service (the
# lines of a model that does not score get that route's own 400 in the error file)
BATCH_ENDPOINTS = ("/v1/embeddings", "/v1/rerank", "/v1/score")
# OpenAI's bounds of `expires_after[seconds]` and `output_expires_after.seconds`: one hour to thirty days
EXPIRES_AFTER_S = (3600, 30 * 24 * 3600)


class OutputExpiresAfter(BaseModel):
    """OpenAI's `output_expires_after`: the batch's output and error files are deleted this long after they
    are written (the anchor OpenAI names, `created_at`, is the files' creation)."""

    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"] = Field(description="OpenAI's only anchor: the output file's creation")
    seconds: int = Field(ge=EXPIRES_AFTER_S[0], le=EXPIRES_AFTER_S[1],
                         description="between 1 hour and 30 days, as OpenAI allows")


class BatchCreateRequest(BaseModel):
    """`client.batches.create(...)`'s body."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=64, description="a file uploaded with purpose `batch`")
    endpoint: Literal["/v1/embeddings", "/v1/rerank", "/v1/score"] = Field(
        description="the route every line of the file calls (each line's `url` must be it)")
    completion_window: Literal["24h"] = Field("24h", description="OpenAI's only window: unfinished after it, expired")
    metadata: dict[str, str] | None = Field(None, description="up to 16 pairs, kept with the batch")
    output_expires_after: OutputExpiresAfter | None = Field(
        None, description="when the output and error files are deleted (default: batch_output_expires_s)")

    @field_validator("metadata")
    @classmethod
    def _openai_metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512")
        return value
