"""``python -m bench.run [--full] [--only KEY[,KEY]]``: measure the figures, write bench/results.json,
regenerate docs/BENCHMARKS.md.

Every figure is a ratio of two things measured side by side in this one run (interleaved, repeated,
medians), so that a machine shared with other work still gives comparable numbers. The default sizes
take about 8 minutes on 2 AMD EPYC cores (over an hour on the slower Intel Xeon kind: its matmuls run
at a tenth of the rate); ``--full`` uses larger sizes and more repeats.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
import traceback

from . import common

common.setup_environment()  # before logit_distill, jax or gcsfs are imported

from .sizes import SIZES  # noqa: E402 - sizes per mode, shared with the groups' own entry points

# key -> (group that measures it). A group runs once if any of its keys is wanted.
KEYS = {
    "dump_overhead_ratio": "dump",
    "dump_overhead_ratio_gcs": "dump",
    "bytes_per_entry": "dump",
    "codec_max_abs_logprob_error": "dump",
    "selection_overhead_ratio": "selection",
    "resume_time_ratio_10k_chunks": "resume",
    "train_overhead_ratio": "train",
    "online_over_offline_step_ratio": "train",
    "loader_over_train_throughput": "train",
    "verify_over_decode_ratio": "verify",
    "kd_vs_ce_heldout": "kd",
    "fidelity": "fidelity",
    "teacher_flop_utilization_1024": "teacher",
    "teacher_flop_utilization_4096": "teacher",
    "attention_temp_bytes_ratio_8192_over_2048": "teacher",
    "load_over_read_ratio": "teacher",
    "moe_teacher_flop_utilization": "teacher",
    "moe_over_dense_step_ratio": "teacher",
    "chat_prepare_over_plain_tokenize": "chat",
    "chat_store_bytes_ratio": "chat",
}
ORDER = ["selection", "dump", "resume", "verify", "train", "kd", "fidelity", "teacher", "chat"]


def _run_group(group: str, size: dict, want: set) -> dict:
    if group == "selection":
        from .dump_bench import selection

        return selection(size)
    if group == "dump":
        from .dump_bench import dump

        return dump(size, want)
    if group == "resume":
        from .dump_bench import resume

        return resume(size)
    if group == "verify":
        from .train_bench import verify

        return verify(size)
    if group == "train":
        from .train_bench import train

        return train(size)
    if group == "kd":
        from .train_bench import kd_vs_ce

        return kd_vs_ce(size)
    if group == "fidelity":
        from .fidelity_bench import fidelity

        return fidelity(size)
    if group == "teacher":
        from .teacher_bench import teacher

        return teacher(size, want)
    if group == "chat":
        from .chat_bench import prepare, store_bytes

        return {**prepare(size), **store_bytes(size)}
    raise ValueError(group)


def _runs_behind(old_meta: dict, measured: set) -> list[dict]:
    """The earlier runs whose figures a partial run keeps: each with the keys it still provides."""
    runs = old_meta.get("runs") or [{"command": old_meta.get("command", "?"), "date": old_meta.get("date", "?"),
                                     "wall_s": old_meta.get("wall_s", 0.0), "keys": sorted(KEYS)}]
    kept = []
    for run in runs:
        keys = [k for k in run["keys"] if k not in measured]
        if keys:
            kept.append({**run, "keys": keys})
    return kept


def _meta(args, argv, started: float) -> dict:
    import jax

    devices = jax.devices()
    return {
        "command": "python -m bench.run" + (" " + " ".join(argv) if argv else ""),
        "mode": "device" if args.device else "full" if args.full else "quick",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax_version": jax.__version__,
        "jax_backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "load_average_start": list(os.getloadavg()),
        "started_unix": started,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="larger sizes and more repeats (longer)")
    p.add_argument("--device", action="store_true",
                   help="accelerator sizes (with --only teacher: a 1.7B bfloat16 teacher at L=4096)")
    p.add_argument("--only", default=None, help="comma-separated keys (or groups) to measure: "
                   + ", ".join(list(KEYS) + ORDER))
    p.add_argument("--results", default=os.path.join(common.ROOT, "bench", "results.json"))
    p.add_argument("--doc", default=os.path.join(common.ROOT, "docs", "BENCHMARKS.md"))
    p.add_argument("--no-doc", action="store_true", help="do not regenerate docs/BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.only:
        want = set()
        for item in args.only.split(","):
            item = item.strip()
            if item in KEYS:
                want.add(item)
            elif item in ORDER:
                want |= {k for k, g in KEYS.items() if g == item}
            else:
                p.error(f"unknown key {item!r}; known: {', '.join(list(KEYS) + ORDER)}")
    else:
        want = set(KEYS)
    size = SIZES["device" if args.device else "full" if args.full else "quick"]

    started = time.time()
    common.enable_compile_cache()
    meta = _meta(args, argv, started)
    results: dict = {}
    errors: dict = {}
    for group in ORDER:
        keys = {k for k in want if KEYS[k] == group}
        if not keys:
            continue
        common.log(f"== {group}: {', '.join(sorted(keys))}")
        t0 = time.perf_counter()
        try:
            out = _run_group(group, size, keys)
        except Exception as e:  # noqa: BLE001 - one failed group must not lose the others' figures
            traceback.print_exc()
            errors[group] = f"{type(e).__name__}: {e}"
            continue
        for key, value in out.items():
            if key in keys:
                results[key] = value
                common.log(f"   {key} = {_short(value['value'])}")
        common.log(f"   {group} took {time.perf_counter() - t0:.0f} s")
    meta["wall_s"] = time.time() - started
    meta["load_average_end"] = list(os.getloadavg())
    meta["size"] = size
    if errors:
        meta["errors"] = errors

    this_run = {"command": meta["command"], "date": meta["date"], "wall_s": meta["wall_s"], "keys": sorted(results)}
    meta["runs"] = [this_run]
    doc = {"meta": meta, **{k: results[k] for k in KEYS if k in results}}
    if args.only and os.path.exists(args.results):  # a subset updates the earlier full results
        try:
            with open(args.results) as f:
                old = json.load(f)
            merged = {k: v for k, v in old.items() if k != "meta"}
            merged.update({k: v for k, v in doc.items() if k != "meta"})
            meta["runs"] = _runs_behind(old.get("meta", {}), set(results)) + [this_run]
            doc = {"meta": {**meta, "partial_update_of": old.get("meta", {}).get("date")}, **merged}
        except (OSError, ValueError):
            pass
    with open(args.results, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False, default=float)
        f.write("\n")
    common.log(f"wrote {args.results} ({meta['wall_s']:.0f} s)")
    if not args.no_doc:
        from .report import write_markdown

        write_markdown(doc, args.doc)
        common.log(f"wrote {args.doc}")
    return 1 if errors else 0


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_short(v)}" for k, v in value.items())
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
