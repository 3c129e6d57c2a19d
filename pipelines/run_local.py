"""Run a pipeline on this machine under ``kfp.local``, with the same ``param=value`` syntax as submit.

    python -m pipelines.run_local [--pipeline logit-distill|logit-distill-from-store] [--root DIR] [-v] \\
        teacher=... data=... student=... output_root=... dump_num_steps=32 [param=value ...]

Parameters are typed and checked against the pipeline's parameter table
(``pipelines/params.py``) before anything runs. Tasks run in subprocesses
(``kfp.local.SubprocessRunner``, this Python environment); their outputs land
under ``--root`` (default ``local-runs/``). Quiet by default: the tasks' full
log goes to ``<root>/<run>.log`` and the console shows one line per finished
task; ``-v`` shows everything. Exit code 0 when the run succeeded, 1 when a task
failed, with the failing task's own line (the tool's one-line error of a
dump, a plan or a training; for a store that failed verification, its first
failing check), 2 for bad parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import re
import sys
import time

VARIANTS = {"logit-distill": "local", "logit-distill-from-store": "from_store"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FINISHED = re.compile(r"Task '([^']+)' finished with status (\w+)")
# The tool's one-line error (docs/ERRORS.md), as a failing task prints it.
_TOOL_ERROR = re.compile(r"logit-distill [a-z-]+: error: .*")


@dataclasses.dataclass
class LocalRun:
    ok: bool
    run_dir: str  # <root>/<pipeline>-<time>: one folder per task with its outputs
    log: str  # the tasks' full log ('' with verbose)
    error: str  # one line when not ok
    tasks: dict  # task -> SUCCESS / FAILURE, in the order they finished


class _Tee:
    """A text stream over the tasks' output: it keeps everything in a log file (or, verbose, passes it on to
    the console), echoes one line per finished task, and remembers the last one-line error of the
    tool that a task printed."""

    def __init__(self, path: str | None, echo, tasks: dict):
        self._file = open(path, "w", encoding="utf-8") if path else None
        self._echo, self._tasks, self._buf = echo, tasks, ""
        self._console = sys.stdout  # (before the redirection)
        self.tool_error = ""

    def write(self, text: str) -> int:
        if self._file is not None:
            self._file.write(text)
        else:
            self._console.write(text)
        self._buf += text
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            plain = _ANSI.sub("", line)
            error = _TOOL_ERROR.search(plain)
            if error:
                self.tool_error = error.group(0).strip()
            m = _FINISHED.search(plain)
            if m:
                self._tasks[m.group(1)] = m.group(2)
                if self._echo is not None and self._file is not None:
                    print(f"  {m.group(1):<28} {m.group(2).lower()}", file=self._echo, flush=True)
        return len(text)

    def flush(self) -> None:
        (self._file or self._console).flush()

    def isatty(self) -> bool:
        return False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def run(pipeline: str = "logit-distill", values: dict | None = None, root: str = "local-runs",
        verbose: bool = False, echo=True) -> LocalRun:
    """Run ``pipeline`` with ``values`` (typed) under kfp.local; never raises for a failed task. ``echo``:
    True prints one line per finished task on stdout, None prints nothing, or a stream to print to."""
    from kfp import local

    from pipelines import params
    from pipelines import pipeline as pipelines_mod

    pipe = {"logit-distill": pipelines_mod.distill_pipeline,
            "logit-distill-from-store": pipelines_mod.distill_from_store}[pipeline]
    known = {p.name for p in params.of(VARIANTS[pipeline])}
    for name in values or {}:
        if name not in known:
            raise ValueError(params.renamed_hint(name, known) or f"unknown parameter {name!r}")
    root = os.path.abspath(root)
    os.makedirs(root, exist_ok=True)
    before = set(glob.glob(os.path.join(root, f"{pipeline}-*")))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["LOGIT_DISTILL_VERBOSE"] = "1" if verbose else os.environ.get("LOGIT_DISTILL_VERBOSE", "0")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=root)
    import warnings

    # kfp.local runs the tasks in this environment, not in the images, and ignores resource requests: expected.
    warnings.filterwarnings("ignore", message=".*non-Python base image", category=RuntimeWarning)
    warnings.filterwarnings("ignore", message=".*have no effect in the current local runner", category=UserWarning)
    tasks: dict = {}
    log = "" if verbose else os.path.join(root, f"{pipeline}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    error = ""
    tee = _Tee(log or None, sys.stdout if echo is True else echo, tasks)
    try:
        with contextlib.redirect_stdout(tee):
            pipe(**(values or {}))
    except RuntimeError as e:  # kfp.local: "Pipeline ... finished with status FAILURE. Inner task failed: ..."
        failed = [task for task, status in tasks.items() if status == "FAILURE"]
        error = (f"task {failed[0]} failed" if failed else
                 _ANSI.sub("", str(e)).strip().splitlines()[0].split(". Inner task")[0])
        if tee.tool_error:
            error += f": {tee.tool_error}"
    finally:
        tee.close()
    runs = sorted(set(glob.glob(os.path.join(root, f"{pipeline}-*"))) - before - {log}, key=os.path.getmtime)
    run_dir = next((r for r in reversed(runs) if os.path.isdir(r)), "")
    if error:
        why = verification_failure(run_dir)
        if why:
            error = f"{error.rstrip('.')}: {why}"
    return LocalRun(ok=not error, run_dir=run_dir, log=log, error=error, tasks=tasks)


def task_outputs(run_dir: str, task: str) -> dict:
    """A task's outputs: parameters by name, artifacts as ``{"uri", "metadata"}`` (kfp.local keeps each
    task's executor output next to its outputs)."""
    found = {}
    for path in glob.glob(os.path.join(run_dir, task, "**", "executor_output.json"), recursive=True):
        with open(path) as f:
            out = json.load(f)
        for name, arts in (out.get("artifacts") or {}).items():
            for art in arts.get("artifacts", []):
                found[name] = {"uri": art.get("uri"), "metadata": art.get("metadata") or {}}
        for name, value in (out.get("parameterValues") or {}).items():
            found[name] = value
    return found


def verification_failure(run_dir: str) -> str:
    """The first failing check of the run's verification, if it failed."""
    if not run_dir:
        return ""
    report = task_outputs(run_dir, "verify-logits").get("report", {}).get("metadata", {})
    return report.get("first_failure", "") if report.get("passed") is False else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.run_local", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipeline", choices=sorted(VARIANTS), default="logit-distill")
    ap.add_argument("--root", default="local-runs", help="where the runs' outputs go (default local-runs/)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show every task's full log")
    ap.add_argument("params", nargs="*", metavar="param=value")
    args = ap.parse_args(argv)
    from pipelines import params

    variant = VARIANTS[args.pipeline]
    try:
        values = params.parse_pairs(args.params, variant)
        problems = params.check(values, variant)
        if problems:
            raise ValueError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    except ValueError as e:
        print(f"run_local: error: {e}", file=sys.stderr)
        return 2
    print(f"running {args.pipeline} under kfp.local ...", flush=True)
    result = run(args.pipeline, values, args.root, args.verbose)
    if result.log:
        print(f"full log: {result.log}")
    print(f"outputs:  {result.run_dir}")
    if not result.ok:
        print(f"run_local: error: {result.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
