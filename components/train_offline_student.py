"""``train_offline_student``: train a student from the verified store (no teacher loaded).

A thin wrapper over ``logit_distill.train.train_student``. Outputs: a ``Model``
artifact (the training folder: Orbax checkpoints, ``metrics.jsonl``,
``eval.json`` and the exported student: Hugging Face format in ``hf/``, or ``student/``
for a ``flax:MODULE:FACTORY`` student), ``Metrics`` (final
losses, held-out cross-entropy and perplexity when ``eval_data`` or
``eval_store`` is given, and with ``eval_teacher`` or ``eval_store`` the
teacher-relative measures, ``eval_teacher_<measure>``) and
an ``HTML`` report with the loss curves as a picture; per-step curves also go
to TensorBoard event files (``$AIP_TENSORBOARD_LOG_DIR`` on Vertex, else the
folder's ``tensorboard/``).

Where it trains: ``output_dir`` if given, else
``<output_root>/students/<train_key>/`` (the key a fingerprint of the store and
every training setting), else the ``Model`` artifact's URI. In the first two, a
retried, preempted or resubmitted task with the same settings resumes from its
latest checkpoint. On a multi-host job only process 0 writes the task's
outputs; the others exit 0 once the training and its export are done.
``resources`` (what the pipeline requested for the task) is recorded in the
model's metadata; configuration values are metadata, not metrics.

A deterministic failure of the tool (bad input such as a mistyped
``eval_data`` or a student whose tokenizer differs, exit 2; non-finite values,
3; a damaged store, 4) does not fail the task, which a retry would only repeat
on a new accelerator job: the task succeeds with the one-line error in
``error`` and its code in ``exit_code`` (0 when it trained), and the pipeline's
``fail_on_error`` task fails the run with that line. Anything else (a
preemption, a crash) fails the task, which its retry policy runs again.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from .image import DEFAULT_IMAGE


def train_offline_student(
    store: Input[Dataset],
    student: str,
    num_steps: int,
    batch_size: int,
    model: Output[Model],
    metrics: Output[Metrics],
    report: Output[HTML],
    learning_rate: float = 3e-4,
    warmup_steps: int = -1,
    seed: int = 0,
    loss: str = "",
    alpha: float = 1.0,
    alpha_end: float = -1.0,
    alpha_schedule: str = "constant",
    temperature: float = 1.0,
    jsd_beta: float = 0.5,
    skew: float = 0.1,
    allow_biased_temperature: bool = False,
    checkpoint_every: int = 500,
    eval_data: str = "",
    eval_teacher: str = "",
    eval_store: str = "",
    max_eval_examples: int = 0,
    grad_accum: int = 1,
    allow_tokenizer_mismatch: bool = False,
    log_every: int = 10,
    output_root: str = "",
    output_dir: str = "",
    title: str = "",
    resources: dict = {},
) -> NamedTuple("TrainOutputs", [("hf_dir", str), ("error", str), ("exit_code", int)]):
    """Train ``student`` on ``store.uri``; export it; report its loss curves. ``-1`` / ``""`` mean "default"."""
    import base64
    import collections
    import html
    import os
    import sys

    from logit_distill import paths
    from logit_distill.distributed import init_from_environment
    from logit_distill.errors import LogitDistillError
    from logit_distill.failures import describe
    from logit_distill.train import TrainConfig, train_student
    from logit_distill.train.report import PLOT_NAME, outcome_lines, read_metrics
    from logit_distill.train.tensorboard import log_dir_for

    from logit_distill.logs import configure_from_environment

    configure_from_environment()
    init_from_environment()
    import jax

    from logit_distill.train.key import train_output, training_settings

    outputs = collections.namedtuple("TrainOutputs", ["hf_dir", "error", "exit_code"])
    settings = training_settings(
        student=student, num_steps=num_steps, batch_size=batch_size, grad_accum=grad_accum,
        learning_rate=learning_rate, warmup_steps=warmup_steps, seed=seed, loss=loss, alpha=alpha,
        alpha_end=alpha_end, alpha_schedule=alpha_schedule, temperature=temperature,
        allow_tokenizer_mismatch=allow_tokenizer_mismatch, jsd_beta=jsd_beta, skew=skew,
        allow_biased_temperature=allow_biased_temperature)
    try:
        # A folder named by the store and the settings: a retried or preempted task resumes there.
        output = output_dir or (train_output(output_root, store.uri, settings) if output_root else model.uri)
        result = train_student(TrainConfig.from_flat(
            store=store.uri, student=student, output=output, num_steps=num_steps, batch_size=batch_size,
            learning_rate=learning_rate, warmup_steps=warmup_steps, seed=seed, loss=loss, alpha=alpha,
            alpha_end=alpha_end, alpha_schedule=alpha_schedule, temperature=temperature, jsd_beta=jsd_beta,
            skew=skew, allow_biased_temperature=allow_biased_temperature, checkpoint_every=checkpoint_every,
            eval_data=eval_data, eval_teacher=eval_teacher, eval_store=eval_store,
            max_eval_examples=max_eval_examples, grad_accum=grad_accum, log_every=log_every,
            allow_tokenizer_mismatch=allow_tokenizer_mismatch, progress=False))
    except LogitDistillError as e:  # deterministic: recorded for fail_on_error, not retried
        code, line = describe(e)
        line = f"logit-distill train: {line}"
        print(line, file=sys.stderr, flush=True)
        if jax.process_index() != 0:
            raise SystemExit(0)
        return outputs("", line, code)
    if jax.process_index() != 0:
        raise SystemExit(0)  # the checkpoint and export are complete; process 0 writes the task's outputs
    model.uri = result.output
    rows = read_metrics(result.output)
    model.metadata.update({
        "framework": "jax", "hf_dir": result.hf_dir or "", "export_dir": result.export_dir,
        "format": "orbax + " + ("huggingface safetensors" if result.hf_dir else "flax nnx safetensors + student.json"),
        "student": student, "store": store.uri, "num_steps": result.final_step, "loss": loss, "alpha": alpha,
        "resources_requested": dict(resources), "settings": settings,
        "resumed_from_step": result.resumed_from_step, "tensorboard": log_dir_for(result.output),
    })
    if result.eval:  # eval.json, as use_existing_student gives it for a reused student
        model.metadata["eval"] = result.eval

    final = result.metrics or (rows[-1] if rows else {})
    for key in ("loss", "kd_loss", "ce_loss", "grad_norm", "tokens_per_s"):
        if key in final:
            metrics.log_metric(f"final_{key}", round(float(final[key]), 6))
    if result.eval:
        metrics.log_metric("eval_cross_entropy", round(float(result.eval["cross_entropy"]), 6))
        metrics.log_metric("eval_perplexity", round(float(result.eval["perplexity"]), 4))
        metrics.log_metric("eval_tokens", int(result.eval["num_tokens"]))
        # with eval_teacher or eval_store: the teacher-relative means per position (eval.json's "teacher")
        for name, value in result.eval.get("teacher", {}).items():
            if name in ("k", "count"):
                metrics.log_metric(f"eval_teacher_{name}", int(value))
            elif name != "against":
                metrics.log_metric(f"eval_teacher_{name}", round(float(value), 6))

    # ---- the report: the training's own figure (loss.png, written by the run) embedded in one page
    png = base64.b64encode(paths.read_bytes(paths.join(result.output, PLOT_NAME))).decode()
    shown = {"student": student, "store": store.uri, "steps": num_steps, "batch_size": batch_size,
             "grad_accum": grad_accum, "learning_rate": learning_rate, "loss": loss, "alpha": alpha,
             "alpha_end": None if alpha_end < 0 else alpha_end, "alpha_schedule": alpha_schedule,
             "temperature": temperature, "seed": seed, "output": result.output, "export": result.export_dir}
    # the loss settings in the train key (only where they apply), and the evaluation asked for
    shown.update({k: v for k, v in settings.items() if k in ("jsd_beta", "skew", "allow_biased_temperature")})
    shown.update({k: v for k, v in (("eval_data", eval_data), ("eval_teacher", eval_teacher),
                                    ("eval_store", eval_store)) if v})
    table = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                    for k, v in shown.items())
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>student training</title>"
        "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}"
        "th,td{border:1px solid #ccc;padding:2px 8px;text-align:left}</style></head><body>"
        f"<h1>{html.escape(title or 'Offline distillation: student training')}</h1>"
        f"<p>{'<br>'.join(html.escape(line) for line in outcome_lines(result, final))}</p>"
        f"<img alt='loss curves' src='data:image/png;base64,{png}'>"
        f"<h2>Settings</h2><table>{table}</table></body></html>"
    )
    os.makedirs(os.path.dirname(report.path) or ".", exist_ok=True)
    with open(report.path, "w", encoding="utf-8") as f:
        f.write(page)
    # a Flax NNX student has no HF export: its export folder (student/) is the model to register
    return outputs(result.hf_dir or result.export_dir, "", 0)


# Descriptions of the inputs no pipeline parameter feeds (the others come from pipelines/params.py).
INPUTS = {
    "store": "The verified store.",
    "model": "The training folder: Orbax checkpoints, metrics.jsonl, eval.json, the HF export in hf/.",
    "metrics": "Final losses, the held-out cross-entropy / perplexity and the teacher-relative measures "
               "(eval_teacher_<measure>).",
    "report": "Loss curves and schedules (HTML).",
    "max_eval_examples": "Evaluate on at most this many held-out examples (0: all).",
    "log_every": "Optimizer steps between metric rows.",
    "output_dir": "Train here instead of under <output_root>/students/<train_key>/ (a re-run resumes from it).",
    "title": "Title of the report.",
    "resources": "The resources the pipeline requested for the task (recorded in the model's metadata).",
    "error": "The tool's one-line error when it failed deterministically (exit 2, 3, 4), else empty.",
    "exit_code": "That error's exit code (docs/ERRORS.md); 0 when the student trained.",
}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(train_offline_student, INPUTS), base_image=image, install_kfp_package=False)


component = build()
