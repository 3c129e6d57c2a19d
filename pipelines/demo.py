"""``make demo``: the whole distillation pipeline under ``kfp.local``, on a laptop's CPU, in minutes.

    python -m pipelines.demo [--out demo-output] [--train-num-steps 300] [--fresh] [--demo-data chat]

1. Builds the demo's models and data in ``<out>/inputs`` (cached between runs):
   a small teacher whose next-token distributions are peaked but learnable
   (``preset:demo-teacher``), a student (``preset:tiny-qwen3``), and documents
   *sampled from the teacher*
   (train + held-out), so the teacher is the best possible model of the data
   and a student that learns its distributions (KD) has something to gain over
   one that only sees the sampled tokens (CE). With ``--demo-data chat`` each
   document is a turn of a conversation: a prompt (its first quarter to half)
   and the reply that follows, only the reply supervised (pre-tokenized records
   with a loss mask, docs/DATA.md): the store holds the teacher at the replies
   only, and the students are trained and evaluated on the replies' tokens.
2. Runs ``pipelines.pipeline.distill_pipeline`` (plan -> dump -> verify ->
   train KD student + CE-only baseline) with ``kfp.local.SubprocessRunner``
   through ``pipelines.run_local``: one line per task, the full log in a file
   (``-v`` shows it).
3. Prints a summary: store size, bytes per entry, the verification result, the
   held-out loss of the teacher, the KD student and the CE-only student, and
   where the reports are.
"""

import argparse
import glob
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The demo's settings. Measured on 2 CPU cores: data ~25 s, the pipeline ~2 min.
DEMO = {
    "teacher_preset": "demo-teacher",  # peaked: entropy ~2 nats of a possible 6.2
    "student_preset": "tiny-qwen3",
    "vocab_size": 512,
    "train_docs": 512,
    "eval_docs": 64,
    "doc_len": 64,
    "sample_seed": 0,
}
PIPELINE_ARGS = {
    "dump_num_steps": 32,  # 32 steps x 16 examples = the 512 training documents
    "dump_batch_size": 16,
    "seq_len": 64,  # the store: the default selection, hybrid (its top-4 head + tail mass, 16 draws from the tail)
    "steps_per_file": 4,
    "verify_sample": 64,
    "spot_check": 4,
    "train_num_steps": 300,
    "train_batch_size": 16,
    "learning_rate": 3e-3,  # the loss: the store's default (hybrid_kl)
    "alpha": 1.0,
    "dump_dtype": "float32",
    "ce_baseline": True,
}


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def prepare_inputs(inputs_dir: str) -> dict:
    """Teacher, student (HF checkpoint folders) and train / held-out data; reused when already there."""
    stamp_path = os.path.join(inputs_dir, "inputs.json")
    want = {"settings": DEMO}
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            stamp = json.load(f)
        if stamp.get("settings") == DEMO and "chat_data" in stamp["paths"]:
            _log(f"reusing the demo's models and data in {inputs_dir}")
            return stamp["paths"]

    from logit_distill.data import write_pretokenized
    from logit_distill.models import load_model, materialize_preset
    from logit_distill.train import sample_from_teacher

    t0 = time.perf_counter()
    os.makedirs(inputs_dir, exist_ok=True)
    paths = {"teacher": os.path.join(inputs_dir, "teacher"), "student": os.path.join(inputs_dir, "student"),
             "data": os.path.join(inputs_dir, "train.array_record"),
             "eval_data": os.path.join(inputs_dir, "eval.array_record"),
             "chat_data": os.path.join(inputs_dir, "chat-train.array_record"),
             "chat_eval_data": os.path.join(inputs_dir, "chat-eval.array_record")}
    materialize_preset(DEMO["teacher_preset"], paths["teacher"])
    materialize_preset(DEMO["student_preset"], paths["student"])
    teacher = load_model(paths["teacher"])
    n_train, n_eval = DEMO["train_docs"], DEMO["eval_docs"]
    _log(f"sampling {n_train} + {n_eval} documents of {DEMO['doc_len']} tokens from the teacher ...")
    docs = sample_from_teacher(teacher, n_train + n_eval, DEMO["doc_len"], DEMO["sample_seed"])
    write_pretokenized(paths["data"], docs[:n_train])
    write_pretokenized(paths["eval_data"], docs[n_train:])
    replies = reply_flags([len(d) for d in docs], DEMO["sample_seed"])
    write_pretokenized(paths["chat_data"], docs[:n_train], supervised=replies[:n_train])
    write_pretokenized(paths["chat_eval_data"], docs[n_train:], supervised=replies[n_train:])
    with open(stamp_path, "w") as f:
        json.dump({**want, "paths": paths}, f, indent=2)
    _log(f"models and data ready in {time.perf_counter() - t0:.0f} s")
    return paths


