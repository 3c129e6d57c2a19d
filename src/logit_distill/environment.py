"""The environment variables the tool reads, in one table: each is parsed here, and a bad value is
one line naming the variable (exit 2); a ``LOGIT_DISTILL_*`` name that is not in the table gets a
warning (a typo would otherwise be silently ignored)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from typing import Callable

from .errors import InputError

PREFIX = "LOGIT_DISTILL_"


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    parse: Callable[[str], object]  # raises ValueError (or returns None) on a bad value
    expected: str  # what a good value is
    help: str


def _positive_seconds(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) and value > 0 else None


def _port(text: str) -> int | None:
    value = int(text)
    return value if 0 < value < 65536 else None


def _flag(text: str) -> bool | None:
    low = text.strip().lower()
    return None if low not in ("0", "1", "true", "false", "yes", "no") else low in ("1", "true", "yes")


def _folder(text: str) -> str | None:
    if not text.strip() or ("://" in text and not text.startswith("file://")):
        return None
    return text.removeprefix("file://")


VARIABLES = {v.name: v for v in (
    Variable("LOGIT_DISTILL_CACHE", _folder, "a local folder (the caches are memory-mapped), not a URI",
             "the caches: tokenized data, presets, chunks read from GCS (default ~/.cache/logit-distill)"),
    Variable("LOGIT_DISTILL_GCS_PROBE_TIMEOUT", _positive_seconds, "a number of seconds > 0",
             "how long a gs:// path may take to answer before the command fails in one line (default 10)"),
    Variable("LOGIT_DISTILL_COORDINATOR_PORT", _port, "a TCP port in 1..65535",
             "the JAX coordinator's port of a multi-host job (default 8476)"),
    Variable("LOGIT_DISTILL_VERBOSE", _flag, "1/true/yes or 0/false/no",
             "1: the pipeline components log at INFO level"),
    Variable("LOGIT_DISTILL_VERTEX_ENDPOINT", str, "a URL",
             "the Vertex AI REST endpoint the pipeline's launcher guard asks (tests point it at loopback)"),
)}


def get(name: str, default=None):
    """The parsed value of variable ``name``, or ``default`` when it is unset or empty."""
    variable = VARIABLES[name]
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = variable.parse(text)
    except ValueError:
        value = None
    if value is None:
        raise InputError(f"environment variable {name}={text!r}: expected {variable.expected} ({variable.help}); "
                         "fix or unset it")
    return value


def check(warn: Callable[[str], None] | None = None) -> None:
    """Parse every set variable of the table (InputError on a bad one) and warn about each unknown
    ``LOGIT_DISTILL_*`` name."""
    for name in sorted(os.environ):
        if name in VARIABLES:
            get(name)
        elif name.startswith(PREFIX):
            close = difflib.get_close_matches(name, VARIABLES, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(sorted(VARIABLES))})"
            (warn or _warn)(f"warning: environment variable {name} is not one logit-distill reads{hint}")


def _warn(line: str) -> None:
    print(f"logit-distill: {line}", file=sys.stderr, flush=True)
