"""``logit-distill dump|verify|train|preset``: every stage as a command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback


def _register_preset(subparsers) -> None:
    p = subparsers.add_parser(
        "preset", help="write a tiny built-in model (random weights) as an HF checkpoint directory",
        description="Materialize a built-in preset (config.json, model.safetensors, tokenizer.json).",
    )
    p.add_argument("name", help="preset name, e.g. tiny-qwen3 (see --list)")
    p.add_argument("--output", required=True, help="directory to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.set_defaults(func=_preset_main)


def _preset_main(args) -> int:
    from .errors import InputError
    from .models import PRESETS, materialize_preset
    from .outputs import check_output

    if args.name not in PRESETS:
        raise InputError(f"unknown preset {args.name!r}; known: {', '.join(sorted(PRESETS))}")
    check_output(args.output, "--output", kind="dir")
    print(materialize_preset(args.name, args.output, seed=args.seed))
    return 0


COMMANDS = ("dump", "verify", "train", "preset")


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block), like every other failure
    (docs/ERRORS.md); ``--help`` still prints the usage. Sub-commands inherit it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    from . import dump
    from .train import register_cli as register_train
    from .verify import register_cli as register_verify

    parser = OneLineParser(
        prog="logit-distill",
        description="Offline knowledge distillation: dump a teacher's top-k log-probs once, "
                    "verify the store, train students from it.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (INFO level)")
    parser.add_argument("--debug", action="store_true",
                        help="on failure, print the full traceback before the one-line error (docs/ERRORS.md)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dump.register_cli(sub)
    register_verify(sub)
    register_train(sub)
    _register_preset(sub)
    for p in sub.choices.values():  # also accepted after the command
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on failure, print the full traceback before the one-line error")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    given = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in given if a in COMMANDS), None)  # named even if Ctrl-C comes while parsing
    debug = "--debug" in given
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command, debug = args.command, bool(getattr(args, "debug", False))
        logging.basicConfig(
            level=logging.DEBUG if debug else logging.INFO if args.verbose else logging.WARNING,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
        code = run(args, command=command, debug=debug)
    except KeyboardInterrupt as e:  # Ctrl-C while parsing or importing
        code = report_failure(command, e, debug)
    if argv is None:  # the program itself, not a caller in Python
        _keep_exit_code_on_interrupt()
    return code


def _keep_exit_code_on_interrupt() -> None:
    """Once the command's outcome is known, a Ctrl-C during the interpreter's teardown (JAX, gcsfs and
    thread clean-up take a moment) must not turn it into a death by SIGINT. SIG_IGN, unlike a Python
    handler, is not reset to the default by the interpreter's finalization, so it covers all of it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _import_jax_holding_interrupts() -> None:
    """Import JAX with Ctrl-C held, then act on it: a KeyboardInterrupt raised in the middle of
    importing JAX's native modules can abort the interpreter (SIGABRT/SIGSEGV) instead of ending the
    command with one line and exit 130. Imports only: the backend starts later (multi-host jobs must
    join their peers first)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        import jax  # noqa: F401
        import jax.numpy  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def run(args, *, command: str, debug: bool = False) -> int:
    """Run a parsed command: its exit status, or one line on stderr and a documented exit code."""
    if not debug:
        quiet_libraries()
    try:
        if command in ("dump", "verify", "train"):
            _import_jax_holding_interrupts()
        return args.func(args)
    except BaseException as e:  # noqa: BLE001 - every failure ends as one line (see docs/ERRORS.md)
        if isinstance(e, SystemExit):
            raise
        return report_failure(command, e, debug)


def report_failure(command: str | None, e: BaseException, debug: bool) -> int:
    """Print ``logit-distill <command>: error: ...`` (one line) for ``e``; return its exit code."""
    from .failures import describe

    code, line = describe(e)
    if debug:
        traceback.print_exception(e)
    prefix = f"logit-distill {command}" if command else "logit-distill"
    print(f"{prefix}: {line}", file=sys.stderr, flush=True)
    return code


def quiet_libraries() -> None:
    """Keep the storage clients' loggers off stderr: gcsfs logs a whole traceback per retry, and the
    failure that matters reaches the user as one line anyway. --debug shows them."""
    for name in ("gcsfs", "fsspec", "google.auth", "google.api_core", "urllib3", "aiohttp"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


if __name__ == "__main__":
    sys.exit(main())
