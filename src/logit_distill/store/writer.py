"""Writing a store: create or check the manifest, write chunks, commit them atomically.

``ChunkWriter`` writes one chunk (one process, one fixed step range) and
commits it: the file's SHA-256 goes into its final name, then the file becomes
visible at once (see ``paths.commit_file``). ``BackgroundWriter`` runs encoding
and committing on two threads behind bounded queues, so the caller's compute
overlaps with them and a slow upload applies back-pressure instead of
buffering without bound.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import tempfile
import threading
import uuid
from typing import Callable

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from .. import codec as codec_mod
from .. import paths
from ..errors import NotAStoreError, StoreError
from . import chunks as chunks_mod
from . import manifest as manifest_mod
from .layout import StoreLayout
from .lease import LEASE_NAME

log = logging.getLogger("logit_distill.store")


def init_store(store_uri: str, manifest: dict) -> dict:
    """Create the store with ``manifest`` or check that the existing one matches.

    Raises ConfigMismatchError (listing each differing field) when the store
    holds another configuration, and NotAStoreError when the location holds files
    but no manifest. Touches nothing in either case.
    """
    manifest_uri = paths.join(store_uri, manifest_mod.MANIFEST_NAME)
    if paths.exists(manifest_uri):
        existing = manifest_mod.parse_manifest(paths.read_bytes(manifest_uri), manifest_uri)
        manifest_mod.require_same_config(existing, manifest, store_uri)
        return existing
    others = [
        f["name"] for f in paths.list_files(store_uri)
        if not f["name"].startswith((paths.TMP_PREFIX, LEASE_NAME))
    ]
    if others:
        raise NotAStoreError(
            f"{store_uri} is not empty and holds no {manifest_mod.MANIFEST_NAME} "
            f"(found {', '.join(sorted(others)[:5])}{' ...' if len(others) > 5 else ''}); "
            "choose an empty output location"
        )
    paths.makedirs(store_uri)
    paths.write_bytes_atomic(manifest_uri, manifest_mod.manifest_bytes(manifest))
    return manifest


def remove_leftovers(store_uri: str, scan) -> None:
    """Start-up cleanup by the writer that holds the store's lease: temporary files are of writers that
    are dead; other files and chunks of other stores are left in place (with a warning); several
    chunks for one step range stop the writer."""
    for name in scan.leftovers:
        if name.startswith(paths.TMP_PREFIX):
            paths.remove(paths.join(store_uri, name))
            log.info("removed leftover %s", name)
        else:
            log.warning("%s: %s is no part of the store; left in place", store_uri, name)
    for chunk in scan.foreign:
        log.warning("%s: chunk %s belongs to another store or range; left in place", store_uri, chunk.name)
    if scan.duplicates:
        names = ", ".join(c.name for c in scan.duplicates[0])
        raise StoreError(f"{store_uri}: several committed chunks for one step range ({names}); "
                         "run `logit-distill verify` and delete the wrong one")


def forget_unused_manifest(store_uri: str) -> None:
    """A run that created the manifest and failed before its first chunk removes the manifest (and the
    tokenizer copy) again, so that a corrected command is not refused as "another configuration".
    (It holds the lease.)"""
    try:
        names = [f["name"] for f in paths.list_files(store_uri, with_sizes=False)]
        if manifest_mod.MANIFEST_NAME in names and not any(n.startswith("chunk-") for n in names):
            for name in (manifest_mod.TOKENIZER_NAME, manifest_mod.TOKENIZER_CONFIG_NAME,
                         manifest_mod.CHAT_TEMPLATE_NAME):
                if name in names:  # first: a manifest alone is still a store
                    paths.remove(paths.join(store_uri, name))
            paths.remove(paths.join(store_uri, manifest_mod.MANIFEST_NAME))
    except Exception as e:  # noqa: BLE001 - the original failure is the one to report
        log.warning("%s: could not remove the unused manifest: %s", store_uri, e)


_OS_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EFBIG, errno.EIO)


def as_os_error(e: RuntimeError, path: str) -> BaseException:
    """ArrayRecord reports I/O failures as RuntimeError("write() failed: <strerror>; ..."): give back the
    OSError it stands for (so the caller names it like any other), or ``e`` itself."""
    for code in _OS_ERRNOS:
        if os.strerror(code) in str(e):
            return OSError(code, os.strerror(code), path)
    return e


def put_tokenizer(store_uri: str, manifest: dict, tokenizer, chat_template: str | None = None) -> bool:
    """Keep a copy of the tokenizer the data was tokenized with in the store (once, atomically):
    its tokenizer.json, a tokenizer_config.json naming its EOS token (the rest of the original's
    fields kept), and for conversations the chat template they were rendered with, as
    chat_template.jinja (which a template in tokenizer_config.json yields to, as in transformers), so
    that the store alone can render and tokenize the data again.

    ``tokenizer`` is a ``data.tokenizer.Tokenizer``; its tokenizer.json's SHA-256 must be the manifest's
    ``content.data.tokenizer_sha256``. Files already there are left as they are. Returns True when
    the copy was written now.
    """
    import hashlib
    import json
    import posixpath

    want = manifest_mod.tokenizer_sha256(manifest)
    if want is None:
        return False
    uri = paths.join(store_uri, manifest_mod.TOKENIZER_NAME)
    config_uri = paths.join(store_uri, manifest_mod.TOKENIZER_CONFIG_NAME)
    template_uri = paths.join(store_uri, manifest_mod.CHAT_TEMPLATE_NAME)
    wrote = False
    if chat_template is not None and not paths.exists(template_uri):  # first: the tokenizer.json comes last
        paths.write_bytes_atomic(template_uri, chat_template.encode("utf-8"))
        wrote = True
    if not paths.exists(config_uri):  # first: a tokenizer.json alone is a copy of an earlier version
        original = posixpath.join(posixpath.dirname(tokenizer.path), manifest_mod.TOKENIZER_CONFIG_NAME)
        config = json.loads(paths.read_bytes(original)) if paths.exists(original) else {}
        config = config if isinstance(config, dict) else {}
        config["eos_token"] = tokenizer.eos_token
        paths.write_bytes_atomic(config_uri, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        wrote = True
    if not paths.exists(uri):
        data = paths.read_bytes(tokenizer.path)
        if hashlib.sha256(data).hexdigest() != want:
            raise StoreError(f"{tokenizer.path} is not the tokenizer of {store_uri}'s manifest "
                             f"(SHA-256 {hashlib.sha256(data).hexdigest()[:16]}..., manifest {want[:16]}...)")
        paths.write_bytes_atomic(uri, data)
        wrote = True
    return wrote


class ChunkWriter:
    """Writes the records of one chunk to a temporary file; ``commit`` publishes it."""

    def __init__(self, store_uri: str, manifest: dict, process: int, start: int, end: int,
                 work_dir: str | None = None):
        self.store_uri = store_uri
        self.manifest = manifest
        self.process, self.start, self.end = process, start, end
        self.expected_records = StoreLayout.of(manifest).records_in(start, end)
        self.local_store = paths.is_local(store_uri)
        if self.local_store:
            directory = paths.local_path(store_uri)
        else:
            directory = work_dir or tempfile.gettempdir()
        os.makedirs(directory, exist_ok=True)
        self.tmp_path = os.path.join(
            directory, f"{paths.TMP_PREFIX}{uuid.uuid4().hex}-p{process:05d}-s{start:09d}.array_record"
        )
        self._writer = ArrayRecordWriter(self.tmp_path, manifest["codec"]["array_record_options"])
        self.num_records = 0

    def write(self, record: bytes) -> None:
        try:
            self._writer.write(record)
        except RuntimeError as e:
            self.abort()
            raise as_os_error(e, self.tmp_path) from e
        self.num_records += 1

    def commit(self) -> chunks_mod.ChunkInfo:
        if self.num_records != self.expected_records:
            self.abort()
            raise StoreError(
                f"chunk p{self.process} steps [{self.start}, {self.end}) got {self.num_records} records, "
                f"expected {self.expected_records}; not committed"
            )
        try:
            self._writer.close()
        except RuntimeError as e:
            self.abort()
            raise as_os_error(e, self.tmp_path) from e
        checksum, _ = paths.sha256_file(self.tmp_path)
        name = chunks_mod.chunk_name(
            self.manifest["fingerprint"][:8], self.process, self.start, self.end, checksum
        )
        final_uri = paths.join(self.store_uri, name)
        size = os.path.getsize(self.tmp_path)
        try:
            paths.commit_file(self.tmp_path, final_uri, move=True)
        finally:
            if os.path.exists(self.tmp_path):
                os.remove(self.tmp_path)
        return chunks_mod.parse_chunk_name(name, size)

    def abort(self) -> None:
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - closing a half-written file may fail; it is removed anyway
            pass
        if os.path.exists(self.tmp_path):
            os.remove(self.tmp_path)


def encode_step(manifest: dict, step_records: dict, store_tag: int) -> list[bytes]:
    """Encode the examples of one step (arrays with a leading example axis) into records."""
    codec = manifest["codec"]["name"]
    vocab_size = manifest["shapes"]["vocab_size"]
    selection = manifest_mod.selection_of(manifest)
    fields = codec_mod.SELECTION_FIELDS[selection]
    if selection != "sampled" and not manifest_mod.tail_temperatures_of(manifest):
        fields = tuple(f for f in fields if f != "tail_logprob_tempered")
    extra = {"num_samples": manifest["shapes"]["num_samples"]} if selection != "topk" else {}
    masked = manifest_mod.masked_of(manifest)
    out = []
    for i in range(len(step_records["example_index"])):
        out.append(codec_mod.encode_record(
            codec,
            example_index=int(step_records["example_index"][i]),
            tokens=step_records["tokens"][i],
            segment_ids=step_records["segment_ids"][i],
            positions=step_records["positions"][i],
            vocab_size=vocab_size,
            store_tag=store_tag,
            **{key: step_records[key][i] for key in fields},
            **extra,
            loss_mask=np.asarray(step_records["loss_mask"][i], bool) if masked else None,
        ))
    return out


_STOP = object()


class BackgroundWriter:
    """Encode and commit the chunks of one process on background threads.

    ``submit(step, records)`` hands over one step's examples (numpy arrays with
    a leading example axis: example_index, tokens, segment_ids, positions,
    the selection's fields, and loss_mask for a masked store). Steps of a chunk must come in
    order and complete; a chunk is committed as soon as its last step is
    written. At most ``max_pending_steps`` steps wait for encoding and at most
    ``max_pending_chunks`` written chunks wait for their commit (upload):
    ``submit`` blocks when both are full. ``close()`` waits for everything
    submitted; ``abort()`` drops the chunk in flight. An error on a background
    thread is raised again by the next ``submit`` or by ``close``.
    """

    def __init__(self, store_uri: str, manifest: dict, process: int, *,
                 max_pending_steps: int = 4, max_pending_chunks: int = 1,
                 on_commit: Callable[[chunks_mod.ChunkInfo], None] | None = None):
        self.store_uri, self.manifest, self.process = store_uri, manifest, process
        self.on_commit = on_commit
        self._tag = manifest_mod.store_tag(manifest)
        self._steps: queue.Queue = queue.Queue(maxsize=max_pending_steps)
        self._chunks: queue.Queue = queue.Queue(maxsize=max_pending_chunks)
        self._error: BaseException | None = None
        self._work_dir = None if paths.is_local(store_uri) else tempfile.mkdtemp(prefix="logit-distill-chunks-")
        self.committed: list[chunks_mod.ChunkInfo] = []
        self._encoder = threading.Thread(target=self._encode_loop, name="ld-encode", daemon=True)
        self._committer = threading.Thread(target=self._commit_loop, name="ld-commit", daemon=True)
        self._encoder.start()
        self._committer.start()

    # -- caller side

    def submit(self, step: int, records: dict) -> None:
        self._raise_if_failed()
        while True:
            try:
                self._steps.put((step, records), timeout=0.5)
                return
            except queue.Full:
                self._raise_if_failed()

    def close(self) -> list[chunks_mod.ChunkInfo]:
        """Wait for every submitted step to be written and committed."""
        self._steps.put(_STOP)
        self._encoder.join()
        self._committer.join()
        self._cleanup()
        self._raise_if_failed()
        return self.committed

    def abort(self) -> None:
        """Stop: every chunk whose steps were all submitted is still written and committed (at most
        ``max_pending_steps`` steps wait to be encoded); the chunk in flight, whose last steps never
        came, is dropped."""
        while True:  # an encoder that stopped on an error takes nothing more: make room for the stop
            try:
                self._steps.put(_STOP, timeout=0.5)
                break
            except queue.Full:
                if not self._encoder.is_alive():
                    while not self._steps.empty():
                        self._steps.get_nowait()
        self._encoder.join()
        self._committer.join()
        self._cleanup()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _cleanup(self) -> None:
        if self._work_dir and os.path.isdir(self._work_dir):
            for name in os.listdir(self._work_dir):
                os.remove(os.path.join(self._work_dir, name))
            os.rmdir(self._work_dir)

    # -- background side

    def _encode_loop(self) -> None:
        current: ChunkWriter | None = None
        next_step = None
        try:
            while True:
                item = self._steps.get()
                if item is _STOP:
                    break
                step, records = item
                if current is None:
                    start, end = chunks_mod.range_of_step(self.manifest, step)
                    if step != start:
                        raise StoreError(f"step {step} submitted, but its chunk starts at step {start}")
                    current = ChunkWriter(self.store_uri, self.manifest, self.process, start, end, self._work_dir)
                    next_step = start
                if step != next_step:
                    raise StoreError(f"step {step} submitted, expected step {next_step}")
                for record in encode_step(self.manifest, records, self._tag):
                    current.write(record)
                next_step += 1
                if next_step == current.end:
                    self._put_chunk(current)
                    current = None
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._error = self._error or e
        finally:
            if current is not None:
                current.abort()
            self._put_chunk(_STOP)

    def _put_chunk(self, item) -> None:
        while True:
            try:
                self._chunks.put(item, timeout=0.5)
                return
            except queue.Full:
                if self._error is not None and item is not _STOP:
                    item.abort()
                    return

    def _commit_loop(self) -> None:
        while True:
            item = self._chunks.get()
            if item is _STOP:
                return
            if self._error is not None:
                item.abort()
                continue
            try:
                info = item.commit()
                self.committed.append(info)
                if self.on_commit is not None:
                    self.on_commit(info)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._error = self._error or e
                item.abort()


def write_examples(store_uri: str, manifest: dict, process: int, examples_by_step: dict[int, dict]) -> None:
    """Synchronously write whole chunks from ready arrays (tests and synthetic stores)."""
    writer = BackgroundWriter(store_uri, manifest, process)
    for step in sorted(examples_by_step):
        writer.submit(step, examples_by_step[step])
    writer.close()
