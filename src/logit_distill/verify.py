"""Verify a logit store: prove it complete, intact and aligned. docs/VERIFY.md describes the checks.

``verify_store(uri, ...)`` runs the checks below, each reported by name with
the chunk / record it concerns, and returns a ``VerifyReport`` (JSON and
Markdown); ``register_cli`` adds ``logit-distill verify``.

  manifest            present, known format version, self-consistent
  coverage            committed chunks cover steps 0..N-1 of every process:
                      no gap, duplicate or foreign chunk; ``expected_steps``
  integrity           every chunk: SHA-256 against its name, readable, record count
  records             every record: header, shapes, dtypes, id ranges, distinct ids,
                      finite sorted log-probs <= 0, normalization with the tail,
                      example index, store tag and token hash
  data_alignment      (``data``) sampled examples' tokens equal the data pipeline's
  teacher_spot_check  (``teacher`` + ``spot_check``) the teacher recomputed on
                      sampled examples agrees within the codec's bound

Speed: the store is read once. Chunks are checked on a thread pool (numpy
releases the GIL), at most ``workers`` at a time; inside a chunk, records are
read and checked in batches of bounded size with vectorized numpy, so memory
stays bounded whatever the chunk size. A local chunk is hashed in a streaming
pass and then parsed by the ArrayRecord reader (which needs a path; the second
read hits the page cache); a remote chunk is downloaded once, hashed on the
way, parsed from the temporary copy and deleted. Records sampled for the data
and teacher checks are kept during that same pass.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from . import __version__
from . import codec as codec_mod
from . import paths
from .errors import InputError, LogitDistillError, StoreError
from .store import chunks as chunks_mod
from .store import manifest as manifest_mod

CHECK_NAMES = ("manifest", "coverage", "integrity", "records", "data_alignment", "teacher_spot_check")
MAX_LISTED = 50  # problems listed per check in the report (all are counted)
BATCH_BYTES = 32 << 20  # decoded bytes per record batch inside a chunk
DEFAULT_SAMPLE = 256
# Normalization tolerance: |logaddexp(logsumexp(top-k), tail)| (float32 log-softmax on device).
NORM_ATOL = 5e-4
POSITIVE_ATOL = 1e-6  # a log-prob may exceed 0 by float32 rounding only


# ----------------------------------------------------------------------------- report


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


# ----------------------------------------------------------------------------- the store's geometry


@dataclasses.dataclass
class _Ctx:
    uri: str
    manifest: dict
    local: bool
    tmp_dir: str | None
    seq_len: int
    top_k: int
    vocab: int
    codec: str
    id_bits: int
    B: int  # examples per step
    b: int  # examples per step and process
    tag: int
    on_records: Any  # progress callback(n)
    wanted: dict  # chunk name -> {record: global index} kept for the data / teacher checks

    def global_index(self, chunk: chunks_mod.ChunkInfo, record) -> Any:
        """Global example index of record(s) ``record`` of ``chunk`` (works on arrays)."""
        step = chunk.start + record // self.b
        return step * self.B + chunk.process * self.b + record % self.b

    def expected_records(self, chunk: chunks_mod.ChunkInfo) -> int:
        return (chunk.end - chunk.start) * self.b

    def chunk_uri(self, chunk) -> str:
        return paths.join(self.uri, chunk.name)


@dataclasses.dataclass
class _ChunkResult:
    chunk: chunks_mod.ChunkInfo
    size: int = 0
    records_checked: int = 0
    integrity: list = dataclasses.field(default_factory=list)  # (kind, message, where)
    records: _Check = dataclasses.field(default_factory=lambda: _Check("records"))
    kept: dict = dataclasses.field(default_factory=dict)  # global index -> (record dict, record no)
    sums: dict = dataclasses.field(default_factory=lambda: {
        "positions": 0, "tokens": 0, "entropy": 0.0, "topk_mass": 0.0})


def _sha256_stream(read_block, sink=None) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    for block in iter(read_block, b""):
        h.update(block)
        size += len(block)
        if sink is not None:
            sink.write(block)
    return h.hexdigest(), size


def _fetch_and_hash(ctx: _Ctx, chunk) -> tuple[str, str, int, bool]:
    """(local path, sha256, size, is_temporary): the file is read exactly once from its store."""
    uri = ctx.chunk_uri(chunk)
    if ctx.local:
        path = paths.local_path(uri)
        with open(path, "rb") as f:
            digest, size = _sha256_stream(lambda: f.read(1 << 22))
        return path, digest, size, False
    fs, remote = paths.url_to_fs(uri)
    path = os.path.join(ctx.tmp_dir, chunk.name)
    with fs.open(remote, "rb", block_size=1 << 23) as src, open(path, "wb") as dst:
        digest, size = _sha256_stream(lambda: src.read(1 << 23), dst)
    return path, digest, size, True


def _check_chunk(ctx: _Ctx, chunk: chunks_mod.ChunkInfo) -> _ChunkResult:
    from array_record.python.array_record_module import ArrayRecordReader

    res = _ChunkResult(chunk)
    uri = ctx.chunk_uri(chunk)
    where = {"chunk": chunk.name}
    expected = ctx.expected_records(chunk)
    path, temporary = None, False
    try:
        try:
            path, digest, res.size, temporary = _fetch_and_hash(ctx, chunk)
        except Exception as e:  # noqa: BLE001 - vanished file, network error, permissions
            res.integrity.append(("unreadable", f"{uri}: cannot be read ({type(e).__name__}: {e})", where))
            ctx.on_records(expected)
            return res
        if digest[:16] != chunk.checksum:
            res.integrity.append((
                "checksum",
                f"{uri}: checksum mismatch: the file ({res.size} bytes) has SHA-256 {digest[:16]}..., its name "
                f"says {chunk.checksum}; the chunk is corrupt or truncated; delete it and re-run the dump",
                where,
            ))
        try:
            reader = ArrayRecordReader(path)
            if not reader.ok():  # a damaged file opens, reports not ok, and raises its reason on close
                _close(reader)
        except Exception as e:  # noqa: BLE001 - the C++ reader raises plain errors
            res.integrity.append(("unreadable", f"{uri}: not a readable ArrayRecord file, truncated or corrupt "
                                                f"({res.size} bytes; {_short(e)})", where))
            ctx.on_records(expected)
            return res
        try:
            n = reader.num_records()
            if n != expected:
                res.integrity.append(("record_count", f"{uri}: holds {n} records, expected {expected} "
                                                      f"(steps [{chunk.start}, {chunk.end}) x {ctx.b}); "
                                                      "truncated or of another layout", where))
            per_record = ctx.seq_len * (ctx.top_k * 8 + 24)
            batch = int(max(1, min(1024, BATCH_BYTES // per_record)))
            for first in range(0, n, batch):
                last = min(n, first + batch)
                try:
                    raws = reader.read(first, last)
                except Exception as e:  # noqa: BLE001 - a damaged file surfaces here
                    res.integrity.append(("unreadable", f"{uri}: records {first}..{last - 1} cannot be read "
                                                        f"({_short(e)}); the chunk is corrupt", where))
                    ctx.on_records(max(0, expected - first))
                    break
                _check_batch(ctx, chunk, first, raws, res)
                ctx.on_records(last - first)
            else:
                if n < expected:
                    ctx.on_records(expected - n)
        finally:
            try:
                reader.close()
            except Exception as e:  # noqa: BLE001 - corruption found while reading surfaces here
                res.integrity.append(("unreadable", f"{uri}: corrupt ArrayRecord file ({_short(e)})", where))
    except Exception as e:  # noqa: BLE001 - never lose the whole run to one chunk
        res.integrity.append(("error", f"{uri}: {type(e).__name__}: {e}", where))
    finally:
        if temporary and path and os.path.exists(path):
            os.remove(path)
    return res


def _close(reader) -> None:
    """Close a reader that is not ok: raises the reader's error (ArrayRecord reports it on close)."""
    reader.close()
    raise RuntimeError("the ArrayRecord reader is not ok")


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def _check_batch(ctx: _Ctx, chunk, first: int, raws: list[bytes], res: _ChunkResult) -> None:
    """Decode a batch of records and check them with vectorized numpy."""
    n, L, k, V = len(raws), ctx.seq_len, ctx.top_k, ctx.vocab
    uri = ctx.chunk_uri(chunk)
    chk = res.records
    ids = np.zeros((n, L, k), np.int32)
    lp = np.zeros((n, L, k), np.float32)
    tail = np.zeros((n, L), np.float32)
    tokens = np.zeros((n, L), np.int32)
    seg = np.zeros((n, L), np.int32)
    index = np.zeros(n, np.int64)
    tags = np.zeros(n, np.int64)
    ok = np.ones(n, bool)
    dtype_ok = True
    wanted = ctx.wanted.get(chunk.name, {})
    expected_index = ctx.global_index(chunk, np.arange(first, first + n, dtype=np.int64))

    def where(i: int, position: int | None = None) -> dict:
        w = {"chunk": chunk.name, "record": int(first + i), "example": int(expected_index[i])}
        if position is not None:
            w["position"] = int(position)
        return w

    def label(i: int) -> str:
        return f"{uri} record {first + i} (example {int(expected_index[i])})"

    for i, raw in enumerate(raws):
        try:
            h = codec_mod.decode_header(raw)
            bad = [f"{key} {h[key]} (manifest: {want})" for key, want in (
                ("codec", ctx.codec), ("seq_len", L), ("top_k", k), ("id_bits", ctx.id_bits)) if h[key] != want]
            if bad:
                chk.add("header", f"{label(i)}: header says {', '.join(bad)}: a record of another configuration",
                        **where(i))
                ok[i] = False
                continue
            rec = codec_mod.decode_record(raw)
        except StoreError as e:
            chk.add("decode", f"{label(i)}: cannot be decoded: {e}", **where(i))
            ok[i] = False
            continue
        if codec_mod.token_hash(rec["tokens"]).hex() != rec["token_hash"]:
            chk.add("token_hash", f"{label(i)}: token hash does not match its tokens (corrupt tokens)", **where(i))
        if rec["topk_ids"].shape != (L, k) or rec["topk_logprobs"].shape != (L, k) or rec["tokens"].shape != (L,):
            chk.add("shape", f"{label(i)}: shapes topk_ids {rec['topk_ids'].shape}, topk_logprobs "
                             f"{rec['topk_logprobs'].shape}, tokens {rec['tokens'].shape}; manifest says "
                             f"{(L, k)}", **where(i))
            ok[i] = False
            continue
        dtype_ok &= (rec["topk_ids"].dtype == np.int32 and rec["tokens"].dtype == np.int32
                     and rec["topk_logprobs"].dtype == np.float32 and rec["tail_logprob"].dtype == np.float32)
        ids[i], lp[i], tail[i] = rec["topk_ids"], rec["topk_logprobs"], rec["tail_logprob"]
        tokens[i], seg[i] = rec["tokens"], rec["segment_ids"]
        index[i], tags[i] = int(rec["example_index"]), int(rec["store_tag"])
        g = wanted.get(first + i)
        if g is not None:
            res.kept[g] = (rec, first + i)
    if not dtype_ok:
        chk.add("dtype", f"{uri}: records {first}..{first + n - 1} decode to unexpected dtypes", chunk=chunk.name)

    # Record-level fields.
    for i in np.flatnonzero(ok & (index != expected_index)):
        chk.add("example_index", f"{label(i)}: holds example {int(index[i])}; its position in the store is "
                                 f"example {int(expected_index[i])} (misplaced or shifted records)", **where(i))
    for i in np.flatnonzero(ok & (tags != ctx.tag)):
        chk.add("store_tag", f"{label(i)}: belongs to another store (tag {int(tags[i]):08x}, this store's is "
                             f"{ctx.tag:08x}): a chunk of another configuration was copied in", **where(i))

    # Position-level checks: [n, L] masks, few passes over the [n, L, k] arrays.
    # Ids as uint32: a negative id becomes >= 2**31, so one comparison checks [0, V). After a
    # sort (needed for distinctness) the range check reads only the last column.
    s = np.sort(ids.view(np.uint32), axis=-1)
    per_position = {
        "token_range": (tokens.view(np.uint32) >= V, f"token id outside [0, {V})"),
        "id_range": (s[..., -1] >= V, f"top-k id outside [0, {V})"),
        "id_distinct": ((s[..., 1:] == s[..., :-1]).any(-1), "repeated top-k id"),
    }
    del s
    if ctx.codec == "exact":
        # The default codec's fixed point decodes to finite values in [-64, 0] by construction.
        per_position["logprob_finite"] = (~np.isfinite(lp).all(-1), "non-finite top-k log-prob")
        per_position["logprob_positive"] = (lp[..., 0] > POSITIVE_ATOL, "largest top-k log-prob > 0")
    per_position["logprob_sorted"] = ((lp[..., 1:] > lp[..., :-1]).any(-1), "top-k log-probs not sorted descending")
    per_position["tail"] = (np.isnan(tail) | (tail > POSITIVE_ATOL), "tail log-prob NaN or > 0")
    with np.errstate(all="ignore"):
        p = np.exp(lp)
        mass = p.sum(-1)
        lse = np.log(mass)
        norm_atol = NORM_ATOL + (codec_mod.LOGPROB_MAX_ERROR if ctx.codec == "default" else 0.0)
        # NaN fails these comparisons, so a NaN anywhere in a position is caught here too.
        per_position["topk_mass"] = (~(lse <= norm_atol), f"logsumexp(top-k) > 0 (beyond {norm_atol:.1e})")
        total = np.logaddexp(lse, tail)
        per_position["normalization"] = (
            ~(np.abs(total) <= norm_atol),
            f"top-k and tail mass do not sum to 1 (|logaddexp(logsumexp(top-k), tail)| > {norm_atol:.1e})",
        )
        any_bad = np.zeros((n, L), bool)
        for mask, _ in per_position.values():
            any_bad |= mask
        any_bad &= ok[:, None]
        if any_bad.any():
            for kind, (mask, text) in per_position.items():
                for i in np.flatnonzero(ok & mask.any(-1)):
                    pos = int(np.argmax(mask[i]))
                    chk.add(kind, f"{label(i)}: {text} at position {pos}", **where(i, pos))

        # Figures over real tokens (segment_ids != 0) of decodable records whose position passed.
        # Entropy estimate from the top-k: -sum p log p over the top-k, plus -P_tail log P_tail
        # (the tail as one outcome): a lower bound of the teacher's entropy.
        use = (seg != 0) & ~any_bad & ok[:, None]
        ent = -np.vecdot(p, lp) - np.exp(tail) * np.where(np.isfinite(tail), tail, 0.0)
        res.sums["positions"] += int(ok.sum()) * L
        res.sums["tokens"] += int(use.sum())
        res.sums["entropy"] += float(ent[use].sum(dtype=np.float64))
        res.sums["topk_mass"] += float(mass[use].sum(dtype=np.float64))
    res.records_checked += int(ok.sum())


