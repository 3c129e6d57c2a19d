"""Dump figures: dump_overhead_ratio (local and GCS emulator), bytes_per_entry, codec error,
selection_overhead_ratio, resume_time_ratio_10k_chunks."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid

import numpy as np

from . import common
from .common import BENCH_TEACHER, log


# ----------------------------------------------------------------------------- selection


def teacher_logsumexp(apply):
    """Forward + logsumexp only: the baseline of the selection-cost benchmark."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def teacher_lse(params, tokens, positions, segment_ids):
        return jax.nn.logsumexp(apply(params, tokens, positions, segment_ids).astype(jnp.float32), axis=-1)

    return teacher_lse


def selection(size: dict) -> dict:
    """(forward + top-k) / (forward + logsumexp) of the bench teacher on one [1, L] example."""
    import jax
    import jax.numpy as jnp

    from logit_distill.selection import make_teacher_topk

    L, k = size["selection_seq_len"], 64
    model = common.build(BENCH_TEACHER, 0)
    params = jax.device_put(model.params)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, BENCH_TEACHER["vocab_size"], (1, L), dtype=np.int32))
    positions = jnp.arange(L, dtype=jnp.int32)[None]
    segment_ids = jnp.ones((1, L), jnp.int32)
    topk_fn = make_teacher_topk(model.apply, k)
    lse_fn = teacher_logsumexp(model.apply)
    index = jnp.zeros((1,), jnp.int32)
    fns = {
        "forward_topk": lambda: jax.block_until_ready(topk_fn(params, tokens, positions, segment_ids, index)),
        "forward_logsumexp": lambda: jax.block_until_ready(lse_fn(params, tokens, positions, segment_ids)),
    }
    for fn in fns.values():  # compile
        fn()
        fn()
    times = common.interleave(fns, size["selection_repeats"])
    return {
        "selection_overhead_ratio": {
            "value": common.ratio(times, "forward_topk", "forward_logsumexp"),
            "details": {
                "teacher": "Qwen3-style, 8 layers, width 512, vocab 32000, random weights",
                "seq_len": L, "top_k": k, "batch": 1,
                "forward_topk": common.summary(times["forward_topk"]),
                "forward_logsumexp": common.summary(times["forward_logsumexp"]),
                "tokens_per_s_forward_topk": L / common.median(times["forward_topk"]),
            },
        }
    }


# ----------------------------------------------------------------------------- dump


