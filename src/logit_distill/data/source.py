"""ExampleSource: random access to the packed (or padded) examples of a data set."""

from __future__ import annotations

import operator
import os
import tempfile
from typing import Iterable

import numpy as np

from logit_distill.errors import InputError

from .conversations import ChatOptions
from .formats import TEXT, DataFormat, detect_format
from .inputs import ARRAY_RECORD, KIND_NAMES, DataInputs, data_identity, resolve_inputs
from .order import PackedLayout, UnpackedLayout, document_order
from .token_cache import TokenCache, build_or_load, default_cache_dir, load_cache
from .tokenizer import Tokenizer, load_tokenizer

FORMAT = "logit-distill-data/1"
ORDER = "splitmix64-argsort/1"
# Identity fields that follow from the others (counted while tokenizing); left out of store
# fingerprints so that a fingerprint can be planned before any tokenizing.
DERIVED_FIELDS = ("num_documents", "num_tokens", "num_examples")


def settings_identity(identity: dict) -> dict:
    """``identity`` without the fields derived by tokenizing (see ``plan_identity``)."""
    return {k: v for k, v in identity.items() if k not in DERIVED_FIELDS}


def _settings(kind: str, data_sha256: str, tokenizer: Tokenizer | None, text_field: str, fmt: DataFormat,
              seed: int, seq_len: int, packing: bool) -> dict:
    """The identity fields known before tokenizing (shared by plan_identity and ExampleSource).
    A text or pre-tokenized data set has exactly the fields it had before conversations existed."""
    eos_id = tokenizer.eos_id if tokenizer is not None else None
    identity = {
        "format": FORMAT,
        "order": ORDER,
        "data_kind": kind,
        "data_sha256": data_sha256,
        "tokenizer_sha256": tokenizer.identity if tokenizer is not None else None,
        "eos_id": eos_id,
        "pad_id": eos_id if eos_id is not None else 0,
        "text_field": text_field if fmt.format == TEXT else None,
        "seed": int(seed),
        "seq_len": int(seq_len),
        "packing": bool(packing),
    }
    if fmt.is_chat:
        identity["chat"] = fmt.identity()
    return identity


def _tokenizer_for(inputs: DataInputs, data: str, tokenizer_path: str | None) -> Tokenizer | None:
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    if inputs.kind != ARRAY_RECORD and tokenizer is None:
        raise InputError(f"data {data} is {KIND_NAMES[inputs.kind]}: a tokenizer (tokenizer.json) is needed to "
                         "tokenize it")
    return tokenizer


def plan_identity(
    data: str,
    tokenizer_path: str | None,
    *,
    seq_len: int,
    packing: bool = True,
    seed: int = 0,
    text_field: str = "text",
    chat: ChatOptions | None = None,
    cache_dir: str | None = None,
) -> dict:
    """``settings_identity(ExampleSource.open(...).identity)`` without tokenizing anything.

    Reads the tokenizer (and for conversations the chat template), the first record (which fixes
    the data set's format) and hashes the data files (cached locally; on GCS the objects' checksums
    are used), so a pipeline can name a store before the expensive work starts.
    """
    inputs = resolve_inputs(data)
    tokenizer = _tokenizer_for(inputs, data, tokenizer_path)
    fmt = detect_format(inputs, tokenizer_path, text_field, chat)
    cache_dir = (cache_dir or default_cache_dir()).removeprefix("file://")
    data_sha256 = data_identity(inputs, os.path.join(cache_dir, "hashes"))
    return _settings(inputs.kind, data_sha256, tokenizer, text_field, fmt, seed, seq_len, packing)


