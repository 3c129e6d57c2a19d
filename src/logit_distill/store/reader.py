"""Reading a store: ``open_store(uri)`` and random access by global example index.

Where example ``g`` lies (its step, process, chunk and record) is ``StoreLayout``'s arithmetic
(``store/layout.py``).

A chunk is checked against the SHA-256 in its name the first time this
process opens it; chunks on GCS are downloaded once into a local cache (the
ArrayRecord reader needs a local file) and checked on the way.
"""

from __future__ import annotations

import collections
import os
import threading
import uuid

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from .. import codec as codec_mod
from .. import paths
from ..errors import NotAStoreError, StoreError
from . import chunks as chunks_mod
from . import manifest as manifest_mod
from .layout import StoreLayout


def open_store(uri: str, *, verify_checksums: bool = True, cache_dir: str | None = None,
               max_open_chunks: int = 64) -> "Store":
    """Open the store at ``uri`` (local path, ``file://`` or ``gs://``)."""
    manifest_uri = paths.join(uri, manifest_mod.MANIFEST_NAME)
    try:
        exists = paths.exists(manifest_uri)
    except Exception as e:  # noqa: BLE001 - e.g. an unreachable bucket
        raise StoreError(f"{uri}: cannot be read ({type(e).__name__}: {e})") from e
    if not exists:
        where = "does not exist" if not paths.exists(uri) else f"holds no {manifest_mod.MANIFEST_NAME}"
        raise NotAStoreError(f"{uri} is not a logit store: it {where}; give the folder a dump wrote")
    manifest = manifest_mod.parse_manifest(paths.read_bytes(manifest_uri), manifest_uri)
    return Store(uri, manifest, verify_checksums=verify_checksums, cache_dir=cache_dir,
                 max_open_chunks=max_open_chunks)


