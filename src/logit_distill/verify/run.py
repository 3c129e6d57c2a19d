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
from ..errors import LogitDistillError, NotAStoreError
from ..outputs import check_output
from ..store import chunks as chunks_mod
from ..store import manifest as manifest_mod
from ..store.layout import StoreLayout
from ..models.specs import parse_model_spec
from ..store.reader import store_tokenizer
from .alignment import _check_data, _check_teacher, _prepare_source, _prepare_teacher, _sample
from .context import _ChunkResult, _Ctx
from .coverage import _check_coverage, _check_manifest
from .integrity import _check_chunk
from .config import VerifyConfig
from .report import CHECK_NAMES, VerifyReport, _Check

def verify_store(config: VerifyConfig) -> VerifyReport:
    """Verify the store ``config.store`` and return the report; write it to ``report_json`` / ``report_md``.

    ``data`` (+ ``tokenizer``, default the store's own copy of its tokenizer) checks ``sample``
    sampled examples against the data pipeline; ``teacher`` + ``spot_check`` recomputes the
    teacher on that many sampled examples. Never raises for a bad store: problems are failed
    checks. Raises InputError for bad arguments, and for a path that is no store at all.
    """
    t0 = time.perf_counter()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    config.check()
    paths.check_inputs_reachable(config.inputs)  # gs://: one line within seconds, not a minute of retries
    for flag, uri in (("--report-json", config.report_json), ("--report-md", config.report_md)):
        if uri is not None:
            check_output(uri, flag, kind="report", inputs=config.inputs)
    require_store(config.store)
    checks = {name: _Check(name) for name in CHECK_NAMES}
    figures: dict = {}

    manifest = _check_manifest(config.store, checks["manifest"])
    if manifest is None:
        for name in CHECK_NAMES[1:]:
            checks[name].skip("not run: the manifest is unusable")
    else:
        _verify_contents(config, manifest, checks, figures)
    figures["elapsed_s"] = time.perf_counter() - t0
    if figures.get("bytes") and figures["elapsed_s"] > 0:
        figures["mb_per_s"] = figures["bytes"] / 1e6 / figures["elapsed_s"]
    report = VerifyReport(store=config.store, checks=[checks[n].result() for n in CHECK_NAMES], figures=figures,
                          started_at=started)
    if config.report_json:
        paths.write_bytes_atomic(config.report_json, report.to_json().encode())
    if config.report_md:
        paths.write_bytes_atomic(config.report_md, report.markdown().encode())
    return report


def require_store(uri: str) -> None:
    """A path without a manifest is not a damaged store but the wrong path (exit 2, not 4)."""
    if not paths.exists(paths.join(uri, manifest_mod.MANIFEST_NAME)):
        where = "it does not exist" if not paths.exists(uri) else f"it holds no {manifest_mod.MANIFEST_NAME}"
        raise NotAStoreError(f"{uri} is not a logit store: {where}; give the folder a dump wrote")


def _verify_contents(config: VerifyConfig, manifest, checks, figures) -> None:
    uri, data, teacher = config.store, config.data, config.teacher
    try:
        scan = chunks_mod.scan(uri, manifest)
    except Exception as e:  # noqa: BLE001 - listing failed (network, permissions)
        checks["coverage"].add("unreadable", f"{uri}: cannot be listed ({type(e).__name__}: {e})")
        for name in CHECK_NAMES[2:]:
            checks[name].skip("not run: the store cannot be listed")
        return
    _check_coverage(uri, manifest, scan, config.expected_steps, checks["coverage"])

    shapes, layout = manifest["shapes"], manifest["layout"]
    codec_name = manifest["codec"]["name"]
    local = paths.is_local(uri)
    ctx = _Ctx(
        uri=uri, manifest=manifest, local=local,
        tmp_dir=None if local else tempfile.mkdtemp(prefix="logit-distill-verify-"),
        seq_len=shapes["seq_len"], top_k=shapes["top_k"], vocab=shapes["vocab_size"], codec=codec_name,
        id_bits=32 if codec_name == "exact" else codec_mod.id_bits_for(shapes["vocab_size"]),
        layout=StoreLayout.of(manifest),
        tag=manifest_mod.store_tag(manifest), on_records=lambda n: None, wanted={},
        masked=manifest_mod.masked_of(manifest),
    )
    # Every well-named chunk of this store is read, duplicates included; foreign ones are not.
    to_read = sorted([c for g in scan.duplicates for c in g[1:]] + list(scan.chunks.values()),
                     key=lambda c: (c.process, c.start, c.name))
    present = sorted(scan.chunks.values(), key=lambda c: (c.process, c.start))

    n_data = config.sample if data else 0
    n_teacher = config.spot_check if teacher else 0
    samples = _sample(ctx, present, max(n_data, n_teacher), config.seed)
    for g, chunk, record in samples:
        ctx.wanted.setdefault(chunk.name, {})[record] = g

    # Data and teacher load on a side thread while the chunks are read.
    side = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ld-verify-prep")
    src_future, teacher_future = _start_side_loads(side, config, manifest, n_teacher)
    results = _read_chunks(ctx, to_read, config)
    integrity, records = checks["integrity"], checks["records"]
    kept: dict = {}
    sums = {"positions": 0, "tokens": 0, "supervised": 0, "entropy": 0.0, "topk_mass": 0.0}
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
                          "example index, store tag, token hash"
                          + (f"; values at the {sums['supervised']} supervised positions only, every mask inside "
                             "its documents" if ctx.masked else ""))
    if not to_read:
        integrity.skip("no committed chunk to check")
        records.skip("no committed chunk to check")

    k = shapes["top_k"]
    valued = sums["supervised"] if ctx.masked else sums["positions"]  # the positions that hold values
    figures.update(
        examples=checked,
        examples_expected=layout["num_steps"] * layout["examples_per_step"],
        chunks=len(to_read),
        chunks_expected=scan.num_expected,
        positions=sums["positions"],
        tokens=sums["tokens"],
        supervised_positions=sums["supervised"],
        bytes=num_bytes,
        # per position (supervised ones, in a masked store) and per entry: the most ids a position holds
        # (top_k; a hybrid store: its head's k plus its N draws)
        bytes_per_position=num_bytes / max(1, valued) if checked else float("nan"),
        bytes_per_entry=num_bytes / max(1, valued * manifest_mod.entries_per_position(manifest))
        if checked else float("nan"),
        seq_len=shapes["seq_len"],
        top_k=k,
        vocab_size=shapes["vocab_size"],
        codec=codec_name,
        # top-k: -sum p log p over the top-k plus the tail as one outcome, a lower bound of the entropy;
        # sampled: the mean of -log p over the draws (unbiased at proposal temperature 1)
        **{"teacher_entropy_estimate_nats" if manifest_mod.selection_of(manifest) == "sampled"
           else "teacher_entropy_lower_bound_nats": sums["entropy"] / sums["tokens"] if sums["tokens"] else float("nan")},
        mean_topk_mass=sums["topk_mass"] / sums["tokens"] if sums["tokens"] else float("nan"),
    )

    _side_checks(config, ctx, checks, samples[:n_data], samples[:n_teacher], kept, src_future, teacher_future)
    side.shutdown(wait=True)


