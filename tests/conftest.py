"""Shared fixtures. A real GCS emulator (gcp-storage-emulator) runs on loopback for gs:// tests."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
from cpu_devices import COMPILE_SAVING_XLA_FLAGS

from logit_distill.emulator import free_port


# Set before anything imports gcsfs; subprocesses started by tests inherit them. Each pytest-xdist worker
# starts its own emulator, on its own port (a worker inherits the controller's environment).
if os.environ.get("PYTEST_XDIST_WORKER") or "STORAGE_EMULATOR_HOST" not in os.environ:
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{free_port()}"
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Module- and session-scoped fixtures run before the per-test cache below: give them a fresh one too.
os.environ["LOGIT_DISTILL_CACHE"] = tempfile.mkdtemp(prefix="logit-distill-test-cache-")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One persistent JAX compilation cache for the whole run, shared by the workers and every subprocess a
# test starts (the same tiny models are compiled in many processes: a training subprocess spends ~40% less
# CPU when its programs are cached). A fresh folder per run, removed at the end; every program is cached
# (no minimum compile time), and a size limit turns on JAX's file lock, which concurrent processes need.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="logit-distill-test-jax-cache-")
    os.environ["TESTS_OWN_JAX_CACHE"] = "1"
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
# XLA's CPU backend without LLVM's optimisation passes and with its older (elemental) fusion emitters: the
# tests' models are tiny, so compiling is most of their CPU time. Without the optimisation passes a 150-step
# training subprocess spends ~20% less CPU in all; the elemental emitters compile a program in ~60% of the
# time (a cold 20-step training subprocess: 10.3 CPU-s against 13.8; `make quick-test`: 18% less CPU), though
# their code runs slower (a 150-step training of 16 x 64 tokens: +20%). The programs compute the same values.
# Subprocesses inherit the flags (tests/cpu_devices.py keeps them when it adds fake devices).
# A test whose subprocess computes more than it compiles (the demo) runs it without them
# (tests/cpu_devices.py's env_with_xla_defaults).
for _flag in COMPILE_SAVING_XLA_FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()


def pytest_unconfigure(config):
    """The run's JAX cache goes with the run (removed by the process that made it, after its workers)."""
    if os.environ.get("TESTS_OWN_JAX_CACHE") and not os.environ.get("PYTEST_XDIST_WORKER"):
        import shutil

        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own logit-distill cache directory."""
    monkeypatch.setenv("LOGIT_DISTILL_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def gcs_emulator():
    """Start gcp-storage-emulator on loopback for the session; yield its URL."""
    from logit_distill.emulator import gcs_emulator as run_emulator

    port = int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])
    with run_emulator(port) as url:
        yield url


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


@pytest.fixture
def small_fs(tmp_path):
    """A tiny tmpfs at ``tmp_path/mnt``: ``mount(size)``; ``read_only()`` remounts it read-only."""
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = []

    class FS:
        path = mnt

        def mount(self, size="512k"):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"mounting a tmpfs needs root with CAP_SYS_ADMIN: {r.stderr.strip()}")
            mounted.append(mnt)

        def read_only(self):
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)

    yield FS()
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], check=False)


# The longest test files first: pytest-xdist hands out whole files (--dist loadfile) in collection
# order, so a long file that came last would run alone at the end.
LONGEST_FIRST = ("test_demo.py", "test_train.py", "test_pipeline.py", "test_sampled.py", "test_teacher_speed.py",
                 "test_user_files.py", "test_image.py", "test_flax_student.py", "test_models.py", "test_divergences.py",
                 "test_moe_dump.py", "test_dump.py", "test_bad_input.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))
