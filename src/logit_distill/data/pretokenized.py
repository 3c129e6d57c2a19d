"""Pre-tokenized ArrayRecord files: one record per document, in one of two layouts.

* Plain (the original layout): the document's token ids as little-endian int32
  (``numpy.dtype("<i4")``), concatenated, nothing else. Its length is a multiple of 4 and no id is
  negative.
* Supervised: ``MAGIC`` (the 4 bytes ``b"LDM\\xff"``) | ``n`` (uint32 LE) | ``n`` token ids (int32
  LE) | ``n`` supervision flags (uint8, 0 or 1), ``8 + 5 n`` bytes. Flag ``t`` = 1 means token
  ``t`` is a training target (the prediction of token ``t`` from the tokens before it is trained).
  Read as int32, the magic is negative, which no plain record may start with, so the two layouts
  never collide and a reader of plain records refuses a supervised one instead of misreading it.

No header beyond that, no pickle. One data set uses one layout (mixing them is an InputError).
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterator, Sequence

import fsspec.core
import numpy as np

from logit_distill.errors import InputError

from .inputs import ARRAY_RECORD, TOKEN_DTYPE, _protocols, file_kind

MAGIC = b"LDM\xff"
_HEADER = 8
_COUNT_DTYPE = np.dtype("<u4")


def array_record_reader(local_path: str):
    from array_record.python.array_record_module import ArrayRecordReader

    return ArrayRecordReader(local_path, "readahead_buffer_size:16M")


def decode_record(rec: bytes, where: str) -> tuple[np.ndarray, np.ndarray | None]:
    """``(token ids int32, supervision flags uint8 or None)`` of one record."""
    if rec[:4] == MAGIC:
        if len(rec) < _HEADER:
            raise InputError(f"{where}: supervised record of {len(rec)} bytes is shorter than its 8-byte header")
        n = int(np.frombuffer(rec, _COUNT_DTYPE, 1, 4)[0])
        if len(rec) != _HEADER + 5 * n:
            raise InputError(
                f"{where}: supervised record of {len(rec)} bytes, its header says {n} tokens ({_HEADER + 5 * n} bytes)"
            )
        ids = np.frombuffer(rec, TOKEN_DTYPE, n, _HEADER)
        flags = np.frombuffer(rec, np.uint8, n, _HEADER + 4 * n)
        if flags.size and flags.max() > 1:
            raise InputError(f"{where}: supervision flag {int(flags.max())}: flags must be 0 or 1")
    else:
        if len(rec) % TOKEN_DTYPE.itemsize:
            raise InputError(
                f"{where}: record of {len(rec)} bytes is not a whole number of little-endian int32 token ids"
            )
        ids, flags = np.frombuffer(rec, dtype=TOKEN_DTYPE), None
    if ids.size and ids.min() < 0:
        raise InputError(f"{where}: negative token id {int(ids.min())}")
    return ids, flags


def iter_array_record_docs(local_path: str, url: str, batch: int = 4096) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
    reader = array_record_reader(local_path)
    try:
        n = reader.num_records()
        for start in range(0, n, batch):
            for j, rec in enumerate(reader.read(start, min(n, start + batch))):
                yield decode_record(rec, f"{url} record {start + j}")
    finally:
        reader.close()


def encode_record(ids: np.ndarray, supervised: np.ndarray | None = None) -> bytes:
    ids = ids.astype(TOKEN_DTYPE)
    if supervised is None:
        return ids.tobytes()
    return MAGIC + np.array([ids.size], _COUNT_DTYPE).tobytes() + ids.tobytes() + supervised.astype(np.uint8).tobytes()


def _checked(i: int, doc, flags) -> tuple[np.ndarray, np.ndarray | None]:
    arr = np.asarray(doc)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"document {i}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise InputError(f"document {i}: token ids must be in [0, 2**31)")
    if flags is None:
        return arr, None
    f = np.asarray(flags)
    if f.shape != arr.shape or not (f.dtype == bool or np.issubdtype(f.dtype, np.integer)) or (
            f.size and not np.isin(f, (0, 1)).all()):
        raise InputError(f"document {i}: supervision flags must be {arr.size} values 0/1 (got {f.dtype} {f.shape})")
    return arr, f


def write_pretokenized(path: str, documents: Sequence[np.ndarray], *, supervised: Sequence[np.ndarray] | None = None,
                       options: str = "group_size:1024") -> str:
    """Write documents (1-D integer arrays of token ids) as a pre-tokenized ArrayRecord file.

    Each record is one document: its ids as little-endian int32 bytes, or with `supervised`
    (per document, one 0/1 flag per token: 1 = the token is a training target) the supervised
    layout of the module docstring. `path` may be local, file:// or gs:// (written locally, then
    uploaded). The file appears atomically. Returns the URL written.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    fs, fpath = fsspec.core.url_to_fs(path)
    if file_kind(fpath) != ARRAY_RECORD:
        raise InputError(f"{path}: a pre-tokenized file name must end in .array_record")
    if supervised is not None and len(supervised) != len(documents):
        raise InputError(f"{len(documents)} documents but {len(supervised)} supervision arrays")
    local = "file" in _protocols(fs)
    out_dir = os.path.dirname(fpath) if local else None
    if local:
        os.makedirs(out_dir or ".", exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".tmp-", suffix=".array_record")
    os.close(fd)
    try:
        writer = ArrayRecordWriter(tmp, options)
        for i, doc in enumerate(documents):
            writer.write(encode_record(*_checked(i, doc, None if supervised is None else supervised[i])))
        writer.close()
        if local:
            os.replace(tmp, fpath)
        else:
            fs.put_file(tmp, fpath)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return fs.unstrip_protocol(fpath)
