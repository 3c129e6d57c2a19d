"""HF `tokenizers` wrapper: tokenizer.json + the EOS id from the checkpoint's config files."""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import Any, Sequence

import fsspec.core

from logit_distill.errors import InputError

TOKENIZER_FILE = "tokenizer.json"


def _read_bytes(fs, path: str) -> bytes:
    with fs.open(path, "rb") as f:
        return f.read()


def _read_json(fs, path: str) -> dict | None:
    if not fs.exists(path):
        return None
    try:
        obj = json.loads(_read_bytes(fs, path))
    except ValueError as e:
        raise InputError(f"{fs.unstrip_protocol(path)} is not valid JSON: {e}") from e
    return obj if isinstance(obj, dict) else None


@dataclass
class Tokenizer:
    """A loaded tokenizer.

    `encode(text)` follows the HF convention for pre-training text: no special tokens are added
    by the post-processor (`add_special_tokens=False`); the data pipeline appends `eos_id` after
    every document itself.
    """

    hf: Any  # tokenizers.Tokenizer
    path: str
    eos_id: int
    eos_token: str | None
    vocab_size: int
    identity: str  # sha256 of the tokenizer.json bytes

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise InputError when this tokenizer can produce ids the model has no embedding for."""
        if self.vocab_size > int(model_vocab_size):
            raise InputError(
                f"tokenizer {self.path} has {self.vocab_size} tokens (with added tokens) but the model's "
                f"vocabulary has only {model_vocab_size}: use the tokenizer.json of the same checkpoint"
            )


def _eos_from_configs(fs, directory: str, hf) -> tuple[int, str | None]:
    """EOS id: `eos_token` of tokenizer_config.json, else `eos_token_id` of config.json."""
    tc_path = posixpath.join(directory, "tokenizer_config.json")
    tc = _read_json(fs, tc_path)
    if tc is not None and tc.get("eos_token") is not None:
        tok = tc["eos_token"]
        if isinstance(tok, dict):  # old AddedToken serialization: {"content": "...", ...}
            tok = tok.get("content")
        if not isinstance(tok, str):
            raise InputError(f"{fs.unstrip_protocol(tc_path)}: eos_token {tc['eos_token']!r} is not a string")
        tid = hf.token_to_id(tok)
        if tid is None:
            raise InputError(
                f"{fs.unstrip_protocol(tc_path)}: eos_token {tok!r} is not in the vocabulary of tokenizer.json"
            )
        return int(tid), tok
    cfg = _read_json(fs, posixpath.join(directory, "config.json"))
    if cfg is not None and cfg.get("eos_token_id") is not None:
        eid = cfg["eos_token_id"]
        if isinstance(eid, list):  # e.g. Llama 3 instruct lists several; the first is the document end
            if not eid:
                eid = None
            else:
                eid = eid[0]
        if isinstance(eid, int) and not isinstance(eid, bool):
            return eid, hf.id_to_token(eid)
    raise InputError(
        f"cannot find the EOS token of tokenizer {fs.unstrip_protocol(posixpath.join(directory, TOKENIZER_FILE))}: "
        "put a tokenizer_config.json with `eos_token` (or a config.json with `eos_token_id`) next to it"
    )


def load_tokenizer(tokenizer_path: str) -> Tokenizer:
    """Load `tokenizer.json` (a path to the file or to its directory; local, file:// or gs://)."""
    from tokenizers import Tokenizer as HFTokenizer

    fs, path = fsspec.core.url_to_fs(tokenizer_path)
    if fs.isdir(path):
        path = posixpath.join(path, TOKENIZER_FILE)
    if not fs.exists(path):
        raise InputError(f"tokenizer file not found: {tokenizer_path} (expected a tokenizer.json or its directory)")
    raw = _read_bytes(fs, path)
    try:
        hf = HFTokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises a plain Exception on parse errors
        raise InputError(f"{fs.unstrip_protocol(path)} is not a valid HF tokenizer.json: {e}") from e
    vocab_size = int(hf.get_vocab_size(with_added_tokens=True))
    eos_id, eos_token = _eos_from_configs(fs, posixpath.dirname(path), hf)
    if not 0 <= eos_id < vocab_size:
        raise InputError(f"EOS id {eos_id} of {fs.unstrip_protocol(path)} is outside its vocabulary (size {vocab_size})")
    return Tokenizer(
        hf=hf,
        path=fs.unstrip_protocol(path),
        eos_id=eos_id,
        eos_token=eos_token,
        vocab_size=vocab_size,
        identity=hashlib.sha256(raw).hexdigest(),
    )


def tokenizer_file(tokenizer_path: str) -> str:
    """The tokenizer.json of ``tokenizer_path`` (the file, or its directory), as a URL or path."""
    fs, path = fsspec.core.url_to_fs(tokenizer_path)
    if fs.isdir(path):
        path = posixpath.join(path, TOKENIZER_FILE)
    return fs.unstrip_protocol(path)


def file_sha256(tokenizer_path: str) -> str:
    """SHA-256 of the tokenizer.json bytes: the identity recorded in a store's manifest."""
    fs, path = fsspec.core.url_to_fs(tokenizer_file(tokenizer_path))
    return hashlib.sha256(_read_bytes(fs, path)).hexdigest()


def differing_ids(a_path: str, b_path: str, limit: int = 5) -> tuple[list[tuple[int, str | None, str | None]], int]:
    """Ids whose token differs between two tokenizer.json files (added tokens included):
    ``(first `limit` as (id, token in a, token in b), how many differ)``. Empty when the
    vocabularies are equal (the files may still differ in merges, normalizer or pre-tokenizer)."""
    from tokenizers import Tokenizer as HFTokenizer

    def id_to_token(path: str) -> dict[int, str]:
        fs, p = fsspec.core.url_to_fs(tokenizer_file(path))
        vocab = HFTokenizer.from_str(_read_bytes(fs, p).decode("utf-8")).get_vocab(with_added_tokens=True)
        return {i: t for t, i in vocab.items()}

    a, b = id_to_token(a_path), id_to_token(b_path)
    ids = sorted(i for i in set(a) | set(b) if a.get(i) != b.get(i))
    return [(i, a.get(i), b.get(i)) for i in ids[:limit]], len(ids)
