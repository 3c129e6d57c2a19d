"""Records of JSONL and Parquet files: one dict per document, with where it came from.

* JSONL (`*.jsonl`, `*.jsonl.gz`, `*.jsonl.zst`): one JSON object per non-blank line; a place is
  ``file:line`` (1-based).
* Parquet (`*.parquet`, read with pyarrow, only the columns needed): one row per record; a place is
  ``file row N`` (0-based). A Parquet struct column has one schema for every row, so a key that a
  message lacks reads back as null: nulls inside ``messages`` (and ``tools``) are dropped, so a
  template's ``message.reasoning_content is defined`` sees what the JSONL would have said.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import fsspec

from logit_distill.errors import InputError

from .inputs import JSONL, PARQUET, InputFile

_PARQUET_BATCH_ROWS = 1024


def _archive_errors() -> tuple:
    """Exceptions of a truncated or mislabelled compressed file (gzip, zlib, zstd)."""
    import gzip
    import zlib

    errors = [EOFError, gzip.BadGzipFile, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:
        pass
    return tuple(errors)


def iter_jsonl_records(f: InputFile, on_bytes=None) -> Iterator[tuple[str, dict]]:
    """Yield ``(place, object)`` for every non-blank line; InputError names file and line, also
    for a compressed file that is truncated or not what its name says."""
    where = [0]
    try:
        yield from _iter_jsonl_records(f, on_bytes, where)
    except _archive_errors() as e:
        raise InputError(
            f"{f.url}: after line {where[0]}: the compressed file is truncated or not what its name says "
            f"({type(e).__name__}: {e}); re-copy or re-compress it, or name it by its real format"
        ) from None


def _iter_jsonl_records(f: InputFile, on_bytes, where: list) -> Iterator[tuple[str, dict]]:
    with fsspec.open(f.url, "rb", compression="infer") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where[0] = lineno - 1
            if on_bytes is not None:
                on_bytes(len(raw))
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:
                raise InputError(f"{f.url}:{lineno}: not valid JSON ({e})") from e
            if not isinstance(obj, dict):
                raise InputError(f"{f.url}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield f"{f.url}:{lineno}", obj


def _parquet_file(fh, f: InputFile):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(fh)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{f.url}: not a readable Parquet file ({e}); re-copy it or remove it from the data") from None


def parquet_schema(f: InputFile):
    """The Arrow schema of a Parquet file (read from its footer only)."""
    with fsspec.open(f.url, "rb") as fh:
        return _parquet_file(fh, f).schema_arrow


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def iter_parquet_records(f: InputFile, columns: list[str], nested: tuple[str, ...] = (),
                         on_bytes=None) -> Iterator[tuple[str, dict]]:
    """Yield ``(place, {column: value})`` for every row, reading only `columns`; nulls are
    dropped inside the `nested` columns (see the module docstring)."""
    import pyarrow as pa

    with fsspec.open(f.url, "rb") as fh:
        pf = _parquet_file(fh, f)
        names = pf.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise InputError(f"{f.url}: no column {missing[0]!r} (columns: {names[:10]}); set the field name")
        total = max(1, pf.metadata.num_rows)
        row = 0
        try:
            for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
                for rec in batch.to_pylist():
                    for c in nested:
                        if rec.get(c) is not None:
                            rec[c] = _drop_nulls(rec[c])
                    yield f"{f.url} row {row}", rec
                    row += 1
                if on_bytes is not None:
                    on_bytes(f.size * batch.num_rows // total)
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{f.url}: after row {row}: the Parquet file is damaged ({e}); re-copy it") from None


def iter_texts(f: InputFile, kind: str, text_field: str, on_bytes=None) -> Iterator[str]:
    """The `text_field` string of every record of a JSONL or Parquet file."""
    if kind == JSONL:
        records = iter_jsonl_records(f, on_bytes)
    else:
        assert kind == PARQUET
        records = iter_parquet_records(f, [text_field], on_bytes=on_bytes)
    for place, obj in records:
        if text_field not in obj:
            raise InputError(
                f"{place}: no field {text_field!r} (fields: {sorted(obj)[:10]}); set the text field name"
            )
        text = obj[text_field]
        if not isinstance(text, str):
            raise InputError(f"{place}: field {text_field!r} is a {type(text).__name__}, not a string")
        yield text
