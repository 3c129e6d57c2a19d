"""The one-time index: every document tokenized once into a local, content-addressed token cache.

Layout of `<cache_dir>/tokens/<key>/` (key = sha256 of data identity, tokenizer identity and EOS,
text field, cache format version, and for remote objects their GCS generations). The data identity
is a content digest (inputs.file_digest): locally a sha256 whose own cache is keyed by inode, size,
mtime_ns and ctime_ns, on GCS the objects' md5/crc32c, so an edit in place is never served stale.
Files:

* `tokens.i32`   all documents' tokens back to back, raw little-endian int32 (memory-mapped);
* `offsets.npy`  int64 `[num_documents + 1]`, document d is `tokens[offsets[d]:offsets[d+1]]`
                 (saved with allow_pickle=False);
* `meta.json`    counts and what the key was made of.

A cache directory is built under a unique temporary name and renamed into place as a whole, so a
crash never leaves a half-built cache, and two processes building the same key at once are safe
(the second rename fails, that process drops its copy and uses the winner's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass

import numpy as np

from logit_distill import paths
from logit_distill.errors import InputError

from .inputs import (
    ARRAY_RECORD,
    JSONL,
    TOKEN_DTYPE,
    DataInputs,
    _progress,
    iter_array_record_docs,
    iter_jsonl_texts,
    object_versions,
)
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_VERSION = 1
_BATCH_DOCS = 1024
_BATCH_CHARS = 8 << 20


def default_cache_dir() -> str:
    return paths.default_cache_dir("data")


@dataclass
class TokenCache:
    dir: str
    tokens: np.ndarray  # memmap int32 [num_tokens]
    offsets: np.ndarray  # int64 [num_documents + 1]
    meta: dict

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def cache_key(data_id: str, kind: str, tokenizer: Tokenizer | None, text_field: str,
              versions: list | None = None) -> str:
    parts = {"version": CACHE_VERSION, "data": data_id, "kind": kind}
    if versions is not None:  # remote objects: their generations (see inputs.object_versions)
        parts["versions"] = versions
    if kind == JSONL:  # pre-tokenized records are used verbatim: the tokenizer does not enter the cache
        parts.update(tokenizer=tokenizer.identity, eos_id=tokenizer.eos_id, text_field=text_field)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def load_cache(path: str) -> TokenCache | None:
    """Open a built cache, or None when it is absent or inconsistent."""
    try:
        with open(os.path.join(path, "meta.json")) as fh:
            meta = json.load(fh)
        offsets = np.load(os.path.join(path, "offsets.npy"), allow_pickle=False)
        n_tok = int(meta["num_tokens"])
        tok_file = os.path.join(path, "tokens.i32")
        if (
            offsets.dtype != np.int64
            or offsets.ndim != 1
            or len(offsets) != int(meta["num_documents"]) + 1
            or int(offsets[-1]) != n_tok
            or os.path.getsize(tok_file) != n_tok * TOKEN_DTYPE.itemsize
        ):
            log.warning("token cache %s is inconsistent; rebuilding it", path)
            return None
        tokens = np.memmap(tok_file, dtype=TOKEN_DTYPE, mode="r", shape=(n_tok,))
    except (OSError, ValueError, KeyError) as e:
        if os.path.exists(path):
            log.warning("token cache %s is unreadable (%s); rebuilding it", path, e)
        return None
    return TokenCache(path, tokens, offsets, meta)


class _Builder:
    def __init__(self, tmp: str):
        self.tok_path = os.path.join(tmp, "tokens.i32")
        self.fh = open(self.tok_path, "wb")
        self.lengths: list[np.ndarray] = []
        self.max_id = -1
        self.skipped_empty = 0

    def add(self, docs: list[np.ndarray]) -> None:
        keep = [d for d in docs if d.size]
        self.skipped_empty += len(docs) - len(keep)
        if not keep:
            return
        flat = np.concatenate(keep).astype(TOKEN_DTYPE, copy=False)
        self.max_id = max(self.max_id, int(flat.max()))
        flat.tofile(self.fh)
        self.lengths.append(np.fromiter((d.size for d in keep), dtype=np.int64, count=len(keep)))

    def close(self) -> np.ndarray:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _tokenize_jsonl(inputs: DataInputs, tokenizer: Tokenizer, text_field: str, b: _Builder) -> list[dict]:
    eos = np.array([tokenizer.eos_id], dtype=TOKEN_DTYPE)
    per_file = []
    with _progress(inputs.total_bytes, "tokenizing") as bar:
        for f in inputs.files:
            texts: list[str] = []
            chars = 0
            n_docs0, n_skip0 = sum(len(x) for x in b.lengths), b.skipped_empty

            def flush():
                # A document = its tokens (no special tokens added) + EOS; an empty text is skipped.
                docs = [
                    np.concatenate([np.asarray(ids, dtype=TOKEN_DTYPE), eos]) if ids else np.zeros(0, TOKEN_DTYPE)
                    for ids in tokenizer.encode_batch(texts)
                ]
                b.add(docs)
                texts.clear()

            for text in iter_jsonl_texts(f, text_field, on_bytes=bar.update):
                texts.append(text)
                chars += len(text)
                if len(texts) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                    flush()
                    chars = 0
            if texts:
                flush()
            per_file.append(
                {
                    "name": f.name,
                    "documents": sum(len(x) for x in b.lengths) - n_docs0,
                    "skipped_empty": b.skipped_empty - n_skip0,
                }
            )
    return per_file


def _read_array_records(inputs: DataInputs, b: _Builder, tmp: str) -> list[dict]:
    per_file = []
    for f in inputs.files:
        local = f.path
        if not inputs.is_local:  # the C++ reader takes local paths: copy the object next to the build
            local = os.path.join(tmp, "download.array_record")
            inputs.fs.get_file(f.path, local)
        n_docs0, n_skip0 = sum(len(x) for x in b.lengths), b.skipped_empty
        batch: list[np.ndarray] = []
        for doc in iter_array_record_docs(local, f.url):
            batch.append(doc)
            if len(batch) >= 4096:
                b.add(batch)
                batch = []
        b.add(batch)
        if local != f.path:
            os.unlink(local)
        per_file.append(
            {
                "name": f.name,
                "documents": sum(len(x) for x in b.lengths) - n_docs0,
                "skipped_empty": b.skipped_empty - n_skip0,
            }
        )
    return per_file


def _remove_stale_temporaries(root: str, max_age_s: float = 2 * 86400) -> None:
    """Remove what crashed builds left behind (a live build touches its files far more often)."""
    now = time.time()
    for name in os.listdir(root):
        if name.startswith(".tmp-") or ".bad-" in name:
            path = os.path.join(root, name)
            try:
                newest = max([os.path.getmtime(path)] + [os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path)])
            except OSError:
                continue
            if now - newest > max_age_s:
                shutil.rmtree(path, ignore_errors=True)


def build_or_load(
    inputs: DataInputs, data_id: str, tokenizer: Tokenizer | None, text_field: str, cache_dir: str
) -> TokenCache:
    key = cache_key(data_id, inputs.kind, tokenizer, text_field, object_versions(inputs))
    root = os.path.join(cache_dir, "tokens")
    final = os.path.join(root, key)
    cache = load_cache(final)
    if cache is not None:
        return cache
    if os.path.exists(final):  # inconsistent: move it aside (readers holding a memmap keep their inode)
        trash = f"{final}.bad-{uuid.uuid4().hex}"
        try:
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        except OSError:
            pass
    os.makedirs(root, exist_ok=True)
    _remove_stale_temporaries(root)
    tmp = tempfile.mkdtemp(dir=root, prefix=f".tmp-{key[:16]}-")
    try:
        b = _Builder(tmp)
        if inputs.kind == JSONL:
            per_file = _tokenize_jsonl(inputs, tokenizer, text_field, b)
        else:
            assert inputs.kind == ARRAY_RECORD
            per_file = _read_array_records(inputs, b, tmp)
        offsets = b.close()
        n_docs, n_tok = len(offsets) - 1, int(offsets[-1])
        if n_docs == 0 or n_tok == 0:
            raise InputError(
                f"data {inputs.uri} has no documents with tokens"
                + (f" (skipped {b.skipped_empty} empty documents)" if b.skipped_empty else "")
            )
        np.save(os.path.join(tmp, "offsets.npy"), offsets, allow_pickle=False)
        paths.fsync(os.path.join(tmp, "offsets.npy"))
        meta = {
            "version": CACHE_VERSION,
            "key": key,
            "data_sha256": data_id,
            "kind": inputs.kind,
            "data": inputs.uri,
            "tokenizer_sha256": tokenizer.identity if (tokenizer and inputs.kind == JSONL) else None,
            "eos_id": tokenizer.eos_id if (tokenizer and inputs.kind == JSONL) else None,
            "text_field": text_field if inputs.kind == JSONL else None,
            "num_documents": n_docs,
            "num_tokens": n_tok,
            "max_token_id": b.max_id,
            "skipped_empty_documents": b.skipped_empty,
            "files": per_file,
        }
        with open(os.path.join(tmp, "meta.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process committed the same key first; its cache is identical by construction.
            if load_cache(final) is None:
                raise
        else:
            try:  # make the rename durable
                fd = os.open(root, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            except OSError:
                pass
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    cache = load_cache(final)
    if cache is None:
        raise InputError(f"token cache {final} could not be read back after building it")
    return cache
