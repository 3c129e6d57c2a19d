"""Paths and files through fsspec: local paths, ``file://`` and ``gs://`` (gcsfs).

A GCS emulator is selected with the standard ``STORAGE_EMULATOR_HOST`` variable,
which gcsfs reads itself (and which sets tensorstore's ``TENSORSTORE_GCS_HTTP_URL``
unless that is set). Against an emulator we also turn off gcsfs's extended
(zonal/HNS) client: it probes each bucket over gRPC and stalls about 60 s per
bucket when nothing answers. The variable is read when gcsfs is imported, so it
is set here, before fsspec loads gcsfs.

The commit protocol (``commit_file``) is the one place that decides how a file
becomes visible: locally a temporary name, fsync and rename; on GCS a single
upload, since an object appears only once its upload completes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid

if os.environ.get("STORAGE_EMULATOR_HOST"):
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    # tensorstore (Orbax's array writer) has its own GCS client and endpoint setting; it reads
    # it once, at its first GCS request. Without application-default credentials it is anonymous.
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", os.environ["STORAGE_EMULATOR_HOST"])

import fsspec  # noqa: E402  (after the environment above)

from .errors import InputError  # noqa: E402

# Prefix of temporary names; the store scan reports any file carrying it as a leftover.
TMP_PREFIX = ".tmp-"


def _require_base(uri) -> None:
    """An empty base would silently mean the working folder (or ``/`` once joined): refuse it."""
    if not isinstance(uri, str) or not uri.strip() or uri.strip() in ("file://", "gs://"):
        raise InputError(f"empty path {uri!r}; give a local path or a gs://bucket/prefix URI")


def url_to_fs(uri: str):
    """(filesystem, path) for a local path, ``file://`` or ``gs://`` URI; refuses an empty one."""
    _require_base(uri)
    kwargs = {}
    if uri.startswith("gs://") and os.environ.get("STORAGE_EMULATOR_HOST"):
        kwargs["token"] = "anon"
    return fsspec.core.url_to_fs(uri, **kwargs)


def is_local(uri: str) -> bool:
    if uri.startswith(("gs://", "gcs://")):  # without building a client (credential discovery)
        _require_base(uri)
        return False
    fs, _ = url_to_fs(uri)
    return "file" in _protocols(fs)


def _protocols(fs) -> tuple:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


def join(uri: str, *parts: str) -> str:
    """``uri/part/...``; an empty ``uri`` is refused (it would give the root path ``/part``)."""
    _require_base(uri)
    out = uri.rstrip("/")
    for part in parts:
        out = out + "/" + part.strip("/")
    return out


GCS_PROBE_TIMEOUT_S = 10.0  # LOGIT_DISTILL_GCS_PROBE_TIMEOUT overrides it


