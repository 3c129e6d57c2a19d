"""``plan_training``: name a student's training folder and say whether its training is already done.

A CPU task before each training (the KD student, the CE-only baseline). It
computes the train key (a fingerprint of the store and every training
setting, ``logit_distill.train.key``) and the folder
``<output_root>/students/<train_key>/`` the training resumes in (or
``output_dir`` when given), and reads that folder's names: ``complete`` when
the export is written (and the evaluation on ``eval_data`` or ``eval_store``,
against ``eval_teacher`` when given, when one is asked for),
so the pipeline skips the training task and no accelerator job starts for a
student that exists. A training still to do is planned here
(``logit_distill.train.plan_training``: the student's vocabulary, length and
tokenizer against the store, the loss, the evaluation data read and
tokenized, the evaluation teacher's config or the held-out store's manifest, the
folder): a mistyped held-out path or a student of another
tokenizer fails here, on the CPU image, with the tool's one line (exit 2),
before the training's accelerator job. ``state`` says what is there (``empty``, ``checkpoint at
step N``, ...). ``job_display_name`` names the training's custom job after the
run, the student's role and its key.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Input

from .image import DEFAULT_IMAGE


def plan_training(
    store: Input[Dataset],
    student: str,
    num_steps: int,
    batch_size: int,
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
    grad_accum: int = 1,
    allow_tokenizer_mismatch: bool = False,
    eval_data: str = "",
    eval_teacher: str = "",
    eval_store: str = "",
    output_root: str = "",
    output_dir: str = "",
    role: str = "student",
    run_name: str = "",
) -> NamedTuple("TrainingPlan", [("output", str), ("complete", bool), ("state", str),
                                 ("job_display_name", str)]):
    """The training folder of these settings, whether its training is done, and the job's display name."""
    import collections
    import sys

    from logit_distill import paths
    from logit_distill.errors import InputError, LogitDistillError
    from logit_distill.failures import describe
    from logit_distill.train import TrainConfig, plan_training
    from logit_distill.train.key import STUDENTS_DIR, train_key, training_settings, training_state

    try:
        if not (output_dir or output_root):
            raise InputError("output_root is empty: give a local directory or a gs:// prefix")
        settings = training_settings(
            student=student, num_steps=num_steps, batch_size=batch_size, grad_accum=grad_accum,
            learning_rate=learning_rate, warmup_steps=warmup_steps, seed=seed, loss=loss, alpha=alpha,
            alpha_end=alpha_end, alpha_schedule=alpha_schedule, temperature=temperature,
            allow_tokenizer_mismatch=allow_tokenizer_mismatch, jsd_beta=jsd_beta, skew=skew,
            allow_biased_temperature=allow_biased_temperature)
        key = train_key(store.uri, settings)
        output = output_dir or paths.join(output_root, STUDENTS_DIR, key)
        state = training_state(output, eval_data, eval_teacher, eval_store)
        if state != "complete":  # everything the training checks before its first step, on this CPU
            plan_training(TrainConfig.from_flat(
                store=store.uri, student=student, output=output, num_steps=num_steps, batch_size=batch_size,
                learning_rate=learning_rate, warmup_steps=warmup_steps, seed=seed, loss=loss, alpha=alpha,
                alpha_end=alpha_end, alpha_schedule=alpha_schedule, temperature=temperature, jsd_beta=jsd_beta,
                skew=skew, allow_biased_temperature=allow_biased_temperature, grad_accum=grad_accum,
                eval_data=eval_data, eval_teacher=eval_teacher, eval_store=eval_store,
                allow_tokenizer_mismatch=allow_tokenizer_mismatch, progress=False))
    except LogitDistillError as e:  # a CPU task without retries: the run fails with this line
        code, line = describe(e)
        print(f"logit-distill train: {line}", file=sys.stderr, flush=True)
        raise SystemExit(code)
    name = "-".join(part for part in (run_name, role, key) if part)[:128]
    print(f"plan_training: {role} {output} ({state})", flush=True)
    return collections.namedtuple("TrainingPlan", ["output", "complete", "state", "job_display_name"])(
        output, state == "complete", state, name)


# Descriptions of the inputs no pipeline parameter feeds (the others come from pipelines/params.py).
INPUTS = {
    "store": "The verified store.",
    "output_dir": "Train here instead of under <output_root>/students/<train_key>/.",
    "role": "The student's role in the run (kd, ce-baseline): part of the job's display name.",
    "run_name": "The pipeline run's name (Vertex's {{$.pipeline_job_name}}): part of the job's display name.",
}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(plan_training, INPUTS), base_image=image, install_kfp_package=False)


component = build()
