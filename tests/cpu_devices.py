"""The environments of test subprocesses (no tests here): ``n`` fake CPU devices, or XLA's own defaults."""

from __future__ import annotations

import os


def env_with_cpu_devices(n: int, **extra: str) -> dict:
    """``os.environ`` plus ``n`` host-platform devices, keeping the XLA flags already set (tests/conftest.py's)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)


# The XLA flags tests/conftest.py sets for the tests and their subprocesses: compiling is cheaper, the code
# compiled runs slower.
COMPILE_SAVING_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def env_with_xla_defaults(**extra: str) -> dict:
    """``os.environ`` without the compile-saving flags: for a subprocess whose compute outweighs its compiles
    (the demo: 108 CPU-s so, against 150 with the flags)."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in COMPILE_SAVING_XLA_FLAGS)
    return dict(os.environ, XLA_FLAGS=flags, **extra)
