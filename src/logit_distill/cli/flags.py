"""Argument types of the command line: numbers are checked where they are parsed.

Every float flag of every command goes through one of these, so a NaN or an
infinity (``float("nan")`` parses) is refused before anything runs, with
argparse's one-line usage error (exit 2).
"""

from __future__ import annotations

import argparse
import math


def finite_float(text: str) -> float:
    """A finite float (no nan, inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0."""
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite float >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def positive_float_or_none(text: str) -> float | None:
    """A finite float > 0, or the word ``none`` (the feature off)."""
    if text.strip().lower() == "none":
        return None
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or 'none' to turn it off)") from None


def add_output_arguments(parser: argparse.ArgumentParser, json_help: str = "print the result as JSON on stdout") -> None:
    """The flags every command has for what it prints: ``--no-progress`` (also spelled ``--quiet``) and
    ``--json``; the result is ``args.progress`` and ``args.json``."""
    parser.add_argument("--no-progress", "--quiet", dest="progress", action="store_false",
                        help="no progress bar (the one-line start, resume and summary lines are still printed)")
    parser.add_argument("--json", action="store_true", help=json_help)
