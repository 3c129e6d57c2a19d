"""``preflight``: the whole run checked on the CPU image before any accelerator job starts.

The pipeline's first task after ``plan_dump``: it plans the dump (the teacher's config and tokenizer, the
data's identity, the store's key) and then the KD student's training against the store that dump will
write (``logit_distill.train.plan.plan_training_on``: the student's vocabulary, length and tokenizer against the
teacher's, the loss against the store's selection, the evaluation data read and tokenized, the evaluation teacher's
config or the held-out store's manifest, the training
folder, every setting). A deterministic failure (exit 2) fails the run here, with the tool's one line and
no retry; nothing is written. The dump starts only after it. Its inputs are the plan's and, prefixed
``train_``, the training plan's.
"""

from kfp import dsl

from .image import DEFAULT_IMAGE


def preflight(
    teacher: str,
    data: str,
    output_root: str,
    num_steps: int,
    train_student: str,
    train_num_steps: int,
    train_batch_size: int,
    top_k: int = 0,
    seq_len: int = 512,
    batch_size: int = 8,
    steps_per_file: int = 50,
    codec: str = "default",
    selection: str = "hybrid",
    samples: int = 0,
    proposal_temperature: float = 1.0,
    tail_temperatures: str = "",
    data_seed: int = 0,
    packing: bool = True,
    dtype: str = "float32",
    text_field: str = "text",
    tokenizer: str = "",
    data_format: str = "auto",
    messages_field: str = "messages",
    chat_template: str = "",
    chat_template_kwargs: str = "",
    supervise_roles: str = "assistant",
    supervise_end_of_turn: bool = True,
    mask_empty_reasoning: bool = True,
    mask_method: str = "auto",
    num_processes: int = 1,
    tpu_topology: str = "",
    machine_type: str = "",
    train_learning_rate: float = 3e-4,
    train_warmup_steps: int = -1,
    train_seed: int = 0,
    train_loss: str = "",
    train_alpha: float = 1.0,
    train_alpha_end: float = -1.0,
    train_alpha_schedule: str = "constant",
    train_temperature: float = 1.0,
    train_jsd_beta: float = 0.5,
    train_skew: float = 0.1,
    train_allow_biased_temperature: bool = False,
    train_grad_accum: int = 1,
    train_allow_tokenizer_mismatch: bool = False,
    train_eval_data: str = "",
    train_eval_teacher: str = "",
    train_eval_store: str = "",
) -> str:
    """Check the dump and the training of these settings; return the training folder they would use."""
    inputs = dict(locals())  # the arguments: DumpConfig.from_component takes the store's settings among them
    import sys

    from logit_distill import paths
    from logit_distill.distributed import planned_processes
    from logit_distill.dump import DumpConfig, plan_dump
    from logit_distill.errors import InputError, LogitDistillError
    from logit_distill.failures import describe
    from logit_distill.train import TrainConfig
    from logit_distill.train.plan import plan_training_on
    from logit_distill.train.key import STUDENTS_DIR, train_key, training_settings

    try:
        if not output_root:
            raise InputError("output_root is empty: give a local directory or a gs:// prefix")
        dump_config = DumpConfig.from_component(inputs, output="", progress=False)  # as plan_dump's
        processes = planned_processes(num_processes, tpu_topology, machine_type)
        planned = plan_dump(dump_config, num_processes=processes)
        store_uri = output_root.rstrip("/") + "/teacher_topk/" + planned.dump_key
        flat = dict(student=train_student, num_steps=train_num_steps, batch_size=train_batch_size,
                    learning_rate=train_learning_rate, warmup_steps=train_warmup_steps, seed=train_seed,
                    loss=train_loss, alpha=train_alpha, alpha_end=train_alpha_end,
                    alpha_schedule=train_alpha_schedule, temperature=train_temperature, jsd_beta=train_jsd_beta,
                    skew=train_skew, allow_biased_temperature=train_allow_biased_temperature,
                    grad_accum=train_grad_accum, allow_tokenizer_mismatch=train_allow_tokenizer_mismatch)
        key = train_key(store_uri, training_settings(**flat), fingerprint=planned.manifest["fingerprint"])
        output = paths.join(output_root, STUDENTS_DIR, key)
        plan_training_on(planned, TrainConfig.from_flat(store=store_uri, output=output, eval_data=train_eval_data,
                                                        eval_teacher=train_eval_teacher,
                                                        eval_store=train_eval_store, progress=False, **flat))
    except LogitDistillError as e:  # a CPU task without retries: the run fails with this line
        code, line = describe(e)
        print(f"logit-distill preflight: {line}", file=sys.stderr, flush=True)
        raise SystemExit(code)
    print(f"preflight: the dump into {store_uri} and the KD student's training in {output} checked", flush=True)
    return output


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import PLAN, TRAIN_PLAN, describe, input_descriptions

    from .plan_dump import INPUTS as PLAN_INPUTS

    # the plan's inputs, and the training plan's prefixed train_, described as there
    inputs = {**input_descriptions(PLAN), **PLAN_INPUTS, **input_descriptions(TRAIN_PLAN, prefix="train_")}
    return dsl.component(describe(preflight, inputs), base_image=image, install_kfp_package=False)


component = build()
