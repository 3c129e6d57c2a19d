#!/bin/sh
# The component image's install step, in one place: containers/Dockerfile runs it (three layers), and
# tests/test_image.py runs it in a fresh virtual environment (no docker daemon or registry needed).
#
#   sh install.sh base      refuses a base image not pinned by digest ($BASE_IMAGE, the Dockerfile's
#                           build argument): name@sha256:<64 hex digits>
#   sh install.sh lock      the locked dependencies of $JAX_BACKEND: requirements-<backend>.lock (next to
#                           this script), every package by version and SHA-256 (the JAX plugin of the
#                           backend included), no resolver
#   sh install.sh package   the package in the current folder (without dependencies: the lock has them),
#                           then `pip check` and the import check
#
# `python` is the interpreter installed into (the image's; the test puts its venv first on PATH).
# The Dockerfile's build arguments arrive as the environment: JAX_BACKEND (cpu | cuda | tpu; default
# cpu), BASE_IMAGE. POSIX sh: the base image's /bin/sh is dash.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
backend="${JAX_BACKEND:-cpu}"

case "${1:-}" in
  base)
    case "${BASE_IMAGE:-}" in
      *@sha256:????????????????????????????????????????????????????????????????) ;;
      *) echo "BASE_IMAGE '${BASE_IMAGE:-}' is not pinned by digest: build with --build-arg" \
              "BASE_IMAGE=python:3.11-slim@sha256:<digest> (docs/PIPELINE.md, 'The base image')" >&2
         exit 1 ;;
    esac
    ;;
  lock)
    case "$backend" in
      cpu|cuda|tpu) ;;
      *) echo "JAX_BACKEND must be cpu, cuda or tpu, got $backend" >&2; exit 1 ;;
    esac
    python -m pip install --require-hashes --no-deps -r "$here/requirements-$backend.lock"
    ;;
  package)
    python -m pip install --no-deps .
    python -m pip check
    python -c "import kfp, logit_distill, jax; print('kfp', kfp.__version__, 'jax', jax.__version__)"
    ;;
  *)
    echo "usage: sh install.sh base|lock|package" >&2
    exit 2
    ;;
esac
