"""What a training run will do, found before any weight is read: ``plan_training(config)``.

The plan checks everything that needs no forward pass: the output (never inside an input, a
training output of this tool or empty), the data (a store's manifest, or the teacher's config and
the data), the loss against what the store holds, the student's vocabulary, length and tokenizer,
the evaluation data; and it names the run: its settings (``train_config.json``: a re-run with
other settings is refused) and the checkpoint it resumes from.
"""

from __future__ import annotations

import dataclasses
import json

from .. import paths
from ..errors import InputError
from ..outputs import check_output
from . import checkpointing
from .config import TrainConfig
from .losses import KIND_PARTS, check_sampled_divergence, check_sampled_temperature, representation
from .sources import TrainSource, open_source
from .student import StudentSpec, check_tokenizer, describe_student

CONFIG_NAME = "train_config.json"
EVAL_NAME = "eval.json"
# What a training output holds besides its run's files while it runs (a new output may hold only these).
OWN_NAMES = ("lease.json",)


@dataclasses.dataclass
class TrainPlan:
    config: TrainConfig
    source: TrainSource
    loss: str
    student: StudentSpec
    settings: dict  # the run's identity (train_config.json)
    resume_from: int | None  # the checkpoint step this run starts from (None: from scratch)
    tokenizer_path: str | None  # shipped with the export, and used to read --eval-data
    eval_examples: object | None  # ExampleSource over --eval-data, or teacher_eval.StoreExamples (--eval-store)
    warnings: list
    eval_reference: object | None = None  # what the student is measured against (teacher_eval)

    @property
    def proposal_temperature(self) -> float:
        return self.source.proposal_temperature(self.config)

    @property
    def existing_settings(self) -> bool:
        return paths.exists(paths.join(self.config.output, CONFIG_NAME))


def plan_training(config: TrainConfig, *, source: TrainSource | None = None) -> TrainPlan:
    """Plan ``config``'s run. ``source``: the data as another step already knows it (a dump's plan,
    ``sources.planned_source``, for a pipeline's preflight before the store exists); by default it is
    opened (``sources.open_source``)."""
    import jax

    config.check()
    paths.check_inputs_reachable(config.inputs)  # gs://: one line within seconds, not a minute of retries
    check_output(config.output, "--output", kind="dir", inputs=config.inputs)
    check_training_output(config.output)
    devices = jax.device_count()
    if config.batch_size % devices:
        raise InputError(f"--batch-size {config.batch_size} is not divisible by the {devices} devices (the batch "
                         "is split evenly over them)")
    _check_schedules(config)
    source = source or open_source(config)
    loss = config.resolved_loss(source.selection, source.top_k, source.vocab_size)
    _check_loss(config, source, loss)
    if representation(loss) == "sampled":  # draws made at t give a biased signal at T != t: refused before any output
        check_sampled_divergence(KIND_PARTS[loss][1], config.temperature, source.proposal_temperature(config))
        check_sampled_temperature(config.temperature, source.proposal_temperature(config),
                                  allow_biased_temperature=config.allow_biased_temperature, where=source.where)
    if representation(loss) == "hybrid":  # the tail draws weigh count / N: exact in expectation at T = t only
        check_sampled_temperature(config.temperature, source.proposal_temperature(config), where=source.where)
    if config.batch_size > len(source):
        raise InputError(f"--batch-size {config.batch_size} exceeds the {len(source)} examples of {source.where}: "
                         "every batch would repeat examples; lower --batch-size")
    student = describe_student(config.student, vocab_size=source.vocab_size, seq_len=source.seq_len,
                               where=source.where)
    reference = f"the {source.where}" if source.mode == "online" else source.where
    warnings = [w for w in (check_tokenizer(student, source.tokenizer_file, source.tokenizer_sha256, reference,
                                            allow=config.allow_tokenizer_mismatch),) if w]
    if loss == "topk_kl" and config.alpha == 1.0 and config.alpha_schedule == "constant" and \
            source.top_k < source.vocab_size:
        warnings.append("warning: --loss topk_kl with --alpha 1 gives no signal on the student's mass outside the "
                        "teacher's top-k (it stays where initialization put it); use topk_tail_kl, sampled_kl, "
                        "or alpha < 1 (docs/LOSSES.md)")
    bias = _temperature_bias_warning(config, source, loss)
    if bias:
        warnings.append(bias)
    tokenizer_path = student.tokenizer_path or source.tokenizer_file
    eval_examples = None
    if config.eval_data is not None:
        from .evaluate import open_eval_data

        # Held-out data is read as the training data was: the data's tokenizer folder (its chat template and
        # EOS; the student's tokenizer.json is the same unless a mismatch was allowed) and its chat options.
        eval_tokenizer = tokenizer_path if config.allow_tokenizer_mismatch else source.tokenizer_file or tokenizer_path
        eval_examples = open_eval_data(config.eval_data, eval_tokenizer, seq_len=source.seq_len,
                                       packing=source.packing, vocab_size=student.vocab_size,
                                       text_field=config.text_field or source.text_field,
                                       chat=config.chat or source.chat)
    eval_reference = None
    if config.eval_teacher is not None or config.eval_store is not None:
        from .teacher_eval import open_eval_reference

        eval_examples, eval_reference = open_eval_reference(config, source, eval_examples)
        if config.eval_store is not None and config.eval_store == config.store:
            warnings.append(f"warning: --eval-store is the training store {config.store}: its measures are on "
                            "examples the student trained on, not held-out ones")
    settings = run_settings(config, source, student, loss)
    existing = _read_json(paths.join(config.output, CONFIG_NAME))
    if existing is not None:
        _check_same_settings(existing, settings, config.output)
    resume_from = checkpointing.latest_step(config.output)
    if resume_from is not None and resume_from > config.num_steps:
        raise InputError(f"{config.output} holds a checkpoint at step {resume_from}, beyond --num-steps "
                         f"{config.num_steps}; give --num-steps >= {resume_from} or another --output")
    return TrainPlan(config=config, source=source, loss=loss, student=student, settings=settings,
                     resume_from=resume_from, tokenizer_path=tokenizer_path, eval_examples=eval_examples,
                     warnings=warnings, eval_reference=eval_reference)