# ----------------------------------------------------------------------------- checks


def _check_manifest(uri: str, chk: _Check) -> dict | None:
    manifest_uri = paths.join(uri, manifest_mod.MANIFEST_NAME)
    try:
        if not paths.exists(manifest_uri):
            what = "does not exist" if not paths.exists(uri) else f"has no {manifest_mod.MANIFEST_NAME}"
            chk.add("missing", f"{uri} is not a logit store: it {what}", file=manifest_uri)
            return None
        manifest = manifest_mod.parse_manifest(paths.read_bytes(manifest_uri), manifest_uri)
    except StoreError as e:
        chk.add("invalid", str(e), file=manifest_uri)
        return None
    except Exception as e:  # noqa: BLE001 - unreachable bucket, permissions
        chk.add("unreadable", f"{manifest_uri}: cannot be read ({type(e).__name__}: {e})", file=manifest_uri)
        return None
    content = manifest.get("content") or {}
    data = content.get("data") if isinstance(content, dict) else None
    if isinstance(data, dict) and data.get("seq_len") not in (None, manifest["shapes"]["seq_len"]):
        chk.add("inconsistent", f"{manifest_uri}: content.data.seq_len {data.get('seq_len')} differs from "
                                f"shapes.seq_len {manifest['shapes']['seq_len']}", file=manifest_uri)
    dtype = content.get("teacher_dtype") if isinstance(content, dict) else None
    if dtype not in (None, "float32", "bfloat16"):
        chk.add("inconsistent", f"{manifest_uri}: unknown content.teacher_dtype {dtype!r}", file=manifest_uri)
    layout, shapes = manifest["layout"], manifest["shapes"]
    chk.details = {
        "format_version": manifest["format_version"], "fingerprint": manifest["fingerprint"],
        "dump_key": manifest_mod.dump_key(manifest), "shapes": shapes, "layout": layout,
        "codec": manifest["codec"]["name"],
    }
    chk.ok_message = (f"format version {manifest['format_version']}, fingerprint {manifest_mod.dump_key(manifest)}, "
                      f"{layout['num_steps']} steps x {layout['examples_per_step']} examples, seq_len "
                      f"{shapes['seq_len']}, top_k {shapes['top_k']}, codec {manifest['codec']['name']}")
    return manifest