def check_reachable(uri: str, flag: str) -> None:
    """For a gs:// ``uri``: fail within seconds, in one line, if its bucket cannot be used.

    gcsfs retries a dead endpoint for about a minute (with a traceback per retry); this probe
    opens a TCP connection to the endpoint (5 s), then asks for the bucket, all on a background
    thread that is given up after ``LOGIT_DISTILL_GCS_PROBE_TIMEOUT`` seconds (default 10), name
    resolution and credential discovery included.
    """
    import socket
    import threading
    import urllib.parse

    if is_local(uri):
        return
    bucket = uri.split("://", 1)[1].split("/", 1)[0]
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
    parsed = urllib.parse.urlparse(endpoint if "://" in endpoint else "http://" + endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    from . import environment

    timeout = environment.get("LOGIT_DISTILL_GCS_PROBE_TIMEOUT", GCS_PROBE_TIMEOUT_S)
    outcome: dict = {}

    def ask():
        try:
            socket.create_connection((parsed.hostname, port), timeout=min(5.0, timeout)).close()
        except OSError as e:
            outcome["unreachable"] = e
            return
        try:
            fs, _ = url_to_fs(uri)  # credential discovery (metadata server, ...) happens here
            fs.invalidate_cache(bucket)
            outcome["exists"] = fs.exists(bucket)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    probe = threading.Thread(target=ask, name="ld-gcs-probe", daemon=True)
    probe.start()
    probe.join(timeout)
    if probe.is_alive():
        raise InputError(f"{flag} {uri} is not reachable: no answer about bucket {bucket} within {timeout:.0f} s; "
                         "check the network and the credentials")
    if "unreachable" in outcome:
        e = outcome["unreachable"]
        raise InputError(f"{flag} {uri} is not reachable: Cloud Storage at {parsed.hostname}:{port} refused "
                         f"or did not answer ({e.strerror or e}); check the network (or STORAGE_EMULATOR_HOST)")
    if "error" in outcome:
        from .failures import describe

        _, line = describe(outcome["error"])
        raise InputError(f"{flag} {uri} is not reachable: bucket {bucket}: {line.removeprefix('error: ')}")
    if not outcome["exists"]:
        raise InputError(f"{flag} {uri} is not reachable: bucket {bucket} does not exist (or these credentials "
                         "cannot see it); create it or check the name")


def check_inputs_reachable(inputs: dict) -> None:
    """``check_reachable`` for every gs:// value of ``{flag: uri}`` (each bucket once)."""
    seen = set()
    for flag, uri in inputs.items():
        if isinstance(uri, str) and uri.startswith("gs://"):
            bucket = uri[len("gs://"):].split("/", 1)[0]
            if bucket not in seen:
                seen.add(bucket)
                check_reachable(uri, flag)


def basename(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1]


def local_path(uri: str) -> str:
    """The OS path of a local URI (``file://x`` -> ``x``)."""
    _, path = url_to_fs(uri)
    return path


def exists(uri: str) -> bool:
    fs, path = url_to_fs(uri)
    return fs.exists(path)


def read_bytes(uri: str) -> bytes:
    fs, path = url_to_fs(uri)
    with fs.open(path, "rb") as f:
        return f.read()


def list_files(uri: str, with_sizes: bool = True) -> list[dict]:
    """Plain files directly under ``uri`` as dicts with ``name`` (base name) and ``size``.

    Always a fresh listing (fsspec's listing cache is bypassed), since the
    store's truth is what is committed now. Locally, ``with_sizes=False``
    skips one stat per file (sizes are then 0): a scan of 10^4 chunks needs names only.
    """
    fs, path = url_to_fs(uri)
    if "file" in _protocols(fs):  # os.scandir: several times faster than fsspec's ls on 10^4 files
        if not os.path.isdir(path):
            return []
        with os.scandir(path) as entries:
            return [{"name": e.name, "size": e.stat().st_size if with_sizes else 0}
                    for e in entries if e.is_file()]
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return []
    out = []
    for info in fs.ls(path, detail=True):
        if info.get("type") != "file":
            continue
        out.append({"name": basename(info["name"]), "size": int(info.get("size") or 0)})
    return out


def makedirs(uri: str) -> None:
    fs, path = url_to_fs(uri)
    if "file" in _protocols(fs):
        os.makedirs(path, exist_ok=True)
    # Object stores have no directories; a prefix exists once an object is under it.


def remove(uri: str) -> None:
    fs, path = url_to_fs(uri)
    fs.rm_file(path)


def fsync(path: str) -> None:
    """fsync a local file or folder (a folder: so that a rename in it survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_local(path: str, fill) -> None:
    """Create local file ``path`` atomically: ``fill(tmp)`` writes a temporary name in the same
    directory, which is fsynced and renamed; then the directory is fsynced."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{uuid.uuid4().hex}-{os.path.basename(path)}")
    try:
        fill(tmp)
        _rename_synced(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _rename_synced(tmp: str, path: str) -> None:
    """fsync ``tmp``, rename it to ``path`` (same file system), fsync the directory."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync(os.path.dirname(path))


def commit_file(local_src: str, dest_uri: str, *, move: bool = False) -> None:
    """Make ``local_src`` visible at ``dest_uri`` atomically: completely or not at all.

    Local destination: ``local_src`` itself is renamed there when ``move`` and it lies in the same
    directory; otherwise it is copied to a temporary name in the destination directory (rename
    needs the same filesystem). Either way the file is fsynced, renamed and the directory fsynced.
    GCS: one upload; the object becomes visible only once the upload completes. Without ``move``,
    ``local_src`` is left in place.
    """
    fs, path = url_to_fs(dest_uri)
    if "file" in _protocols(fs):
        if move and os.path.dirname(os.path.abspath(local_src)) == os.path.dirname(os.path.abspath(path)):
            _rename_synced(local_src, path)
        else:
            _publish_local(path, lambda tmp: shutil.copyfile(local_src, tmp))
    else:
        fs.put_file(local_src, path)


def read_json(uri: str, what: str):
    """The JSON object of ``uri``; InputError naming ``what`` when the file is missing or is not JSON."""
    import json

    from .errors import InputError

    if not exists(uri):
        raise InputError(f"{uri}: no {basename(uri)} ({what})")
    try:
        return json.loads(read_bytes(uri))
    except ValueError as e:
        raise InputError(f"{uri}: not valid JSON ({e})") from None


def write_bytes_atomic(dest_uri: str, data: bytes) -> None:
    """Write ``data`` to ``dest_uri`` atomically (see ``commit_file``)."""
    fs, path = url_to_fs(dest_uri)
    if "file" in _protocols(fs):
        def fill(tmp):
            with open(tmp, "wb") as f:
                f.write(data)

        _publish_local(path, fill)
    else:
        with fs.open(path, "wb") as f:
            f.write(data)


def fetch_to_local(uri: str, local_dir: str | None = None) -> str:
    """A local file path with the contents of ``uri``: the path itself if local, else a download."""
    fs, path = url_to_fs(uri)
    if "file" in _protocols(fs):
        return path
    local_dir = local_dir or tempfile.mkdtemp(prefix="logit-distill-")
    os.makedirs(local_dir, exist_ok=True)
    dest = os.path.join(local_dir, basename(uri))
    tmp = dest + f".{uuid.uuid4().hex}.part"
    fs.get_file(path, tmp)
    os.replace(tmp, dest)
    return dest


def sha256_file(path: str) -> tuple[str, int]:
    """(hex SHA-256, size in bytes) of a local file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def default_cache_dir(*parts: str) -> str:
    """``$LOGIT_DISTILL_CACHE`` (default ``~/.cache/logit-distill``) joined with ``parts``."""
    from . import environment

    root = environment.get("LOGIT_DISTILL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "logit-distill")
    return os.path.join(root, *parts)
