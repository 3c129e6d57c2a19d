"""A GCS emulator (gcp-storage-emulator) on loopback, for tests, benchmarks and local trials.

gs:// paths reach it through the standard ``STORAGE_EMULATOR_HOST`` variable
(see ``paths``). The emulator is a test dependency (``pip install .[test]``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time


@contextlib.contextmanager
def gcs_emulator(port: int, timeout_s: float = 30.0):
    """Run an in-memory emulator on 127.0.0.1:``port``; yield its URL; stop it on exit."""
    exe = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    proc = subprocess.Popen([exe, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"gcp-storage-emulator did not start on port {port}") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