def _check_coverage(uri: str, manifest: dict, scan: chunks_mod.ScanResult, expected_steps: int | None,
                    chk: _Check) -> None:
    layout = manifest["layout"]
    n = layout["num_steps"]
    if expected_steps is not None and int(expected_steps) != n:
        chk.add("expected_steps", f"{uri}: the manifest says {n} steps, --expected-steps says {expected_steps}",
                file=manifest_mod.MANIFEST_NAME)
    for process, ranges in sorted(scan.missing.items()):
        for start, end in ranges:
            chk.add("missing", f"{uri}: missing steps [{start}, {end}) of process {process}: no committed chunk "
                               f"covers them (a gap: re-run the dump to fill it)", process=process, steps=[start, end])
    for group in scan.duplicates:
        names = ", ".join(c.name for c in group)
        c = group[0]
        chk.add("duplicate", f"{uri}: several committed chunks for process {c.process} steps [{c.start}, {c.end}): "
                             f"{names}; delete the wrong one", process=c.process, steps=[c.start, c.end],
                files=[c.name for c in group])
    tag = manifest["fingerprint"][:8]
    valid = set(chunks_mod.expected_ranges(manifest))
    for c in scan.foreign:
        if c.tag != tag:
            why = f"its tag {c.tag} is not this store's {tag}: a chunk of another store configuration"
        elif c.process >= layout["num_processes"]:
            why = f"process {c.process} is outside the store's {layout['num_processes']} processes"
        elif (c.start, c.end) not in valid:
            why = f"steps [{c.start}, {c.end}) are not a chunk range of this layout (steps_per_file " \
                  f"{layout['steps_per_file']}, num_steps {n})"
        else:
            why = "unexpected"
        chk.add("foreign", f"{paths.join(uri, c.name)}: foreign chunk: {why}", chunk=c.name)
    chk.details = {
        "num_steps": n, "num_processes": layout["num_processes"], "chunks_expected": scan.num_expected,
        "chunks_present": scan.num_present,
        "missing": {str(p): [list(r) for r in rs] for p, rs in scan.missing.items() if rs},
        "duplicates": [[c.name for c in g] for g in scan.duplicates],
        "foreign": [c.name for c in scan.foreign],
        "leftovers": list(scan.leftovers),
    }
    chk.ok_message = f"{scan.num_present} of {scan.num_expected} chunks cover steps 0..{n - 1} of " \
                     f"{layout['num_processes']} process{'es' if layout['num_processes'] > 1 else ''}"
    if scan.leftovers:
        chk.ok_message += f"; {len(scan.leftovers)} leftover file(s) not part of the store: " + \
            ", ".join(scan.leftovers[:5]) + (" ..." if len(scan.leftovers) > 5 else "")


