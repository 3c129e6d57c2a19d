"""The command line: ``logit-distill verify`` (``register_cli``, ``cli_main``) and ``main``."""

from __future__ import annotations

import argparse
import os
import sys

from ..flags import nonnegative_float
from .run import DEFAULT_SAMPLE, verify_store


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add ``verify`` to an argparse ``subparsers``; its ``func(args)`` returns the exit status."""
    p = subparsers.add_parser(
        "verify",
        help="prove a logit store complete, intact and aligned; write a JSON and a Markdown report",
        description=(
            "Check a logit store: manifest, coverage (every step of every process, no gap/duplicate/foreign "
            "chunk), integrity (checksums, readability, record counts), every record (shapes, ids, sorted "
            "normalized log-probs, example index, token hash), optionally alignment with the data and a "
            "teacher spot check. Exit status 0 only when every check passes; otherwise 1, with the failing "
            "check's one-line message last on stderr (2: bad arguments)."
        ),
    )
    p.add_argument("--store", required=True, help="the store: a local path, file:// or gs:// URI")
    p.add_argument("--expected-steps", type=int, default=None,
                   help="fail unless the store's manifest holds exactly this many steps")
    p.add_argument("--data", default=None,
                   help="the dump's data (JSONL / ArrayRecord file, glob or directory): check that sampled "
                        "examples' tokens equal what the data pipeline produces for their indices")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or its directory for --data (default: the --teacher's)")
    p.add_argument("--teacher", default=None,
                   help="the teacher (HF checkpoint directory / gs:// URI, or preset:NAME) for the spot check")
    p.add_argument("--spot-check", type=int, default=0,
                   help="recompute the teacher on this many sampled examples and compare top-k within the codec's "
                        "bound (needs --teacher; default 0: no spot check)")
    p.add_argument("--spot-check-atol", type=nonnegative_float, default=None,
                   help="override the spot check's log-prob tolerance (default: 2**-11 + 1e-4 for the default "
                        "codec, 1e-4 for exact)")
    p.add_argument("--sample", type=int, default=DEFAULT_SAMPLE,
                   help="examples sampled for the --data alignment check, the first and last example included "
                        f"(default {DEFAULT_SAMPLE})")
    p.add_argument("--seed", type=int, default=0, help="seed of the example sample (default 0)")
    p.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)),
                   help="chunks checked in parallel, also the most chunks in flight (default: the CPU count, at most 8)")
    p.add_argument("--report-json", default=None, help="write the JSON report here (local path or gs://)")
    p.add_argument("--report-md", default=None, help="write the Markdown summary here (local path or gs://)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cli_main)
    return p


def cli_main(args) -> int:
    """Run ``verify`` from parsed arguments: print the summary, return 0 (passed) or 1 (failed).

    Bad input raises; ``logit_distill.cli.run`` turns it into one line and exit code 2."""
    report = verify_store(
        args.store, expected_steps=args.expected_steps, data=args.data, tokenizer=args.tokenizer,
        teacher=args.teacher, spot_check=args.spot_check, sample=args.sample, seed=args.seed,
        workers=args.workers, spot_check_atol=args.spot_check_atol, report_json=args.report_json,
        report_md=args.report_md, progress=not args.no_progress,
    )
    for c in report.checks:
        print(f"{c['name']:>20}: {c['status']:<7} {c['message']}")
    if report.passed:
        print(report.failure_line())
        return 0
    for c in report.failed_checks[1:]:
        print(f"verify failed: {c['name']}: {c['message']}", file=sys.stderr)
    print(report.failure_line(), file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m logit_distill.verify --store URI ...`` (the same as ``logit-distill verify``)."""
    from ..cli import OneLineParser

    parser = OneLineParser(prog="logit-distill")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["verify", *(sys.argv[1:] if argv is None else argv)])
    from ..cli import run as run_command

    return run_command(args, command="verify", debug=False)
