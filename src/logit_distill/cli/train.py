"""``logit-distill train``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ..store.lease import DEFAULT_TIMEOUT_S as DEFAULT_LEASE_TIMEOUT_S
from .chat_flags import add_chat_arguments, chat_options
from .flags import add_output_arguments, finite_float, nonnegative_float, positive_float, positive_float_or_none

# The --loss choices (losses.KINDS), spelled out here so that --help needs no JAX import.
LOSS_CHOICES = ("topk_kl", *(f"topk_tail_{d}" for d in ("kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tv")),
                *(f"sampled_{d}" for d in ("kl", "jsd", "skew_kl", "skew_reverse_kl", "tv")),
                *(f"full_{d}" for d in ("kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tv")), "hybrid_kl")
HELP = "train a student from a logit store (or a teacher in the loop)"
DESCRIPTION = """\
Train a student from a logit store (offline), or from a teacher run in the loop
(online: --teacher, --data, --top-k or --samples, --seq-len). Re-running the same
command with the same --output resumes from the latest checkpoint there; one
training at a time writes an output (a second one is refused, naming the first).
Outputs in --output: checkpoints/ (Orbax), metrics.jsonl, train_config.json,
tensorboard/, hf/ (the final student in HF format; student/ for a Flax NNX
student), eval.json (with --eval-data), report.md and loss.png.
See docs/TRAIN.md and docs/STUDENTS.md."""
FORMATTER = argparse.RawDescriptionHelpFormatter


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("data (offline: --store; online: --teacher --data --top-k --seq-len)")
    src.add_argument("--store", help="logit store URI (local path or gs://) written by `logit-distill dump`")
    src.add_argument("--teacher", help="online mode: teacher HF checkpoint dir (or preset:NAME) run in the loop")
    src.add_argument("--data", help="online mode: JSONL or Parquet (text, conversations, prompt/completion) or "
                                    "pre-tokenized ArrayRecord (file, glob or dir)")
    src.add_argument("--top-k", type=int, help="online mode: teacher entries kept per position")
    src.add_argument("--samples", type=int,
                     help="online mode, --loss sampled_kl: draws per position from the teacher (as dump --samples)")
    src.add_argument("--proposal-temperature", type=positive_float, default=1.0,
                     help="online mode, --loss sampled_kl: draw from the teacher at this temperature (default 1)")
    src.add_argument("--seq-len", type=int, help="online mode: tokens per example")
    src.add_argument("--no-packing", dest="packing", action="store_false",
                     help="online mode: one document per example instead of packing (default: packed)")
    src.add_argument("--data-seed", type=int, default=0,
                     help="online mode: seed of the document order of the data (as given to the dump; default 0)")
    src.add_argument("--num-examples", type=int,
                     help="online mode: use only the first N examples of the data (e.g. as many as the dump wrote)")
    src.add_argument("--text-field", default=None,
                     help="field holding the text of --data and --eval-data (default: the store's, else text)")
    add_chat_arguments(p, applies_to="online --data and --eval-data; default: as the store's data was read")

    p.add_argument("--student", required=True,
                   help="student: HF checkpoint dir (local or gs://), preset:NAME[@SEED] (random weights), or "
                        "flax:MODULE:FACTORY[?key=value&...] (a Flax NNX module, docs/STUDENTS.md); "
                        "its vocabulary must equal the teacher's")
    p.add_argument("--output", required=True,
                   help="output folder (local or gs://): new, empty, or an earlier run's (which then resumes)")
    p.add_argument("--num-steps", type=int, required=True, help="optimizer steps to train")
    p.add_argument("--batch-size", type=int, required=True,
                   help="examples per micro-step over all devices and processes (divisible by the device count)")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-steps per optimizer step (optax.MultiSteps); examples per step = "
                        "batch size x grad accum (default 1)")
    p.add_argument("--learning-rate", type=positive_float, default=3e-4, help="peak AdamW learning rate (default 3e-4)")
    p.add_argument("--warmup-steps", type=int,
                   help="linear warmup steps before the cosine decay (default min(100, num_steps // 10))")
    p.add_argument("--end-lr-fraction", type=nonnegative_float, default=0.1,
                   help="final learning rate as a fraction of the peak (default 0.1)")
    p.add_argument("--weight-decay", type=nonnegative_float, default=0.0,
                   help="AdamW weight decay on matrices, >= 0 (default 0)")
    p.add_argument("--max-grad-norm", type=positive_float_or_none, default=1.0,
                   help="gradient clipping by global norm, > 0, or 'none' for no clipping (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the training shuffle (default 0)")
    p.add_argument("--loss", choices=LOSS_CHOICES, default=None, metavar="LOSS",
                   help="KD loss, <teacher values>_<divergence>: topk_kl (KL over the top-k ids only), "
                        "topk_tail_D (the k + 1 bins of a top-k store, or an online --top-k teacher), sampled_D "
                        "(the draws of a sampled store, or an online --samples teacher), full_D (online only: the "
                        "teacher's whole vocabulary), hybrid_kl (a hybrid store: its exact top-k head plus its "
                        "draws from the rest); D is kl, reverse_kl, jsd, skew_kl, skew_reverse_kl or tv "
                        "(no sampled_reverse_kl: it has no estimator from draws). Default: topk_tail_kl for a "
                        "top-k store, topk_kl for one whose top-k is the whole vocabulary (exact there), "
                        "sampled_kl for a sampled store, hybrid_kl for a hybrid store; docs/LOSSES.md")
    p.add_argument("--jsd-beta", type=finite_float, default=0.5,
                   help="the *_jsd losses: weight beta in (0, 1) of the mixture beta p + (1 - beta) q (GKD's "
                        "generalized JSD; default 0.5)")
    p.add_argument("--skew", type=finite_float, default=0.1,
                   help="the *_skew_kl / *_skew_reverse_kl losses: mixture weight in (0, 1) (default 0.1)")
    p.add_argument("--allow-biased-temperature", action="store_true",
                   help="a sampled_* loss at a --temperature other than the draws' proposal temperature "
                        "(refused by default: the importance weights are then self-normalised, a biased "
                        "gradient); the run logs the bias measured for its number of draws")
    p.add_argument("--alpha", type=finite_float, default=1.0,
                   help="weight of the KD loss in [0, 1]: loss = alpha * KD + (1 - alpha) * CE; 0 trains on CE only "
                        "(default 1); the start value of a schedule")
    p.add_argument("--alpha-end", type=finite_float, help="alpha at the last step (with --alpha-schedule linear|cosine)")
    p.add_argument("--alpha-schedule", choices=("constant", "linear", "cosine"), default="constant",
                   help="how alpha goes from --alpha to --alpha-end over the steps (default constant)")
    p.add_argument("--temperature", type=positive_float, default=1.0,
                   help="KD temperature T, finite and > 0; the KD loss is scaled by T^2 (default 1)")
    p.add_argument("--checkpoint-every", type=int, default=500,
                   help="save an Orbax checkpoint every N optimizer steps (and at the end; default 500)")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints kept (default 3)")
    p.add_argument("--allow-tokenizer-mismatch", action="store_true",
                   help="train a student whose tokenizer.json differs from the one the data was tokenized with "
                        "(refused by default); the HF export then ships the student's tokenizer")
    p.add_argument("--eval-data", help="held-out data (as --data): student cross-entropy and perplexity on its "
                                       "supervised tokens after training, written to <output>/eval.json")
    p.add_argument("--eval-teacher",
                   help="with --eval-data: a teacher (HF checkpoint dir or preset:NAME) run on it after training: "
                        "KL(teacher || student) over the full vocabulary, top-1 agreement, the student's mass on "
                        "the teacher's top-k and the tail-shape KL outside it (k: the run's top-k, else 64), "
                        "in eval.json, report.md and TensorBoard")
    p.add_argument("--eval-store",
                   help="a held-out logit store (same teacher and --seq-len, not the training store) evaluated "
                        "after training: cross-entropy and, against its teacher values, the KL over its k + 1 "
                        "bins (a lower bound), top-1 agreement and top-k mass (a top-k store) or the KL "
                        "estimated from its draws (a sampled store at proposal temperature 1); excludes "
                        "--eval-data")
    p.add_argument("--max-eval-examples", type=int,
                   help="evaluate on at most N examples of --eval-data or --eval-store")
    p.add_argument("--param-sharding", choices=("replicate", "fsdp"), default="replicate",
                   help="parameters and optimizer state replicated on every device, or split (fsdp)")
    p.add_argument("--log-every", type=int, default=None,
                   help="write a metrics row and a log line every N steps (default: about 20 per run)")
    p.add_argument("--no-report", dest="report", action="store_false",
                   help="no report.md / loss.png in the output")
    p.add_argument("--force-takeover", action="store_true",
                   help="take over the output's lease when it is stale (its training stopped refreshing it, "
                        "e.g. on a machine that is gone)")
    p.add_argument("--lease-timeout", type=positive_float, default=DEFAULT_LEASE_TIMEOUT_S,
                   help=f"seconds without a refresh after which this run's lease on its output counts as stale "
                        f"(default {DEFAULT_LEASE_TIMEOUT_S:.0f})")
    add_output_arguments(p)


def config_from_args(args: argparse.Namespace):
    from ..train.config import TrainConfig

    return TrainConfig(
        student=args.student, output=args.output, num_steps=args.num_steps, batch_size=args.batch_size,
        store=args.store, teacher=args.teacher, data=args.data, top_k=args.top_k, seq_len=args.seq_len,
        samples=args.samples, proposal_temperature=args.proposal_temperature, packing=args.packing,
        data_seed=args.data_seed, num_examples=args.num_examples, text_field=args.text_field, chat=chat_options(args),
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, end_lr_fraction=args.end_lr_fraction,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, grad_accum=args.grad_accum, seed=args.seed,
        param_sharding=args.param_sharding, loss=args.loss, alpha=args.alpha, alpha_end=args.alpha_end,
        alpha_schedule=args.alpha_schedule, temperature=args.temperature, jsd_beta=args.jsd_beta, skew=args.skew,
        allow_biased_temperature=args.allow_biased_temperature, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, eval_data=args.eval_data, eval_teacher=args.eval_teacher,
        eval_store=args.eval_store, max_eval_examples=args.max_eval_examples,
        log_every=args.log_every, progress=args.progress, report=args.report, force_takeover=args.force_takeover,
        lease_timeout_s=args.lease_timeout,
    )


def run(args: argparse.Namespace) -> int:
    import jax

    from ..train import train_student
    from ..train.report import outcome_lines

    result = train_student(config_from_args(args).check())
    if jax.process_index() == 0:
        lines = outcome_lines(result, result.metrics) or [f"trained to step {result.final_step}"]
        where = f"; report {result.report}" if result.report else ""
        print(f"logit-distill train: {result.output}: {'; '.join(lines)}; student exported to {result.export_dir}"
              f"{where}", file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(dataclasses.asdict(result), indent=2, sort_keys=True))
    return 0
