"""The environment of a subprocess that sees ``n`` fake CPU devices (no tests here)."""

from __future__ import annotations

import os


def env_with_cpu_devices(n: int, **extra: str) -> dict:
    """``os.environ`` plus ``n`` host-platform devices, keeping the XLA flags already set (tests/conftest.py's)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)
