"""docs/BENCHMARKS.md from bench/results.json: the figures, their goals, the machine and the command."""

from __future__ import annotations

import json
import os
import sys

GOALS = {  # key -> (comparison, goal); None: reported without a goal
    "dump_overhead_ratio": ("<=", 1.05),
    "dump_overhead_ratio_gcs": ("<=", 1.05),
    "selection_overhead_ratio": None,
    "bytes_per_entry": ("<=", 4.25),
    "codec_max_abs_logprob_error": ("<=", 1e-3),
    "resume_time_ratio_10k_chunks": ("<=", 2.0),
    "train_overhead_ratio": ("<=", 1.10),
    "online_over_offline_step_ratio": (">=", 1.5),
    "loader_over_train_throughput": (">=", 10.0),
    "verify_over_decode_ratio": ("<=", 1.5),
    "kd_vs_ce_heldout": ("kd<ce", None),
    "teacher_flop_utilization_1024": (">=", 0.55),
    "teacher_flop_utilization_4096": (">=", 0.5),
    "attention_temp_bytes_ratio_8192_over_2048": ("<=", 5.0),
    "load_over_read_ratio": ("<=", 1.3),
    "moe_teacher_flop_utilization": (">=", 0.35),
    "moe_over_dense_step_ratio": ("<=", 1.5),
    "chat_prepare_over_plain_tokenize": ("<=", 1.5),
    "chat_store_bytes_ratio": ("<=f+", 0.02),
}


def _s(summary: dict | None) -> str:
    return "?" if not summary else f"{summary['median_s']:.3g} s"


def _f(x, digits: int = 4) -> str:
    if isinstance(x, float):
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
            return f"{x:.3g}"
        return f"{x:.{digits}g}"
    return str(x)


def met(key: str, value) -> str:
    goal = GOALS.get(key)
    if goal is None:
        return "(no goal)"
    op, target = goal
    if op == "kd<ce":
        ok = value["kd_student"] < value["ce_student"]
    elif op == "<=f+":
        ok = value["ratio"] <= value["assistant_fraction"] + target
    elif op == "<=":
        ok = value <= target
    else:
        ok = value >= target
    return "yes" if ok else "**no**"


def goal_text(key: str) -> str:
    goal = GOALS.get(key)
    if goal is None:
        return "-"
    op, target = goal
    if op == "kd<ce":
        return "KD < CE"
    if op == "<=f+":
        return f"≤ f + {_f(target)}"
    return f"{'≤' if op == '<=' else '≥'} {_f(target)}"


def value_text(key: str, value) -> str:
    if key == "kd_vs_ce_heldout":
        return (f"KD {value['kd_student']:.3f}, CE {value['ce_student']:.3f}, "
                f"teacher {value['teacher']:.3f}")
    if key == "chat_store_bytes_ratio":
        return f"{value['ratio']:.4f} (f = {value['assistant_fraction']:.4f})"
    return _f(value)