def _start_side_loads(side, config: VerifyConfig, manifest: dict, n_teacher: int):
    """Futures of (the data source for the alignment check, the teacher for the spot check), or None."""
    data, teacher = config.data, config.teacher
    src_future = teacher_future = None
    if data:
        tok = config.tokenizer or store_tokenizer(config.store, manifest)
        preset = teacher is not None and parse_model_spec(teacher).kind == "preset"
        if tok is None and teacher and not preset:
            tok = teacher
        if tok is None and preset:
            teacher_future = side.submit(_prepare_teacher, manifest, teacher)
            src_future = side.submit(lambda: _prepare_source(manifest, data, teacher_future.result().tokenizer_path))
        else:
            src_future = side.submit(_prepare_source, manifest, data, tok)
    if teacher and n_teacher and teacher_future is None:
        teacher_future = side.submit(_prepare_teacher, manifest, teacher)
    return src_future, teacher_future


def _read_chunks(ctx: _Ctx, to_read: list, config: VerifyConfig) -> list[_ChunkResult]:
    """Every chunk of ``to_read`` checked (integrity and records) on a thread pool, with a progress bar."""
    total_records = sum(ctx.expected_records(c) for c in to_read)
    bar = _progress_bar(config.progress, total_records, ctx.uri)
    lock = threading.Lock()

    def on_records(n: int) -> None:
        with lock:
            bar.update(n)

    ctx.on_records = on_records
    results: list[_ChunkResult] = []
    try:
        with cf.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="ld-verify") as pool:
            # At most `workers` chunks are in flight: each task downloads (if remote), hashes and checks one.
            for res in pool.map(lambda c: _check_chunk(ctx, c), to_read):
                results.append(res)
    finally:
        bar.close()
        if ctx.tmp_dir:
            shutil.rmtree(ctx.tmp_dir, ignore_errors=True)
    return results


def _side_checks(config: VerifyConfig, ctx: _Ctx, checks: dict, data_samples: list, teacher_samples: list,
                 kept: dict, src_future, teacher_future) -> None:
    """The data alignment and the teacher spot check, on the records kept while reading."""
    data, teacher = config.data, config.teacher
    # data alignment
    if not data:
        checks["data_alignment"].skip("no --data given")
    else:
        try:
            source, want = src_future.result()
            _check_data(ctx, source, want, data_samples, kept, checks["data_alignment"])
        except LogitDistillError as e:
            checks["data_alignment"].add("input", f"cannot rebuild the data pipeline: {e}")
        except Exception as e:  # noqa: BLE001
            checks["data_alignment"].add("error", f"cannot rebuild the data pipeline: {type(e).__name__}: {e}")

    # teacher spot check
    if not teacher:
        checks["teacher_spot_check"].skip("no --teacher given")
    elif not config.spot_check:
        checks["teacher_spot_check"].skip("--spot-check 0")
    else:
        try:
            loaded = teacher_future.result()
            _check_teacher(ctx, loaded, teacher_samples, kept, config.spot_check_atol,
                           checks["teacher_spot_check"])
        except LogitDistillError as e:
            checks["teacher_spot_check"].add("input", f"cannot load the teacher {teacher}: {e}")
        except Exception as e:  # noqa: BLE001
            checks["teacher_spot_check"].add("error", f"teacher spot check failed to run: {type(e).__name__}: {e}")


def _progress_bar(enabled: bool, total: int, uri: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="rec", desc="verify", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, postfix=paths.basename(uri), smoothing=0.1)
