"""Exception types. Every error a user can cause says what is wrong, where, and what to do."""


class LogitDistillError(Exception):
    """Base class of the errors logit-distill raises on purpose."""


class InputError(LogitDistillError, ValueError):
    """Bad user input: a missing file, a wrong setting, an unsupported checkpoint."""


class StoreError(LogitDistillError):
    """A logit store is missing, malformed, corrupt or incomplete."""


class ConfigMismatchError(StoreError):
    """An existing store was written with a different configuration."""