def _sample(ctx: _Ctx, present: list[chunks_mod.ChunkInfo], count: int, seed: int) -> list[tuple]:
    """Up to ``count`` (global index, chunk, record), the first and last present example first, then random."""
    if count <= 0 or not present:
        return []
    sizes = np.array([ctx.expected_records(c) for c in present], np.int64)
    total = int(sizes.sum())
    count = min(count, total)
    rng = np.random.default_rng(seed)
    picks = [0, total - 1] if total > 1 else [0]
    if count > len(picks):
        rest = rng.choice(total, size=min(total, count + 2), replace=False)
        picks += [int(x) for x in rest if x not in (0, total - 1)]
    picks = list(dict.fromkeys(picks))[:count]
    ends = np.cumsum(sizes)
    out = []
    for flat in picks:
        ci = int(np.searchsorted(ends, flat, side="right"))
        record = flat - (int(ends[ci - 1]) if ci else 0)
        out.append((int(ctx.global_index(present[ci], record)), present[ci], int(record)))
    return out


def _prepare_source(manifest: dict, data: str, tokenizer: str | None):
    from .data import ExampleSource

    content = manifest.get("content") or {}
    want = content.get("data") if isinstance(content, dict) else None
    if not isinstance(want, dict):
        raise InputError("the manifest records no data settings (content.data): the store was not written by "
                         "`logit-distill dump`, so the data order cannot be rebuilt")
    source = ExampleSource.open(
        data, tokenizer, seq_len=manifest["shapes"]["seq_len"], packing=bool(want.get("packing", True)),
        seed=int(want.get("seed", 0)), text_field=want.get("text_field") or "text",
    )
    return source, want


