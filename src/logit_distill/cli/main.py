"""``main(argv)``: parse, set up logging, run the command, and end every failure as one line.

Every command reports the same way: progress and messages on stderr, one short summary at the end
(also on stderr), machine-readable results in files or, with ``--json``, on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from .parser import OneLineParser

COMMANDS = ("dump", "verify", "train", "preset")  # a module of this package each
JAX_COMMANDS = ("dump", "verify", "train")


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="logit-distill",
        description="Offline knowledge distillation: dump a teacher's top-k log-probs once, "
                    "verify the store, train students from it.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (INFO level)")
    parser.add_argument("--debug", action="store_true",
                        help="on failure, print the full traceback before the one-line error (docs/ERRORS.md)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f".{name}", __package__)
        p = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION,
                           formatter_class=module.FORMATTER)
        module.add_arguments(p)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,  # also after the command
                       help="on failure, print the full traceback before the one-line error")
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``logit-distill`` with ``argv`` (default: the process's arguments); returns the exit status."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    given = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in given if a in COMMANDS), None)  # named even if Ctrl-C comes while parsing
    debug = "--debug" in given
    try:
        with interrupts_as_sigint():
            parser = build_parser()
            args = parser.parse_args(given)
            command, debug = args.command, bool(getattr(args, "debug", False))
            logging.basicConfig(
                level=logging.DEBUG if debug else logging.INFO if args.verbose else logging.WARNING,
                format="%(asctime)s %(name)s %(levelname)s %(message)s",
            )
            from ..logs import configure

            configure(verbose=args.verbose or debug)
            code = run(args, command=command, debug=debug)
    except KeyboardInterrupt as e:  # Ctrl-C while parsing or importing
        code = report_failure(command, e, debug)
    if argv is None:  # the program itself, not a caller in Python
        keep_exit_code_on_interrupt()
        if code == 130:
            leave_now(code)
    return code


def leave_now(code: int) -> None:
    """End an interrupted program at once: what it committed is on disk and its line is printed, while
    the interpreter's teardown, with JAX's and the loaders' threads stopped mid-work, can crash
    (SIGSEGV) and lose the exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class interrupts_as_sigint:
    """While active, SIGTERM (a preemption, ``kill``) raises KeyboardInterrupt like Ctrl-C, so that both
    end the same way: one line and exit 130 (docs/ERRORS.md). Long jobs install their own handler
    (``signals.StopOnSignal``) to stop at a safe point; it takes over while it is active."""

    def __enter__(self):
        import signal
        import threading

        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def __exit__(self, *exc):
        import signal

        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _raise_interrupt(signum, frame):
    from ..signals import SignalInterrupt

    raise SignalInterrupt(signum)


def keep_exit_code_on_interrupt() -> None:
    """Once the command's outcome is known, a Ctrl-C during the interpreter's teardown (JAX, gcsfs and
    thread clean-up take a moment) must not turn it into a death by SIGINT. SIG_IGN, unlike a Python
    handler, is not reset to the default by the interpreter's finalization, so it covers all of it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def import_jax_holding_interrupts() -> None:
    """Import JAX with Ctrl-C held, then act on it: a KeyboardInterrupt raised in the middle of
    importing JAX's native modules can abort the interpreter (SIGABRT/SIGSEGV) instead of ending the
    command with one line and exit 130. Imports only: the backend starts later (multi-host jobs must
    join their peers first)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    held = []
    previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        import jax  # noqa: F401
        import jax.numpy  # noqa: F401
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        from ..signals import SignalInterrupt

        raise SignalInterrupt(held[0])


def run(args, *, command: str, debug: bool = False) -> int:
    """Run a parsed command: its exit status, or one line on stderr and a documented exit code."""
    if not debug:
        quiet_libraries()
    try:
        from ..logs import warn_unknown_environment

        warn_unknown_environment(command)
        if command in JAX_COMMANDS:
            import_jax_holding_interrupts()
        return args.func(args)
    except BaseException as e:  # noqa: BLE001 - every failure ends as one line (see docs/ERRORS.md)
        if isinstance(e, SystemExit):
            raise
        return report_failure(command, e, debug)


def report_failure(command: str | None, e: BaseException, debug: bool) -> int:
    """Print ``logit-distill <command>: error: ...`` (one line) for ``e``; return its exit code."""
    from ..failures import describe

    code, line = describe(e)
    if debug:
        traceback.print_exception(e)
    prefix = f"logit-distill {command}" if command else "logit-distill"
    print(f"{prefix}: {line}", file=sys.stderr, flush=True)
    return code


def quiet_libraries() -> None:
    """Keep the storage clients' and Orbax's loggers off stderr: gcsfs logs a whole traceback per retry,
    Orbax's save threads one per failed write, and the failure that matters reaches the user as one
    line anyway. --debug shows them."""
    for name in ("gcsfs", "fsspec", "google.auth", "google.api_core", "urllib3", "aiohttp", "absl", "orbax"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
