"""What a sentence-transformers model says about its use, applied to a request: its prompts and the
embedding sizes it was trained to be cut to (matryoshka). Both come from the bundle's manifest
(export/checkpoint.py SentenceConventions).

A prompt is text put before every input, as `SentenceTransformer.encode(prompt_name=...)` puts it: the
request's `prompt_name`, else its `input_type` (Cohere's `query`/`document`) where the model has a
prompt of that name, else the model's default_prompt_name. On a model whose Pooling has
include_prompt false, the prompt's tokens are then left out of pooling (EncodeJob.pool_skip).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bundle.manifest import ModelInfo
from service.engine.errors import BadRequest, InvalidRequest
from service.engine.runner import l2_normalize

INPUT_TYPES = ("query", "document")  # Cohere's search_query/search_document, named as prompts usually are


@dataclass(frozen=True)
class Prompt:
    name: str
    text: str
    pool_skip: int  # leading tokens pooling leaves out: the prompt's, with include_prompt false; else 0

    def apply(self, texts: list[str]) -> list[str]:
        return [self.text + t for t in texts]


def prompt_for(model: ModelInfo, model_name: str, prompt_name: str | None, input_type: str | None) -> Prompt | None:
    """The prompt a request gets, or None. A `prompt_name` the model has not is a 400 that lists its
    prompts; an `input_type` picks the prompt of that name where there is one (many models prompt
    queries only), else the default."""
    if input_type is not None and input_type not in INPUT_TYPES:
        raise InvalidRequest(f"input_type {input_type!r} is not one of {', '.join(INPUT_TYPES)}")
    if prompt_name is not None:
        if prompt_name not in model.prompts:
            listed = ", ".join(repr(p) for p in model.prompts) or "none"
            raise BadRequest(f"model {model_name!r} has no prompt {prompt_name!r}; its prompts: {listed}")
        name = prompt_name
    elif input_type is not None and input_type in model.prompts:
        name = input_type
    else:
        name = model.default_prompt_name
    if name is None:
        return None
    skip = 0 if model.include_prompt else model.prompt_tokens[name]
    return Prompt(name, model.prompts[name], skip)


def check_dimensions(model: ModelInfo, model_name: str, dimensions: int | None) -> None:
    """`dimensions` cuts the embedding only where the model was trained for it (matryoshka): a vector cut
    from another model means something else, and OpenAI refuses the same way (400)."""
    if dimensions is None:
        return
    if not model.matryoshka:
        raise BadRequest(f"model {model_name!r} does not support dimensions: it was not trained for shorter "
                         f"embeddings (matryoshka); its embeddings have {model.sentence_dim} dimensions")
    allowed = model.matryoshka_dimensions
    if allowed is not None and dimensions not in allowed:
        raise BadRequest(f"model {model_name!r} supports dimensions {', '.join(map(str, allowed))}, not {dimensions}")
    if dimensions > model.sentence_dim:
        raise BadRequest(f"dimensions {dimensions} exceeds model {model_name!r}'s {model.sentence_dim}")


def shortened(vectors: np.ndarray, dimensions: int, normalize: bool = True) -> np.ndarray:
    """The first `dimensions` of each embedding (after check_dimensions), L2-normalised again unless
    `normalize` is false, as float32 in C order: OpenAI's `dimensions`, TEI's, Cohere's `output_dimension`."""
    cut = vectors[:, :dimensions]
    return np.ascontiguousarray(l2_normalize(cut) if normalize else cut, dtype=np.float32)


def describe(model: ModelInfo) -> dict:
    """The conventions of a model for /info and /v1/models."""
    return {"prompts": dict(model.prompts), "default_prompt_name": model.default_prompt_name,
            "include_prompt": model.include_prompt,
            "dimensions": (model.matryoshka_dimensions or "any") if model.matryoshka else None,
            "representations": model.representations, **representation_details(model)}


def representation_details(model: ModelInfo) -> dict:
    """How a model's sparse and multi-vector outputs are made, for clients that index them: the kind
    (splade, bge-m3, colbert), a token vector's width, a ColBERT's query and document lengths."""
    details: dict = {}
    if model.sparse is not None:
        details["sparse"] = {"kind": model.sparse.kind, "vocab_size": model.vocab_size}
    if (mv := model.multivector) is not None:
        details["multivector"] = {"kind": mv.kind, "dim": mv.dim, "normalized": mv.normalize,
                                  "similarity": "maxsim" if mv.kind == "colbert" else "maxsim (mean over query tokens)",
                                  "query_length": mv.query_length, "document_length": mv.document_length}
    return details


# Cohere's input types, each onto the model's prompts: a prompt of its own name first, else the name
# sentence-transformers models usually give that side (query, document); classification and clustering
# embed a text for itself, as a query side does (E5's and BGE's advice for symmetric tasks)
COHERE_INPUT_TYPES = {
    "search_query": ("search_query", "query"),
    "search_document": ("search_document", "document", "passage"),
    "classification": ("classification", "query"),
    "clustering": ("clustering", "query"),
}


def cohere_prompt_name(model: ModelInfo, model_name: str, input_type: str) -> str | None:
    """The prompt a Cohere `input_type` asks for: None where the model has no prompts (it embeds every
    text alike), or where the type is search_document and the model prompts only its queries (then its
    default applies, as for any request); a 400 where the model has prompts and none fits a query-side
    type (a query embedded without its prompt would not match its documents)."""
    if input_type == "image":
        raise BadRequest(f"input_type 'image': model {model_name!r} embeds text only")
    if not model.prompts:
        return None
    by_lower = {name.lower(): name for name in model.prompts}
    for candidate in COHERE_INPUT_TYPES[input_type]:
        if candidate in by_lower:
            return by_lower[candidate]
    if input_type == "search_document":
        return None
    raise BadRequest(f"input_type {input_type!r}: model {model_name!r} has the prompts "
                     f"{', '.join(repr(p) for p in model.prompts)} and none for it (looked for "
                     f"{' or '.join(repr(c) for c in COHERE_INPUT_TYPES[input_type])})")


def prompt_chars(prompted_texts: list[str], texts: list[str]) -> int:
    """The characters of the prompt put before every text (0 without one): what left truncation keeps
    (EncoderService.tokenize's `kept`)."""
    return len(prompted_texts[0]) - len(texts[0])


def normalization(asked: bool | None, model: ModelInfo) -> bool:
    """Whether a request's embeddings are L2-normalised: as asked, else as the model was trained."""
    normalize = model.normalize if asked is None else asked
    if model.normalize and not normalize and model.dense_layers:
        # the raw embedding is re-pooled from the token encodings, which would skip the Dense projection
        raise InvalidRequest("normalize: false is not available for this model: it normalises after a Dense "
                             "projection inside its graph, so only the normalised embedding exists")
    return normalize

