"""Exception types and exit codes. Every error a user can cause says what is wrong, where, and what to do.

Exit codes (docs/ERRORS.md): 2 bad input (arguments, paths, data, a busy or mismatched store,
an unreachable or unwritable output), 3 non-finite values, 4 store damaged, 130 interrupted.
"""

EXIT_BAD_INPUT = 2
EXIT_NON_FINITE = 3
EXIT_STORE_DAMAGED = 4
EXIT_INTERRUPTED = 130


class LogitDistillError(Exception):
    """Base class of the errors logit-distill raises on purpose."""

    exit_code = EXIT_BAD_INPUT


class InputError(LogitDistillError, ValueError):
    """Bad user input: a missing file, a wrong setting, an unsupported checkpoint."""

    exit_code = EXIT_BAD_INPUT


class StoreError(LogitDistillError):
    """A logit store is missing, malformed, corrupt or incomplete."""

    exit_code = EXIT_STORE_DAMAGED


class ConfigMismatchError(StoreError):
    """An existing store was written with a different configuration (the wrong output, not damage)."""

    exit_code = EXIT_BAD_INPUT


class StoreBusyError(InputError):
    """Another dump holds the store's lease."""


class NotAStoreError(StoreError):
    """The output location holds files but no store: the wrong output, not a damaged store."""

    exit_code = EXIT_BAD_INPUT


class NonFiniteError(LogitDistillError):
    """A NaN or infinite value where a finite one is needed (teacher output, loss, gradient, record)."""

    exit_code = EXIT_NON_FINITE
