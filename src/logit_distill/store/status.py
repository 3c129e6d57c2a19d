"""Whether a store already holds everything a manifest asks for: a scan of names, no teacher, no reads.

The pipeline's plan step asks this before any accelerator is provisioned, and
``run_dump`` before it loads the teacher. The store's *state* is a digest of
its manifest fingerprint and the names of its committed chunks (each name
carries its chunk's SHA-256), so it changes whenever a chunk is added,
removed or rewritten: verification is cached on it.
"""

from __future__ import annotations

import dataclasses
import hashlib

from .. import paths
from . import manifest as manifest_mod
from .chunks import scan
from .layout import StoreLayout


@dataclasses.dataclass(frozen=True)
class StoreStatus:
    exists: bool  # a manifest is there
    complete: bool  # every expected chunk is committed, once
    state: str  # 16 hex digits: the manifest fingerprint and the committed chunk names
    present: int  # committed chunks
    expected: int  # chunks of a complete store


def store_status(store_uri: str, manifest: dict) -> StoreStatus:
    """The status of ``store_uri`` judged against ``manifest`` (the planned one).

    A store holding another configuration raises ConfigMismatchError, as the dump would.
    """
    manifest_uri = paths.join(store_uri, manifest_mod.MANIFEST_NAME)
    digest = hashlib.sha256(manifest["fingerprint"].encode())
    if not paths.exists(manifest_uri):
        expected = StoreLayout.of(manifest).num_chunks
        return StoreStatus(False, False, digest.hexdigest()[:16], 0, expected)
    existing = manifest_mod.parse_manifest(paths.read_bytes(manifest_uri), manifest_uri)
    manifest_mod.require_same_config(existing, manifest, store_uri)
    result = scan(store_uri, manifest)
    for name in sorted(c.name for c in result.chunks.values()):
        digest.update(b"\n" + name.encode())
    return StoreStatus(True, result.complete, digest.hexdigest()[:16], result.num_present, result.num_expected)


def may_be_complete(store_uri: str, manifest: dict) -> bool:
    """False when ``store_uri`` cannot hold every chunk of ``manifest``: fewer names of this store's
    chunks than a complete store has. Names only, none parsed: the dump asks this first, so that
    resuming a store of many chunks pays for one full scan (under its lease), not two."""
    if not paths.exists(paths.join(store_uri, manifest_mod.MANIFEST_NAME)):
        return False
    prefix = f"chunk-{manifest['fingerprint'][:8]}-"
    present = sum(f["name"].startswith(prefix) for f in paths.list_files(store_uri, with_sizes=False))
    return present >= StoreLayout.of(manifest).num_chunks