class ExampleSource:
    """Examples `{"tokens", "segment_ids", "positions"}` (int32 `[seq_len]`) and `"loss_mask"`
    (bool `[seq_len]`) in a fixed order.

    ``loss_mask[j]`` says that the prediction at position j (of token j + 1) is trained: token
    j + 1 is in the same segment (so never padding, never across documents) and, for conversations
    and supervised pre-tokenized records, is a supervised token. For text it is exactly
    ``train.losses.next_token_mask(segment_ids)``.

    `src[i]` costs O(seq_len * log num_documents) whatever i is: resuming at step 10**6 seeks, it does
    not replay. A Grain `RandomAccessDataSource` (`__len__`, `__getitem__`); picklable without
    copying the token cache (a worker re-opens the memory map).
    """

    def __init__(
        self,
        cache: TokenCache,
        *,
        seq_len: int,
        packing: bool,
        seed: int,
        text_field: str,
        tokenizer: Tokenizer | None,
        fmt: DataFormat,
        data: str | None = None,
    ):
        self._cache = cache
        self.seq_len = seq_len
        self.packing = packing
        self.seed = seed
        self.text_field = text_field
        self.tokenizer = tokenizer
        meta = cache.meta
        self.kind = meta["kind"]
        self.data = data or meta["data"]  # where the data was read from (not part of the identity)
        self.num_documents = cache.num_documents
        self.num_tokens = cache.num_tokens
        self.max_token_id = int(meta["max_token_id"])
        if tokenizer is not None:
            self.vocab_size = tokenizer.vocab_size
            self.eos_id: int | None = tokenizer.eos_id
            if self.max_token_id >= self.vocab_size:
                raise InputError(
                    f"data {meta['data']} holds token id {self.max_token_id}, outside the vocabulary of "
                    f"tokenizer {tokenizer.path} (size {self.vocab_size})"
                )
        else:
            self.vocab_size = self.max_token_id + 1
            self.eos_id = None
        self.pad_id = self.eos_id if self.eos_id is not None else 0
        self.format = fmt.format
        # The chat template the documents were rendered with (None: no conversations), kept in a store.
        self.chat_template_text = fmt.template.text if fmt.template is not None else None
        # Documents left out because no token of theirs is supervised (to report at the end of a dump).
        self.skipped_unsupervised = int(meta.get("skipped_unsupervised_documents", 0))
        self._build_layout()
        self.identity = {
            **_settings(self.kind, meta["data_sha256"], tokenizer, text_field, fmt, seed, seq_len, packing),
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "num_examples": len(self),
        }

    def _build_layout(self) -> None:
        order = document_order(self.num_documents, self.seed)
        layout_cls = PackedLayout if self.packing else UnpackedLayout
        self._layout = layout_cls(self._cache.lengths, order, self._cache.offsets, self.seq_len)

    # ------------------------------------------------------------------ construction

    @classmethod
    def open(
        cls,
        data: str,
        tokenizer_path: str | None,
        *,
        seq_len: int,
        packing: bool = True,
        seed: int = 0,
        text_field: str = "text",
        chat: ChatOptions | None = None,
        cache_dir: str | None = None,
        fresh: bool = False,
    ) -> "ExampleSource":
        """Open `data` (a .jsonl / .parquet / .array_record file, a glob, or a directory of them; local,
        file://, gs://).

        JSONL and Parquet need `tokenizer_path` (tokenizer.json or its directory). For pre-tokenized
        ArrayRecord it is optional: it gives `vocab_size`, `eos_id` (the pad token) and a check of the ids.
        Records with `messages` (or `prompt` + `completion`) are conversations, rendered with the chat
        template and masked as `chat` says (default `ChatOptions()`; docs/DATA.md).
        The first open tokenizes everything into `cache_dir` (default `$LOGIT_DISTILL_CACHE/data`, else
        `~/.cache/logit-distill/data`; a local directory); later opens reuse it.
        `fresh=True` trusts no cache: the files are hashed again and tokenized into a temporary
        directory that lives as long as the source (what `verify --data` uses).
        """
        if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
            raise InputError(f"seq_len must be an integer >= 2, got {seq_len!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise InputError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        if not isinstance(text_field, str) or not text_field:
            raise InputError(f"text_field must be a non-empty string, got {text_field!r}")
        cache_dir = cache_dir or default_cache_dir()
        if "://" in cache_dir and not cache_dir.startswith("file://"):
            raise InputError(f"cache_dir must be a local directory (the token cache is memory-mapped), got {cache_dir}")
        cache_dir = cache_dir.removeprefix("file://")
        inputs = resolve_inputs(data)
        tokenizer = _tokenizer_for(inputs, data, tokenizer_path)
        fmt = detect_format(inputs, tokenizer_path, text_field, chat)
        scratch = None
        if fresh:
            scratch = tempfile.TemporaryDirectory(prefix="logit-distill-fresh-")
            cache_dir = scratch.name
        data_id = data_identity(inputs, None if fresh else os.path.join(cache_dir, "hashes"))
        cache = build_or_load(inputs, data_id, tokenizer, text_field, cache_dir, fmt)
        source = cls(
            cache, seq_len=int(seq_len), packing=bool(packing), seed=int(seed), text_field=text_field, tokenizer=tokenizer,
            fmt=fmt, data=data,
        )
        source._scratch = scratch  # removed with the source
        return source

    # ------------------------------------------------------------------ access

    def __len__(self) -> int:
        return self._layout.num_examples

    def _index(self, i) -> int:
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"example index must be an integer, got {type(i).__name__}") from None
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"example index out of range: {i} (the source has {n} examples)")
        return i

    def __getitem__(self, i) -> dict[str, np.ndarray]:
        i = self._index(i)
        L = self.seq_len
        src, seg, pos = self._layout.gather(i)
        n = len(src)
        tokens = np.full(L, self.pad_id, dtype=np.int32)
        segment_ids = np.zeros(L, dtype=np.int32)
        positions = np.zeros(L, dtype=np.int32)
        tokens[:n] = self._cache.tokens[src]
        segment_ids[:n] = seg
        positions[:n] = pos
        loss_mask = np.zeros(L, dtype=bool)
        loss_mask[:-1] = (segment_ids[:-1] != 0) & (segment_ids[1:] == segment_ids[:-1])
        if self._cache.supervised is not None:
            target = np.zeros(L, dtype=bool)
            target[:n] = self._cache.supervised[src] != 0
            loss_mask[:-1] &= target[1:]
        return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions, "loss_mask": loss_mask}

    def batch(self, indices: Iterable[int]) -> dict[str, np.ndarray]:
        """Examples `indices` stacked: arrays `[n, seq_len]` (int32; loss_mask bool)."""
        idx = indices if isinstance(indices, np.ndarray) else list(indices)
        arr = np.asarray(idx).reshape(-1)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"example indices must be integers, got {arr.dtype}")
        examples = [self[i] for i in arr]
        if not examples:
            out = {k: np.zeros((0, self.seq_len), np.int32) for k in ("tokens", "segment_ids", "positions")}
            return {**out, "loss_mask": np.zeros((0, self.seq_len), bool)}
        return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise InputError when the data/tokenizer vocabulary exceeds the model's."""
        if self.tokenizer is not None:
            self.tokenizer.check_vocab(model_vocab_size)
        if self.max_token_id >= int(model_vocab_size):
            raise InputError(
                f"data {self.data} holds token id {self.max_token_id} but the model's vocabulary has "
                f"only {model_vocab_size} entries: the data was tokenized for another model"
            )

    def __repr__(self) -> str:
        return (
            f"ExampleSource({self.data!r}, seq_len={self.seq_len}, packing={self.packing}, "
            f"seed={self.seed}, examples={len(self)}, documents={self.num_documents}, tokens={self.num_tokens})"
        )

    # ------------------------------------------------------------------ pickling (Grain worker processes)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"] = self._cache.dir  # re-open the memory map instead of copying the tokens
        state.pop("_layout")
        state.pop("_scratch", None)  # the original owns a fresh source's temporary cache
        return state

    def __setstate__(self, state):
        cache = load_cache(state["_cache"])
        if cache is None:
            raise InputError(f"token cache {state['_cache']} is gone; open the ExampleSource again")
        state["_cache"] = cache
        self.__dict__.update(state)
        self._build_layout()
