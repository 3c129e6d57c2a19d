"""``logit-distill dump|verify|train|preset``: every stage as a command."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .errors import LogitDistillError
from .signals import Interrupted


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
    from .models import PRESETS, materialize_preset

    if args.name not in PRESETS:
        print(f"unknown preset {args.name!r}; known: {', '.join(sorted(PRESETS))}", file=sys.stderr)
        return 2
    print(materialize_preset(args.name, args.output, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import dump
    from .train import register_cli as register_train
    from .verify import register_cli as register_verify

    parser = argparse.ArgumentParser(
        prog="logit-distill",
        description="Offline knowledge distillation: dump a teacher's top-k log-probs once, "
                    "verify the store, train students from it.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    dump.register_cli(sub)
    register_verify(sub)
    register_train(sub)
    _register_preset(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return args.func(args)
    except Interrupted as e:
        print(f"logit-distill {args.command}: interrupted: {e}", file=sys.stderr)
        return 130
    except LogitDistillError as e:
        print(f"logit-distill {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
