"""Turning any exception into the one line and exit code of docs/ERRORS.md.

``describe(e)`` gives ``(exit code, "error: <what>, <where>, <what to do>")``:
our own errors carry their code; operating-system errors (permission,
read-only, no space, is-a-directory, ...), bad archives and GCS client
failures are named with a hint; anything else is an unexpected error
(exit 1) whose traceback ``--debug`` shows.
"""

from __future__ import annotations

import errno
import gzip
import zlib

from .errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, LogitDistillError
from .signals import Interrupted

MAX_LINE = 600

_OS_HINTS = {
    errno.EACCES: "check its permissions or choose another location",
    errno.EPERM: "check its permissions or choose another location",
    errno.EROFS: "the file system is read-only; choose a writable location",
    errno.ENOSPC: "free some space or choose another location; re-running the same command resumes",
    errno.EDQUOT: "free some space or choose another location; re-running the same command resumes",
    errno.EISDIR: "it is a folder; give a file path",
    errno.ENOTDIR: "a part of the path is a file, not a folder; choose another path",
    errno.ENOENT: "check the path",
    errno.EEXIST: "it exists already; choose another path",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.EFBIG: "the file is too large for this location; choose another location",
}


def one_line(text: str) -> str:
    """``text`` on one line, at most MAX_LINE characters, local paths as paths (fsspec's ``file://`` URLs,
    which a user never typed, without their scheme)."""
    text = " ".join(str(text).split()).replace("file:///", "/")
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


def describe(e: BaseException) -> tuple[int, str]:
    if isinstance(e, KeyboardInterrupt):
        how = getattr(e, "name", None) or "Ctrl-C"
        return EXIT_INTERRUPTED, f"interrupted ({how}); committed work is kept, re-run the same command to resume"
    if isinstance(e, Interrupted):
        return EXIT_INTERRUPTED, "interrupted: " + one_line(e)
    if isinstance(e, LogitDistillError):
        return e.exit_code, "error: " + one_line(e)
    gcs = _gcs_failure(e)
    if gcs:
        return EXIT_BAD_INPUT, "error: " + gcs
    if isinstance(e, (EOFError, zlib.error, gzip.BadGzipFile)):
        return EXIT_BAD_INPUT, f"error: a compressed input is truncated or not what its name says ({one_line(e)}); " \
                               "check the data files"
    if isinstance(e, OSError):
        return EXIT_BAD_INPUT, "error: " + _os_line(e)
    if isinstance(e, MemoryError):
        return EXIT_BAD_INPUT, "error: out of memory; lower --batch-size or --seq-len"
    return 1, (f"error: unexpected {type(e).__name__}: {one_line(e)}; "
               "re-run with --debug for the traceback and report it")


def _os_line(e: OSError) -> str:
    what = e.strerror or type(e).__name__
    where = e.filename
    if e.filename2:
        where = f"{e.filename} -> {e.filename2}"
    hint = _OS_HINTS.get(e.errno, "check the path and the device")
    if where is None:
        return f"{one_line(what if e.strerror else e)}; {hint}"
    return f"{one_line(what)}: {where}; {hint}"


def _gcs_failure(e: BaseException) -> str | None:
    """A line for the failures of gcsfs / google-auth / aiohttp, or None for other errors."""
    module = type(e).__module__ or ""
    if not module.startswith(("gcsfs", "google.auth", "aiohttp", "google.api_core")):
        return None
    name = type(e).__name__
    if module.startswith("google.auth"):
        return (f"no usable Google Cloud credentials ({one_line(e)}); run `gcloud auth application-default "
                "login` or set GOOGLE_APPLICATION_CREDENTIALS")
    if module.startswith("aiohttp"):
        return f"Cloud Storage is not reachable ({name}: {one_line(e)}); check the network or STORAGE_EMULATOR_HOST"
    code = getattr(e, "code", None)
    if code in (401, 403):
        return f"Cloud Storage refused access ({one_line(e)}); check the credentials' permissions on the bucket"
    if code == 404:
        return f"Cloud Storage object or bucket not found ({one_line(e)}); check the gs:// path"
    return f"Cloud Storage request failed ({name}: {one_line(e)}); retry, or check the path and the credentials"
