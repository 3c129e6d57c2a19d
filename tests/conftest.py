"""Shared fixtures. A real GCS emulator (gcp-storage-emulator) runs on loopback for gs:// tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Set before anything imports gcsfs; subprocesses started by tests inherit them.
os.environ.setdefault("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{_free_port()}")
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Module- and session-scoped fixtures run before the per-test cache below: give them a fresh one too.
os.environ["LOGIT_DISTILL_CACHE"] = tempfile.mkdtemp(prefix="logit-distill-test-cache-")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own logit-distill cache directory."""
    monkeypatch.setenv("LOGIT_DISTILL_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def gcs_emulator():
    """Start gcp-storage-emulator on loopback for the session; yield its URL."""
    url = os.environ["STORAGE_EMULATOR_HOST"]
    port = int(url.rsplit(":", 1)[1])
    exe = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    proc = subprocess.Popen(
        [exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"gcp-storage-emulator did not start on port {port}")
            time.sleep(0.1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def gcs_bucket(gcs_emulator):
    """A fresh, empty bucket on the emulator; yields ``gs://<bucket>``."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon")
    name = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    yield f"gs://{name}"


@pytest.fixture(params=["local", "gcs"])
def store_root(request, tmp_path):
    """A place for stores: a local directory and a gs:// prefix on the emulator."""
    if request.param == "local":
        return str(tmp_path / "stores")
    return request.getfixturevalue("gcs_bucket") + "/stores"