def _dump_setup(size: dict) -> tuple:
    from logit_distill.data import write_pretokenized
    from logit_distill.dump import DumpConfig

    L, B, N, S = size["dump_seq_len"], size["dump_batch"], size["dump_steps"], size["dump_steps_per_file"]
    teacher = common.save_checkpoint(BENCH_TEACHER, 0, os.path.join(common.OUT, "models", "bench-teacher"))
    need = int(N * B * L * 1.2)
    docs = common.random_documents(max(8, need // 300), BENCH_TEACHER["vocab_size"], 100, 500, seed=1)
    os.makedirs(os.path.join(common.OUT, "data"), exist_ok=True)
    data = write_pretokenized(os.path.join(common.OUT, "data", f"dump-{need}.array_record"), docs)
    config = DumpConfig(teacher=teacher, data=data, output="", selection="topk", top_k=64, seq_len=L,
                        batch_size=B, num_steps=N, steps_per_file=S, codec="default", progress=False)
    return config


def dump(size: dict, want: set) -> dict:
    """The dump (run_dump: scan, compute, encode, write, commit) against the same compute with nothing
    written (the same loading + TeacherStep over the same batches, outputs fetched to host), interleaved."""
    from logit_distill.dump import TeacherStep, run_dump
    from logit_distill.dump.run import load_teacher_and_data
    from logit_distill.dump.teacher_step import dump_mesh

    config = _dump_setup(size)
    L, B, N = config.seq_len, config.batch_size, config.num_steps
    tokens_run = N * B * L
    use_gcs = "dump_overhead_ratio_gcs" in want
    loops: dict[str, list[float]] = {"dump_local": [], "dump_gcs": [], "compute_only": []}
    kept: dict[int, dict] = {}
    last = {}

    def compute_only():
        mesh = dump_mesh(config)
        teacher, source, plan = load_teacher_and_data(config, mesh)
        manifest = plan.manifest
        t0 = time.perf_counter()  # the span run_dump's tokens_per_s covers: from building the TeacherStep
        compute = TeacherStep(teacher, config, mesh)
        pending = None

        def finish(item):
            step, local, out = item
            compute.nonfinite(out)  # run_dump's finite check: scalars over the whole batch
            records = compute.fetch(out)
            records.update(local)  # kept for the codec figures (every pass computes the same records)
            records["example_index"] = np.arange(step * B, (step + 1) * B, dtype=np.int64)
            kept[step] = records

        for step in range(N):  # run_dump's loop: dispatch step s, then fetch step s - 1
            local = source.batch(range(step * B, (step + 1) * B))
            out = compute.dispatch(local, np.arange(step * B, (step + 1) * B))
            if pending is not None:
                finish(pending)
            pending = (step, local, out)
        finish(pending)
        loops["compute_only"].append(time.perf_counter() - t0)
        last["manifest"] = manifest

    def dump_to(kind: str, uri: str):
        result = run_dump(dataclasses.replace(config, output=uri))
        assert result.complete and result.steps_run == N, result
        loops[f"dump_{kind}"].append(tokens_run / result.tokens_per_s)
        last[kind] = result

    local_root = common.fresh_dir("dump")
    counter = iter(range(10**6))

    def local_uri():
        return os.path.join(local_root, f"store-{next(counter)}")

    results: dict = {}
    with (common.gcs_emulator() if use_gcs else _null()):
        bucket = common.make_bucket(f"bench-{uuid.uuid4().hex[:8]}") if use_gcs else None
        fns = {"dump_local": lambda: dump_to("local", local_uri()), "compute_only": compute_only}
        if use_gcs:
            fns["dump_gcs"] = lambda: dump_to("gcs", f"{bucket}/store-{next(counter)}")
        log(f"dump: warm-up ({', '.join(fns)})")
        for fn in fns.values():
            fn()
        for v in loops.values():
            v.clear()
        log(f"dump: {size['dump_repeats']} interleaved rounds of {N} steps x {B} examples x {L} tokens")
        walls = common.interleave(fns, size["dump_repeats"])

    detail_common = {
        "teacher": "bench teacher (Qwen3-style, 8 layers, width 512, vocab 32000)",
        "seq_len": L, "batch_size": B, "num_steps": N, "steps_per_file": config.steps_per_file, "top_k": 64,
        "chunks": -(-N // config.steps_per_file),
        "compute_only_loop": common.summary(loops["compute_only"]),
        "compute_only_wall": common.summary(walls["compute_only"]),
        "compute_only_tokens_per_s": tokens_run / common.median(loops["compute_only"]),
    }
    for kind in ("local", "gcs"):
        if not loops[f"dump_{kind}"]:
            continue
        key = "dump_overhead_ratio" + ("" if kind == "local" else "_gcs")
        results[key] = {
            "value": common.paired_ratio(loops[f"dump_{kind}"], loops["compute_only"]),
            "details": {
                **detail_common,
                "storage": "local disk" if kind == "local" else "gcp-storage-emulator on loopback (in memory)",
                "dump_loop": common.summary(loops[f"dump_{kind}"]),
                "dump_wall": common.summary(walls[f"dump_{kind}"]),
                "end_to_end_ratio": common.ratio(walls, f"dump_{kind}", "compute_only"),
                "dump_tokens_per_s": tokens_run / common.median(loops[f"dump_{kind}"]),
            },
        }
    store_path = last["local"].store
    results.update(_codec_figures(config, store_path, kept, last["manifest"]))
    return results


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _tile(kept: dict, B: int, steps: int, B_out: int) -> dict:
    """The kept examples repeated (example_index renumbered) into ``steps`` steps of ``B_out``."""
    flat = [{key: v[o] for key, v in kept[s].items()} for s in sorted(kept) for o in range(B)]
    out = {}
    for step in range(steps):
        rows = [flat[(step * B_out + o) % len(flat)] for o in range(B_out)]
        rec = {key: np.stack([r[key] for r in rows]) for key in rows[0]}
        rec["example_index"] = np.arange(step * B_out, (step + 1) * B_out, dtype=np.int64)
        out[step] = rec
    return out


def _codec_figures(config, store_path: str, kept: dict, manifest: dict) -> dict:
    """bytes_per_entry of the same records in each layout, and the default codec's error.

    The records are the dump's; the size figures use them in the dump's default layout (8 examples
    per step, 50 steps per chunk): ArrayRecord pads each file to 64 KiB blocks, which is noise on a
    chunk of tens of MB but +18% on the benchmark dump's own 0.45 MB chunks (reported as well)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from logit_distill import codec as codec_mod
    from logit_distill import store as store_mod
    from logit_distill.dump import DumpConfig

    L, B, N, k = config.seq_len, config.batch_size, config.num_steps, config.top_k
    defaults = DumpConfig(teacher="", data="", output="")
    B_out, S_out = defaults.batch_size, defaults.steps_per_file
    tiled = _tile(kept, B, S_out, B_out)
    entries = S_out * B_out * L * k
    dumped_entries = N * B * L * k
    V = manifest["shapes"]["vocab_size"]

    def rewrite(codec: str, vocab_size: int) -> str:
        m = store_mod.build_manifest(
            seq_len=L, top_k=k, vocab_size=vocab_size, codec=codec, num_steps=S_out, examples_per_step=B_out,
            steps_per_file=S_out, content=manifest["content"])
        uri = common.fresh_dir("codec", f"{codec}-{vocab_size}")
        store_mod.init_store(uri, m)
        store_mod.write_examples(uri, m, 0, tiled)
        return uri

    sizes = {"default": common.dir_bytes(rewrite("default", V)),
             "exact": common.dir_bytes(rewrite("exact", V)),
             "default_at_vocab_151936": common.dir_bytes(rewrite("default", 151936))}
    # The reference's layout: one record per example of float32 log-probs + int64 ids, same chunking.
    ref_dir = common.fresh_dir("codec", "reference")
    w = ArrayRecordWriter(os.path.join(ref_dir, "chunk-00000.array_record"),
                          manifest["codec"]["array_record_options"])
    for step in range(S_out):
        rec = tiled[step]
        for o in range(B_out):
            w.write(rec["topk_logprobs"][o].astype("<f4").tobytes() + rec["topk_ids"][o].astype("<i8").tobytes())
    w.close()
    sizes["reference_f32_i64"] = common.dir_bytes(ref_dir)
    dumped_bytes = common.dir_bytes(store_path)

    # Decoded default store (the dump's own) vs the exact float32 values of the same compute.
    err_top = err_tail = 0.0
    ids_equal = True
    with store_mod.open_store(store_path) as st:
        for g in range(N * B):
            rec = st.read(g)
            ref = kept[g // B]
            o = g % B
            held = rec["loss_mask"]  # the store holds values at the supervised positions only
            ids_equal &= bool(np.array_equal(rec["topk_ids"][held], ref["topk_ids"][o][held]))
            err_top = max(err_top, float(np.max(np.abs(rec["topk_logprobs"][held] - ref["topk_logprobs"][o][held]))))
            tail = ref["tail_logprob"][o]
            ok = held & np.isfinite(tail) & (tail >= codec_mod.LOGPROB_FLOOR)
            if ok.any():
                err_tail = max(err_tail, float(np.max(np.abs(rec["tail_logprob"][ok] - tail[ok]))))
    per_entry = {name: size / entries for name, size in sizes.items()}
    return {
        "bytes_per_entry": {
            "value": per_entry["default"],
            "details": {
                "bytes_per_entry_exact": per_entry["exact"],
                "bytes_per_entry_reference_f32_i64": per_entry["reference_f32_i64"],
                "bytes_per_entry_default_at_vocab_151936": per_entry["default_at_vocab_151936"],
                "bytes_per_entry_formula_default": codec_mod.bytes_per_entry("default", V, L, k),
                "bytes_per_entry_formula_default_at_vocab_151936": codec_mod.bytes_per_entry("default", 151936, L, k),
                "bytes_per_entry_dumped_store_small_chunks": dumped_bytes / dumped_entries,
                "dumped_store_chunk_mb": dumped_bytes / max(1, -(-N // config.steps_per_file)) / 1e6,
                "store_bytes": sizes,
                "layout": f"{S_out} steps x {B_out} examples in one chunk (DumpConfig defaults), seq_len {L}",
                "positions": S_out * B_out * L, "top_k": k, "vocab_size": V, "id_bits": codec_mod.id_bits_for(V),
                "what": "whole store directory (manifest + chunks) / (positions x k); every layout holds the "
                        "dump's records (the reference: float32 log-probs + int64 ids only)",
            },
        },
        "codec_max_abs_logprob_error": {
            "value": max(err_top, err_tail),
            "details": {"topk_logprobs": err_top, "tail_logprob": err_tail, "ids_identical": ids_equal,
                        "bound": codec_mod.LOGPROB_MAX_ERROR, "examples": N * B,
                        "what": "the dumped default store decoded vs the float32 values of the same compute"},
        },
    }


# ----------------------------------------------------------------------------- resume


def resume(size: dict) -> dict:
    """From the start of a dump to its first new step, on a store of 10,000 committed chunks vs 1.

    Each side is a real ``run_dump`` (tiny teacher, its load, the plan, the manifest check, the
    scan of the store, the teacher's compile, the first step) resuming a store that lacks only
    its last chunk: ``DumpResult.time_to_first_step_s``. The committed chunks are hard links of
    one real chunk under the names a dump gives them (the scan reads names only); the chunk the
    run writes is deleted again, so every round resumes the same store. The scan alone is timed
    too (details), since it is the only part that grows with the number of chunks.
    """
    from logit_distill import store as store_mod
    from logit_distill.data import write_pretokenized
    from logit_distill.dump import DumpConfig, plan_dump, run_dump

    n_chunks = size["resume_chunks"]
    S = 1
    root = common.fresh_dir("resume")
    docs = common.random_documents(n_chunks + 2, 512, 8, 8, seed=0)
    data = write_pretokenized(os.path.join(root, "data.array_record"), docs)
    configs, stores = {}, {}
    for name, count in (("many", n_chunks), ("one", 1)):
        uri = os.path.join(root, name)
        config = DumpConfig(teacher="preset:tiny-qwen3", data=data, output=uri, selection="topk", top_k=4, seq_len=8,
                            batch_size=1, num_steps=(count + 1) * S, steps_per_file=S, progress=False)
        manifest = plan_dump(config).manifest
        store_mod.init_store(uri, manifest)
        seed_dir = os.path.join(root, f"seed-{name}")
        store_mod.init_store(seed_dir, manifest)
        store_mod.write_examples(seed_dir, manifest, 0, {0: common.fake_step(manifest, 0)})
        (chunk,) = [n for n in os.listdir(seed_dir) if n.startswith("chunk-")]
        info = store_mod.parse_chunk_name(chunk)
        for c in range(count):
            target = store_mod.chunk_name(info.tag, 0, c * S, (c + 1) * S, info.checksum)
            os.link(os.path.join(seed_dir, chunk), os.path.join(uri, target))
        configs[name], stores[name] = config, (uri, manifest, set(os.listdir(uri)))

    def reset(name):
        uri, _, before = stores[name]
        for extra in set(os.listdir(uri)) - before:
            os.remove(os.path.join(uri, extra))

    first, scans = {"many": [], "one": []}, {"many": [], "one": []}
    for _ in range(size["resume_repeats"]):
        for name in ("many", "one"):
            reset(name)
            result = run_dump(configs[name])
            assert result.resumed_from_step == (n_chunks if name == "many" else 1) * S, result
            first[name].append(result.time_to_first_step_s)
            uri, manifest, _ = stores[name]
            t0 = time.perf_counter()
            store_mod.scan(uri, manifest)
            scans[name].append(time.perf_counter() - t0)
    for name in stores:
        reset(name)
    return {
        "resume_time_ratio_10k_chunks": {
            "value": common.ratio(first, "many", "one"),
            "details": {
                "chunks": n_chunks, "storage": "local disk",
                "many_chunks": common.summary(first["many"]), "one_chunk": common.summary(first["one"]),
                "span": "run_dump from its call to the first new step handed to the writer "
                        "(teacher load, plan, manifest check, scan, compile, first step)",
                "scan_only_ratio": common.ratio(scans, "many", "one"),
                "scan_many_chunks": common.summary(scans["many"]),
                "scan_one_chunk": common.summary(scans["one"]),
            },
        }
    }

