"""The component image reference: pinned by tag or digest, never ``:latest``."""

from __future__ import annotations

import re

# What `make compile` writes into compiled/*.yaml. `pipelines.submit --image URI` replaces it
# with the image you pushed (see docs/PIPELINE.md); `pipelines.compile --image URI` compiles
# with another one.
DEFAULT_IMAGE = "us-docker.pkg.dev/YOUR_PROJECT/logit-distill/logit-distill:0.1.0-cuda"
# The small image of the CPU steps (plan, verify, ...): `submit --cpu-image` replaces it.
DEFAULT_CPU_IMAGE = "us-docker.pkg.dev/YOUR_PROJECT/logit-distill/logit-distill:0.1.0-cpu"
PLACEHOLDER = "YOUR_PROJECT"

_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_TAG = re.compile(r":[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def check_image(image: str) -> str:
    """Return ``image`` if it is pinned (``name:tag`` other than latest, or ``name@sha256:...``)."""
    if not isinstance(image, str) or not image or any(c.isspace() for c in image):
        raise ValueError(f"bad image reference {image!r}")
    if _DIGEST.search(image):
        return image
    last = image.rsplit("/", 1)[-1]
    m = _TAG.search(last)
    if not m:
        raise ValueError(f"image {image!r} has no tag or digest: pin it (name:TAG or name@sha256:DIGEST)")
    if m.group(0) == ":latest":
        raise ValueError(f"image {image!r} uses :latest: pin a version tag or a digest")
    return image
