"""``logit-distill verify``."""

from __future__ import annotations

import argparse
import os
import sys

from ..verify.config import DEFAULT_SAMPLE
from .flags import add_output_arguments, nonnegative_float

HELP = "prove a logit store complete, intact and aligned; write a JSON and a Markdown report"
DESCRIPTION = (
    "Check a logit store: manifest, coverage (every step of every process, no gap/duplicate/foreign chunk), "
    "integrity (checksums, readability, record counts), every record (shapes, ids, sorted normalized "
    "log-probs, example index, token hash), optionally alignment with the data and a teacher spot check. "
    "Exit status 0 only when every check passes; otherwise 1, with the failing check's one-line message last "
    "on stderr (2: bad arguments or a path that is no store)."
)
FORMATTER = argparse.HelpFormatter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help="the store: a local path, file:// or gs:// URI")
    p.add_argument("--expected-steps", type=int, default=None,
                   help="fail unless the store's manifest holds exactly this many steps")
    p.add_argument("--data", default=None,
                   help="the dump's data (JSONL / ArrayRecord file, glob or directory): check that sampled "
                        "examples' tokens equal what the data pipeline produces for their indices")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or its directory for --data (default: the store's own copy)")
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
    p.add_argument("--report-json", default=None,
                   help="write the JSON report here (local path or gs://); an existing file is replaced only if "
                        "it is a report logit-distill wrote")
    p.add_argument("--report-md", default=None, help="write the Markdown summary here (the same rule)")
    add_output_arguments(p, json_help="print the JSON report on stdout")


def config_from_args(args: argparse.Namespace):
    from ..verify import VerifyConfig

    return VerifyConfig(
        store=args.store, expected_steps=args.expected_steps, data=args.data, tokenizer=args.tokenizer,
        teacher=args.teacher, spot_check=args.spot_check, spot_check_atol=args.spot_check_atol, sample=args.sample,
        seed=args.seed, workers=args.workers, report_json=args.report_json, report_md=args.report_md,
        progress=args.progress,
    )


def run(args: argparse.Namespace) -> int:
    """Each check on a line, then the summary (stderr); 0 when every check passed, else 1."""
    from ..verify import verify_store

    report = verify_store(config_from_args(args).check())
    for c in report.checks:
        print(f"logit-distill verify: {c['name']:>18}: {c['status']:<7} {c['message']}", file=sys.stderr)
    if args.json:
        print(report.to_json(), end="")
    for c in report.failed_checks[1:]:
        print(f"logit-distill verify: failed: {c['name']}: {c['message']}", file=sys.stderr)
    # the last line: "passed: ..." or the first failing check's "failed: <check>: <message>"
    print(f"logit-distill verify: {report.failure_line().removeprefix('verify ')}", file=sys.stderr, flush=True)
    return 0 if report.passed else 1
