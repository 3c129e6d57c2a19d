"""A writer's lease on its output: one dump per store, one training per training output.

A dump holds ``<store>/lease.json`` while it runs (a training ``<output>/lease.json``,
with the same rules; "dump" below stands for either). The lease object is created
only if absent (locally a hard link of a complete temporary file, which fails
if the name exists; on GCS an upload with the precondition
``ifGenerationMatch=0``), and refreshed by its holder every
``timeout_s / 4`` seconds (locally the file's modification time, after checking
that it still holds the holder's token; on GCS an upload with
``ifGenerationMatch=<generation it holds>``). It is released
(deleted) when the dump ends, however it ends.

A second dump finds the lease and refuses, naming the holder. A lease is
taken over without asking only when its holder is proven dead: a process on
this host that no longer runs. A lease not refreshed for ``timeout_s``
(default 120 s, recorded in the lease by its holder) is stale: it may belong to
a dead machine, and ``--force-takeover`` takes it over (atomically: a rename
locally, a generation-matched upload on GCS; of two takers one wins). A holder
whose refresh finds the lease taken stops at its next step. With
``wait_for_stale`` (the pipeline's dump: a retry may start before a preempted
attempt's lease is stale), a taker that finds a lease not yet stale waits until
it would be, once, then judges it again: refreshed meanwhile, its holder lives
and the taker is refused; not refreshed, it is stale and taken over.

Because only the holder writes, the temporary files found in a store by the
dump that has just acquired its lease belong to writers that are dead (or, after
a forced takeover, presumed dead): start-up cleanup removes them then, and only then.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from urllib.parse import quote

from .. import paths
from ..errors import StoreBusyError

log = logging.getLogger("logit_distill.store.lease")

LEASE_NAME = "lease.json"
DEFAULT_TIMEOUT_S = 120.0


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (/proc), telling a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] == "Z":  # a zombie has finished; only its parent has not reaped it yet
            return None
        return fields[19]
    except (OSError, IndexError):
        return None


def holder_is_dead(record: dict) -> bool:
    """True only when provably dead: the holder ran on this host and its process is gone."""
    if record.get("host") != socket.gethostname():
        return False
    pid = record.get("pid")
    if not isinstance(pid, int):
        return False
    start = _process_start(pid)
    return start is None or (record.get("pid_start") is not None and start != record.get("pid_start"))


def describe(record: dict) -> str:
    return f"process {record.get('pid')} on {record.get('host')} (since {record.get('acquired_at')})"


class _Local:
    """Locally: create = hard link of a complete file (fails if the name exists); refresh = the
    file's mtime, after checking it still holds our token; takeover = rename aside (of two
    takers one wins), check the token, then create."""

    def __init__(self, path: str):
        self.path = path
        self.dir = os.path.dirname(path)
        self.created_dir = False

    def read(self, path: str | None = None):
        """(record, version, refreshed_at) or (None, None, None) when absent; the version is the
        holder's random token (inode numbers are reused at once on some file systems)."""
        try:
            with open(path or self.path, "rb") as f:
                data = f.read()
                st = os.fstat(f.fileno())
        except FileNotFoundError:
            return None, None, None
        record = _parse(data, self.path)
        return record, record.get("token"), st.st_mtime

    def create(self, data: bytes) -> bool:
        if not os.path.isdir(self.dir):
            os.makedirs(self.dir, exist_ok=True)
            self.created_dir = True
        tmp = os.path.join(self.dir, f"{paths.TMP_PREFIX}lease-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, self.path)  # fails if the name exists: created only if absent
            return True
        except (FileExistsError, FileNotFoundError):
            # exists; or our temporary was removed by the start-up cleanup of a dump that holds the lease
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    def refresh(self, version, data: bytes):
        if self.read()[1] != version:
            return None
        try:
            os.utime(self.path)  # (if a taker replaced it just now, this refreshes the taker's: harmless)
        except FileNotFoundError:
            return None
        return version

    def take(self, version, data: bytes) -> bool:
        aside = os.path.join(self.dir, f"{paths.TMP_PREFIX}lease-aside-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, aside)  # of two takers, one wins the rename
        except FileNotFoundError:
            return False
        try:
            if self.read(aside)[1] != version:  # not the lease we judged: put it back
                with contextlib.suppress(FileExistsError):
                    os.link(aside, self.path)
                return False
        except FileNotFoundError:
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(aside)
        return self.create(data)

    def delete(self, version) -> None:
        try:
            if self.read()[1] == version:
                os.remove(self.path)
            if self.created_dir and not os.listdir(self.dir):
                os.rmdir(self.dir)  # a dump that failed before writing anything leaves nothing behind
        except (FileNotFoundError, OSError):
            pass


class _GCS:
    """On GCS: every change is an upload with the precondition ifGenerationMatch (0: absent)."""

    def __init__(self, uri: str):
        self.fs, path = paths.url_to_fs(uri)
        self.bucket, self.key = path.split("/", 1)
        self.path = path

    def read(self):
        self.fs.invalidate_cache(self.path)
        try:
            info = self.fs.info(self.path)
            data = self.fs.cat_file(self.path)
        except FileNotFoundError:
            return None, None, None
        record = _parse(data, "gs://" + self.path)
        return record, str(info.get("generation")), float(record.get("refreshed_at") or 0.0)

    def _upload(self, data: bytes, generation: str):
        try:
            out = self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket)}/o",
                               uploadType="media", name=self.key, ifGenerationMatch=generation, data=data,
                               headers={"Content-Type": "application/octet-stream"}, json_out=True)
            return str(out["generation"])
        except FileExistsError:  # gcsfs's name for HTTP 412: the precondition did not hold
            return None
        finally:
            self.fs.invalidate_cache(self.path)

    def create(self, data: bytes) -> bool:
        return self._upload(data, "0") is not None

    def refresh(self, version, data: bytes):
        return self._upload(data, version)

    def take(self, version, data: bytes) -> bool:
        return self._upload(data, version) is not None

    def delete(self, version) -> None:
        try:
            self.fs.call("DELETE", f"{self.fs._location}/storage/v1/b/{quote(self.bucket)}/o/"
                                   f"{quote(self.key, safe='')}", ifGenerationMatch=version)
        except (FileNotFoundError, FileExistsError):
            pass
        finally:
            self.fs.invalidate_cache(self.path)


