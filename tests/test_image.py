"""The component image's install step, checked without a registry: the Dockerfile installs
containers/requirements.lock with --require-hashes --no-deps, so the lock must hold every package the
image needs (the package's dependencies and the `component` extra, closed under their own requirements)
at versions that satisfy them, and nothing the image does not need."""

import os
import re
import tomllib
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join(REPO, "containers", "requirements.lock")
DOCKERFILE = os.path.join(REPO, "containers", "Dockerfile")
# The image's platform: the markers of Linux x86_64, CPython 3.11.
ENV = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "python_version": "3.11", "python_full_version": "3.11.0", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix"}


def _lock() -> dict:
    pinned = {}
    with open(LOCK) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+) --hash=sha256:[0-9a-f]{64}\n?", line)
            assert m, f"not a pinned, hashed line: {line!r}"
            pinned[canonicalize_name(m.group(1))] = m.group(2)
    return pinned


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**ENV, "extra": e}) for e in (extras or {""}))


def test_lock_holds_the_image_packages_and_their_requirements_closed():
    pinned = _lock()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    roots = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["component"]]
    todo = [(r, set()) for r in roots]
    seen = set()
    while todo:  # the closure of the image's requirements, read from the installed distributions' metadata
        req, _ = todo.pop()
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req} is needed in the image but missing from the lock"
        assert req.specifier.contains(pinned[name], prereleases=True), f"the lock's {name}=={pinned[name]} misses {req}"
        key = (name, tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(name)
        assert canonicalize_name(dist.metadata["Name"]) == name
        assert dist.version == pinned[name], f"{name}: lock {pinned[name]}, tested with {dist.version}: make lock"
        for text in dist.requires or []:
            sub = Requirement(text)
            if _applies(sub, set(req.extras)):
                todo.append((sub, set()))
    needed = {n for n, _ in seen}
    assert set(pinned) == needed, f"in the lock but not needed by the image: {sorted(set(pinned) - needed)}"
    for absent in ("google-tunix", "google-cloud-aiplatform", "google-cloud-pipeline-components", "torch",
                   "transformers", "pytest"):
        assert absent not in pinned


def test_dockerfile_installs_the_lock_on_a_pinned_base():
    with open(DOCKERFILE) as f:
        text = f.read()
    assert re.search(r"ARG BASE_IMAGE=python:3\.11-slim@sha256:[0-9a-f]{64}\n", text)
    assert "pip install --require-hashes --no-deps -r requirements.lock" in text
    assert "pip install --no-deps ." in text and "pip check" in text
