"""The one-time index: every document tokenized once into a local, content-addressed token cache.

Layout of `<cache_dir>/tokens/<key>/` (key = sha256 of data identity, tokenizer identity and EOS,
text field, cache format version, for remote objects their GCS generations, and for conversations
the chat settings: format, template, its arguments, the mask options). The data identity
is a content digest (inputs.file_digest): locally a sha256 whose own cache is keyed by inode, size,
mtime_ns and ctime_ns, on GCS the objects' md5/crc32c, so an edit in place is never served stale.
Files:

* `tokens.i32`   all documents' tokens back to back, raw little-endian int32 (memory-mapped);
* `offsets.npy`  int64 `[num_documents + 1]`, document d is `tokens[offsets[d]:offsets[d+1]]`
                 (saved with allow_pickle=False);
* `supervised.u8` conversations and supervised pre-tokenized records only: one byte per token, 1
                 where the token is a training target (memory-mapped beside the tokens);
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

from .conversations import Conversation, columns_of, format_of_fields, parse_record
from .formats import TOKENS, DataFormat
from .inputs import ARRAY_RECORD, JSONL, TOKEN_DTYPE, DataInputs, _progress, object_versions
from .pretokenized import iter_array_record_docs
from .records import iter_jsonl_records, iter_parquet_records, iter_texts, parquet_schema
from .supervision import ChatPreparer
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
    supervised: np.ndarray | None = None  # memmap uint8 [num_tokens]: 1 = a training target

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
              versions: list | None = None, chat: dict | None = None) -> str:
    parts = {"version": CACHE_VERSION, "data": data_id, "kind": kind}
    if versions is not None:  # remote objects: their generations (see inputs.object_versions)
        parts["versions"] = versions
    if kind != ARRAY_RECORD:  # pre-tokenized records are used verbatim: the tokenizer does not enter the cache
        parts.update(tokenizer=tokenizer.identity, eos_id=tokenizer.eos_id, text_field=text_field)
    if chat is not None:  # conversations: how they are rendered and masked
        parts["chat"] = chat
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
        supervised = None
        if meta.get("supervised"):
            sup_file = os.path.join(path, "supervised.u8")
            if os.path.getsize(sup_file) != n_tok:
                log.warning("token cache %s is inconsistent; rebuilding it", path)
                return None
            supervised = np.memmap(sup_file, dtype=np.uint8, mode="r", shape=(n_tok,))
    except (OSError, ValueError, KeyError) as e:
        if os.path.exists(path):
            log.warning("token cache %s is unreadable (%s); rebuilding it", path, e)
        return None
    return TokenCache(path, tokens, offsets, meta, supervised)


class _Builder:
    """Appends documents (and their supervision flags) to the cache files being built."""

    def __init__(self, tmp: str, supervised: bool):
        self.tok_path = os.path.join(tmp, "tokens.i32")
        self.fh = open(self.tok_path, "wb")
        self.sup_fh = open(os.path.join(tmp, "supervised.u8"), "wb") if supervised else None
        self.lengths: list[np.ndarray] = []
        self.max_id = -1
        self.skipped_empty = 0
        self.skipped_unsupervised = 0  # documents without a training target: never trained on

    @property
    def num_documents(self) -> int:
        return sum(len(x) for x in self.lengths)

    def add(self, docs: list[np.ndarray], flags: list[np.ndarray] | None = None) -> None:
        assert (flags is None) == (self.sup_fh is None)
        keep = [i for i, d in enumerate(docs) if d.size]
        self.skipped_empty += len(docs) - len(keep)
        if flags is not None:
            n = len(keep)
            keep = [i for i in keep if flags[i].any()]
            self.skipped_unsupervised += n - len(keep)
        if not keep:
            return
        flat = np.concatenate([docs[i] for i in keep]).astype(TOKEN_DTYPE, copy=False)
        self.max_id = max(self.max_id, int(flat.max()))
        flat.tofile(self.fh)
        if flags is not None:
            np.concatenate([flags[i] for i in keep]).astype(np.uint8, copy=False).tofile(self.sup_fh)
        self.lengths.append(np.fromiter((docs[i].size for i in keep), dtype=np.int64, count=len(keep)))

    def close(self) -> np.ndarray:
        for fh in (self.fh, self.sup_fh):
            if fh is not None:
                fh.flush()
                os.fsync(fh.fileno())
                fh.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def file_counts(self, name: str, docs0: int, empty0: int, unsup0: int) -> dict:
        counts = {"name": name, "documents": self.num_documents - docs0, "skipped_empty": self.skipped_empty - empty0}
        if self.sup_fh is not None:
            counts["skipped_unsupervised"] = self.skipped_unsupervised - unsup0
        return counts

    def marks(self) -> tuple[int, int, int]:
        return self.num_documents, self.skipped_empty, self.skipped_unsupervised


def _tokenize_texts(inputs: DataInputs, tokenizer: Tokenizer, text_field: str, b: _Builder) -> list[dict]:
    eos = np.array([tokenizer.eos_id], dtype=TOKEN_DTYPE)
    per_file = []
    with _progress(inputs.total_bytes, "tokenizing") as bar:
        for f in inputs.files:
            texts: list[str] = []
            chars = 0
            marks = b.marks()

            def flush():
                # A document = its tokens (no special tokens added) + EOS; an empty text is skipped.
                docs = [
                    np.concatenate([np.asarray(ids, dtype=TOKEN_DTYPE), eos]) if ids else np.zeros(0, TOKEN_DTYPE)
                    for ids in tokenizer.encode_batch(texts)
                ]
                b.add(docs)
                texts.clear()

            for text in iter_texts(f, inputs.kind, text_field, on_bytes=bar.update):
                texts.append(text)
                chars += len(text)
                if len(texts) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                    flush()
                    chars = 0
            if texts:
                flush()
            per_file.append(b.file_counts(f.name, *marks))
    return per_file


def _chat_records(inputs: DataInputs, f, fmt: DataFormat, text_field: str, on_bytes):
    """The records of one file of a chat data set (a Parquet file's columns must fit its format)."""
    options = fmt.options
    if inputs.kind == JSONL:
        return iter_jsonl_records(f, on_bytes)
    names = parquet_schema(f).names
    got = format_of_fields(names, options, text_field)
    if got != fmt.format:
        raise InputError(f"{f.url}: columns {names[:10]} make it a {got or 'unreadable'} file in a data set of "
                         f"{fmt.format} files (the first file decides); use one format per data set")
    columns = columns_of(fmt.format, options, text_field)
    columns += [options.tools_field] if options.tools_field in names else []
    return iter_parquet_records(f, columns, nested=tuple(columns), on_bytes=on_bytes)


def _prepare_chat(inputs: DataInputs, tokenizer: Tokenizer, fmt: DataFormat, text_field: str, b: _Builder) -> list[dict]:
    preparer = ChatPreparer(tokenizer, fmt.template, fmt.options)
    per_file = []
    with _progress(inputs.total_bytes, "rendering and tokenizing") as bar:
        for f in inputs.files:
            marks = b.marks()
            items: list = []

            def flush():
                docs = preparer.prepare(items)
                b.add([ids for ids, _ in docs], [flags for _, flags in docs])
                items.clear()

            for place, record in _chat_records(inputs, f, fmt, text_field, bar.update):
                item = parse_record(record, fmt.format, fmt.conversational, fmt.options, text_field, place)
                if isinstance(item, Conversation) and not item.messages:
                    b.skipped_empty += 1
                    continue
                items.append(item)
                if len(items) >= _BATCH_DOCS:
                    flush()
            if items:
                flush()
            per_file.append(b.file_counts(f.name, *marks))
    return per_file


def _read_array_records(inputs: DataInputs, tmp: str) -> tuple[_Builder, list[dict]]:
    """Copy the records into a builder whose layout (with supervision flags or not) is that of the
    first record; a record of the other layout is an InputError."""
    builder: list[_Builder] = []  # made at the first record, which sets the layout

    def add(docs, flags):
        if docs:
            b = builder[0]
            b.add(docs, flags if b.sup_fh is not None else None)

    per_file = []
    for f in inputs.files:
        local = f.path
        if not inputs.is_local:  # the C++ reader takes local paths: copy the object next to the build
            local = os.path.join(tmp, "download.array_record")
            inputs.fs.get_file(f.path, local)
        marks = builder[0].marks() if builder else (0, 0, 0)
        docs: list[np.ndarray] = []
        flags: list[np.ndarray | None] = []
        for j, (ids, sup) in enumerate(iter_array_record_docs(local, f.url)):
            if not builder:
                builder.append(_Builder(tmp, supervised=sup is not None))
            layout = "supervised" if builder[0].sup_fh is not None else "plain"
            if (sup is not None) != (layout == "supervised"):
                raise InputError(f"{f.url} record {j}: a {'supervised' if sup is not None else 'plain'} record in a "
                                 f"data set of {layout} records (the first decides); write every record with "
                                 "supervision flags or none")
            docs.append(ids)
            flags.append(sup)
            if len(docs) >= 4096:
                add(docs, flags)
                docs, flags = [], []
        add(docs, flags)
        if local != f.path:
            os.unlink(local)
        per_file.append(builder[0].file_counts(f.name, *marks) if builder else
                        {"name": f.name, "documents": 0, "skipped_empty": 0})
    if not builder:  # no record at all: reported as an empty data set
        builder.append(_Builder(tmp, supervised=False))
    return builder[0], per_file


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
    inputs: DataInputs, data_id: str, tokenizer: Tokenizer | None, text_field: str, cache_dir: str,
    fmt: DataFormat,
) -> TokenCache:
    key = cache_key(data_id, inputs.kind, tokenizer, text_field, object_versions(inputs), fmt.identity())
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
        if fmt.format == TOKENS:
            b, per_file = _read_array_records(inputs, tmp)
        elif fmt.is_chat:
            b = _Builder(tmp, supervised=True)
            per_file = _prepare_chat(inputs, tokenizer, fmt, text_field, b)
        else:
            b = _Builder(tmp, supervised=False)
            per_file = _tokenize_texts(inputs, tokenizer, text_field, b)
        offsets = b.close()
        n_docs, n_tok = len(offsets) - 1, int(offsets[-1])
        if n_docs == 0 or n_tok == 0:
            skipped = [f"{n} {what}" for n, what in ((b.skipped_empty, "empty documents"),
                                                     (b.skipped_unsupervised, "without a supervised token")) if n]
            raise InputError(
                f"data {inputs.uri} has no documents with tokens"
                + (f" (skipped {', '.join(skipped)})" if skipped else "")
                + ("; check the supervised roles and the mask options" if b.skipped_unsupervised else "")
            )
        np.save(os.path.join(tmp, "offsets.npy"), offsets, allow_pickle=False)
        paths.fsync(os.path.join(tmp, "offsets.npy"))
        tokenized = inputs.kind != ARRAY_RECORD
        meta = {
            "version": CACHE_VERSION,
            "key": key,
            "data_sha256": data_id,
            "kind": inputs.kind,
            "data": inputs.uri,
            "tokenizer_sha256": tokenizer.identity if (tokenizer and tokenized) else None,
            "eos_id": tokenizer.eos_id if (tokenizer and tokenized) else None,
            "text_field": text_field if tokenized else None,
            "num_documents": n_docs,
            "num_tokens": n_tok,
            "max_token_id": b.max_id,
            "skipped_empty_documents": b.skipped_empty,
            "files": per_file,
        }
        if b.sup_fh is not None:
            meta.update(supervised=True, skipped_unsupervised_documents=b.skipped_unsupervised, chat=fmt.identity())
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
