"""``fail_on_error``: fail the run with a task's one-line error, unretried; else pass its value on.

The dump and the training record a deterministic failure of the tool (exit 2
bad input, 3 non-finite values, 4 store damaged) as their ``error`` and
``exit_code`` outputs instead of failing: their retry policy is for
preemptions and crashes, and a retry of a deterministic failure would only
provision another accelerator job to fail the same way. This CPU task runs
after each of them, with no retries: with an error it prints that line and
exits with its code, so the run fails with the failing task's own line (the
Vertex UI shows it as this task's error); without one it returns ``value``
(the dump's store state, the training's export folder) for the tasks after it.
"""

from kfp import dsl

from .image import DEFAULT_IMAGE


def fail_on_error(stage: str, error: str, exit_code: int, value: str = "") -> str:
    """Exit ``exit_code`` with ``error`` when the stage failed; else return ``value``."""
    import sys

    if exit_code:
        print(error or f"{stage} failed with exit code {exit_code}", file=sys.stderr, flush=True)
        raise SystemExit(exit_code)
    return value


INPUTS = {
    "stage": "What ran (dump, train): named when the error line is empty.",
    "error": "The stage's one-line error (empty: it succeeded).",
    "exit_code": "The stage's exit code (0: it succeeded).",
    "value": "What the stage hands on when it succeeded.",
}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(fail_on_error, INPUTS), base_image=image, install_kfp_package=False)


component = build()
