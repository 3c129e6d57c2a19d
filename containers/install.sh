#!/bin/sh
# The component image's install step, in one place: containers/Dockerfile runs it (two layers), and
# tests/test_image.py runs it in a fresh virtual environment (no docker daemon or registry needed).
#
#   sh install.sh lock      the locked dependencies: requirements.lock (next to this script), every
#                           package by version and SHA-256, no resolver
#   sh install.sh package   the package in the current folder (without dependencies: the lock has them),
#                           the JAX accelerator plugin of $JAX_BACKEND under the lock's versions, then
#                           `pip check` and the import check
#
# `python` is the interpreter installed into (the image's; the test puts its venv first on PATH).
# The Dockerfile's build arguments arrive as the environment: JAX_BACKEND (cpu | cuda | tpu; default
# cpu), JAX_VERSION and JAX_CUDA_EXTRA (cuda, tpu). POSIX sh: the base image's /bin/sh is dash.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
lock="$here/requirements.lock"

case "${1:-}" in
  lock)
    python -m pip install --require-hashes --no-deps -r "$lock"
    ;;
  package)
    python -m pip install --no-deps .
    backend="${JAX_BACKEND:-cpu}"
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    sed 's/ --hash=.*//' "$lock" > "$constraints"  # the lock's versions, without hashes: a constraints file
    case "$backend" in
      cpu)  ;;
      cuda) python -m pip install -c "$constraints" "jax[${JAX_CUDA_EXTRA:?}]==${JAX_VERSION:?}" ;;
      tpu)  python -m pip install -c "$constraints" "jax[tpu]==${JAX_VERSION:?}" ;;
      *)    echo "JAX_BACKEND must be cpu, cuda or tpu, got $backend" >&2; exit 1 ;;
    esac
    python -m pip check
    python -c "import kfp, logit_distill, jax; print('kfp', kfp.__version__, 'jax', jax.__version__)"
    ;;
  *)
    echo "usage: sh install.sh lock|package" >&2
    exit 2
    ;;
esac
