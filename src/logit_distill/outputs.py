"""Checks of every path a command writes, made before any work: outputs never overlap inputs.

A command names its outputs (a store, a training folder, a report file) and
its inputs; ``check_output`` refuses, with one ``InputError`` line each:

- an empty or blank path (``paths.join("", x)`` would be ``/x``);
- a path inside a logit store other than the one being written: a
  ``manifest.json`` in the folder itself or in any parent (a report written
  over ``S/manifest.json`` or ``S/<chunk>`` would destroy the store);
- a path equal to one of the inputs, or inside an input folder: a checkpoint
  folder (teacher, student), the folder of a tokenizer file, a data folder and
  the folder a data glob names (a file written there would join the data set);
- an existing folder where a file is expected, an existing file where a
  folder is expected, and a parent that is a file;
- for a report (``kind="report"``), an existing file that is not a report this
  tool wrote (recognised by its content): reports replace only reports.

Single files are then written atomically through ``paths.write_bytes_atomic``
(temporary name and rename locally, one upload on GCS).
"""

from __future__ import annotations

import fnmatch
import os

from . import paths
from .errors import InputError
from .models.specs import is_path_spec

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


def _protected(flag: str, spec: str) -> list[tuple[str, str]]:
    """The places an output must not be, for input ``spec``: (normalized path, how), how being "equal"
    (the path itself), "inside" (the folder and everything in it) or "matches" (a glob's pattern)."""
    if not is_path_spec(spec):
        return []
    spec = str(spec)
    if any(c in spec for c in "*?["):  # a glob: what it could match (a recursive one: all under its root)
        pattern = normalize(spec)
        if "**" in spec:
            parts = pattern.split("/")
            root = "/".join(parts[: next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))])
            return [(root, "inside")]
        return [(pattern, "matches")]
    norm = normalize(spec)
    if norm.startswith("gs://"):
        fs, path = paths.url_to_fs(spec)
        try:
            is_dir = fs.isdir(path)
        except Exception:  # noqa: BLE001 - an unreadable input fails where it is read, with its own line
            is_dir = False
    else:
        is_dir = os.path.isdir(norm)
    out = [(norm, "inside" if is_dir else "equal")]
    if not is_dir and flag == "--tokenizer":  # tokenizer.json sits in its model's folder
        out.append((norm.rsplit("/", 1)[0], "inside"))
    return out


def _inside(norm: str, folder: str) -> bool:
    return norm.startswith(folder.rstrip("/") + "/")


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
    store = enclosing_store(uri, include_self=not own_store)
    if store is not None:
        what = "is" if store == norm else "lies inside"
        raise InputError(f"{flag} {uri} {what} the logit store {store} (it holds {MANIFEST_NAME}); "
                         "writing there could destroy the store; choose a path outside it")
    for in_flag, in_uri in (inputs or {}).items():
        for place, how in _protected(in_flag, in_uri):
            if norm == place:
                raise InputError(f"{flag} {uri} is the input {in_flag} {in_uri}; choose another output path")
            if how == "inside" and _inside(norm, place):
                raise InputError(f"{flag} {uri} lies inside {place}, a folder of the input {in_flag} {in_uri}; "
                                 "writing there could change or destroy an input: choose a path outside it")
            if how == "matches" and fnmatch.fnmatchcase(norm, place):
                raise InputError(f"{flag} {uri} matches the input {in_flag} {in_uri}: it would join the data set; "
                                 "choose another output path")
    local = not norm.startswith("gs://")
    if local:
        _check_local_shape(norm, uri, flag, "file" if kind == "report" else kind)
    elif kind in ("file", "report"):
        fs, path = paths.url_to_fs(uri)
        fs.invalidate_cache(path)
        if fs.isdir(path):
            raise InputError(f"{flag} {uri} is an existing folder (objects lie under it); give a file path")
    if kind == "report":
        _check_replaceable_report(uri, flag)
    return uri


REPORT_MARK = "logit-distill"  # a report's JSON "report" field, or the comment its Markdown starts with


def report_comment(what: str) -> str:
    """The first line of a Markdown report of ``what`` (how a later run recognises it as replaceable)."""
    return f"<!-- {REPORT_MARK} {what} report: this file is rewritten by the command that wrote it -->"


def is_report(data: bytes) -> bool:
    """Whether ``data`` is a report this tool wrote (JSON with a ``report`` field naming it, or Markdown
    starting with ``report_comment``; earlier versions' verify reports are recognised too)."""
    text = data.decode("utf-8", errors="replace").lstrip()
    if text.startswith(f"<!-- {REPORT_MARK} ") or text.startswith("# Logit store verification:"):
        return True
    try:
        import json

        obj = json.loads(text)
    except ValueError:
        return False
    if not isinstance(obj, dict):
        return False
    return str(obj.get("report", "")).startswith(REPORT_MARK) or {"store", "checks", "logit_distill_version"} <= set(obj)


def _check_replaceable_report(uri: str, flag: str) -> None:
    if not paths.exists(uri):
        return
    if not is_report(paths.read_bytes(uri)):
        raise InputError(f"{flag} {uri} exists and is not a report logit-distill wrote; it is left as it is: "
                         "give another path, or remove the file first")


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
