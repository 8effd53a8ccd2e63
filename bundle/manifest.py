"""bundle.json: one definition of the manifest, and a loader that verifies a bundle.

The exporter writes a `BundleManifest`; the service calls `load_bundle` and refuses to
start on any `BundleError`. Nothing here imports torch or onnxruntime.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bundle.contract import BUNDLE_MANIFEST, INPUT_NAMES, MIN_OPSET, OUTPUT_NAMES

SCHEMA_VERSION = 1
Pooling = Literal["mean", "cls", "max"]


class BundleError(Exception):
    """A bundle that must not be served; the message is one line naming the file and reason."""


class _Strict(BaseModel):
    # Unknown keys are a sign of a manifest from another version: refuse, don't guess.
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Strict):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    bytes: int = Field(ge=0)


class OutputParity(_Strict):
    """One line of the parity table: how far onnxruntime is from PyTorch on one output."""

    output: str
    shape: str
    probes: int = Field(ge=0, description="probe batches compared")
    values: int = Field(ge=0, description="real (unpadded) values compared")
    max_abs_diff: float
    max_rel_diff: float
    atol: float
    rtol: float
    passed: bool
    problems: list[str] = Field(default_factory=list)


class ParityReport(_Strict):
    passed: bool
    reference: str = "pytorch"
    candidate: str = "onnxruntime"
    provider: str
    probe_shapes: list[tuple[int, int]] = Field(description="(batch, seq) of each probe batch")
    outputs: list[OutputParity]


def parity_lines(report: ParityReport) -> list[str]:
    """The parity table, one line per output, then one line per problem."""
    lines = [
        f"{'output':<20} {'shape':<34} {'values':>10} {'max_abs':>9} {'max_rel':>9}  result",
    ]
    for o in report.outputs:
        lines.append(
            f"{o.output:<20} {o.shape:<34} {o.values:>10} {o.max_abs_diff:>9.2e} {o.max_rel_diff:>9.2e}  "
            f"{'PASS' if o.passed else 'FAIL'} (atol {o.atol:g}, rtol {o.rtol:g})"
        )
        lines.extend(f"    {o.output}: {problem}" for problem in o.problems)
    lines.append(
        f"parity {'PASSED' if report.passed else 'FAILED'}: {len(report.probe_shapes)} probes "
        f"(batch, seq) {report.probe_shapes} on {report.provider}"
    )
    return lines


class ModelInfo(_Strict):
    name: str = Field(min_length=1, description="served model name (OpenAI `model`, v2 `{name}`)")
    architecture: str
    source: str = Field(description="checkpoint the bundle was exported from")
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    max_tokens: int = Field(gt=0, description="longest input, in tokens incl. special tokens")
    pooling: Pooling
    normalize: bool
    pad_token_id: int = Field(ge=0)


class GraphInfo(_Strict):
    file: str
    opset: int = Field(ge=MIN_OPSET)
    inputs: list[str]
    outputs: list[str]


class BundleManifest(_Strict):
    schema_version: Literal[1] = SCHEMA_VERSION
    model: ModelInfo
    graph: GraphInfo
    tokenizer: str
    files: dict[str, FileEntry]
    parity: ParityReport
    versions: dict[str, str]
    created_at: str

    def write(self, directory: Path) -> Path:
        """Write bundle.json into `directory` and return its path."""
        path = directory / BUNDLE_MANIFEST
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
        return path


@dataclass(frozen=True)
class Bundle:
    """A verified bundle on disk: every file present and matching its hash."""

    root: Path
    manifest: BundleManifest

    @property
    def graph_path(self) -> Path:
        return self.root / self.manifest.graph.file

    @property
    def tokenizer_path(self) -> Path:
        return self.root / self.manifest.tokenizer

    @property
    def sha256(self) -> str:
        """A short identity of the whole bundle: the hash of its manifest."""
        return sha256_file(self.root / BUNDLE_MANIFEST)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so a large graph is not loaded whole."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_entry(path: Path) -> FileEntry:
    """Hash and size of one bundle file."""
    return FileEntry(sha256=sha256_file(path), bytes=path.stat().st_size)


def load_bundle(root: str | Path) -> Bundle:
    """Read and verify a bundle (schema, contract, file hashes); raise BundleError if unfit."""
    root = Path(root)
    manifest_path = root / BUNDLE_MANIFEST
    if not root.is_dir():
        raise BundleError(f"{root}: bundle directory does not exist")
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: missing (not a bundle, or an export that did not finish)")
    try:
        manifest = BundleManifest.model_validate_json(manifest_path.read_bytes())
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise BundleError(
            f"{manifest_path}: invalid manifest at {where}: {first['msg']} ({exc.error_count()} error(s))"
        ) from None
    except ValueError as exc:
        raise BundleError(f"{manifest_path}: not valid JSON: {exc}") from None

    if tuple(manifest.graph.inputs) != INPUT_NAMES or tuple(manifest.graph.outputs) != OUTPUT_NAMES:
        raise BundleError(
            f"{manifest_path}: graph I/O {manifest.graph.inputs} -> {manifest.graph.outputs} "
            f"is not the contract {list(INPUT_NAMES)} -> {list(OUTPUT_NAMES)}"
        )
    if not manifest.parity.passed:
        raise BundleError(f"{manifest_path}: parity report says failed; this bundle must not be served")
    for required in (manifest.graph.file, manifest.tokenizer):
        if required not in manifest.files:
            raise BundleError(f"{manifest_path}: {required} is used but has no hash in 'files'")
    for name, entry in sorted(manifest.files.items()):
        path = root / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise BundleError(f"{manifest_path}: file name {name!r} escapes the bundle directory")
        if not path.is_file():
            raise BundleError(f"{path}: missing (listed in {BUNDLE_MANIFEST})")
        size = path.stat().st_size
        if size != entry.bytes:
            raise BundleError(f"{path}: size {size} bytes, manifest says {entry.bytes} (truncated or replaced)")
        actual = sha256_file(path)
        if actual != entry.sha256:
            raise BundleError(f"{path}: sha256 {actual[:12]}... does not match manifest {entry.sha256[:12]}...")
    return Bundle(root=root, manifest=manifest)
