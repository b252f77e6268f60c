"""Rows of a prompt file, in chunks: JSON lines or Parquet through pyarrow.

A row is ``(index, fields)`` where ``fields`` maps each requested field to its value (``None`` when absent
or null), or ``(index, Malformed)`` for a line that is not a JSON object. ``index`` counts records in file
order (blank JSON lines are not records) and is the stable id of a prompt.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)

# A JSON line longer than pyarrow's block makes the typed reader fail; 16 MiB keeps long chat records on
# the fast path (the line-by-line reader would still read them).
_JSON_BLOCK_BYTES = 16 << 20
_DETAIL_CHARS = 80


@dataclasses.dataclass(frozen=True, slots=True)
class Malformed:
    """Why a record is skipped: ``reason`` groups the counts, ``detail`` goes into examples."""

    reason: str
    detail: str = ""

    def describe(self, index: int) -> str:
        detail = self.detail if len(self.detail) <= _DETAIL_CHARS else self.detail[:_DETAIL_CHARS] + "..."
        return f"row {index}: {self.reason}" + (f" ({detail})" if detail else "")


Row = tuple[int, "dict[str, Any] | Malformed"]


@dataclasses.dataclass(frozen=True, slots=True)
class Fields:
    """Names of the fields a record may carry (``None`` or ``""``: a field that is not read)."""

    prompt: str | None
    messages: str | None
    response: str
    answer: str
    group: str | None = None

    def names(self) -> list[str]:
        return [name for name in (self.prompt, self.messages, self.response, self.answer, self.group) if name]


def open_rows(path: str, format: str, fields: Fields, chunk_size: int) -> tuple[int | None, Iterator[list[Row]]]:
    """The number of rows when known up front, and an iterator over chunks of rows.

    Raises:
        ValueError: the file is missing or cannot be read at all.
    """
    if not pathlib.Path(path).is_file():
        raise ValueError(f"prompt file {path!r} does not exist; check data.train_path / data.eval_path")
    if format == "parquet":
        return _parquet_rows(path, fields, chunk_size)
    return _jsonl_rows(path, fields, chunk_size)


def _parquet_rows(path: str, fields: Fields, chunk_size: int) -> tuple[int, Iterator[list[Row]]]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"prompt file {path!r} is not a readable Parquet file: {error}") from error
    present = [name for name in fields.names() if name in parquet.schema_arrow.names]
    num_rows = parquet.metadata.num_rows

    def chunks() -> Iterator[list[Row]]:
        if not present:  # no requested column at all: every record lacks its prompt
            for start in range(0, num_rows, chunk_size):
                yield [(index, {}) for index in range(start, min(start + chunk_size, num_rows))]
            return
        start = 0
        for batch in parquet.iter_batches(batch_size=chunk_size, columns=present):
            yield _indexed(batch.to_pylist(), start)
            start += batch.num_rows

    return num_rows, chunks()


def _jsonl_rows(path: str, fields: Fields, chunk_size: int) -> tuple[int | None, Iterator[list[Row]]]:
    try:
        table = _read_typed_json(path, fields)
    except pa.ArrowInvalid as error:
        # pyarrow stops at the first bad line or mistyped field and cannot say which records are bad; the
        # line-by-line reader counts them so that a few bad records do not stop a run.
        logger.info("%s: pyarrow cannot read it as typed JSON lines (%s); reading it line by line to count bad "
                    "records", path, str(error).splitlines()[0])
        return None, _json_lines(path, fields, chunk_size)

    def chunks() -> Iterator[list[Row]]:
        for start in range(0, table.num_rows, chunk_size):
            yield _indexed(table.slice(start, chunk_size).to_pylist(), start)

    return table.num_rows, chunks()


def _read_typed_json(path: str, fields: Fields) -> pa.Table:
    """Reads the requested fields with an explicit schema, so that pyarrow infers nothing (no timestamps
    from date-like answers) and rejects a value of another type instead of converting it."""
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    types = {fields.prompt: pa.string(), fields.messages: pa.list_(message), fields.response: pa.string(),
             fields.answer: pa.string(), fields.group: pa.string()}
    schema = pa.schema([(name, types[name]) for name in fields.names()])
    options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    return pa_json.read_json(path, read_options=pa_json.ReadOptions(block_size=_JSON_BLOCK_BYTES),
                             parse_options=options)


def _json_lines(path: str, fields: Fields, chunk_size: int) -> Iterator[list[Row]]:
    names = fields.names()
    chunk: list[Row] = []
    index = 0
    with open(path, "rb") as file:
        for line in file:
            if not line.strip():
                continue
            chunk.append((index, _decode_line(line, names)))
            index += 1
            if len(chunk) == chunk_size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _decode_line(line: bytes, names: Sequence[str]) -> dict[str, Any] | Malformed:
    try:
        value = json.loads(line)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        return Malformed("undecodable JSON", str(error))
    if not isinstance(value, dict):
        hint = "; a .json file is read as JSON lines: one object a line" if isinstance(value, list) else ""
        return Malformed("not a JSON object", f"a JSON {type(value).__name__}{hint}")
    return {name: value.get(name) for name in names}


def _indexed(rows: list[dict[str, Any]], start: int) -> list[Row]:
    return [(start + offset, row) for offset, row in enumerate(rows)]