def plan_training_on(dump_plan, config: TrainConfig) -> TrainPlan:
    """Plan ``config``'s training on the store ``dump_plan`` will write, before it exists (a pipeline's
    preflight on the CPU: everything but the forward passes is checked before the dump's accelerators
    start). ``config.store`` names the store's planned location."""
    from .sources import planned_source

    return plan_training(config, source=planned_source(config, dump_plan.manifest, dump_plan.tokenizer))


def check_training_output(output: str) -> None:
    """An existing output folder must be empty or a training output of this tool (it holds
    ``train_config.json``): files the tool did not write are never mixed with, or replaced by, a run's."""
    if not paths.exists(output):
        return
    names = [f["name"] for f in paths.list_files(output, with_sizes=False)]
    others = sorted(n for n in names if n not in OWN_NAMES and not n.startswith(paths.TMP_PREFIX))
    if others and CONFIG_NAME not in names:
        shown = ", ".join(others[:5]) + (" ..." if len(others) > 5 else "")
        raise InputError(f"--output {output} is not empty and holds no {CONFIG_NAME} (found {shown}): it is not "
                         "a training output of logit-distill; choose an empty or new folder")


def run_settings(config: TrainConfig, source: TrainSource, student: StudentSpec, loss: str) -> dict:
    """The settings a resumed run must share with the run that wrote the output (train_config.json)."""
    settings = {
        **source.identity,
        "student": config.student, "student_identity": student.identity,
        "num_steps": config.num_steps, "batch_size": config.batch_size, "grad_accum": config.grad_accum,
        "learning_rate": float(config.learning_rate), "warmup_steps": config.warmup,
        "end_lr_fraction": float(config.end_lr_fraction), "weight_decay": float(config.weight_decay),
        "max_grad_norm": None if config.max_grad_norm is None else float(config.max_grad_norm),
        "seed": config.seed, "loss": loss, "alpha": float(config.alpha),
        "alpha_end": None if config.alpha_end is None else float(config.alpha_end),
        "alpha_schedule": config.alpha_schedule, "temperature": float(config.temperature),
        "process_count": _process_count(), "param_sharding": config.param_sharding,
    }
    if config.allow_tokenizer_mismatch:  # recorded only when set: outputs of earlier versions still resume
        settings["allow_tokenizer_mismatch"] = True
    if representation(loss) in ("sampled", "hybrid"):
        settings["proposal_temperature"] = source.proposal_temperature(config)
        if config.online:
            settings["samples"] = int(config.samples)
    # Recorded only where they apply: outputs of earlier versions still resume.
    if loss.endswith("_jsd"):
        settings["jsd_beta"] = float(config.jsd_beta)
    if "_skew_" in loss:
        settings["skew"] = float(config.skew)
    if config.allow_biased_temperature:
        settings["allow_biased_temperature"] = True
    return settings


def write_settings(plan: TrainPlan) -> None:
    """train_config.json, written once by the run that starts the output."""
    if not plan.existing_settings:
        paths.makedirs(plan.config.output)
        write_json(paths.join(plan.config.output, CONFIG_NAME), plan.settings)


