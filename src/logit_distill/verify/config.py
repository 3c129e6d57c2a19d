"""Verify's settings: one frozen ``VerifyConfig`` whose ``check()`` validates them before any read."""

from __future__ import annotations

import dataclasses
import math

from ..errors import InputError

DEFAULT_SAMPLE = 256


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    store: str  # local path, file:// or gs:// URI
    expected_steps: int | None = None  # fail unless the manifest holds exactly this many steps
    data: str | None = None  # the dump's data: sampled examples' tokens against the data pipeline
    tokenizer: str | None = None  # for ``data`` (default: the store's own tokenizer.json)
    teacher: str | None = None  # for the spot check
    spot_check: int = 0  # examples recomputed with the teacher
    spot_check_atol: float | None = None  # default: the codec's bound
    sample: int = DEFAULT_SAMPLE  # examples compared with the data
    seed: int = 0  # of the example sample
    workers: int = 2  # chunks checked in parallel
    report_json: str | None = None
    report_md: str | None = None
    progress: bool = True

    def check(self) -> "VerifyConfig":
        if self.store is None or not str(self.store).strip():
            raise InputError("--store is empty; give the store's path or gs:// URI")
        for name, low in (("spot_check", 0), ("sample", 0), ("seed", 0), ("workers", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.expected_steps is not None and (not isinstance(self.expected_steps, int) or self.expected_steps < 1):
            raise InputError(f"--expected-steps must be an integer >= 1, got {self.expected_steps!r}")
        if self.spot_check and not self.teacher:
            raise InputError("--spot-check needs --teacher (the teacher checkpoint or preset:NAME)")
        if self.spot_check_atol is not None and not (math.isfinite(self.spot_check_atol) and self.spot_check_atol >= 0):
            raise InputError(f"--spot-check-atol must be a finite number >= 0, got {self.spot_check_atol!r}")
        if self.tokenizer and not self.data:
            raise InputError("--tokenizer is only used with --data")
        for flag, uri in (("--report-json", self.report_json), ("--report-md", self.report_md)):
            if uri is not None and not str(uri).strip():
                raise InputError(f"{flag} is empty; give a file path")
        if self.report_json is not None and self.report_md is not None and \
                self.report_json.strip() == self.report_md.strip():
            raise InputError(f"--report-json and --report-md are both {self.report_json}; give two different files")
        return self

    @property
    def inputs(self) -> dict:
        """The input paths by flag (a report must not land on one of them)."""
        return {"--store": self.store, "--data": self.data, "--tokenizer": self.tokenizer, "--teacher": self.teacher}