def _check_data(ctx: _Ctx, source, want: dict, samples: list, kept: dict, chk: _Check) -> None:
    have = source.identity
    # Only the fields the store recorded are compared (the dump may leave derived counts out).
    differ = sorted(k for k in want if want[k] != have.get(k, "<absent>"))
    for key in differ:
        chk.add("identity", f"data identity differs from the store's manifest: {key}: store has "
                            f"{want.get(key, '<absent>')!r}, --data gives {have.get(key, '<absent>')!r}", field=key)
    needed = ctx.manifest["layout"]["num_steps"] * ctx.B
    if len(source) < needed:
        chk.add("length", f"--data gives {len(source)} examples, the store holds {needed}")
    checked = mismatched = 0
    for g, chunk, record in samples:
        if g not in kept:
            continue  # undecodable: reported by `records`
        rec = kept[g][0]
        if g >= len(source):
            continue
        want_ex = source[g]
        checked += 1
        for key in ("tokens", "segment_ids", "positions"):
            diff = np.flatnonzero(want_ex[key] != rec[key])
            if diff.size:
                mismatched += 1
                chk.add("tokens", f"{ctx.chunk_uri(chunk)} record {record} (example {g}): {key} differ from the "
                                  f"data pipeline's at {diff.size} of {ctx.seq_len} positions (first at {int(diff[0])})",
                        chunk=chunk.name, record=record, example=g, field=key)
                break
    chk.details.update(examples_compared=checked, examples_mismatched=mismatched, identity_differs=differ)
    chk.ok_message = f"{checked} sampled examples equal the data pipeline's; data identity matches the manifest"


def _prepare_teacher(manifest: dict, teacher: str):
    from .models import load_model

    content = manifest.get("content") or {}
    dtype = content.get("teacher_dtype") or "float32"
    return load_model(teacher, dtype=dtype)


def _spot_fn(apply, k: int):
    import jax
    import jax.numpy as jnp

    from .topk import select_topk

    @jax.jit
    def fn(params, tokens, positions, segment_ids, stored_ids):
        logits = apply(params, tokens, positions, segment_ids).astype(jnp.float32)
        out = select_topk(logits, k)
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        out["stored_ids_logprob"] = jnp.take_along_axis(logits, stored_ids, axis=-1) - lse
        return out

    return fn


