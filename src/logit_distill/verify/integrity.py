"""The integrity check of one chunk: read once (streaming SHA-256), open as ArrayRecord, count and
batch its records through the per-record checks (``records``)."""

from __future__ import annotations

import hashlib
import os

from .. import paths
from ..store import chunks as chunks_mod
from .context import _ChunkResult, _Ctx
from .records import _check_batch

BATCH_BYTES = 32 << 20  # decoded bytes per record batch inside a chunk


def _sha256_stream(read_block, sink=None) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    for block in iter(read_block, b""):
        h.update(block)
        size += len(block)
        if sink is not None:
            sink.write(block)
    return h.hexdigest(), size


def _fetch_and_hash(ctx: _Ctx, chunk) -> tuple[str, str, int, bool]:
    """(local path, sha256, size, is_temporary): the file is read exactly once from its store."""
    uri = ctx.chunk_uri(chunk)
    if ctx.local:
        path = paths.local_path(uri)
        with open(path, "rb") as f:
            digest, size = _sha256_stream(lambda: f.read(1 << 22))
        return path, digest, size, False
    fs, remote = paths.url_to_fs(uri)
    path = os.path.join(ctx.tmp_dir, chunk.name)
    with fs.open(remote, "rb", block_size=1 << 23) as src, open(path, "wb") as dst:
        digest, size = _sha256_stream(lambda: src.read(1 << 23), dst)
    return path, digest, size, True


def _check_chunk(ctx: _Ctx, chunk: chunks_mod.ChunkInfo) -> _ChunkResult:
    from array_record.python.array_record_module import ArrayRecordReader

    res = _ChunkResult(chunk)
    uri = ctx.chunk_uri(chunk)
    where = {"chunk": chunk.name}
    expected = ctx.expected_records(chunk)
    path, temporary = None, False
    try:
        try:
            path, digest, res.size, temporary = _fetch_and_hash(ctx, chunk)
        except Exception as e:  # noqa: BLE001 - vanished file, network error, permissions
            res.integrity.append(("unreadable", f"{uri}: cannot be read ({type(e).__name__}: {e})", where))
            ctx.on_records(expected)
            return res
        if digest[:16] != chunk.checksum:
            res.integrity.append((
                "checksum",
                f"{uri}: checksum mismatch: the file ({res.size} bytes) has SHA-256 {digest[:16]}..., its name "
                f"says {chunk.checksum}; the chunk is corrupt or truncated; delete it and re-run the dump",
                where,
            ))
        try:
            reader = ArrayRecordReader(path)
            if not reader.ok():  # a damaged file opens, reports not ok, and raises its reason on close
                _close(reader)
        except Exception as e:  # noqa: BLE001 - the C++ reader raises plain errors
            res.integrity.append(("unreadable", f"{uri}: not a readable ArrayRecord file, truncated or corrupt "
                                                f"({res.size} bytes; {_short(e)})", where))
            ctx.on_records(expected)
            return res
        try:
            n = reader.num_records()
            if n != expected:
                res.integrity.append(("record_count", f"{uri}: holds {n} records, expected {expected} "
                                                      f"(steps [{chunk.start}, {chunk.end}) x {ctx.layout.examples_per_process}); "
                                                      "truncated or of another layout", where))
            per_record = ctx.seq_len * (ctx.top_k * 8 + 24)
            batch = int(max(1, min(1024, BATCH_BYTES // per_record)))
            for first in range(0, n, batch):
                last = min(n, first + batch)
                try:
                    raws = reader.read(first, last)
                except Exception as e:  # noqa: BLE001 - a damaged file surfaces here
                    res.integrity.append(("unreadable", f"{uri}: records {first}..{last - 1} cannot be read "
                                                        f"({_short(e)}); the chunk is corrupt", where))
                    ctx.on_records(max(0, expected - first))
                    break
                _check_batch(ctx, chunk, first, raws, res)
                ctx.on_records(last - first)
            else:
                if n < expected:
                    ctx.on_records(expected - n)
        finally:
            try:
                reader.close()
            except Exception as e:  # noqa: BLE001 - corruption found while reading surfaces here
                res.integrity.append(("unreadable", f"{uri}: corrupt ArrayRecord file ({_short(e)})", where))
    except Exception as e:  # noqa: BLE001 - never lose the whole run to one chunk
        res.integrity.append(("error", f"{uri}: {type(e).__name__}: {e}", where))
    finally:
        if temporary and path and os.path.exists(path):
            os.remove(path)
    return res


def _close(reader) -> None:
    """Close a reader that is not ok: raises the reader's error (ArrayRecord reports it on close)."""
    reader.close()
    raise RuntimeError("the ArrayRecord reader is not ok")


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
