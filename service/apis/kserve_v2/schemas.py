"""The Open Inference Protocol v2 (KServe, Triton) bodies, over HTTP and, read from the gRPC message, over gRPC."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field



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
