"""Quiet by default: the libraries underneath (Orbax, absl, JAX, gcsfs, ...) log at WARNING unless asked.

The CLI calls ``configure(verbose)`` (``-v``, ``--debug``); the pipeline components call
``configure_from_environment()`` (``LOGIT_DISTILL_VERBOSE=1`` for more), so a
Vertex task's log holds what matters: progress, summaries and warnings.
"""

from __future__ import annotations

import logging
import os

ENV = "LOGIT_DISTILL_VERBOSE"
LIBRARIES = ("absl", "orbax", "jax", "jax._src", "gcsfs", "fsspec", "google", "google_auth_httplib2", "urllib3",
             "grain", "tensorboardX", "matplotlib", "PIL", "etils")


def configure(verbose: bool = False) -> None:
    level = logging.INFO if verbose else logging.WARNING
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(level)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.INFO if verbose else absl_logging.WARNING)
    except ImportError:  # absl comes with JAX; without it there is nothing to quiet
        pass


def configure_from_environment() -> None:
    from . import environment

    configure(bool(environment.get(ENV, False)))


def warn_unknown_environment(command: str | None = None) -> None:
    """Check the tool's environment variables (a bad value is one line naming it) and warn, on stderr,
    about a ``LOGIT_DISTILL_*`` name the tool does not read."""
    import sys

    from . import environment

    prefix = f"logit-distill {command}" if command else "logit-distill"
    environment.check(warn=lambda line: print(f"{prefix}: {line}", file=sys.stderr, flush=True))
