"""The job's input files as one numbered sequence of rows: a row's number is its position in the inputs
taken in order (the `row` column of the output when no id column is named), which is what makes a range
of rows a unit of work that a second run can recognise as done.

Parquet files are read by row group (their row counts are in the footer); JSONL files by byte offset
(every line's start, found once with numpy); a CSV file has no cheap way to its n-th row (a quoted field
may hold a newline), so its two columns are copied once into a Parquet file under the output's
_staging/ and read from there. So is a Parquet file whose row groups are much larger than a range (pyarrow's
default writer makes one group of up to a million rows): Parquet cannot read part of a group, so each
range would decode its whole group again, and reading would grow with the square of the file (a 400,000-row
group: 50 ms per 2,048-row range instead of 1 ms); its copy has groups of one range each, read once.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
           ".csv": "csv"}
CHUNK = 1 << 24  # bytes read at a time when finding JSONL lines
GROUP_RANGES = 4  # a Parquet file with a row group of more than this many ranges' rows is staged (copied once)


class InputError(ValueError):
    """An input the job cannot read as asked: the message names the file and the fix."""


@dataclass(frozen=True)
class InputFile:
    path: str  # as read: a CSV's staged Parquet copy
    format: str  # parquet or jsonl
    first: int  # the number of its first row in the job
    rows: int
    line_starts: str | None = None  # JSONL: an .npy file of every line's byte offset (and the file's size last)


def format_of(path: Path, given: str | None) -> str:
    if given is not None:
        return given
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InputError(f"{path}: cannot tell its format from the suffix {path.suffix!r}; name it with --format "
                         "parquet|jsonl|csv")
    return fmt


def expand(paths: list[Path], given: str | None) -> list[tuple[Path, str]]:
    """Each input path with its format; a directory stands for its files of a known suffix, sorted."""
    found: list[tuple[Path, str]] = []
    for path in paths:
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.is_file() and (given or p.suffix.lower() in FORMATS))
            if not files:
                raise InputError(f"{path}: a directory with no .parquet, .jsonl or .csv file in it")
            found += [(p, format_of(p, given)) for p in files]
        elif path.is_file():
            found.append((path, format_of(path, given)))
        else:
            raise InputError(f"{path}: no such file or directory")
    return found


def plan_inputs(paths: list[Path], given: str | None, text_column: str, id_column: str | None,
                staging: Path, range_rows: int = 2048) -> list[InputFile]:
    """The inputs numbered in order; Parquet columns checked; JSONL lines indexed, CSV and Parquet files of
    row groups much larger than `range_rows` staged into `staging` (once: a second run finds them there)."""
    files, first = [], 0
    for n, (path, fmt) in enumerate(expand(paths, given)):
        if fmt == "csv":
            path, fmt = stage_csv(path, staging / f"{n}-{path.stem}.parquet", text_column, id_column), "parquet"
        if fmt == "parquet":
            import pyarrow.parquet as pq

            try:
                meta = pq.ParquetFile(path)
            except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
                raise InputError(f"{path}: not a Parquet file ({exc}); name its format with --format") from None
            names = meta.schema_arrow.names
            for column in (text_column, id_column):
                if column is not None and column not in names:
                    raise InputError(f"{path}: no column {column!r} (it has {', '.join(names)}); name the text with "
                                     "--text-column and the id with --id-column")
            rows = meta.metadata.num_rows
            largest = max((meta.metadata.row_group(g).num_rows for g in range(meta.metadata.num_row_groups)), default=0)
            if largest > GROUP_RANGES * range_rows:
                path = stage_parquet(path, staging / f"{n}-{path.stem}.parquet",
                                     [c for c in (id_column, text_column) if c is not None], range_rows)
            files.append(InputFile(str(path.resolve()), "parquet", first, rows))
        elif fmt == "jsonl":
            starts = line_starts(path)
            index = staging / f"{n}-{path.stem}.lines.npy"
            atomic_write(index, lambda f: np.save(f, starts))
            rows = len(starts) - 1
            files.append(InputFile(str(path.resolve()), "jsonl", first, rows, str(index)))
        else:
            raise InputError(f"{path}: unknown format {fmt!r} (parquet, jsonl or csv)")
        first += rows
    return files


def line_starts(path: Path) -> np.ndarray:
    """Every line's byte offset, then the file's size: line i is bytes [starts[i], starts[i+1])."""
    found = [np.zeros(1, dtype=np.int64)]
    offset, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            newlines = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10) + offset + 1
            found.append(newlines.astype(np.int64))
            offset += len(chunk)
            last = chunk[-1:]
    starts = np.concatenate(found)
    if last == b"\n":  # the final newline starts no line
        starts = starts[:-1]
    return np.append(starts, offset)


def stage_csv(path: Path, staged: Path, text_column: str, id_column: str | None, block_size: int = 1 << 20) -> Path:
    """The CSV's text and id columns as strings, copied into a Parquet file (streamed: any size)."""
    import pyarrow as pa
    import pyarrow.csv as pv
    import pyarrow.parquet as pq

    if staged.exists():
        return staged
    columns = [c for c in (id_column, text_column) if c is not None]
    try:
        # a quoted field may hold a newline: without newlines_in_values the reader's chunker cuts blocks at
        # any newline, and the parser fails past the first block ("got out of sync with chunker")
        reader = pv.open_csv(path, read_options=pv.ReadOptions(block_size=block_size),
                             parse_options=pv.ParseOptions(newlines_in_values=True),
                             convert_options=pv.ConvertOptions(include_columns=columns,
                                                               column_types={c: pa.string() for c in columns},
                                                               strings_can_be_null=False))
    except (pa.ArrowInvalid, KeyError) as exc:
        raise InputError(f"{path}: {exc} (name the text with --text-column and the id with --id-column)") from None
    try:
        staged_write(staged, reader.schema, reader, None)
    except pa.ArrowInvalid as exc:  # a malformed row past the first block
        raise InputError(f"{path}: not readable as CSV: {' '.join(str(exc).split())}") from None
    return staged


