"""The checkpoint families the encoder loads: one module per family (bert.py, roberta.py, ...), each
holding its `Family` rows: how its config.json maps onto EncoderConfig (`fields`), its weight names
(native and original layouts) onto our modules, what it leaves out on purpose, and its
sequence-classification head. export/checkpoint.py reads a checkpoint; these modules say what each
family means (../shared/DESIGN.md, "Families as blocks"): data, not code paths; base.py holds what they share.
"""

from __future__ import annotations

from pathlib import Path

from export.errors import CheckpointError
from export.families import bert, distilbert, electra, gemma3, modernbert, mpnet, qwen3, roberta, rotary_bert
from export.families.base import Family, HeadLayout, MaskedLMLayout, config_value

__all__ = ["FAMILIES", "SUPPORTED_MODEL_TYPES", "Family", "HeadLayout", "MaskedLMLayout", "config_value", "family_of"]

# the order family_of tries them in and its refusal lists them in
FAMILIES: tuple[Family, ...] = (
    *bert.ROWS,
    *roberta.ROWS,
    *distilbert.ROWS,
    *electra.ROWS,
    *mpnet.ROWS,
    *modernbert.ROWS,
    *gemma3.ROWS,
    *rotary_bert.ROWS,
    *qwen3.ROWS,
)
SUPPORTED_MODEL_TYPES = tuple(t for f in FAMILIES for t in f.model_types)


def family_of(model_type: str | None, config_path: Path) -> Family:
    """The family of a model_type, or one CheckpointError that lists every family we load."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)
    raise CheckpointError(
        f"{config_path}: model_type {model_type!r} is not supported; the encoder loads these families "
        f"(model_type): {supported}"
    )
