"""The argument parser of every command."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block), like every other failure
    (docs/ERRORS.md); ``--help`` still prints the usage. Sub-commands inherit it.

    Abbreviated flags are refused (``--top 16`` for ``--top-k 16``): a flag added later could
    otherwise change what an old command means."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")
