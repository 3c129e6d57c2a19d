"""``verify_store``: the parallel streaming read of the store and the orchestration of the checks."""

from __future__ import annotations

import concurrent.futures as cf
import datetime as _dt
import shutil
import sys
import tempfile
import threading
import time

from .. import codec as codec_mod
from .. import paths
from ..errors import InputError, LogitDistillError
from ..store import chunks as chunks_mod
from ..store import manifest as manifest_mod
from .alignment import _check_data, _check_teacher, _prepare_source, _prepare_teacher, _sample
from .context import _ChunkResult, _Ctx
from .coverage import _check_coverage, _check_manifest
from .integrity import _check_chunk
from .report import CHECK_NAMES, VerifyReport, _Check

DEFAULT_SAMPLE = 256


def _check_report_paths(store_uri, report_json, report_md, **inputs) -> None:
    """Reports never land on an input, inside a store (the verified one included) or on a folder."""
    from ..outputs import check_output

    given = {"--store": store_uri, **{f"--{k}": v for k, v in inputs.items()}}
    for flag, uri in (("--report-json", report_json), ("--report-md", report_md)):
        if uri is not None:
            check_output(uri, flag, kind="file", inputs=given)
    if report_json is not None and report_md is not None and report_json.strip() == report_md.strip():
        raise InputError(f"--report-json and --report-md are both {report_json}; give two different files")


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
    # gs://: one line within seconds, not a minute of retries
    paths.check_inputs_reachable({"--store": store_uri, "--data": data, "--tokenizer": tokenizer, "--teacher": teacher})
    _check_report_paths(store_uri, report_json, report_md, data=data, tokenizer=tokenizer, teacher=teacher)
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
