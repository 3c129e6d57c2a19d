"""The verification report: ``VerifyReport`` (JSON and Markdown) and ``_Check``, one check's problems."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from .. import __version__
from ..outputs import REPORT_MARK, report_comment

CHECK_NAMES = ("manifest", "coverage", "integrity", "records", "data_alignment", "teacher_spot_check")
MAX_LISTED = 50  # problems listed per check in the report (all are counted)


@dataclasses.dataclass
class VerifyReport:
    """The outcome of ``verify_store``: every check (pass / fail / skipped) and the store's figures."""

    store: str
    checks: list[dict]
    figures: dict
    started_at: str
    logit_distill_version: str = __version__

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.checks)

    @property
    def failed_checks(self) -> list[dict]:
        return [c for c in self.checks if not c["passed"]]

    def check(self, name: str) -> dict:
        for c in self.checks:
            if c["name"] == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {
            "report": f"{REPORT_MARK} verify",  # recognised as replaceable by a later run (outputs.is_report)
            "store": self.store,
            "passed": self.passed,
            "checks": self.checks,
            "figures": self.figures,
            "started_at": self.started_at,
            "logit_distill_version": self.logit_distill_version,
        }

    def to_json(self) -> str:
        return json.dumps(_jsonable(self.to_dict()), indent=2, sort_keys=False) + "\n"

    def failure_line(self) -> str:
        """One line: the first failing check and its message (the others named), or a pass summary."""
        failed = self.failed_checks
        if not failed:
            ran = sum(1 for c in self.checks if c["status"] == "passed")
            return f"verify passed: {self.store}: {ran} checks passed ({self._figures_line()})"
        first = failed[0]
        line = f"verify failed: {first['name']}: {first['message']}"
        if len(failed) > 1:
            line += f" (also failed: {', '.join(c['name'] for c in failed[1:])})"
        return line

    def _figures_line(self) -> str:
        f = self.figures
        parts = []
        if "examples" in f:
            parts.append(f"{f['examples']} examples")
        if "bytes" in f:
            parts.append(f"{f['bytes'] / 1e6:.1f} MB")
        if "elapsed_s" in f:
            parts.append(f"{f['elapsed_s']:.1f} s")
        return ", ".join(parts)

    def markdown(self) -> str:
        """A summary for people (e.g. a KFP Markdown artifact in the Vertex UI)."""
        icon = {"passed": "✅ passed", "failed": "❌ FAILED", "skipped": "➖ skipped"}
        lines = [
            report_comment("verify"),
            f"# Logit store verification: {'PASSED' if self.passed else 'FAILED'}",
            "",
            f"Store: `{self.store}`  ",
            f"Verified at {self.started_at} by logit-distill {self.logit_distill_version}",
            "",
        ]
        if not self.passed:
            lines += [f"> **{self.failure_line()}**", ""]
        lines += ["| check | result | message |", "| --- | --- | --- |"]
        for c in self.checks:
            lines.append(f"| {c['name']} | {icon[c['status']]} | {_md_cell(c['message'])} |")
        lines += ["", "## Figures", "", "| figure | value |", "| --- | --- |"]
        for key, value in self.figures.items():
            if isinstance(value, dict):
                continue
            lines.append(f"| {key} | {_fmt(value)} |")
        for c in self.checks:
            problems = c["details"].get("problems") or []
            if c["status"] != "failed" or not problems:
                continue
            total = c["details"].get("num_problems", len(problems))
            lines += ["", f"## {c['name']}: {total} problem{'s' if total != 1 else ''}", ""]
            for p in problems[:MAX_LISTED]:
                lines.append(f"- {_md_cell(p['message'] if isinstance(p, dict) else str(p))}")
            if total > len(problems[:MAX_LISTED]):
                lines.append(f"- ... and {total - len(problems[:MAX_LISTED])} more")
        return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != value or math.isinf(value):
            return str(value)
        return f"{value:.6g}"
    return str(value)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and (obj != obj or math.isinf(obj)):
        return str(obj)
    return obj


class _Check:
    """Accumulates the problems of one check; caps the listed ones, counts all."""

    def __init__(self, name: str):
        self.name = name
        self.problems: list[dict] = []
        self.num_problems = 0
        self.by_kind: dict[str, int] = {}
        self.details: dict = {}
        self.skipped: str | None = None
        self.ok_message = ""

    def add(self, kind: str, message: str, **where) -> None:
        self.num_problems += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        if len(self.problems) < MAX_LISTED:
            self.problems.append({"kind": kind, "message": message, **where})

    def merge(self, problems: list[dict], num: int, by_kind: dict) -> None:
        room = MAX_LISTED - len(self.problems)
        self.problems.extend(problems[:max(0, room)])
        self.num_problems += num
        for k, v in by_kind.items():
            self.by_kind[k] = self.by_kind.get(k, 0) + v

    def skip(self, why: str) -> None:
        self.skipped = why

    def result(self) -> dict:
        if self.skipped is not None and not self.num_problems:
            status, message = "skipped", self.skipped
        elif self.num_problems:
            status = "failed"
            message = self.problems[0]["message"] if self.problems else f"{self.num_problems} problems"
            if self.num_problems > 1:
                message += f" (and {self.num_problems - 1} more problem{'s' if self.num_problems > 2 else ''})"
        else:
            status, message = "passed", self.ok_message or "ok"
        details = dict(self.details)
        if self.num_problems:
            details.update(num_problems=self.num_problems, by_kind=self.by_kind, problems=self.problems)
        return {"name": self.name, "passed": status != "failed", "status": status, "message": message,
                "details": details}
