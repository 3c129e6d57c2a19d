"""Where a pipeline's student trains: ``<output_root>/students/<train_key>/``.

The train key is a fingerprint of the store (its manifest fingerprint) and every
training setting, as the dump key is of the store's settings: a retried,
preempted or resubmitted training task with the same settings lands in the same
folder and resumes from its last checkpoint; other settings get another folder.
"""

from __future__ import annotations

import hashlib

from .. import paths
from ..store import manifest as manifest_mod

STUDENTS_DIR = "students"


def store_fingerprint(store_uri: str) -> str:
    uri = paths.join(store_uri, manifest_mod.MANIFEST_NAME)
    return manifest_mod.parse_manifest(paths.read_bytes(uri), uri)["fingerprint"]


def train_key(store_uri: str, settings: dict) -> str:
    """16 hex digits of SHA-256 over the store's fingerprint and ``settings`` (canonical JSON)."""
    text = manifest_mod.canonical_json({"store": store_fingerprint(store_uri), "settings": settings})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def train_output(output_root: str, store_uri: str, settings: dict) -> str:
    return paths.join(output_root, STUDENTS_DIR, train_key(store_uri, settings))