def _parse(data: bytes, where: str) -> dict:
    try:
        record = json.loads(data)
        if isinstance(record, dict):
            return record
    except ValueError:
        pass
    return {"host": "?", "pid": None, "acquired_at": "?", "refreshed_at": 0.0, "unreadable": where}


class Lease:
    """The lease of one writer (a dump, or a training: ``holder``) on ``store_uri`` (the store, or the
    training output); ``acquire()``, then ``release()`` (or use ``with``)."""

    def __init__(self, store_uri: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, force_takeover: bool = False,
                 wait_for_stale: bool = False, holder: str = "dump"):
        self.holder = holder
        if not timeout_s > 0:
            raise StoreBusyError(f"--lease-timeout must be > 0 seconds, got {timeout_s}")
        self.uri = paths.join(store_uri, LEASE_NAME)
        self.store_uri = store_uri
        self.timeout_s = float(timeout_s)
        self.force_takeover = force_takeover
        self.wait_for_stale = wait_for_stale  # with force_takeover: wait for a lease to go stale, once
        self._backend = _Local(paths.local_path(self.uri)) if paths.is_local(self.uri) else _GCS(self.uri)
        self.record = {
            "holder": f"process {os.getpid()} on {socket.gethostname()}",
            "host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
            "token": uuid.uuid4().hex, "timeout_s": self.timeout_s,
            "acquired_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        self._version = None
        self.lost: str | None = None  # why the lease was lost, once it is
        self.previous: dict | None = None  # the lease taken over, if any
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _bytes(self) -> bytes:
        return (json.dumps({**self.record, "refreshed_at": time.time()}, indent=1, sort_keys=True) + "\n").encode()

    def _refusal(self, record: dict, refreshed_at: float) -> None:
        """Raise unless ``record``'s holder is dead, or stale and --force-takeover was given."""
        if holder_is_dead(record):
            return
        age = time.time() - refreshed_at
        timeout = float(record.get("timeout_s") or DEFAULT_TIMEOUT_S)
        if age <= timeout:
            raise StoreBusyError(
                f"{self.store_uri} is being written by another {self.holder}: {describe(record)}, its lease refreshed "
                f"{max(age, 0):.0f} s ago; wait for it to finish or stop it (a lease not refreshed for "
                f"{timeout:.0f} s is stale, and --force-takeover takes it over)")
        if not self.force_takeover:
            raise StoreBusyError(
                f"{self.store_uri} has a stale lease of {describe(record)}, not refreshed for {age:.0f} s "
                f"(timeout {timeout:.0f} s); if that {self.holder} is gone, re-run with --force-takeover")

    def _wait_before_judging(self, record: dict, refreshed_at: float) -> float:
        """Seconds until ``record`` would be stale, when this taker waits for that (else 0). At most its
        timeout: a holder whose clock runs ahead of ours is judged, and refused, after one timeout."""
        if not (self.force_takeover and self.wait_for_stale) or holder_is_dead(record):
            return 0.0
        timeout = float(record.get("timeout_s") or DEFAULT_TIMEOUT_S)
        left = refreshed_at + timeout - time.time()
        return min(left, timeout) + 0.5 if math.isfinite(left) and left >= 0 else 0.0

    def acquire(self) -> "Lease":
        waited = False
        for _ in range(5):
            if self._backend.create(self._bytes()):
                break
            record, version, refreshed_at = self._backend.read()
            if record is None:
                continue  # released meanwhile: try again
            wait = 0.0 if waited else self._wait_before_judging(record, refreshed_at)
            if wait:
                log.warning("%s: the lease of %s is not stale yet; waiting %.0f s to see whether it is refreshed",
                            self.store_uri, describe(record), wait)
                time.sleep(wait)
                waited = True
                continue  # judged again: refreshed meanwhile (its holder lives), it is refused
            self._refusal(record, refreshed_at)
            if self._backend.take(version, self._bytes()):
                self.previous = record
                log.warning("%s: took over the lease of %s", self.store_uri, describe(record))
                break
        else:
            raise StoreBusyError(f"{self.store_uri}: the lease changed hands repeatedly while taking it; "
                                 f"another {self.holder} is starting there; try again")
        record, self._version, _ = self._backend.read()
        if record is None or record.get("token") != self.record["token"]:
            raise StoreBusyError(f"{self.store_uri} was taken by another {self.holder} while starting"
                                 + (f": {describe(record)}" if record else "") + "; try again")
        self._thread = threading.Thread(target=self._refresh_loop, name="ld-lease", daemon=True)
        self._thread.start()
        return self

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - a failed refresh is retried; the lease may go stale
                log.warning("%s: could not refresh the lease: %s", self.store_uri, e)
            if self.lost:
                return

    def refresh(self) -> None:
        version = self._backend.refresh(self._version, self._bytes())
        if version is not None:
            self._version = version
        else:
            record, _, _ = self._backend.read()
            self.lost = (f"the lease of {self.store_uri} was taken over by "
                         f"{describe(record) if record else f'another {self.holder}, which has released it'}")

    def check(self) -> None:
        """Raise if the lease was lost (taken over after going stale): stop before writing more."""
        if self.lost:
            kept = "committed chunks are kept" if self.holder == "dump" else "the last checkpoint is kept"
            raise StoreBusyError(f"{self.lost}; this {self.holder} stopped; {kept}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._version is not None and not self.lost:
            try:
                self._backend.delete(self._version)
            except Exception as e:  # noqa: BLE001 - a leftover lease of a dead process is taken over later
                log.warning("%s: could not release the lease: %s", self.store_uri, e)
        self._version = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
