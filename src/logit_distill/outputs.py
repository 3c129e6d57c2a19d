"""Checks of every path a command writes, made before any work: outputs never overlap inputs.

A command names its outputs (a store, a training folder, a report file) and
its inputs; ``check_output`` refuses, with one ``InputError`` line each:

- an empty or blank path (``paths.join("", x)`` would be ``/x``);
- a path inside a logit store other than the one being written: a
  ``manifest.json`` in the folder itself or in any parent (a report written
  over ``S/manifest.json`` or ``S/<chunk>`` would destroy the store);
- a path equal to one of the inputs;
- an existing folder where a file is expected, an existing file where a
  folder is expected, and a parent that is a file.

Single files are then written atomically through ``paths.write_bytes_atomic``
(temporary name and rename locally, one upload on GCS).
"""

from __future__ import annotations

import os

from . import paths
from .errors import InputError

MANIFEST_NAME = "manifest.json"  # the store's marker (store.manifest.MANIFEST_NAME; no import cycle)


def normalize(uri: str) -> str:
    """A comparable form of ``uri``: the absolute real path locally, ``gs://bucket/key`` on GCS."""
    if paths.is_local(uri):
        return os.path.realpath(os.path.abspath(paths.local_path(uri)))
    fs, path = paths.url_to_fs(uri)
    return "gs://" + path.strip("/")


def _parents(norm: str) -> list[str]:
    """``norm`` and every folder above it (local root or bucket included)."""
    out = [norm]
    if norm.startswith("gs://"):
        parts = norm[len("gs://"):].split("/")
        for i in range(len(parts) - 1, 0, -1):
            out.append("gs://" + "/".join(parts[:i]))
        return out
    while True:
        parent = os.path.dirname(out[-1])
        if parent == out[-1]:
            return out
        out.append(parent)


def enclosing_store(uri: str, *, include_self: bool = True) -> str | None:
    """The nearest folder at or above ``uri`` holding a ``manifest.json`` (a logit store), or None."""
    norm = normalize(uri)
    candidates = _parents(norm)[0 if include_self else 1:]
    local = not norm.startswith("gs://")
    for folder in candidates:
        marker = os.path.join(folder, MANIFEST_NAME) if local else paths.join(folder, MANIFEST_NAME)
        if (os.path.isfile(marker) if local else paths.exists(marker)):
            return folder
    return None


def _is_path(spec) -> bool:
    """Whether an input spec names a path (not e.g. ``preset:NAME`` or a glob)."""
    if not spec or not str(spec).strip() or any(c in str(spec) for c in "*?["):
        return False
    spec = str(spec)
    return spec.startswith(("gs://", "file://")) or ":" not in spec.split("/", 1)[0]


def require_nonblank(uri: str | None, flag: str) -> str:
    if uri is None or not str(uri).strip():
        raise InputError(f"{flag} is empty; give a path (a local folder or gs://bucket/prefix)")
    return str(uri)


def check_output(uri: str, flag: str, *, kind: str, inputs: dict[str, str | None] | None = None,
                 own_store: bool = False) -> str:
    """Refuse ``uri`` (given as ``flag``) as an output of ``kind`` "file" or "dir" (see the module doc).

    ``inputs`` maps flags to the command's input paths. ``own_store``: ``uri`` is the store the
    command writes itself (dump), so a manifest in ``uri`` is its own; one in a parent is not.
    Returns ``uri``.
    """
    require_nonblank(uri, flag)
    paths.check_reachable(uri, flag)  # gs://: one line within seconds, not a minute of retries
    norm = normalize(uri)
    for in_flag, in_uri in (inputs or {}).items():
        if _is_path(in_uri) and normalize(in_uri) == norm:
            raise InputError(f"{flag} {uri} is also the input {in_flag}; choose another output path")
    local = not norm.startswith("gs://")
    if local:
        _check_local_shape(norm, uri, flag, kind)
    elif kind == "file":
        fs, path = paths.url_to_fs(uri)
        fs.invalidate_cache(path)
        if fs.isdir(path):
            raise InputError(f"{flag} {uri} is an existing folder (objects lie under it); give a file path")
    store = enclosing_store(uri, include_self=not own_store)
    if store is not None:
        what = "is" if store == norm else "lies inside"
        raise InputError(f"{flag} {uri} {what} the logit store {store} (it holds {MANIFEST_NAME}); "
                         "writing there could destroy the store; choose a path outside it")
    return uri


def _check_local_shape(norm: str, uri: str, flag: str, kind: str) -> None:
    if kind == "file" and os.path.isdir(norm):
        raise InputError(f"{flag} {uri} is an existing folder; give a file path")
    if kind == "dir" and os.path.exists(norm) and not os.path.isdir(norm):
        raise InputError(f"{flag} {uri} is an existing file, not a folder; give a folder path")
    parent = os.path.dirname(norm)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise InputError(f"{flag} {uri}: {parent} is a file, not a folder; choose another path")
    # The nearest existing folder must take new files (access(2) also reports a read-only mount).
    folder = norm if kind == "dir" and os.path.isdir(norm) else parent
    if folder and not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {uri}: {folder} is not writable (read-only or no permission); "
                         "choose a writable location")
