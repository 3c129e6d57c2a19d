"""``logit-distill preset``."""

from __future__ import annotations

import argparse
import sys

HELP = "write a tiny built-in model (random weights) as an HF checkpoint directory"
DESCRIPTION = "Materialize a built-in preset (config.json, model.safetensors, tokenizer.json)."
FORMATTER = argparse.HelpFormatter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="preset name, e.g. tiny-qwen3 (see --list)")
    p.add_argument("--output", help="directory to write (required unless --list)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--list", action="store_true", help="list the presets and exit")


def run(args: argparse.Namespace) -> int:
    from ..errors import InputError
    from ..models import PRESETS, materialize_preset
    from ..outputs import check_output

    if args.list:
        for name in sorted(PRESETS):
            print(name)
        return 0
    if not args.name:
        raise InputError("give a preset name (logit-distill preset --list shows them)")
    if args.name not in PRESETS:
        raise InputError(f"unknown preset {args.name!r}; known: {', '.join(sorted(PRESETS))}")
    if args.output is None:
        raise InputError("--output is required: the directory to write the checkpoint to")
    check_output(args.output, "--output", kind="dir")
    path = materialize_preset(args.name, args.output, seed=args.seed)
    print(f"logit-distill preset: wrote {args.name} (seed {args.seed}) to {path}", file=sys.stderr)
    return 0