def write_json(uri: str, obj) -> None:
    paths.write_bytes_atomic(uri, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _process_count() -> int:
    import jax

    return jax.process_count()


def _read_json(uri: str):
    return json.loads(paths.read_bytes(uri)) if paths.exists(uri) else None


def _check_same_settings(existing: dict, wanted: dict, where: str) -> None:
    diffs = [
        f"{key}: the earlier run had {existing.get(key, '<absent>')!r}, this run has {wanted.get(key, '<absent>')!r}"
        for key in sorted(set(existing) | set(wanted))
        if existing.get(key, "<absent>") != wanted.get(key, "<absent>")
    ]
    if diffs:
        raise InputError(f"{where} holds a training run with other settings; nothing was changed: "
                         + "; ".join(diffs) + "; use another --output, or the settings of the earlier run to resume it")


def _check_schedules(config: TrainConfig) -> None:
    from .schedules import alpha_schedule, learning_rate_schedule

    try:
        alpha_schedule(config.alpha_schedule, config.alpha, config.alpha_end, config.num_steps)
        learning_rate_schedule(config.learning_rate, config.warmup, config.num_steps, config.end_lr_fraction)
    except ValueError as e:
        raise InputError(str(e)) from None


# The losses each store selection holds the values of: (representations, in words). A hybrid record's
# head is a top-k record (the top-k and its tail mass), so the top-k losses read it too.
_FITS = {
    "topk": (("topk", "topk_tail"), "topk_kl or a topk_tail_* loss (topk_tail_kl, topk_tail_reverse_kl, ...)"),
    "sampled": (("sampled",), "a sampled_* loss (sampled_kl, sampled_jsd, ...)"),
    "hybrid": (("hybrid", "topk", "topk_tail"), "hybrid_kl (its default), or topk_kl / a topk_tail_* loss on its "
                                               "head"),
}


def _check_loss(config: TrainConfig, source: TrainSource, loss: str) -> None:
    """The loss against what the data holds (offline: the store's selection and tails)."""
    if source.manifest is None:
        return
    from ..store import manifest as manifest_mod

    rep = representation(loss)
    if rep not in _FITS[source.selection][0]:
        raise InputError(f"--loss {loss} does not fit {source.where}: it holds a {source.selection} selection; "
                         f"use {_FITS[source.selection][1]}")
    if rep == "topk_tail" and source.top_k >= source.vocab_size:
        raise InputError(f"--loss {loss} needs tail mass, but {source.where} keeps top_k={source.top_k} of "
                         f"vocab_size={source.vocab_size} entries: there is no tail; use --loss topk_kl (exact there)")
    if rep == "topk_tail" and float(config.temperature) != 1.0:
        have = manifest_mod.tail_temperatures_of(source.manifest)
        T = float(config.temperature)
        if T not in have:
            # a hybrid store holds its tail at its proposal temperature; a top-k store at its tail temperatures
            redump = (f"--proposal-temperature {T:g}" if source.selection == "hybrid"
                      else f"--selection topk --tail-temperatures {T:g}")
            raise InputError(
                f"--loss {loss} at --temperature {T:g} needs the teacher's tail mass tempered at {T:g}, but "
                f"{source.where} holds it at {', '.join(f'{t:g}' for t in have) if have else 'no temperature'}; use "
                f"one of those (or 1), or dump with {redump}")


# Measured relative gradient bias of sampled_kl at T != t (docs/LOSSES.md, bench/temperature_bias.py):
# {draws N: (smallest, largest)} over the teachers measured (V = 64 and 4096; t -> T = 1 -> 2 and 2 -> 1).
_MEASURED_TEMPERATURE_BIAS = {4: (0.31, 1.88), 16: (0.081, 0.67), 32: (0.047, 0.43), 64: (0.029, 0.29)}


def _temperature_bias_warning(config: TrainConfig, source: TrainSource, loss: str) -> str | None:
    """The one line a run accepting a biased sampled loss logs: the bias measured at the nearest N."""
    T, t = float(config.temperature), source.proposal_temperature(config)
    if representation(loss) != "sampled" or T == t:
        return None
    n = int(source.top_k)
    near = min(_MEASURED_TEMPERATURE_BIAS, key=lambda m: abs(m - n))
    low, high = _MEASURED_TEMPERATURE_BIAS[near]
    return (f"warning: --allow-biased-temperature: --loss {loss} at --temperature {T:g} from draws made at {t:g} "
            f"({n} a position) uses self-normalised importance weights; the gradient is biased by about "
            f"{low:.0%}-{high:.0%} of its size (measured at N = {near}, docs/LOSSES.md), a bias that shrinks only "
            "as fast as the draws' noise")