def _check_teacher(ctx: _Ctx, loaded, samples: list, kept: dict, atol: float | None, chk: _Check) -> None:
    content = ctx.manifest.get("content") or {}
    want_id = content.get("teacher") if isinstance(content, dict) else None
    if isinstance(want_id, dict) and want_id != loaded.identity:
        keys = sorted(k for k in set(want_id) | set(loaded.identity) if want_id.get(k) != loaded.identity.get(k))
        chk.add("identity", f"the teacher's identity differs from the store's manifest in {', '.join(keys)} "
                            f"(store: {json.dumps(want_id, sort_keys=True)[:200]}); is it the dump's teacher?")
    if loaded.vocab_size != ctx.vocab:
        chk.add("vocab", f"the teacher's vocabulary has {loaded.vocab_size} entries, the store's {ctx.vocab}")
        return
    bound = atol if atol is not None else (
        codec_mod.LOGPROB_MAX_ERROR + 1e-4 if ctx.codec == "default" else 1e-4)
    todo = [(g, chunk, record) for g, chunk, record in samples if g in kept]
    if not todo:
        chk.add("nothing", "no sampled example could be decoded (see records)")
        return
    fn = _spot_fn(loaded.apply, ctx.top_k)
    bs = min(8, len(todo))
    floor = codec_mod.LOGPROB_FLOOR if ctx.codec == "default" else -np.inf
    max_err, id_agree, id_total, positions_bad = 0.0, 0, 0, 0
    for first in range(0, len(todo), bs):
        group = todo[first:first + bs]
        recs = [kept[g][0] for g, _, _ in group]
        recs += [recs[-1]] * (bs - len(recs))  # one shape, one compilation
        stack = {key: np.stack([r[key] for r in recs]) for key in
                 ("tokens", "positions", "segment_ids", "topk_ids", "topk_logprobs", "tail_logprob")}
        stored_ids = np.clip(stack["topk_ids"], 0, ctx.vocab - 1).astype(np.int32)
        out = fn(loaded.params, stack["tokens"], stack["positions"], stack["segment_ids"], stored_ids)
        out = {key: np.asarray(v) for key, v in out.items()}
        for j, (g, chunk, record) in enumerate(group):
            t_top = np.maximum(out["topk_logprobs"][j], floor)
            t_at_stored = np.maximum(out["stored_ids_logprob"][j], floor)
            t_tail = np.maximum(out["tail_logprob"][j], floor)
            with np.errstate(invalid="ignore"):
                # The stored log-prob of each stored id, and ids equal except at ties: where the ids
                # differ, the teacher's log-probs of both ids are within the bound.
                d_value = np.abs(stack["topk_logprobs"][j] - t_at_stored)
                d_ids = np.abs(t_at_stored - t_top)
                d_tail = np.where(stack["tail_logprob"][j] == t_tail, 0.0, np.abs(stack["tail_logprob"][j] - t_tail))
            err = np.maximum(np.maximum(d_value, d_ids).max(-1), d_tail)
            err = np.where(np.isnan(err), np.inf, err)
            id_agree += int((stack["topk_ids"][j] == out["topk_ids"][j]).sum())
            id_total += stack["topk_ids"][j].size
            max_err = max(max_err, float(err.max()))
            bad = np.flatnonzero(err > bound)
            positions_bad += int(bad.size)
            if bad.size:
                pos = int(bad[0])
                chk.add("mismatch", f"{ctx.chunk_uri(chunk)} record {record} (example {g}): {bad.size} of "
                                    f"{ctx.seq_len} positions differ from the recomputed teacher (first at position "
                                    f"{pos}: |Δ log-prob| {float(err[pos]):.3g} > bound {bound:.2g}); logits "
                                    "misaligned with the tokens, or another teacher",
                        chunk=chunk.name, record=record, example=g, position=pos)
    chk.details.update(examples_compared=len(todo), bound=bound, max_abs_error=max_err,
                       id_agreement=id_agree / max(1, id_total), positions_mismatched=positions_bad)
    chk.ok_message = (f"{len(todo)} sampled examples agree with the recomputed teacher (max |Δ log-prob| "
                      f"{max_err:.2g} <= {bound:.2g}; ids equal at {100 * id_agree / max(1, id_total):.2f}%, "
                      "the rest ties)")


# ----------------------------------------------------------------------------- the function