def explain(key: str, d: dict, results: dict) -> str:
    """What the figure measures here, with its two absolute measurements, and what limits it."""
    if key in ("dump_overhead_ratio", "dump_overhead_ratio_gcs"):
        return (f"`run_dump` ({d['storage']}) vs the same loading + `TeacherStep` loop over the same {d['num_steps']} "
                f"steps x {d['batch_size']} x {d['seq_len']} tokens with outputs fetched and nothing written; "
                f"span from building the `TeacherStep` to the last commit: {_s(d['dump_loop'])} vs "
                f"{_s(d['compute_only_loop'])} ({d['chunks']} chunks; whole calls incl. loading: ratio "
                f"{d['end_to_end_ratio']:.3f}). "
                + (f"Below 1 means the writer's cost is under the noise of this shared machine (compute-only "
                   f"rounds took {d['compute_only_loop']['min_s']:.1f}-{d['compute_only_loop']['max_s']:.1f} s). "
                   if results.get(key, {}).get("value", 1) < 1 else "")
                + "Limit: on 2 shared cores the writer's encode thread takes CPU from the teacher's forward; "
                "on an accelerator it runs beside the device.")
    if key == "selection_overhead_ratio":
        return (f"bench teacher on [1, {d['seq_len']}], k={d['top_k']}: forward + top-k + tail "
                f"{_s(d['forward_topk'])} vs forward + logsumexp {_s(d['forward_logsumexp'])}. Limit: "
                "the block top-k (a max pass over 32k logits and two small `top_k`s) and one more pass for the tail, "
                "on CPU.")
    if key == "bytes_per_entry":
        return (f"default codec, whole store / (positions x k) at vocab {d['vocab_size']} ({d['id_bits']}-bit ids), "
                f"{d['layout']}; same records: exact {d['bytes_per_entry_exact']:.3f}, reference float32 + int64 "
                f"{d['bytes_per_entry_reference_f32_i64']:.3f}; default at Qwen's 151,936 vocabulary "
                f"{d['bytes_per_entry_default_at_vocab_151936']:.3f} (formula "
                f"{d['bytes_per_entry_formula_default_at_vocab_151936']:.3f}: 4.25 for the top-k entries + tokens, "
                f"tail and header per position). The bench dump's own small chunks "
                f"({d['dumped_store_chunk_mb']:.2f} MB) give {d['bytes_per_entry_dumped_store_small_chunks']:.3f}: "
                "ArrayRecord pads each file to 64 KiB blocks.")
    if key == "codec_max_abs_logprob_error":
        return (f"the dumped default store decoded vs the float32 compute, {d['examples']} examples: top-k "
                f"{_f(d['topk_logprobs'])}, tail {_f(d['tail_logprob'])} (bound 2^-11 = {_f(d['bound'])}); "
                f"ids identical: {d['ids_identical']}.")
    if key == "resume_time_ratio_10k_chunks":
        return (f"`run_dump` from its call to its first new step (tiny teacher: load, plan, manifest check, "
                f"scan, compile, first step), resuming a local store of {d['chunks']:,} committed chunks vs "
                f"1 (each lacking its last chunk): {_s(d['many_chunks'])} vs {_s(d['one_chunk'])}. The scan "
                f"alone: {_s(d['scan_many_chunks'])} vs {_s(d['scan_one_chunk'])}. Limit: listing and parsing "
                "10k names in Python (about 5 us a chunk) against a start that takes a fraction of a second "
                "only because the bench teacher is tiny and its compile is cached; a real teacher's load "
                "(seconds to minutes) makes the ratio close to 1.")
    if key == "train_overhead_ratio":
        return (f"student step (topk_kl, alpha 0.5) {_s(d['offline_kd_step'])} vs plain-CE step "
                f"{_s(d['ce_only_step'])}, batch {d['batch']} x {d['seq_len']}, vocab {d['vocab_size']}, k "
                f"{d['top_k']}; `train_student`'s own CE run (alpha 0, KD kept as a metric) "
                f"{_s(d['ce_alpha0_step'])}. Limit: the gather of the k ids from [B, L, V] logits and its "
                "scatter-add gradient, plus the teacher fields' transfer, against a small student whose step "
                "is dominated by the 32k-vocab head.")
    if key == "online_over_offline_step_ratio":
        return (f"online step (teacher forward + top-k on the batch, then the same step) "
                f"{_s(d['online_kd_step'])} vs offline {_s(d['offline_kd_step'])}; teacher/student forward "
                f"FLOPs {d['teacher_over_student_forward_flops']:.1f}x.")
    if key == "loader_over_train_throughput":
        return (f"Grain loader over a default-codec store {d['loader_examples_per_s']:.0f} examples/s vs offline "
                f"training {d['train_examples_per_s']:.2f} examples/s (batch {d['batch']} x {d['seq_len']}).")
    if key == "verify_over_decode_ratio":
        return (f"`verify_store` {_s(d['verify'])} vs one single-threaded pass decoding every record "
                f"{_s(d['decode_pass'])} ({d['store']}). Limit: verify's per-record checks (sortedness, "
                "normalization, distinct ids, token hash) on top of the decode, on 2 cores shared with its "
                "2 workers.")
    if key == "kd_vs_ce_heldout":
        return (f"held-out cross-entropy ({d['unit']}); {d['student']} trained {d['steps']} steps, batch "
                f"{d['batch_size']} x {d['seq_len']}, from a store of {d['teacher']} ({d['kd']}) vs CE only; "
                f"untrained student {d['untrained_student']:.3f}, uniform {d['uniform_over_vocab']:.3f}; "
                f"{d['train_tokens']:,} training tokens sampled from the teacher (so it is their best model) for "
                f"{d['steps'] * d['batch_size'] * d['seq_len']:,} tokens of training. Limit: a tiny student "
                "and little data (sampling has no KV cache), so both stay above the teacher.")
    if key.startswith("teacher_flop_utilization_"):
        return (f"model FLOPs/s of the dump's teacher step ({d['teacher']}, {d['dtype']}, {d['batch']} x "
                f"{d['seq_len']} tokens, top-k {d['top_k']}, attention `{d['attention']}`, device batch "
                f"{d['device_batch']}) over a {d['matmul']['size']}^3 {d['dtype']} matmul's FLOPs/s, alternated in one "
                f"process: {d['teacher_gflops_per_s']:.0f} vs {d['matmul_gflops_per_s']:.0f} GFLOP/s "
                f"(step {_s(d['teacher_step'])}, {d['tokens_per_s']:.0f} tokens/s; attention FLOPs counted causal). "
                "Limit: on CPU, attention (XLA runs the score matmul, the mask, the max, the exponentials and the "
                "value matmul as separate passes over [rows, keys] blocks, memory-bound; key-tiled (flash) and "
                "per-head variants measured no faster; its share grows with L) "
                "and the top-k selection's passes over the [L, 32k] logits, neither of them FLOPs.")
    if key == "moe_teacher_flop_utilization":
        return (f"active-parameter model FLOPs/s of the dump's teacher step ({d['teacher']}, {d['dtype']}, "
                f"{d['batch']} x {d['seq_len']} tokens, top-k {d['top_k']}, attention `{d['attention']}`) over a "
                f"{d['matmul']['size']}^3 {d['dtype']} matmul's, alternated in one process: "
                f"{d['teacher_gflops_per_s']:.0f} vs {d['matmul_gflops_per_s']:.0f} GFLOP/s (step {_s(d['moe_step'])}, "
                f"{d['tokens_per_s']:.0f} tokens/s; router, the k experts and attention counted, dropless routing).")
    if key == "moe_over_dense_step_ratio":
        return (f"the dump's teacher step of the MoE bench teacher ({d['moe']}) {_s(d['moe_step'])} over the dense "
                f"bench teacher's ({d['dense']}) {_s(d['dense_step'])}, the same active FLOPs per token, "
                f"{d['batch']} x {d['seq_len']} tokens, alternated in one process. Limit: the experts' matmuls "
                "are small: 64 experts top-8 give each expert an eighth of a device batch's tokens on average "
                "(128 rows of a 1024-token example: a [128, 512] x [512, 384] product, where the dense FFN has "
                "[1024, 512] x [512, 3072]), plus the padding of each expert's last tile of rows; a CPU whose "
                "large matmuls run near its peak runs such small ones at about half that rate.")
    if key == "attention_temp_bytes_ratio_8192_over_2048":
        return (f"XLA's compiled memory analysis of the dump's teacher step (bench teacher, batch 1, attention "
                f"`{d['attention']}`): temporaries {d['temp_bytes_8192'] / 2**20:.0f} MiB at L=8192 vs "
                f"{d['temp_bytes_2048'] / 2**20:.0f} MiB at L=2048 (linear memory gives 4, [L, L] scores 16).")
    if key == "load_over_read_ratio":
        return (f"`load_model` of a {d['checkpoint_bytes'] / 1e6:.0f} MB checkpoint onto the dump's mesh (headers, "
                f"byte-range reads, placement) {_s(d['load'])} vs reading the same files' bytes raw "
                f"{_s(d['read'])} ({d['storage']}).")
    if key == "chat_prepare_over_plain_tokenize":
        p, g = d["prefix_method"], d["generation_method"]
        return (f"checking, rendering, masking and tokenizing {d['conversations']} conversations "
                f"({p['assistant_turns_per_conversation']:.2f} assistant turns each; {d['tokenizer']}) with a "
                f"Qwen3-style template by rendering prefixes {_s(p['chat'])}, over `encode_batch` of the rendered "
                f"texts {_s(p['plain'])}; with {{% generation %}} markers {g['ratio']:.3f}, single-turn "
                f"{d['prefix_method_single_turn']['ratio']:.3f}.")
    if key == "chat_store_bytes_ratio":
        c, f = d["stores"]["chat"], d["stores"]["full"]
        return (f"records of a store of {d['conversations']} conversations (values at the assistant's tokens, "
                f"f = {d['assistant_fraction_f']:.4f} of the tokens) {c['record_bytes']} bytes over those of the "
                f"full store of the same tokens {f['record_bytes']} bytes (default codec, top-k {d['top_k']}, "
                f"V = {d['vocab_size']}, L = {d['seq_len']}; chunk files {d['file_bytes_ratio']:.4f}); the tokens "
                "and the mask bits are the excess over f.")
    return ""


