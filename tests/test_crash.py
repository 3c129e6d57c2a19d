"""A writer SIGKILLed at random moments never leaves a chunk a reader accepts but that is incomplete."""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from logit_distill import store
from logit_distill.store.synthetic import synthetic_step

HERE = os.path.dirname(__file__)


def _committed(uri):
    from logit_distill import paths

    try:
        return sum(f["name"].startswith("chunk-") for f in paths.list_files(uri))
    except Exception:  # noqa: BLE001 - the store may not exist yet
        return 0


def _run_until_killed(uri, delay):
    """Start the writer, wait until it commits a new chunk, then SIGKILL it ``delay`` s later."""
    before = _committed(uri)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "crash_writer.py"), uri],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ.copy())
    deadline = time.time() + 120
    while proc.poll() is None and _committed(uri) <= before and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _check_every_committed_chunk(uri):
    s = store.open_store(uri)
    layout = s.manifest["layout"]
    for chunk in s.scan.chunks.values():
        for step in range(chunk.start, chunk.end):
            want = synthetic_step(s.manifest, step, 0)
            for o in range(layout["examples_per_step"]):
                got = s.read(step * layout["examples_per_step"] + o)
                np.testing.assert_array_equal(got["topk_ids"], want["topk_ids"][o])
                np.testing.assert_array_equal(got["tokens"], want["tokens"][o])
    s.close()
    return s.scan


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_sigkill_never_leaves_an_accepted_incomplete_chunk(backend, tmp_path, request):
    root = str(tmp_path) if backend == "local" else request.getfixturevalue("gcs_bucket")
    uri = root + "/crash"
    rng = random.Random(1234)
    seen_partial = False
    for _ in range(4):
        _run_until_killed(uri, rng.uniform(0.0, 1.0))
        result = _check_every_committed_chunk(uri)
        seen_partial |= 0 < result.num_present < result.num_expected
    # The kills landed mid-run at least once, and a final run completes the store.
    assert seen_partial
    proc = subprocess.run([sys.executable, os.path.join(HERE, "crash_writer.py"), uri],
                          capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert _check_every_committed_chunk(uri).complete
