"""Student training from a logit store: losses, schedules, loader, loop, export."""

from .cli import register_cli

__all__ = ["TrainResult", "register_cli", "sample_from_teacher", "train_student"]


def __getattr__(name):
    # Lazy: the loop pulls in Orbax and Grain, which the CLI's argument parsing does not need.
    if name in ("TrainResult", "train_student"):
        from . import loop

        return getattr(loop, name)
    if name == "sample_from_teacher":
        from .sampling import sample_from_teacher

        return sample_from_teacher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