def stage_parquet(path: Path, staged: Path, columns: list[str], range_rows: int) -> Path:
    """The text and id columns of a Parquet file of huge row groups, copied once (streamed: each group is
    decoded once, a batch at a time) into a file whose groups hold one range each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if staged.exists():
        return staged
    source = pq.ParquetFile(path, buffer_size=1 << 20)  # buffered: a group's column is not read whole
    schema = pa.schema([source.schema_arrow.field(c) for c in columns])
    staged_write(staged, schema, source.iter_batches(batch_size=range_rows, columns=columns), range_rows)
    return staged


def staged_write(staged: Path, schema, batches, group_rows: int | None) -> None:
    """Record batches into `staged` under a temporary name renamed into place; on any failure the temporary
    file is removed (nothing half-written stays)."""
    import pyarrow.parquet as pq

    staged.parent.mkdir(parents=True, exist_ok=True)
    tmp = staged.with_name(f".{staged.name}.tmp-{uuid.uuid4().hex}")
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            for batch in batches:
                writer.write_batch(batch, row_group_size=group_rows)
        os.replace(tmp, staged)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_rows(file: InputFile, first: int, last: int, text_column: str, id_column: str | None):
    """Rows first..last (job numbers, inclusive) of one file as a pyarrow table: `_row`, `_text` (null where
    the row has no text), `_error` (why the row cannot be embedded, else null) and the id column."""
    import pyarrow as pa

    start, stop = first - file.first, last - file.first + 1
    if file.format == "parquet":
        table = parquet_slice(file.path, start, stop, [c for c in (text_column, id_column) if c is not None])
        texts = table.column(text_column)
        if pa.types.is_string(texts.type) or pa.types.is_large_string(texts.type):
            values = texts.to_pylist()
            errors = [None if isinstance(v, str) else "no text (null)" for v in values]
        else:
            values = [None] * table.num_rows
            errors = [f"not text: column {text_column!r} is {texts.type}"] * table.num_rows
        ids = table.column(id_column) if id_column is not None else None
    else:
        values, errors, id_values = jsonl_slice(file, start, stop, text_column, id_column)
        ids = typed(id_values) if id_column is not None else None
    columns = {"_row": pa.array(np.arange(first, last + 1, dtype=np.int64)), "_text": pa.array(values, pa.string()),
               "_error": pa.array(errors, pa.string())}
    if ids is not None:
        columns[id_column] = ids
    return pa.table(columns)


def parquet_slice(path: str, start: int, stop: int, columns: list[str]):
    """Rows start..stop-1 of a Parquet file, reading only the row groups that hold them."""
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    groups, offset, skip = [], 0, 0
    for g in range(f.metadata.num_row_groups):
        n = f.metadata.row_group(g).num_rows
        if offset + n > start and offset < stop:
            if not groups:
                skip = start - offset
            groups.append(g)
        offset += n
    return f.read_row_groups(groups, columns=columns).slice(skip, stop - start)


def jsonl_slice(file: InputFile, start: int, stop: int, text_column: str, id_column: str | None):
    """Lines start..stop-1 parsed one by one, so that one bad line is one bad row."""
    starts = np.load(file.line_starts, mmap_mode="r")
    with open(file.path, "rb") as f:
        f.seek(int(starts[start]))
        data = f.read(int(starts[stop]) - int(starts[start]))
    values, errors, ids = [], [], []
    for n, line in enumerate(data.split(b"\n")[: stop - start]):
        text, error, row_id = None, None, None
        try:
            record = json.loads(line)
        except ValueError as exc:
            record, error = None, f"not JSON: {exc}"
        except RecursionError:  # "[" * 100000: one bad row, not a failed job
            record, error = None, "not JSON: nested too deeply"
        except Exception as exc:  # noqa: BLE001 - whatever a line does, it is that line's error
            record, error = None, f"not JSON: {type(exc).__name__}: {exc}"
        if isinstance(record, dict):
            row_id = record.get(id_column) if id_column is not None else None
            text = record.get(text_column)
            if text_column not in record:
                error = f"no {text_column!r} field"
            elif not isinstance(text, str):
                error, text = f"not text: {text_column!r} is {type(text).__name__}", None
        elif error is None:
            error = f"not a JSON object: {type(record).__name__}"
        if id_column is not None and row_id is None and error is None:
            error = f"no {id_column!r} field"
        values.append(text)
        errors.append(error)
        ids.append(row_id)
    return values, errors, ids


def typed(values: list):
    """JSONL ids as one Arrow column: their own type where they share one, else as strings."""
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if v is None else str(v) for v in values], pa.string())


def atomic_write(path: Path, write) -> None:
    """`write(file)` into a temporary name beside `path`, then renamed over it: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
