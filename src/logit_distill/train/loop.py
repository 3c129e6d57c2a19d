"""The student training loop: ``train_student`` (offline from a store, or online with a teacher).

Order of work: check every input (store complete and intact, vocabularies,
loss vs tail mass, settings vs an earlier run in the same output) before any
step; build the state and the Grain iterator; resume from the latest Orbax
checkpoint if there is one; train; save a checkpoint every
``checkpoint_every`` optimizer steps and at the end; export the student (HF
format to ``<output>/hf``, a Flax NNX student to ``<output>/student``); evaluate on ``eval_data``. docs/TRAIN.md describes
the outputs and the guarantees.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .. import paths
from ..errors import InputError, NonFiniteError
from ..outputs import check_output
from ..signals import Interrupted, StopOnSignal
from . import checkpointing, loader
from .evaluate import evaluate, open_eval_data
from .losses import DEFAULT_LOSS, FIELDS, KINDS, accumulation_scales, check_sampled_temperature, distill_loss
from . import schedules
from .schedules import ALPHA_KINDS, learning_rate_schedule

CONFIG_NAME = "train_config.json"


class TrainingInterrupted(Interrupted):
    """Training stopped on a signal after saving a checkpoint; a re-run resumes."""
METRICS_NAME = "metrics.jsonl"
EVAL_NAME = "eval.json"
from .student import FLAX_DIR, HF_DIR  # noqa: F401 - the export folders under the output
SHARDING_MODES = ("replicate", "fsdp")


@dataclasses.dataclass
class TrainResult:
    output: str
    final_step: int
    metrics: dict | None  # the last logged metrics
    eval: dict | None  # eval.json's content when eval_data was given
    hf_dir: str | None  # the HF export of a built-in student (None for a Flax student)
    resumed_from_step: int | None  # the checkpoint step this run started from (None: from scratch)
    export_dir: str | None = None  # the exported student: hf/ (built-in) or student/ (Flax NNX)


# ----------------------------------------------------------------------------- train step


def make_optimizer(lr_schedule, *, weight_decay: float, max_grad_norm: float | None, grad_accum: int,
                   b1: float = 0.9, b2: float = 0.95):
    """Clip by global norm (unless ``max_grad_norm`` is None), then AdamW (decay on matrices only);
    ``optax.MultiSteps`` for accumulation."""
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(lr_schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask)
    tx = adamw if max_grad_norm is None else optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
    if grad_accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=grad_accum)
    return tx


def make_train_step(apply, tx, *, loss: str, temperature: float, proposal_temperature: float = 1.0):
    """``step(state, batch, alpha, scale=1) -> (state, metrics)``, pure.

    ``alpha`` is a traced float32 scalar, so a CE-only run (alpha 0) and a KD
    run compile to the same function (``distill_loss`` picks the branch with
    ``lax.cond``) and their step times compare like for like. ``scale``
    multiplies the loss whose gradient is taken (``losses.accumulation_scales``:
    token-weighted gradient accumulation); the metrics are unscaled. No host syncs.
    """

    def loss_fn(params, batch, alpha, scale):
        logits = apply(params, batch["tokens"], batch["positions"], batch["segment_ids"])
        value, aux = distill_loss(logits, batch, kind=loss, alpha=alpha, temperature=temperature,
                                  proposal_temperature=proposal_temperature)
        return value * scale, (value, aux)

    def step(state, batch, alpha, scale=jnp.float32(1.0)):
        (_, (value, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch, alpha, scale)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {
            "loss": value,
            "kd_loss": aux["kd_loss"],
            "ce_loss": aux["ce_loss"],
            "num_tokens": aux["num_tokens"],
            "grad_norm": grad_norm,
            # The host stops the run at the first step where this is false (see FiniteGuard).
            "finite": jnp.isfinite(value) & jnp.isfinite(grad_norm),
        }
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return step


# ----------------------------------------------------------------------------- helpers


def _check_floats(**values) -> None:
    """The float settings: finite, and each in its range (None where it means 'off')."""
    rules = {
        "learning_rate": (lambda v: v > 0, "> 0"),
        "temperature": (lambda v: v > 0, "> 0"),
        "weight_decay": (lambda v: v >= 0, ">= 0"),
        "max_grad_norm": (lambda v: v > 0, "> 0 (or None for no clipping)"),
        "end_lr_fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
        "alpha": (lambda v: True, "finite"),
        "alpha_end": (lambda v: True, "finite"),
    }
    optional = ("max_grad_norm", "alpha_end")
    for name, value in values.items():
        if value is None and name in optional:
            continue
        ok, rule = rules[name]
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise InputError(f"{name} must be a number {rule}, got {value!r}") from None
        if not math.isfinite(v) or not ok(v):
            raise InputError(f"{name} must be finite and {rule}, got {value!r}")


class FiniteGuard:
    """Stops training at the first optimizer step whose loss or gradient norm is not finite.

    The train step returns a device bool ``finite`` per micro-step; ``add`` keeps them and
    ``check`` fetches them: every step for all but the newest (one step behind the device,
    so the check never stalls it) and everything before a checkpoint or the export, so a
    checkpoint never holds a state past a NaN. The last good checkpoint stays the latest.
    """

    def __init__(self, output: str):
        self.output = output
        self.pending: list[tuple[int, list]] = []  # (step, [finite, loss, grad_norm] per micro-step)
        self.last_saved: int | None = None

    def add(self, step: int, micro_metrics: list) -> None:
        self.pending.append((step, [(m["finite"], m["loss"], m["grad_norm"]) for m in micro_metrics]))

    def check(self, keep_newest: bool = False) -> None:
        n = len(self.pending) - 1 if keep_newest else len(self.pending)
        if n <= 0:
            return
        todo, self.pending = self.pending[:n], self.pending[n:]
        for step, micro in jax.device_get(todo):
            for finite, loss, grad_norm in micro:
                if not bool(finite):
                    kept = (f"the last good checkpoint, step {self.last_saved}, is kept in "
                            f"{checkpointing.checkpoint_dir(self.output)}" if self.last_saved is not None
                            else "no checkpoint was saved")
                    raise NonFiniteError(
                        f"non-finite loss or gradient norm at step {step} (loss {float(loss)}, grad norm "
                        f"{float(grad_norm)}); training stopped, {kept}; lower --learning-rate, set "
                        "--max-grad-norm, or check the store (logit-distill verify)"
                    )


def make_mesh() -> Mesh:
    """A 1-D ``data`` mesh over all devices (of all processes), with Auto axes."""
    return Mesh(np.asarray(jax.devices()), ("data",), axis_types=(AxisType.Auto,))


def _placer(mesh: Mesh):
    sharding = NamedSharding(mesh, P("data"))

    def put(batch: dict) -> dict:
        return {k: jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(v))
                for k, v in batch.items()}

    return put, sharding


def _read_json(uri: str):
    return json.loads(paths.read_bytes(uri)) if paths.exists(uri) else None


def _write_json(uri: str, obj) -> None:
    paths.write_bytes_atomic(uri, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _check_same_config(existing: dict, wanted: dict, where: str) -> None:
    diffs = [
        f"{key}: the earlier run had {existing.get(key, '<absent>')!r}, this run has {wanted.get(key, '<absent>')!r}"
        for key in sorted(set(existing) | set(wanted))
        if existing.get(key, "<absent>") != wanted.get(key, "<absent>")
    ]
    if diffs:
        raise InputError(
            f"{where} holds a training run with other settings; nothing was changed.\n  "
            + "\n  ".join(diffs)
            + "\nUse another --output, or the settings of the earlier run to resume it."
        )


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step.

    Locally each line is appended and flushed as it comes; on an object store
    (no appends) the whole file is rewritten at each checkpoint and at the end.
    On resume, lines of steps after the checkpoint (logged by the killed run,
    about to be redone) are dropped, so each step appears once.
    """

    def __init__(self, output: str, keep_up_to_step: int):
        self.uri = paths.join(output, METRICS_NAME)
        self.local = paths.is_local(self.uri)
        self.lines: list[str] = []
        if paths.exists(self.uri):
            for line in paths.read_bytes(self.uri).decode(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if isinstance(rec, dict) and rec.get("step", math.inf) <= keep_up_to_step:
                    self.lines.append(json.dumps(rec, sort_keys=True))
        self.flush()
        self._file = open(paths.local_path(self.uri), "a") if self.local else None
        from .tensorboard import TensorBoard

        self.tensorboard = TensorBoard(output, purge_step=keep_up_to_step)

    @property
    def last(self) -> dict | None:
        return json.loads(self.lines[-1]) if self.lines else None

    def write(self, rec: dict) -> None:
        line = json.dumps(rec, sort_keys=True)
        self.lines.append(line)
        self.tensorboard.write(rec)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def flush(self) -> None:
        if getattr(self, "tensorboard", None) is not None:
            self.tensorboard.flush()
        if self.local and getattr(self, "_file", None) is not None:
            self._file.flush()
            return
        paths.write_bytes_atomic(self.uri, "".join(line + "\n" for line in self.lines).encode())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        else:
            self.flush()
        self.tensorboard.close()


def _host_params(params):
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(params, tiled=True)
    return jax.device_get(params)


# ----------------------------------------------------------------------------- the run


def train_student(
    *,
    store: str | None = None,
    teacher: str | None = None,
    data: str | None = None,
    top_k: int | None = None,
    seq_len: int | None = None,
    student: str,
    output: str,
    num_steps: int,
    batch_size: int,
    learning_rate: float = 3e-4,
    warmup_steps: int | None = None,
    seed: int = 0,
    loss: str | None = None,
    alpha: float = 1.0,
    alpha_end: float | None = None,
    alpha_schedule: str = "constant",
    temperature: float = 1.0,
    checkpoint_every: int = 500,
    eval_data: str | None = None,
    grad_accum: int = 1,
    log_every: int = 1,
    progress: bool = True,
    weight_decay: float = 0.0,
    max_grad_norm: float = 1.0,
    end_lr_fraction: float = 0.1,
    param_sharding: str = "replicate",
    packing: bool = True,
    data_seed: int = 0,
    num_examples: int | None = None,
    keep_checkpoints: int = 3,
    max_eval_examples: int | None = None,
    samples: int | None = None,
    proposal_temperature: float = 1.0,
    allow_tokenizer_mismatch: bool = False,
) -> TrainResult:
    """Train a student from a logit store (``store``) or a teacher in the loop
    (``teacher``, ``data``, ``top_k``, ``seq_len``); see docs/TRAIN.md.

    ``batch_size`` examples per micro-step (global, over all devices and
    processes); an optimizer step takes ``grad_accum`` micro-steps, so
    ``num_steps`` optimizer steps read ``num_steps * grad_accum * batch_size``
    examples. ``warmup_steps`` defaults to ``min(100, num_steps // 10)``.
    ``loss`` defaults to the store's selection (``topk_tail_kl`` for a top-k
    store, ``sampled_kl`` for a sampled one). Online only: ``packing``,
    ``data_seed`` (the ExampleSource order seed, as given to the dump; it also
    keys the draws of ``sampled_kl``, as in a sampled dump), ``samples`` and
    ``proposal_temperature`` (``sampled_kl``: draws per position) and ``num_examples`` (use the first n examples of the
    data, e.g. the number the dump wrote). Re-running the same call resumes
    from the latest checkpoint in ``output``. A student whose tokenizer.json
    differs from the one the data was tokenized with is refused unless
    ``allow_tokenizer_mismatch`` (then the export ships the student's, with a warning).
    """
    # --- settings
    inputs = {"--store": store, "--teacher": teacher, "--data": data, "--student": student, "--eval-data": eval_data}
    paths.check_inputs_reachable(inputs)  # gs://: one line within seconds, not a minute of retries
    check_output(output, "--output", kind="dir", inputs=inputs)
    online = store is None
    if online:
        if loss is None:
            loss = "sampled_kl" if samples is not None else DEFAULT_LOSS["topk"]
        if loss == "sampled_kl":
            if samples is None or int(samples) < 1:
                raise InputError("online --loss sampled_kl needs --samples N >= 1 (draws per position)")
            top_k = top_k if top_k is not None else int(samples)
        elif samples is not None:
            raise InputError("--samples applies to --loss sampled_kl")
        missing = [n for n, v in (("teacher", teacher), ("data", data), ("top_k", top_k), ("seq_len", seq_len))
                   if v is None]
        if missing:
            raise InputError("give either store=, or teacher=, data=, top_k= and seq_len= "
                             f"(missing: {', '.join(missing)})")
    elif any(v is not None for v in (teacher, data, top_k, seq_len)):
        raise InputError("store= excludes teacher=, data=, top_k= and seq_len= (offline or online, not both)")
    for name, value, low in (("num_steps", num_steps, 1), ("batch_size", batch_size, 1),
                             ("grad_accum", grad_accum, 1), ("checkpoint_every", checkpoint_every, 1),
                             ("log_every", log_every, 1), ("keep_checkpoints", keep_checkpoints, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise InputError(f"{name} must be an integer >= {low}, got {value!r}")
    if not online and samples is not None:
        raise InputError("--samples is for online mode; a sampled store records its own N")
    if loss is not None and loss not in KINDS:
        raise InputError(f"unknown loss {loss!r}; choose one of {', '.join(KINDS)}")
    if alpha_schedule not in ALPHA_KINDS:
        raise InputError(f"unknown alpha schedule {alpha_schedule!r}; choose one of {', '.join(ALPHA_KINDS)}")
    _check_floats(learning_rate=learning_rate, temperature=temperature, weight_decay=weight_decay,
                  max_grad_norm=max_grad_norm, alpha=alpha, alpha_end=alpha_end, end_lr_fraction=end_lr_fraction)
    if param_sharding not in SHARDING_MODES:
        raise InputError(f"unknown param sharding {param_sharding!r}; choose one of {', '.join(SHARDING_MODES)}")
    if warmup_steps is None:
        warmup_steps = min(100, num_steps // 10)
    try:
        alpha_fn = alpha_schedule_of(alpha_schedule, alpha, alpha_end, num_steps)
        lr_fn = learning_rate_schedule(learning_rate, warmup_steps, num_steps, end_lr_fraction)
    except ValueError as e:
        raise InputError(str(e)) from None

    process_index, process_count = jax.process_index(), jax.process_count()
    num_devices = jax.device_count()
    if batch_size % num_devices:
        raise InputError(f"batch_size={batch_size} is not divisible by the {num_devices} devices "
                         "(the batch is split evenly over them)")

    from ..models import load_model, shard_params  # after argument checks: imports are slow
    from .student import open_student, store_teacher_tokenizer

    # --- data source and its checks (before the student is loaded: a bad store fails fast)
    teacher_model = None
    if online:
        from ..data import ExampleSource

        teacher_model = load_model(teacher)
        if not 0 < int(top_k) <= teacher_model.vocab_size:
            raise InputError(f"top_k={top_k} must be in [1, {teacher_model.vocab_size}] (the teacher's vocabulary)")
        if loss == "topk_tail_kl" and int(top_k) >= teacher_model.vocab_size:
            raise InputError(f"--loss topk_tail_kl needs tail mass, but top_k={top_k} covers the teacher's whole "
                             f"vocabulary ({teacher_model.vocab_size}): there is no tail. Use --loss topk_kl.")
        examples = ExampleSource.open(data, teacher_model.tokenizer_path, seq_len=int(seq_len),
                                      packing=bool(packing), seed=int(data_seed))
        examples.check_vocab(teacher_model.vocab_size)
        source = loader.OnlineSource(examples, num_examples)
        vocab_size, L, data_packing = teacher_model.vocab_size, int(seq_len), bool(packing)
        where = f"teacher {teacher}"
        reference_tokenizer = (teacher_model.tokenizer_path,
                               examples.identity.get("tokenizer_sha256"), f"the teacher {teacher}")
        source_identity = {"mode": "online", "teacher": teacher_model.identity, "data": examples.identity,
                           "top_k": int(top_k), "num_examples": len(source)}
    else:
        from ..store import open_store
        from ..store.manifest import tokenizer_sha256

        st = open_store(store)
        from ..store import manifest as manifest_mod

        selection = manifest_mod.selection_of(st.manifest)
        if loss is None:
            loss = DEFAULT_LOSS[selection]
        loader.verify_store_for_training(st, loss=loss, temperature=temperature)
        if selection == "sampled":
            proposal_temperature = float(st.manifest["shapes"]["proposal_temperature"])
        source = st
        shapes = st.manifest["shapes"]
        vocab_size, L = shapes["vocab_size"], shapes["seq_len"]
        data_packing = bool(st.manifest.get("content", {}).get("data", {}).get("packing", True))
        where = f"store {store}"
        reference_tokenizer = (st.tokenizer_file(), tokenizer_sha256(st.manifest),
                               f"store {store}")
        source_identity = {"mode": "offline", "store_fingerprint": st.manifest["fingerprint"]}

    if loss == "sampled_kl":  # draws made at t give a biased signal at T != t: refused before any output
        check_sampled_temperature(temperature, proposal_temperature, where=where)
    student_model = open_student(student, vocab_size=vocab_size, seq_len=L, where=where)
    _check_tokenizer(student, student_model.tokenizer_path, *reference_tokenizer, allow=allow_tokenizer_mismatch,
                     output=output)
    tokenizer_path = student_model.tokenizer_path or (teacher_model.tokenizer_path if teacher_model else None)
    if tokenizer_path is None and student_model.kind == "flax" and not online:
        tokenizer_path = store_teacher_tokenizer(st.manifest)  # a Flax student speaks the teacher's tokens
    eval_examples = None
    if eval_data is not None:
        eval_examples = open_eval_data(eval_data, tokenizer_path, seq_len=L, packing=data_packing,
                                       vocab_size=student_model.vocab_size)

    # --- the run's settings vs an earlier run in the same output
    config = {
        **source_identity,
        "student": student, "student_identity": student_model.identity,
        "num_steps": int(num_steps), "batch_size": int(batch_size), "grad_accum": int(grad_accum),
        "learning_rate": float(learning_rate), "warmup_steps": int(warmup_steps),
        "end_lr_fraction": float(end_lr_fraction), "weight_decay": float(weight_decay),
        "max_grad_norm": None if max_grad_norm is None else float(max_grad_norm), "seed": int(seed), "loss": loss, "alpha": float(alpha),
        "alpha_end": None if alpha_end is None else float(alpha_end), "alpha_schedule": alpha_schedule,
        "temperature": float(temperature), "process_count": process_count, "param_sharding": param_sharding,
    }
    if allow_tokenizer_mismatch:  # recorded only when set: outputs of earlier versions still resume
        config["allow_tokenizer_mismatch"] = True
    if loss == "sampled_kl":
        config["proposal_temperature"] = float(proposal_temperature)
        if online:
            config["samples"] = int(samples)
    if loss == "topk_kl" and float(alpha) == 1.0 and alpha_schedule == "constant" and process_index == 0:
        print("logit-distill train: warning: --loss topk_kl with --alpha 1 gives no signal on the student's mass "
              "outside the teacher's top-k (it stays where initialization put it); use topk_tail_kl, "
              "sampled_kl, or alpha < 1 (docs/LOSSES.md)", file=sys.stderr, flush=True)
    config_uri = paths.join(output, CONFIG_NAME)
    existing = _read_json(config_uri)
    if existing is not None:
        _check_same_config(existing, config, output)
    elif process_index == 0:
        paths.makedirs(output)
        _write_json(config_uri, config)

    # --- state, step function, data iterator
    mesh = make_mesh()
    put, data_sharding = _placer(mesh)
    replicated = NamedSharding(mesh, P())
    tx = make_optimizer(lr_fn, weight_decay=weight_decay, max_grad_norm=max_grad_norm, grad_accum=grad_accum)
    params = student_model.params
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    state = student_model.place(state, mesh, param_sharding)
    student_model.params = params = None  # the state owns the weights now
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    train_step = jax.jit(
        make_train_step(student_model.apply, tx, loss=loss, temperature=temperature,
                        proposal_temperature=proposal_temperature),
        in_shardings=(state_shardings, data_sharding, replicated, replicated),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,),
    )
    teacher_fn = teacher_params = None
    tempered = loss == "topk_tail_kl" and float(temperature) != 1.0
    if online:
        from ..topk import make_teacher_sampled, make_teacher_topk

        if loss == "sampled_kl":  # the dump's draws: keyed by (data seed, example index, position)
            teacher_fn = make_teacher_sampled(teacher_model.apply, int(samples), seed=int(data_seed),
                                              proposal_temperature=proposal_temperature)
        else:
            topk_fn = make_teacher_topk(teacher_model.apply, int(top_k),
                                        tail_temperatures=(float(temperature),) if tempered else ())

            def teacher_fn(params, tokens, positions, segment_ids, example_index):
                out = topk_fn(params, tokens, positions, segment_ids)
                if tempered:
                    out["tail_logprob_tempered"] = out["tail_logprob_tempered"][..., 0]
                return out
        teacher_params = shard_params(teacher_model.params, mesh, param_sharding)
    batch_fields = loader.MODEL_FIELDS + FIELDS[loss] + (("tail_logprob_tempered",) if tempered else ())
    tempered_index = None
    sample_width = None
    if not online:
        if tempered:
            tempered_index = manifest_mod.tail_temperatures_of(st.manifest).index(float(temperature))
        if loss == "sampled_kl":
            sample_width = int(st.manifest["shapes"]["num_samples"])

    num_micro = num_steps * grad_accum
    dataset = loader.build_dataset(source, seed=seed, batch_size=batch_size, num_batches=num_micro,
                                   process_index=process_index, process_count=process_count,
                                   sample_width=sample_width, tempered_index=tempered_index,
                                   check=None if online else loader.RecordCheck(source.manifest, store))
    data_iter = loader.make_iterator(dataset)

    ckpt = checkpointing.TrainCheckpointer(output, max_to_keep=keep_checkpoints)
    resumed_from = ckpt.latest_step()
    start = 0
    if resumed_from is not None:
        if resumed_from > num_steps:
            raise InputError(f"{output} holds a checkpoint at step {resumed_from}, beyond num_steps={num_steps}")
        state = ckpt.restore(resumed_from, state, data_iter)
        start = resumed_from
    metrics_log = MetricsLog(output, keep_up_to_step=start) if process_index == 0 else None

    # --- train
    log_line = _logger(progress)
    bar = None
    if progress and process_index == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_steps, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    if start < num_steps:
        log_line(f"training {student} on {where}: steps {start}..{num_steps} of {batch_size} x {grad_accum} "
                 f"examples (seq_len {L}), loss {loss}, {num_devices} device(s)"
                 + (f"; resumed from checkpoint {start}" if resumed_from is not None else ""))
    pending = None  # (step, device metrics, alpha, lr, tokens): fetched after the next step is dispatched
    tokens_acc, t_last = 0, time.perf_counter()
    last_metrics = metrics_log.last if metrics_log else None
    guard = FiniteGuard(output)
    guard.last_saved = resumed_from
    stop = StopOnSignal().__enter__()  # SIGTERM/SIGINT: checkpoint at the next step boundary
    try:
        for step in range(start, num_steps):
            alpha_value = float(alpha_fn(step))
            alpha_arr = jnp.asarray(alpha_value, jnp.float32)
            micro_metrics = []
            batches = []
            for _ in range(grad_accum):
                host = next(data_iter)
                tokens_acc += int(np.count_nonzero(host["segment_ids"])) * process_count
                batch = put({k: host[k] for k in batch_fields if k in host})
                if online:  # the teacher runs on the batch, as in the dump (the same draws when sampled)
                    index = put({"i": host["example_index"].astype(np.int32)})["i"]
                    out = teacher_fn(teacher_params, batch["tokens"], batch["positions"], batch["segment_ids"], index)
                    batch.update({k: v for k, v in out.items() if k in batch_fields})
                batches.append(batch)
            # Token-weighted accumulation: micro-batch i's loss is scaled by n * c_i / sum(c).
            scales = (accumulation_scales([b["segment_ids"] for b in batches]) if grad_accum > 1
                      else [jnp.float32(1.0)])
            for batch, scale in zip(batches, scales):
                state, m = train_step(state, batch, alpha_arr, scale)
                micro_metrics.append(m)
            done = step + 1
            guard.add(done, micro_metrics)
            guard.check(keep_newest=True)  # the steps before this one: the device is busy with it
            if pending is not None:
                last_metrics, t_last = _emit(pending, t_last, metrics_log, log_line,
                                                           num_steps)
                pending = None
            if done % log_every == 0 or done == num_steps:
                pending = (done, micro_metrics, alpha_value, float(lr_fn(step)), tokens_acc)
                tokens_acc = 0
            if done % checkpoint_every == 0 or done == num_steps:
                guard.check()  # never checkpoint a state past a NaN
                if pending is not None:  # the checkpoint's metrics are on disk with it
                    last_metrics, t_last = _emit(pending, t_last, metrics_log,
                                                               log_line, num_steps)
                    pending = None
                ckpt.save(done, state, data_iter)
                guard.last_saved = done
                if metrics_log is not None and not metrics_log.local:
                    metrics_log.flush()
            if bar is not None:
                if last_metrics:
                    bar.set_postfix_str(f"{last_metrics['tokens_per_s']:.0f} tokens/s, loss {last_metrics['loss']:.4f}",
                                        refresh=False)
                bar.update(1)
            if stop.event.is_set() and done < num_steps:  # preempted: save here, a re-run resumes exactly
                guard.check()
                if pending is not None:
                    last_metrics, t_last = _emit(pending, t_last, metrics_log, log_line, num_steps)
                    pending = None
                if done % checkpoint_every:
                    ckpt.save(done, state, data_iter)
                raise TrainingInterrupted(f"stopped by signal {stop.signum} at step {done}; checkpoint saved; "
                                          "re-run the same command to resume")
        guard.check()
        if pending is not None:
            last_metrics, t_last = _emit(pending, t_last, metrics_log, log_line,
                                                       num_steps)
    finally:
        stop.__exit__()
        if bar is not None:
            bar.close()
        ckpt.close()
        if metrics_log is not None:
            metrics_log.close()

    # --- export and evaluation
    export_dir = paths.join(output, student_model.export_name)
    params = state["params"]
    if process_index == 0:
        student_model.save(_host_params(params), export_dir, tokenizer_path)
    elif process_count > 1:
        _host_params(params)  # the all-gather is collective
    eval_result = None
    if eval_examples is not None:
        eval_result = evaluate(student_model.apply, params, eval_examples, batch_size=batch_size, put=put,
                               max_examples=max_eval_examples, process_index=process_index,
                               process_count=process_count)
        eval_result = {"data": eval_data, "step": num_steps, **eval_result}
        if process_index == 0:
            _write_json(paths.join(output, EVAL_NAME), eval_result)
        log_line(f"eval: cross-entropy {eval_result['cross_entropy']:.4f} nats/token, "
                 f"perplexity {eval_result['perplexity']:.3f} over {eval_result['num_tokens']} tokens")
    return TrainResult(output=output, final_step=num_steps, metrics=last_metrics, eval=eval_result,
                       hf_dir=export_dir if student_model.kind == "hf" else None,
                       resumed_from_step=resumed_from, export_dir=export_dir)


def _check_tokenizer(student: str, student_tokenizer: str | None, reference_file: str | None,
                     reference_sha: str | None, reference: str, *, allow: bool, output: str) -> None:
    """The student's tokenizer.json must be the one the data was tokenized with (same SHA-256).

    Vocabularies of equal size can still be different tokenizers (many 32000-token ones are):
    a student trained on ids it reads otherwise learns garbage, and its export would ship the
    wrong tokenizer. The error lists the first differing ids when ``reference_file`` is known.
    Nothing to check when either side has no tokenizer recorded (pre-tokenized data without
    one, synthetic stores, a checkpoint without tokenizer.json).
    """
    from ..data.tokenizer import differing_ids, file_sha256

    if student_tokenizer is None or reference_sha is None:
        return
    have = file_sha256(student_tokenizer)
    if have == reference_sha:
        return
    detail = ""
    if reference_file is not None:
        first, count = differing_ids(reference_file, student_tokenizer)
        if first:
            shown = ", ".join(f"{i} ({a!r} vs {b!r})" for i, a, b in first)
            detail = f"; {count} ids differ, the first: {shown}"
        else:
            detail = "; the vocabularies are equal, the rules (merges, normalizer, pre-tokenizer) differ"
    what = (f"student {student} has another tokenizer than {reference} (tokenizer.json SHA-256 "
            f"{have[:12]}... vs {reference_sha[:12]}...){detail}")
    if not allow:
        raise InputError(f"{what}; give the student the teacher's tokenizer.json, or pass "
                         "--allow-tokenizer-mismatch to train anyway")
    if jax.process_index() == 0:
        print(f"logit-distill train: warning: {what}; training anyway (--allow-tokenizer-mismatch): "
              f"the HF export in {paths.join(output, HF_DIR)} ships the student's tokenizer", file=sys.stderr)


def alpha_schedule_of(kind: str, alpha: float, alpha_end: float | None, num_steps: int):
    """The alpha schedule over optimizer steps (``alpha`` -> ``alpha_end``)."""
    if kind == "constant" and alpha_end is not None and float(alpha_end) != float(alpha):
        raise ValueError(f"--alpha-end {alpha_end} differs from --alpha {alpha}: give --alpha-schedule "
                         "linear or cosine to change alpha over training")
    return schedules.alpha_schedule(kind, alpha, alpha_end, num_steps)


def _logger(progress: bool):
    def log(line: str) -> None:
        if jax.process_index() != 0:
            return
        if progress:
            from tqdm.auto import tqdm

            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    return log


def _emit(pending, t_last: float, metrics_log, log_line, num_steps: int):
    """Fetch one logged step's metrics (a host sync, one step behind the device) and write them."""
    step, micro, alpha_value, lr, tokens = pending
    host: list[dict[str, Any]] = jax.device_get(micro)
    now = time.perf_counter()
    n = len(host)
    rec = {
        "step": step,
        "loss": sum(float(m["loss"]) for m in host) / n,
        "kd_loss": sum(float(m["kd_loss"]) for m in host) / n,
        "ce_loss": sum(float(m["ce_loss"]) for m in host) / n,
        "grad_norm": sum(float(m["grad_norm"]) for m in host) / n,
        "num_tokens": sum(int(m["num_tokens"]) for m in host),
        "learning_rate": lr,
        "alpha": alpha_value,
        "tokens_per_s": tokens / max(now - t_last, 1e-9),
    }
    if metrics_log is not None:
        metrics_log.write(rec)
    log_line(f"step {step}/{num_steps} loss {rec['loss']:.4f} kd {rec['kd_loss']:.4f} ce {rec['ce_loss']:.4f} "
             f"lr {lr:.3g} alpha {alpha_value:.3f} tokens/s {rec['tokens_per_s']:.0f}")
    return rec, now
