"""Reading and writing the safetensors format through fsspec.

Written by hand (the format is an 8-byte header length, a JSON header and raw
little-endian bytes) because the ``safetensors`` package reads either a local
path or a whole file held in memory; reading tensor by tensor through an
fsspec file works the same for local paths and ``gs://`` and never holds more
than one tensor's bytes. bfloat16 and the float8 types come from ``ml_dtypes`` (a JAX dependency).
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np

from .. import paths
from ..errors import InputError

DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    # quantized checkpoints: FP8 weights (DeepSeek-V3, Kimi K2), MXFP4 blocks and exponents (gpt-oss)
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
}
NAMES = {v: k for k, v in DTYPES.items()}


def read_header(f, uri: str) -> tuple[dict, int]:
    """(header without __metadata__, offset of the data section) of an open file."""
    raw = f.read(8)
    if len(raw) != 8:
        raise InputError(f"{uri}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > 100 * 2**20:
        raise InputError(f"{uri}: not a safetensors file (header length {n})")
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise InputError(f"{uri}: corrupt safetensors header: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def read_tensors(uri: str, names=None):
    """Yield (name, numpy array) for the tensors of one safetensors file (all, or ``names``)."""
    fs, path = paths.url_to_fs(uri)
    with fs.open(path, "rb") as f:
        header, base = read_header(f, uri)
        items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        for name, info in items:
            if names is not None and name not in names:
                continue
            if info["dtype"] not in DTYPES:
                raise InputError(f"{uri}: tensor {name} has unsupported dtype {info['dtype']}")
            start, end = info["data_offsets"]
            f.seek(base + start)
            buf = f.read(end - start)
            if len(buf) != end - start:
                raise InputError(f"{uri}: tensor {name} is truncated")
            arr = np.frombuffer(buf, dtype=DTYPES[info["dtype"]]).reshape(info["shape"])
            yield name, arr


def read_rows(f, uri: str, base: int, name: str, info: dict, start: int | None = None, end: int | None = None):
    """Rows [start, end) of dimension 0 of one tensor of an open file: one byte-range read.

    The whole tensor for a 0-d one (or with no range given)."""
    if info["dtype"] not in DTYPES:
        raise InputError(f"{uri}: tensor {name} has unsupported dtype {info['dtype']}")
    dtype = DTYPES[info["dtype"]]
    shape = list(info["shape"])
    t0, t1 = info["data_offsets"]
    if not shape or start is None:
        lo, hi, out_shape = t0, t1, shape
    else:
        row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        end = shape[0] if end is None else end
        lo, hi, out_shape = t0 + start * row, t0 + end * row, [end - start, *shape[1:]]
    f.seek(base + lo)
    # straight into a fresh 64-byte-aligned numpy buffer, which a CPU device then takes without
    # another copy (XLA's CPU client aliases aligned host buffers)
    raw = np.empty(hi - lo + 64, np.uint8)
    start_at = (-raw.ctypes.data) % 64
    buf = raw[start_at:start_at + hi - lo]
    got = f.readinto(memoryview(buf)) if hasattr(f, "readinto") else None
    if got is None:
        data = f.read(hi - lo)
        got = len(data)
        buf[:got] = np.frombuffer(data, np.uint8)
    if got != hi - lo:
        raise InputError(f"{uri}: tensor {name} is truncated")
    return buf.view(dtype).reshape(out_shape)


def tensor_names(uri: str) -> dict:
    fs, path = paths.url_to_fs(uri)
    with fs.open(path, "rb") as f:
        header, _ = read_header(f, uri)
    return header


def write_file(local_path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write {name: numpy array} as one safetensors file at a local path."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in NAMES:
            raise InputError(f"cannot write tensor {name} of dtype {a.dtype}")
        nbytes = a.nbytes
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        arrays.append(a)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(local_path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for a in arrays:
            f.write(a.tobytes())