ORDER = list(GOALS)


def _commands(meta: dict) -> list[str]:
    """The command (or, after ``--only`` updates, the commands) that produced the figures below."""
    runs = meta.get("runs") or [{"command": meta["command"], "date": meta["date"], "wall_s": meta["wall_s"]}]
    if len(runs) == 1:
        return [f"Command: `{runs[0]['command']}` (`make bench` runs `python -m bench.run`), "
                f"{runs[0]['wall_s'] / 60:.1f} minutes, {runs[0]['date']}."]
    lines = ["Commands (`make bench` runs `python -m bench.run`; each figure comes from the last run that "
             "measured it):", ""]
    for run in runs:
        lines.append(f"- `{run['command']}`, {run['wall_s'] / 60:.1f} minutes, {run['date']}: "
                     + ", ".join(f"`{k}`" for k in run["keys"]))
    return lines


def render(doc: dict) -> str:
    meta = doc["meta"]
    results = {k: v for k, v in doc.items() if k != "meta"}
    lines = [
        "# Benchmarks",
        "",
        "Generated by `bench/report.py` from `bench/results.json`; do not edit by hand.",
        "",
        *_commands(meta),
        "",
        "Every figure is a ratio of two things measured side by side in the same run: the two are "
        "interleaved (A, B, B, A, ...) and repeated; the figure is the median over rounds of each "
        "round's ratio, so background load hits both sides alike. Absolute times are in `bench/results.json` and below.",
        "",
        "## Figures",
        "",
        "| key | value | goal | met? | what it measures / what limits it |",
        "| --- | --- | --- | --- | --- |",
    ]
    for key in ORDER:
        if key not in results:
            continue
        r = results[key]
        lines.append(f"| `{key}` | {value_text(key, r['value'])} | {goal_text(key)} | {met(key, r['value'])} | "
                     f"{explain(key, r['details'], results).replace('|', '/')} |")
    lines += _fidelity_section(results.get("fidelity"))
    missing = [k for k in ORDER + ["fidelity"] if k not in results]
    if missing:
        lines += ["", f"Not measured in this run: {', '.join(f'`{k}`' for k in missing)}."]
    if meta.get("errors"):
        lines += ["", "Errors: " + "; ".join(f"{g}: {e}" for g, e in meta["errors"].items())]
    la0, la1 = meta.get("load_average_start", [0])[0], meta.get("load_average_end", [0])[0]
    lines += [
        "",
        "## Machine",
        "",
        f"- {meta['cpu_count']} CPU cores ({meta['cpu_model']}), {meta['platform']}, Python {meta['python']}",
        f"- JAX {meta['jax_version']}, backend `{meta['jax_backend']}`, devices {', '.join(meta['devices'])}",
        f"- load average {la0:.1f} at the start and {la1:.1f} at the end (1-minute averages; above the "
        f"{meta['cpu_count']} cores, other work shared the machine): absolute times vary between machines and "
        "with their load; the ratios are what to compare.",
        f"- mode: `{meta['mode']}`; sizes: `{json.dumps(meta.get('size', {}), sort_keys=True)}`",
        "",
    ]
    lines += _accelerator_section(meta, results)
    lines += [
        "## How to run",
        "",
        "```",
        "make bench                                  # everything, default sizes (its minutes on this machine: the command at the top)",
        "python -m bench.run --only dump,train      # a subset: keys or groups (selection, dump, resume, verify, train, kd, fidelity, teacher, chat)",
        "bash bench/device_teacher.sh               # the teacher group on an accelerator (1.7B bfloat16, L=4096)",
        "python -m bench.run --full                 # larger sizes, more repeats (longer)",
        "```",
        "",
        "`bench/results.json` holds every figure with its details (both absolute times, sizes) and `meta` "
        "(machine, versions, date, command). A run with `--only` updates the figures it measures and keeps "
        "the others. The scripts use whatever JAX backend is present; on a GPU or TPU the dump and train "
        "figures come with absolute tokens/s (section above).",
        "",
    ]
    return "\n".join(lines)