def verify_store(
    store_uri: str,
    *,
    expected_steps: int | None = None,
    data: str | None = None,
    tokenizer: str | None = None,
    teacher: str | None = None,
    spot_check: int = 0,
    sample: int = DEFAULT_SAMPLE,
    seed: int = 0,
    workers: int = 2,
    spot_check_atol: float | None = None,
    report_json: str | None = None,
    report_md: str | None = None,
    progress: bool = True,
) -> VerifyReport:
    """Verify the store at ``store_uri`` and return the report; write it to ``report_json`` / ``report_md``.

    ``data`` (+ ``tokenizer``, default the teacher's tokenizer) checks ``sample`` sampled examples
    against the data pipeline; ``teacher`` + ``spot_check`` recomputes the teacher on that many
    sampled examples. Never raises for a bad store: problems are failed checks. Raises InputError
    for bad arguments.
    """
    t0 = time.perf_counter()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if spot_check and not teacher:
        raise InputError("--spot-check needs --teacher (the teacher checkpoint or preset:NAME)")
    if spot_check < 0 or sample < 0 or workers < 1:
        raise InputError(f"spot_check and sample must be >= 0 and workers >= 1 (got {spot_check}, {sample}, "
                         f"{workers})")
    if tokenizer and not data:
        raise InputError("--tokenizer is only used with --data")
    checks = {name: _Check(name) for name in CHECK_NAMES}
    figures: dict = {}

    manifest = _check_manifest(store_uri, checks["manifest"])
    if manifest is None:
        for name in CHECK_NAMES[1:]:
            checks[name].skip("not run: the manifest is unusable")
    else:
        _verify_contents(store_uri, manifest, checks, figures, expected_steps=expected_steps, data=data,
                         tokenizer=tokenizer, teacher=teacher, spot_check=spot_check, sample=sample,
                         seed=seed, workers=workers, atol=spot_check_atol, progress=progress)
    figures["elapsed_s"] = time.perf_counter() - t0
    if figures.get("bytes") and figures["elapsed_s"] > 0:
        figures["mb_per_s"] = figures["bytes"] / 1e6 / figures["elapsed_s"]
    report = VerifyReport(store=store_uri, checks=[checks[n].result() for n in CHECK_NAMES], figures=figures,
                          started_at=started)
    if report_json:
        paths.write_bytes_atomic(report_json, report.to_json().encode())
    if report_md:
        paths.write_bytes_atomic(report_md, report.markdown().encode())
    return report


