"""Input files: resolving a data URI to its files, and the data identity.

Three input kinds, never mixed in one data set:

* JSONL (`*.jsonl`, also `*.jsonl.gz` / `*.jsonl.zst`, decompressed by fsspec): one JSON object
  per line (records.py reads them);
* Parquet (`*.parquet`): one row per record (records.py);
* pre-tokenized ArrayRecord (`*.array_record`, also Grain-style `*.array_record-00000-of-00004`):
  one record per document (pretokenized.py has the record layouts).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import sys
import tempfile
from dataclasses import dataclass

import fsspec
import fsspec.core
import numpy as np

from logit_distill.errors import InputError

JSONL = "jsonl"
PARQUET = "parquet"
ARRAY_RECORD = "array_record"
KIND_NAMES = {JSONL: "JSONL", PARQUET: "Parquet", ARRAY_RECORD: "ArrayRecord"}
TOKEN_DTYPE = np.dtype("<i4")  # the ArrayRecord record encoding and the token cache dtype
_HASH_BLOCK = 8 << 20
PROGRESS_MIN_BYTES = 64 << 20  # show a progress bar only for inputs at least this large


def file_kind(name: str) -> str | None:
    base = posixpath.basename(name)
    if base.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        return JSONL
    if base.endswith(".parquet"):
        return PARQUET
    if base.endswith(".array_record") or ".array_record-" in base:
        return ARRAY_RECORD
    return None


@dataclass(frozen=True)
class InputFile:
    url: str  # full URL (with protocol)
    path: str  # path on `fs`
    name: str  # name relative to the data root: part of the data identity
    size: int
    info: dict


@dataclass
class DataInputs:
    uri: str
    fs: fsspec.AbstractFileSystem
    kind: str
    files: list[InputFile]

    @property
    def is_local(self) -> bool:
        return "file" in _protocols(self.fs)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def _has_magic(path: str) -> bool:
    return any(c in path for c in "*?[")


def resolve_inputs(data: str) -> DataInputs:
    """Resolve `data` (a file, a glob, or a directory; local, file:// or gs://) to sorted input files."""
    if not isinstance(data, str) or not data:
        raise InputError(f"data must be a non-empty path or URI, got {data!r}")
    fs, path = fsspec.core.url_to_fs(data)
    path = path.rstrip("/") or path
    if _has_magic(path):
        paths = [p for p in fs.glob(path) if fs.isfile(p)]
        parts = path.split("/")
        root = "/".join(parts[: next(i for i, s in enumerate(parts) if _has_magic(s))])
        if not paths:
            raise InputError(f"no files match the data glob {data}")
    elif fs.isdir(path):
        root = path
        paths = [e["name"] for e in fs.ls(path, detail=True) if e.get("type") == "file" and file_kind(e["name"])]
        if not paths:
            raise InputError(
                f"data directory {data} holds no *.jsonl, *.parquet or *.array_record files (sub-directories are "
                "not searched)"
            )
    elif fs.isfile(path):
        root = posixpath.dirname(path)
        paths = [path]
    else:
        raise InputError(f"data path not found: {data}; check the path")

    files, kinds = [], set()
    for p in sorted(paths):
        kind = file_kind(p)
        if kind is None:
            raise InputError(
                f"{fs.unstrip_protocol(p)}: unknown data file type (expected *.jsonl[.gz|.zst], *.parquet or "
                "*.array_record)"
            )
        kinds.add(kind)
        info = fs.info(p)
        name = posixpath.relpath(p, root) if root else p
        files.append(InputFile(fs.unstrip_protocol(p), p, name, int(info.get("size") or 0), info))
    if len(kinds) > 1:
        names = " and ".join(KIND_NAMES[k] for k in sorted(kinds))
        raise InputError(f"data {data} mixes {names} files; use one kind per data set")
    return DataInputs(uri=data, fs=fs, kind=kinds.pop(), files=files)


# ----------------------------------------------------------------------------- identity


def _progress(total: int, desc: str, unit: str = "B"):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=True,
        file=sys.stderr,
        disable=total < PROGRESS_MIN_BYTES if unit == "B" else None,
        mininterval=1.0 if sys.stderr.isatty() else 30.0,
        leave=False,
    )


def _sha256_stream(fs, f: InputFile) -> str:
    h = hashlib.sha256()
    with fs.open(f.path, "rb") as fh, _progress(f.size, f"hashing {f.name}") as bar:
        while block := fh.read(_HASH_BLOCK):
            h.update(block)
            bar.update(len(block))
    return h.hexdigest()


def _atomic_write_text(path: str, text: str) -> None:
    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def file_digest(inputs: DataInputs, f: InputFile, hash_cache_dir: str | None) -> str:
    """A digest of one file's content.

    Local files: sha256 of the bytes, cached under `hash_cache_dir` (None: no cache, always read)
    by (absolute path, device, inode, size, mtime_ns, ctime_ns) so that a resume does not re-read
    many GB. Any edit changes ctime_ns, which `touch -r` and `os.utime` cannot set back, so an
    edit that keeps size and mtime is still seen. Object stores that report a content hash (GCS:
    md5Hash and/or crc32c) use it without reading the object. Anything else is read and hashed.
    """
    if inputs.is_local:
        st = os.stat(f.path)
        key = json.dumps([os.path.abspath(f.path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                          st.st_ctime_ns])
        if hash_cache_dir is None:
            return "sha256:" + _sha256_stream(inputs.fs, f)
        cache_file = os.path.join(hash_cache_dir, hashlib.sha256(key.encode()).hexdigest() + ".json")
        try:
            with open(cache_file) as fh:
                cached = json.load(fh)
            if cached.get("key") == key:
                return cached["digest"]
        except (OSError, ValueError, KeyError):
            pass
        digest = "sha256:" + _sha256_stream(inputs.fs, f)
        _atomic_write_text(cache_file, json.dumps({"key": key, "digest": digest}))
        return digest
    parts = [f"{k}:{f.info[k]}" for k in ("md5Hash", "crc32c") if f.info.get(k)]
    if parts:
        return ",".join(parts)
    return "sha256:" + _sha256_stream(inputs.fs, f)


def object_versions(inputs: DataInputs) -> list | None:
    """What names the exact version of each remote object (GCS: its generation), or None
    locally. Keys the token cache next to the content digest: an object rewritten in place
    is tokenized again even if its reported checksums were to collide."""
    if inputs.is_local:
        return None
    return [[f.name, f.info.get("generation"), f.info.get("metageneration")] for f in inputs.files]


def data_identity(inputs: DataInputs, hash_cache_dir: str | None) -> str:
    """sha256 over (name relative to the data root, size, content digest) of every input file, in order."""
    entries = [{"name": f.name, "size": f.size, "digest": file_digest(inputs, f, hash_cache_dir)} for f in inputs.files]
    return hashlib.sha256(json.dumps({"kind": inputs.kind, "files": entries}, sort_keys=True).encode()).hexdigest()