FIDELITY_LABELS = {
    "ce_only": "CE only (alpha 0)",
    "full_kd_online": "full distribution, online (`full_kl`)",
    "topk_kl_k64": "`topk_kl`, k = 64",
    "topk_tail_kl_k8": "`topk_tail_kl`, k = 8",
    "topk_tail_kl_k64": "`topk_tail_kl`, k = 64 (reference)",
    "sampled_kl_n32": "`sampled_kl`, N = 32 independent draws",
    "sampled_kl_n64": "`sampled_kl`, N = 64 independent draws",
    "systematic_kl_n32": "`sampled_kl`, N = 32 systematic draws",
    "systematic_kl_n64": "`sampled_kl`, N = 64 systematic draws",
    "hybrid_kl_k4_n16": "`hybrid_kl`, top-4 + 16 tail draws",
    "hybrid_kl_k8_n8": "`hybrid_kl`, top-8 + 8 tail draws",
}


def _pm(d: dict, digits: int = 3) -> str:
    return f"{d['mean']:+.{digits}f} ± {d['se']:.{digits}f}"


def _fidelity_section(r: dict | None) -> list[str]:
    """The fidelity-per-byte table at convergence: one row per store/loss, paired by seed."""
    if not r:
        return []
    d, rows = r["details"], r["value"]
    c = d["checks"]
    lines = [
        "",
        "## Fidelity per byte at convergence (`fidelity`)",
        "",
        f"Teacher: {d['teacher']} (test entropy {d['teacher_test_entropy_nats']:.2f} nats, top-8 mass "
        f"{d['teacher_test_top8_mass']:.3f}, top-64 mass {d['teacher_test_top64_mass']:.3f}); student: "
        f"{d['student']}. Data sampled from the teacher; settings {d['settings']}. Stopping rule: "
        f"{d['stopping_rule']}. Bytes: {d['bytes']}. Spread: {d['spread']}. KL is the full-vocabulary "
        f"KL(teacher || student) per test position; gap closed = (CE only - row) / (CE only - full), per seed; "
        f"tail-shape KL: teacher and student renormalised outside the teacher's top 64.",
        "",
        "| row | bytes / position | x reference | test KL | KL - reference | gap closed | tail-shape KL | "
        "top-1 agreement | mass on teacher's top 64 | test CE | stopped at (steps) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, row in rows.items():
        b, x = row["bytes_per_position"], row["bytes_over_reference"]
        conv = row["convergence"]
        lines.append(
            f"| {FIDELITY_LABELS.get(key, key)} | "
            f"{'-' if not b else ', '.join(f'{v:.1f} ({k})' for k, v in b.items())} | "
            f"{'-' if not x else ', '.join(f'{v:.3f}' for v in x.values())} | {row['heldout_kl']:.3f} | "
            f"{_pm(row['kl_minus_reference'])} | {_pm(row['gap_closed'], 2)} | {row['heldout_tail_shape_kl']:.3f} | "
            f"{row['heldout_top1_agreement']:.3f} | {row['heldout_topk_mass']:.3f} | "
            f"{row['heldout_cross_entropy']:.3f} | {', '.join(str(s) for s in conv['stopped_at'])}"
            f"{'' if all(conv['converged']) else ' (**not converged**)'} |")
    within = c["rows_within_bytes_goal"]
    lines += [
        "",
        "- Goal: a store of <= 48 bytes per position whose test KL is no worse than the reference's (paired "
        "mean difference <= 2 standard errors) and that closes >= 0.95 of the gap: "
        + (f"met by {', '.join(FIDELITY_LABELS.get(k, k) for k in c['goal_met_by'])}." if c["goal_met_by"]
           else "**not met**.")
        + " Rows within 48 bytes: "
        + "; ".join(f"{FIDELITY_LABELS.get(k, k)} {w['bytes']:.1f} B, KL - reference {_pm(w['kl_minus_reference'])}, "
                    f"gap closed {w['gap_closed']:.2f}" for k, w in within.items()) + ".",
        f"- every KD row beats CE only: {'yes' if c['every_kd_row_beats_ce_only'] else '**no**'}; every row "
        f"converged by the stopping rule: {'yes' if c['every_row_converged'] else '**no**'}.",
        "- training seconds per row (all seeds together, wall on a shared machine; CPU seconds in brackets): "
        + ", ".join(f"{k} {v} ({d['cpu_seconds'].get(k, '?')})" for k, v in d["seconds"].items() if k != "total")
        + f"; the whole group {d['seconds']['total']:.0f} s.",
        "",
    ]
    return lines


def _accelerator_section(meta: dict, results: dict) -> list[str]:
    lines = ["## On an accelerator", ""]
    if meta.get("jax_backend") in (None, "cpu"):
        return lines + ["No GPU figures were measured in this run (no accelerator on this machine). The same "
                        "command on a GPU or TPU machine measures the same figures there and lists the absolute "
                        "tokens/s of the dump and of the training steps in this section.", "",
                        "The teacher at accelerator scale (`bash bench/device_teacher.sh`: installs the project "
                        "with `jax[cuda12]`, then `python -m bench.run --device --only teacher`: a 1.7B-parameter "
                        "Qwen3-style teacher in bfloat16, 8 x 4096 tokens a step through the dump's teacher step, "
                        "tokens/s and MFU against an 8192^3 bfloat16 matmul measured in the same run and against "
                        "the data-sheet peak; goal MFU >= 0.4) has **not been measured**: no accelerator was "
                        "available to this work. The script is ready to run on one H200.", ""]
    rows = []
    for key, field, what in (
        ("dump_overhead_ratio", "dump_tokens_per_s", "dump (local disk)"),
        ("dump_overhead_ratio", "compute_only_tokens_per_s", "dump compute only"),
        ("dump_overhead_ratio_gcs", "dump_tokens_per_s", "dump (GCS emulator)"),
        ("selection_overhead_ratio", "tokens_per_s_forward_topk", "teacher forward + top-k"),
        ("train_overhead_ratio", "offline_kd_tokens_per_s", "offline KD train step"),
        ("online_over_offline_step_ratio", "online_kd_tokens_per_s", "online KD train step"),
        ("teacher_flop_utilization_4096", "tokens_per_s", "teacher step at L=4096 (teacher group)"),
    ):
        if key in results and field in results[key]["details"]:
            rows.append(f"| {what} | {results[key]['details'][field]:.0f} |")
    t = results.get("teacher_flop_utilization_4096", {}).get("details", {})
    if "mfu_vs_datasheet_bf16_peak" in t:
        rows.append(f"| teacher MFU vs the data-sheet bf16 peak ({t['device_kind']}) | "
                    f"{t['mfu_vs_datasheet_bf16_peak']:.3f} |")
    return lines + [f"Backend `{meta['jax_backend']}` ({', '.join(meta['devices'])}).", "",
                    "| what | tokens/s |", "| --- | --- |", *rows, ""]


def write_markdown(doc: dict, path: str) -> None:
    text = render(doc)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":  # python -m bench.report [results.json] [BENCHMARKS.md]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "bench", "results.json")
    dst = sys.argv[2] if len(sys.argv) > 2 else os.path.join(root, "docs", "BENCHMARKS.md")
    with open(src) as f:
        write_markdown(json.load(f), dst)