def reply_flags(lengths: list[int], seed: int) -> list:
    """Per document, 1 at the tokens of its reply: all but a prompt of a quarter to a half of it."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [(np.arange(n) >= rng.integers(n // 4, n // 2 + 1)).astype(np.uint8) for n in lengths]


def teacher_heldout(teacher: str, eval_data: str, seq_len: int) -> dict:
    """The teacher's held-out cross-entropy, with the same evaluation as the students'."""
    from logit_distill.models import load_model
    from logit_distill.train.evaluate import evaluate, open_eval_data

    loaded = load_model(teacher)
    examples = open_eval_data(eval_data, loaded.tokenizer_path, seq_len=seq_len, packing=True,
                              vocab_size=loaded.vocab_size)
    return evaluate(loaded.apply, loaded.params, examples, batch_size=16)


def run_pipeline(paths: dict, out: str, verbose: bool = False, **overrides):
    """Run the pipeline under kfp.local (``pipelines.run_local``); return its ``LocalRun``."""
    from pipelines.run_local import run

    args = {**PIPELINE_ARGS, "teacher": paths["teacher"], "student": paths["student"], "data": paths["data"],
            "eval_data": paths["eval_data"], "output_root": os.path.join(out, "stores"), **overrides}
    return run("logit-distill", args, root=os.path.join(out, "kfp"), verbose=verbose)


def read_executor_metrics(run_dir: str, task: str) -> dict:
    """The outputs a task wrote (see ``pipelines.run_local.task_outputs``)."""
    from pipelines.run_local import task_outputs

    return task_outputs(run_dir, task)


def student_outputs(run_dir: str, n: int) -> dict:
    """The n-th student of the run (1: KD, 2: the CE-only baseline): its model folder, its report and its
    held-out cross-entropy, whether this run trained it or found its folder complete."""
    suffix = "" if n == 1 else f"-{n}"
    trained = read_executor_metrics(run_dir, f"train-offline-student{suffix}")
    if trained.get("model"):
        return {"model": trained["model"]["uri"], "report": trained.get("report", {}).get("uri", ""),
                "eval": trained.get("metrics", {}).get("metadata", {})}
    reused = read_executor_metrics(run_dir, f"use-existing-student{suffix}").get("model", {})
    evaluation = reused.get("metadata", {}).get("eval", {})
    return {"model": reused.get("uri"), "report": "",
            "eval": {"eval_cross_entropy": evaluation["cross_entropy"]} if evaluation else {}}


def _selection(meta: dict) -> str:
    """The store's selection in words, from the dump's artifact metadata."""
    if meta.get("selection") == "hybrid":
        return f"hybrid: top-{meta.get('top_k')} head + {meta.get('samples')} tail draws"
    if meta.get("selection") == "sampled":
        return f"sampled: {meta.get('samples')} draws"
    return f"top-{meta.get('top_k')}"


def summary(run_dir: str, paths: dict, teacher_eval: dict, elapsed: float) -> tuple[str, bool]:
    """The printed summary, and whether the run did what the demo shows (verified, both students
    evaluated, the KD student below the CE-only one)."""
    dump = read_executor_metrics(run_dir, "dump-teacher-topk")
    plan = read_executor_metrics(run_dir, "plan-dump")
    verify = read_executor_metrics(run_dir, "verify-logits")
    kd = student_outputs(run_dir, 1)
    ce = student_outputs(run_dir, 2)
    dm = dump.get("metrics", {}).get("metadata", {})
    store_meta = dump.get("store", {}).get("metadata", {})
    vm = verify.get("metrics", {}).get("metadata", {})
    kd_m, ce_m = kd["eval"], ce["eval"]
    lines = [
        "",
        "=" * 72,
        f"logit-distill demo: done in {elapsed:.0f} s",
        f"  store            {plan.get('store_uri')}",
        *([f"                   {dm.get('examples')} examples, {dm.get('positions')} positions, {dm.get('store_mb')} MB, "
           f"{dm.get('bytes_per_entry')} bytes per entry ({_selection(store_meta)})",
           f"                   resumed from step {dm.get('resumed_from_step')}, "
           f"{dm.get('chunks_written_this_attempt')} chunks written now, {dm.get('tokens_per_s')} positions/s"]
          if dm else ["                   complete already: the dump was skipped (no teacher loaded)"]),
        f"  verification     {'PASSED' if verify.get('Output') else 'FAILED'} "
        f"(teacher entropy >= {vm.get('teacher_entropy_lower_bound_nats', float('nan')):.3f} nats, "
        f"top-k mass {vm.get('mean_topk_mass', float('nan')):.3f})",
        "  held-out cross-entropy (nats/token; lower is better; uniform = 6.238)",
        f"    teacher                     {teacher_eval['cross_entropy']:.4f}",
        f"    KD student (from the store) {kd_m.get('eval_cross_entropy', float('nan')):.4f}",
        f"    CE-only student (alpha = 0) {ce_m.get('eval_cross_entropy', float('nan')):.4f}",
        "  reports",
        f"    verification      {verify.get('report', {}).get('uri')}",
        f"    KD student        {kd['report'] or '(trained by an earlier run)'}",
        f"    CE-only student   {ce['report'] or '(trained by an earlier run)'}",
        f"    KD student model  {kd['model']} (HF export in hf/)",
        "=" * 72,
    ]
    kd_ce, ce_ce = kd_m.get("eval_cross_entropy"), ce_m.get("eval_cross_entropy")
    ok = bool(verify.get("Output")) and kd_ce is not None and ce_ce is not None and kd_ce < ce_ce
    if not ok:
        lines.append("demo FAILED: the store did not verify, a student is missing, or KD did not beat CE-only")
    return "\n".join(lines), ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.demo", description=__doc__, allow_abbrev=False,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "demo-output"), help="demo folder (default demo-output/)")
    ap.add_argument("--train-num-steps", type=int, default=PIPELINE_ARGS["train_num_steps"],
                    help="the students' optimizer steps (the pipeline's train_num_steps)")
    ap.add_argument("--demo-data", choices=("text", "chat"), default="text",
                    help="the data: documents sampled from the teacher (text), or the same as prompt + reply turns "
                         "with the replies supervised (chat)")
    ap.add_argument("--fresh", action="store_true", help="drop the stores and students of earlier demo runs first")
    ap.add_argument("-v", "--verbose", action="store_true", help="show every task's full log")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    out = os.path.abspath(args.out)
    if args.fresh:
        import shutil

        shutil.rmtree(os.path.join(out, "stores"), ignore_errors=True)
    t0 = time.perf_counter()
    paths = prepare_inputs(os.path.join(out, "inputs"))
    if args.demo_data == "chat":
        paths = {**paths, "data": paths["chat_data"], "eval_data": paths["chat_eval_data"]}
    _log("running the pipeline under kfp.local (plan -> dump -> verify -> train KD + CE-only) ...")
    result = run_pipeline(paths, out, verbose=args.verbose, train_num_steps=args.train_num_steps)
    if result.log:
        _log(f"the tasks' full log: {result.log}")
    if not result.ok:
        print(f"demo FAILED: {result.error}", file=sys.stderr)
        return 1
    teacher_eval = teacher_heldout(paths["teacher"], paths["eval_data"], PIPELINE_ARGS["seq_len"])
    text, ok = summary(result.run_dir, paths, teacher_eval, time.perf_counter() - t0)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