class Store:
    """A committed logit store; also a Grain ``RandomAccessDataSource`` (``len``, ``[]``)."""

    def __init__(self, uri: str, manifest: dict, *, verify_checksums: bool = True,
                 cache_dir: str | None = None, max_open_chunks: int = 64):
        self.uri = uri
        self.manifest = manifest
        self.verify_checksums = verify_checksums
        self.max_open_chunks = max_open_chunks
        self.layout = StoreLayout.of(manifest)
        self.tag = manifest_mod.store_tag(manifest)
        self.local = paths.is_local(uri)
        self.cache_dir = cache_dir or paths.default_cache_dir("stores", manifest["fingerprint"][:16])
        self.scan = chunks_mod.scan(uri, manifest)
        if self.scan.duplicates:
            names = [c.name for c in self.scan.duplicates[0]]
            raise StoreError(f"{uri}: several committed chunks for one step range: {', '.join(names)}")
        self._init_runtime_state()

    def _init_runtime_state(self) -> None:
        self._readers: collections.OrderedDict = collections.OrderedDict()
        self._verified: set[str] = set()
        self._lock = threading.Lock()

    # Grain may copy a data source into worker processes: drop open readers and locks.
    def __getstate__(self):
        state = dict(self.__dict__)
        for key in ("_readers", "_verified", "_lock"):
            state.pop(key, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime_state()

    # -- sizes

    @property
    def expected_examples(self) -> int:
        return manifest_mod.num_examples(self.manifest)

    @property
    def num_examples(self) -> int:
        """Committed examples."""
        return sum(self.layout.records_in(c.start, c.end) for c in self.scan.chunks.values())

    @property
    def complete(self) -> bool:
        return self.scan.complete

    def require_complete(self) -> None:
        if not self.complete:
            raise StoreError(f"{self.uri}: the store is incomplete: missing {self.scan.missing_summary()}")

    def __len__(self) -> int:
        return self.num_examples if not self.complete else self.expected_examples

    # -- random access

    def locate(self, index: int) -> tuple[chunks_mod.ChunkInfo, int]:
        """(chunk, record index) of global example ``index``."""
        if not 0 <= index < self.expected_examples:
            raise IndexError(f"example {index} out of range [0, {self.expected_examples})")
        step, process, offset = self.layout.locate(index)
        start, end = self.layout.range_of_step(step)
        chunk = self.scan.chunks.get((process, start, end))
        if chunk is None:
            raise StoreError(
                f"{self.uri}: example {index} (step {step}, process {process}) lies in steps "
                f"[{start}, {end}), whose chunk is not committed"
            )
        return chunk, self.layout.record_of(start, step, offset)

    def read_raw(self, index: int) -> bytes:
        chunk, record = self.locate(int(index))
        reader = self._reader(chunk)
        try:
            return reader.read([record])[0]
        except Exception as e:  # noqa: BLE001 - a damaged file surfaces here
            raise StoreError(f"{self._chunk_uri(chunk)}: cannot read record {record} ({e})") from e

    def read(self, index: int) -> dict:
        """Example ``index`` as numpy arrays (see ``codec.decode_record``)."""
        index = int(index)
        data = self.read_raw(index)
        chunk, record = self.locate(index)
        try:
            out = codec_mod.decode_record(data)
            masked = codec_mod.decode_header(data)["masked"]
        except StoreError as e:
            raise StoreError(f"{self._chunk_uri(chunk)} record {record}: {e}") from None
        if masked != manifest_mod.masked_of(self.manifest):
            raise StoreError(f"{self._chunk_uri(chunk)} record {record} is {'' if masked else 'not '}masked; the "
                             f"manifest says a store of {'supervised' if not masked else 'all'} positions")
        self._check_record(out, index, chunk, record)
        return out

    def __getitem__(self, index: int) -> dict:
        return self.read(index)

    def _check_record(self, rec: dict, index: int, chunk, record: int) -> None:
        where = f"{self._chunk_uri(chunk)} record {record}"
        if int(rec["example_index"]) != index:
            raise StoreError(f"{where} holds example {int(rec['example_index'])}, expected {index}")
        if int(rec["store_tag"]) != self.tag:
            raise StoreError(f"{where} belongs to another store (tag {int(rec['store_tag']):08x}, "
                             f"this store's is {self.tag:08x})")
        shapes = self.manifest["shapes"]
        hybrid = shapes.get("selection") == "hybrid"
        if ("tail_plogp" in rec) != hybrid:
            raise StoreError(f"{where} holds a{' hybrid' if 'tail_plogp' in rec else 'nother'} record; the manifest "
                             f"says a {shapes.get('selection', 'topk')} store")
        if hybrid:
            L, S = rec["sample_ids"].shape
            if rec["topk_ids"].shape != (shapes["seq_len"], shapes["top_k"]) or S > shapes["num_samples"]:
                raise StoreError(f"{where} holds a head of shape {rec['topk_ids'].shape} and draws of shape {(L, S)}; "
                                 f"the manifest says {(shapes['seq_len'], shapes['top_k'])} and at most "
                                 f"{shapes['num_samples']} draws")
        elif "sample_ids" in rec:
            L, S = rec["sample_ids"].shape
            if shapes.get("selection") != "sampled" or L != shapes["seq_len"] or S > shapes["top_k"]:
                raise StoreError(f"{where} holds sampled ids of shape {(L, S)}; the manifest says a "
                                 f"{shapes.get('selection', 'topk')} store of seq_len {shapes['seq_len']}")
        elif shapes.get("selection") == "sampled":
            raise StoreError(f"{where} holds a top-k record; the manifest says a sampled store")
        elif rec["topk_ids"].shape != (shapes["seq_len"], shapes["top_k"]):
            raise StoreError(f"{where} has top-k shape {rec['topk_ids'].shape}, "
                             f"manifest says {(shapes['seq_len'], shapes['top_k'])}")

    # -- the tokenizer

    def tokenizer_file(self) -> str | None:
        """A local path of the store's copy of its tokenizer.json (``store_tokenizer``)."""
        return store_tokenizer(self.uri, self.manifest, self.cache_dir)

    # -- chunks

    def _chunk_uri(self, chunk) -> str:
        return paths.join(self.uri, chunk.name)

    def chunk_path(self, chunk) -> str:
        """A local path of ``chunk``'s file, downloaded and checked if the store is remote."""
        uri = self._chunk_uri(chunk)
        if self.local:
            path = paths.local_path(uri)
            if not os.path.exists(path):
                raise StoreError(f"{uri}: committed chunk vanished (was the store changed while open?)")
            if self.verify_checksums and chunk.name not in self._verified:
                self._check_file(path, chunk, uri)
            return path
        os.makedirs(self.cache_dir, exist_ok=True)
        path = os.path.join(self.cache_dir, chunk.name)
        if not os.path.exists(path):
            tmp = f"{path}.{uuid.uuid4().hex}.part"
            fs, remote = paths.url_to_fs(uri)
            fs.get_file(remote, tmp)
            try:
                self._check_file(tmp, chunk, uri)
            except StoreError:
                os.remove(tmp)
                raise
            os.replace(tmp, path)
        return path

    def _check_file(self, path: str, chunk, uri: str) -> None:
        digest, size = paths.sha256_file(path)
        if digest[:16] != chunk.checksum:
            raise StoreError(
                f"{uri}: checksum mismatch: the file ({size} bytes) has SHA-256 {digest[:16]}..., "
                f"its name says {chunk.checksum}; the chunk is corrupt or truncated; "
                "delete it and re-run the dump to rewrite it"
            )
        self._verified.add(chunk.name)

    def _reader(self, chunk) -> ArrayRecordReader:
        with self._lock:
            reader = self._readers.get(chunk.name)
            if reader is not None:
                self._readers.move_to_end(chunk.name)
                return reader
            path = self.chunk_path(chunk)
            try:
                reader = ArrayRecordReader(path)
            except Exception as e:  # noqa: BLE001 - the C++ reader raises plain errors
                raise StoreError(f"{self._chunk_uri(chunk)}: not a readable ArrayRecord file ({e})") from e
            expected = self.layout.records_in(chunk.start, chunk.end)
            if reader.num_records() != expected:
                reader.close()
                raise StoreError(f"{self._chunk_uri(chunk)}: holds {reader.num_records()} records, "
                                 f"expected {expected}")
            self._readers[chunk.name] = reader
            while len(self._readers) > self.max_open_chunks:
                _, old = self._readers.popitem(last=False)
                old.close()
            return reader

    def read_chunk(self, chunk) -> list[bytes]:
        """All records of one chunk, in order (sequential readers, e.g. verify)."""
        reader = self._reader(chunk)
        return reader.read_all()

    def close(self) -> None:
        with self._lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def store_tokenizer(uri: str, manifest: dict, cache_dir: str | None = None) -> str | None:
    """A local path of the store's copy of its tokenizer.json, beside a tokenizer_config.json naming its EOS
    token (and the chat template of a chat data set); None for stores without a copy (synthetic ones). The copy is checked against the manifest's
    ``content.data.tokenizer_sha256``. A local store with both files is read in place; otherwise (a
    store on GCS, or one written before the config was kept, whose EOS id the manifest records) both
    files are written once into the store's local cache."""
    import json

    want = manifest_mod.tokenizer_sha256(manifest)
    tokenizer_uri = paths.join(uri, manifest_mod.TOKENIZER_NAME)
    if want is None or not paths.exists(tokenizer_uri):
        return None
    config_uri = paths.join(uri, manifest_mod.TOKENIZER_CONFIG_NAME)
    template_uri = paths.join(uri, manifest_mod.CHAT_TEMPLATE_NAME)
    has_config = paths.exists(config_uri)
    if paths.is_local(uri) and has_config:
        _check_tokenizer_copy(tokenizer_uri, paths.read_bytes(tokenizer_uri), want)
        return os.path.abspath(paths.local_path(tokenizer_uri))
    cache_dir = cache_dir or paths.default_cache_dir("stores", manifest["fingerprint"][:16])
    folder = os.path.join(cache_dir, f"tokenizer-{want[:16]}")
    path = os.path.join(folder, manifest_mod.TOKENIZER_NAME)
    if not os.path.exists(path):
        data = paths.read_bytes(tokenizer_uri)
        _check_tokenizer_copy(tokenizer_uri, data, want)
        if has_config:
            config = paths.read_bytes(config_uri)
        else:
            from tokenizers import Tokenizer as HFTokenizer

            eos_id = manifest.get("content", {}).get("data", {}).get("eos_id")
            eos = HFTokenizer.from_str(data.decode("utf-8")).id_to_token(int(eos_id)) if eos_id is not None else None
            config = json.dumps({"eos_token": eos}).encode()
        os.makedirs(folder, exist_ok=True)
        paths.write_bytes_atomic(os.path.join(folder, manifest_mod.TOKENIZER_CONFIG_NAME), config)
        if paths.exists(template_uri):
            paths.write_bytes_atomic(os.path.join(folder, manifest_mod.CHAT_TEMPLATE_NAME),
                                     paths.read_bytes(template_uri))
        paths.write_bytes_atomic(path, data)  # last: its presence says the folder is whole
    return path


def _check_tokenizer_copy(uri: str, data: bytes, want: str) -> None:
    import hashlib

    have = hashlib.sha256(data).hexdigest()
    if have != want:
        raise StoreError(f"{uri}: SHA-256 {have[:16]}... differs from the manifest's tokenizer_sha256 {want[:16]}...; "
                         "the copy is damaged: delete it and re-run the dump to write it again")


def stack_records(records: list[dict]) -> dict:
    """Stack decoded records into a batch of arrays with a leading example axis."""
    keys = [k for k in records[0] if k != "token_hash"]
    return {k: np.stack([r[k] for r in records]) for k in keys}