def _verify_contents(uri, manifest, checks, figures, *, expected_steps, data, tokenizer, teacher, spot_check,
                     sample, seed, workers, atol, progress) -> None:
    try:
        scan = chunks_mod.scan(uri, manifest)
    except Exception as e:  # noqa: BLE001 - listing failed (network, permissions)
        checks["coverage"].add("unreadable", f"{uri}: cannot be listed ({type(e).__name__}: {e})")
        for name in CHECK_NAMES[2:]:
            checks[name].skip("not run: the store cannot be listed")
        return
    _check_coverage(uri, manifest, scan, expected_steps, checks["coverage"])

    shapes, layout = manifest["shapes"], manifest["layout"]
    codec_name = manifest["codec"]["name"]
    local = paths.is_local(uri)
    ctx = _Ctx(
        uri=uri, manifest=manifest, local=local,
        tmp_dir=None if local else tempfile.mkdtemp(prefix="logit-distill-verify-"),
        seq_len=shapes["seq_len"], top_k=shapes["top_k"], vocab=shapes["vocab_size"], codec=codec_name,
        id_bits=32 if codec_name == "exact" else codec_mod.id_bits_for(shapes["vocab_size"]),
        B=layout["examples_per_step"], b=layout["examples_per_step"] // layout["num_processes"],
        tag=manifest_mod.store_tag(manifest), on_records=lambda n: None, wanted={},
    )
    # Every well-named chunk of this store is read, duplicates included; foreign ones are not.
    to_read = sorted([c for g in scan.duplicates for c in g[1:]] + list(scan.chunks.values()),
                     key=lambda c: (c.process, c.start, c.name))
    present = sorted(scan.chunks.values(), key=lambda c: (c.process, c.start))

    n_data = sample if data else 0
    n_teacher = spot_check if teacher else 0
    samples = _sample(ctx, present, max(n_data, n_teacher), seed)
    for g, chunk, record in samples:
        ctx.wanted.setdefault(chunk.name, {})[record] = g

    # Data and teacher load on a side thread while the chunks are read.
    side = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ld-verify-prep")
    src_future = teacher_future = None
    if data:
        tok = tokenizer
        if tok is None and teacher:
            tok = teacher if not teacher.startswith("preset:") else None
        if tok is None and teacher and teacher.startswith("preset:"):
            teacher_future = side.submit(_prepare_teacher, manifest, teacher)
            src_future = side.submit(lambda: _prepare_source(manifest, data, teacher_future.result().tokenizer_path))
        else:
            src_future = side.submit(_prepare_source, manifest, data, tok)
    if teacher and n_teacher and teacher_future is None:
        teacher_future = side.submit(_prepare_teacher, manifest, teacher)

    total_records = sum(ctx.expected_records(c) for c in to_read)
    bar = _progress_bar(progress, total_records, uri)
    lock = threading.Lock()

    def on_records(n: int) -> None:
        with lock:
            bar.update(n)

    ctx.on_records = on_records
    results: list[_ChunkResult] = []
    try:
        with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ld-verify") as pool:
            # At most `workers` chunks are in flight: each task downloads (if remote), hashes and checks one.
            for res in pool.map(lambda c: _check_chunk(ctx, c), to_read):
                results.append(res)
    finally:
        bar.close()
        if ctx.tmp_dir:
            shutil.rmtree(ctx.tmp_dir, ignore_errors=True)

    integrity, records = checks["integrity"], checks["records"]
    kept: dict = {}
    sums = {"positions": 0, "tokens": 0, "entropy": 0.0, "topk_mass": 0.0}
    num_bytes = checked = 0
    for res in results:
        for kind, message, where in res.integrity:
            integrity.add(kind, message, **where)
        records.merge(res.records.problems, res.records.num_problems, res.records.by_kind)
        kept.update(res.kept)
        for key in sums:
            sums[key] += res.sums[key]
        num_bytes += res.size
        checked += res.records_checked
    integrity.details = {"chunks_checked": len(to_read), "bytes": num_bytes}
    integrity.ok_message = f"{len(to_read)} chunks: checksums match, readable, expected record counts"
    records.details = {"records_checked": checked}
    records.ok_message = (f"{checked} records: header, shapes, dtypes, ids, sorted finite log-probs, normalization, "
                          "example index, store tag, token hash")
    if not to_read:
        integrity.skip("no committed chunk to check")
        records.skip("no committed chunk to check")

    k = shapes["top_k"]
    figures.update(
        examples=checked,
        examples_expected=layout["num_steps"] * layout["examples_per_step"],
        chunks=len(to_read),
        chunks_expected=scan.num_expected,
        positions=sums["positions"],
        tokens=sums["tokens"],
        bytes=num_bytes,
        bytes_per_entry=num_bytes / max(1, sums["positions"] * k) if checked else float("nan"),
        seq_len=shapes["seq_len"],
        top_k=k,
        vocab_size=shapes["vocab_size"],
        codec=codec_name,
        mean_teacher_entropy_nats=sums["entropy"] / sums["tokens"] if sums["tokens"] else float("nan"),
        mean_topk_mass=sums["topk_mass"] / sums["tokens"] if sums["tokens"] else float("nan"),
    )

    # data alignment
    if not data:
        checks["data_alignment"].skip("skipped: no --data given")
    else:
        try:
            source, want = src_future.result()
            _check_data(ctx, source, want, samples[:n_data], kept, checks["data_alignment"])
        except LogitDistillError as e:
            checks["data_alignment"].add("input", f"cannot rebuild the data pipeline: {e}")
        except Exception as e:  # noqa: BLE001
            checks["data_alignment"].add("error", f"cannot rebuild the data pipeline: {type(e).__name__}: {e}")

    # teacher spot check
    if not teacher:
        checks["teacher_spot_check"].skip("skipped: no --teacher given")
    elif not n_teacher:
        checks["teacher_spot_check"].skip("skipped: --spot-check 0")
    else:
        try:
            loaded = teacher_future.result()
            _check_teacher(ctx, loaded, samples[:n_teacher], kept, atol, checks["teacher_spot_check"])
        except LogitDistillError as e:
            checks["teacher_spot_check"].add("input", f"cannot load the teacher {teacher}: {e}")
        except Exception as e:  # noqa: BLE001
            checks["teacher_spot_check"].add("error", f"teacher spot check failed to run: {type(e).__name__}: {e}")
    side.shutdown(wait=True)


def _progress_bar(enabled: bool, total: int, uri: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="rec", desc="verify", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, postfix=paths.basename(uri), smoothing=0.1)


# ----------------------------------------------------------------------------- CLI


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
    p.add_argument("--spot-check-atol", type=float, default=None,
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
    """Run ``verify`` from parsed arguments: print the summary, return 0 (passed), 1 (failed) or 2 (bad input)."""
    try:
        report = verify_store(
            args.store, expected_steps=args.expected_steps, data=args.data, tokenizer=args.tokenizer,
            teacher=args.teacher, spot_check=args.spot_check, sample=args.sample, seed=args.seed,
            workers=args.workers, spot_check_atol=args.spot_check_atol, report_json=args.report_json,
            report_md=args.report_md, progress=not args.no_progress,
        )
    except InputError as e:
        print(f"logit-distill verify: error: {e}", file=sys.stderr)
        return 2
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
    parser = argparse.ArgumentParser(prog="logit-distill")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["verify", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
