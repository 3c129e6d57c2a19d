"""``train_student(config)``: plan, hold the output's lease, train, export, evaluate, report.

Order of work: the plan checks every input before anything is written (``train.plan``); then the
store's chunks are checked whole, the state and the Grain iterator are built, and the run resumes
from the latest Orbax checkpoint in the output if there is one; it saves a checkpoint every
``checkpoint_every`` optimizer steps and at the end, exports the student (HF format to
``<output>/hf``, a Flax NNX student to ``<output>/student``), evaluates it on ``eval_data`` and
writes the report. docs/TRAIN.md describes the outputs and the guarantees.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..signals import Interrupted, StopOnSignal
from ..store.lease import Lease
from . import checkpointing, epochs, loader
from .config import TrainConfig
from .losses import accumulation_scales, kd_metric_note, representation
from .metrics import MetricsLog, StepMetrics, say
from .export import TrainResult, finish
from .plan import TrainPlan, plan_training, write_settings
from .schedules import alpha_schedule, learning_rate_schedule
from .step import FiniteGuard, make_optimizer, make_train_step
from .student import open_student


class TrainingInterrupted(Interrupted):
    """Training stopped on a signal after saving a checkpoint; a re-run resumes."""


def train_student(config: TrainConfig) -> TrainResult:
    """Train a student for ``config`` (offline from a store, or online with the teacher in the loop); a
    re-run with the same config resumes from the latest checkpoint in ``config.output``."""
    plan = plan_training(config)
    for line in plan.warnings:
        say(line)
    lease = None
    if jax.process_index() == 0:  # one trainer per output, as one dump per store
        lease = Lease(config.output, timeout_s=config.lease_timeout_s, force_takeover=config.force_takeover,
                      holder="training")
        lease.acquire()
    try:
        return _train(plan, lease)
    finally:
        if lease is not None:
            lease.release()


def _train(plan: TrainPlan, lease) -> TrainResult:
    config, source = plan.config, plan.source
    if source.manifest is not None:
        loader.verify_store_for_training(source.records, loss=plan.loss)
    teacher = source.load_teacher()
    if jax.process_index() == 0:
        write_settings(plan)
    student = open_student(plan.student, seq_len=source.seq_len)
    run = _Run(plan, student, teacher)
    if run.start < config.num_steps:
        say(f"training {config.num_steps} steps of {config.batch_size} x {config.grad_accum} examples of "
            f"{source.seq_len} tokens on {jax.device_count()} device(s), loss {plan.loss} (kd_loss: "
            f"{kd_metric_note(plan.loss, config.temperature, plan.proposal_temperature)}), from {source.where}"
            + (f"; resuming at step {run.start}" if run.start else ""))
    last_metrics = _loop(plan, run, lease)
    return finish(plan, student, run.state, last_metrics, run.put)


class _Run:
    """What the loop runs: the state on the mesh, the jitted step, the data iterator, the checkpointer
    (restored from the plan's checkpoint), the schedules and, online, the teacher's function."""

    def __init__(self, plan: TrainPlan, student, teacher):
        from ..models.sharding import make_mesh

        config, source = plan.config, plan.source
        mesh = make_mesh(jax.devices())
        batch_sharding = NamedSharding(mesh, P("data"))
        replicated = NamedSharding(mesh, P())
        self.put = lambda batch: {k: jax.make_array_from_process_local_data(batch_sharding, np.ascontiguousarray(v))
                                  for k, v in batch.items()}
        self.lr_fn = learning_rate_schedule(config.learning_rate, config.warmup, config.num_steps,
                                            config.end_lr_fraction)
        self.alpha_fn = alpha_schedule(config.alpha_schedule, config.alpha, config.alpha_end, config.num_steps)
        tx = make_optimizer(self.lr_fn, weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm,
                            grad_accum=config.grad_accum)
        state = {"params": student.params, "opt_state": tx.init(student.params), "step": jnp.zeros((), jnp.int32)}
        state = student.place(state, mesh, config.param_sharding)
        student.params = None  # the state owns the weights now
        shardings = jax.tree.map(lambda x: x.sharding, state)
        self.train_step = jax.jit(
            make_train_step(student.apply, tx, loss=plan.loss, temperature=config.temperature,
                            proposal_temperature=plan.proposal_temperature, beta=config.jsd_beta, skew=config.skew,
                            allow_biased_temperature=config.allow_biased_temperature),
            in_shardings=(shardings, batch_sharding, replicated, replicated),
            out_shardings=(shardings, replicated), donate_argnums=(0,))
        self.teacher_fn = source.teacher_function(config, plan.loss)
        self.teacher_params = None if teacher is None else _shard(teacher.params, mesh, config.param_sharding)
        dataset = loader.build_dataset(source.records, seed=config.seed, batch_size=config.batch_size,
                                       num_batches=config.num_steps * config.grad_accum,
                                       process_index=jax.process_index(), process_count=jax.process_count(),
                                       **source.loader_options(plan.loss, config.temperature))
        self.data_iter = loader.make_iterator(dataset)
        self.ckpt = checkpointing.TrainCheckpointer(config.output, max_to_keep=config.keep_checkpoints)
        self.start = plan.resume_from or 0
        if plan.resume_from is not None:
            state = self.ckpt.restore(plan.resume_from, state, self.data_iter)
        self.state = state
        self.fields = source.batch_fields(plan.loss, config.temperature)
        self.grad_accum = config.grad_accum
        # Online draws change per epoch (epoch 0: the dump's); a store's draws are what it holds.
        self.draws_per_epoch = self.teacher_fn is not None and representation(plan.loss) == "sampled"
        self.micro_batch = self.start * config.grad_accum  # micro-batches read so far (the loader's position)
        self.num_examples = len(source)

    def next_batch(self, metrics: StepMetrics) -> dict:
        host = next(self.data_iter)
        micro_batch, self.micro_batch = self.micro_batch, self.micro_batch + 1
        metrics.add_tokens(int(np.count_nonzero(host["segment_ids"])) * jax.process_count())
        batch = self.put({k: host[k] for k in self.fields if k in host})
        if self.teacher_fn is not None:  # the teacher runs on the batch, as in the dump (the same draws when sampled)
            index = host["example_index"]
            if self.draws_per_epoch:
                epoch = epochs.row_epochs(micro_batch, len(index), self.num_examples,
                                          process_index=jax.process_index(), process_count=jax.process_count())
                index = epochs.draw_index(index, epoch, self.num_examples)
            index = self.put({"i": np.asarray(index).astype(np.int32)})["i"]
            out = self.teacher_fn(self.teacher_params, batch["tokens"], batch["positions"], batch["segment_ids"],
                                  index)
            batch.update({k: v for k, v in out.items() if k in self.fields})
        return batch

    def step(self, alpha: float, metrics: StepMetrics) -> list:
        """One optimizer step (``grad_accum`` micro-steps); the device metrics of each micro-step."""
        batches = [self.next_batch(metrics) for _ in range(self.grad_accum)]
        # Token-weighted accumulation: micro-batch i's loss is scaled by n * c_i / sum(c), c its supervised tokens.
        scales = (accumulation_scales(batches) if self.grad_accum > 1
                  else [jnp.float32(1.0)])
        micro = []
        alpha_arr = jnp.asarray(alpha, jnp.float32)
        for batch, scale in zip(batches, scales):
            self.state, m = self.train_step(self.state, batch, alpha_arr, scale)
            micro.append(m)
        return micro

    def save(self, step: int) -> None:
        self.ckpt.save(step, self.state, self.data_iter)


def _loop(plan: TrainPlan, run: _Run, lease) -> dict | None:
    """Optimizer steps ``run.start..num_steps``: checkpoints, the finite guard, metrics; SIGTERM/SIGINT
    checkpoint at the next step boundary and stop. Returns the last logged metrics."""
    config = plan.config
    metrics_log = MetricsLog(config.output, keep_up_to_step=run.start) if jax.process_index() == 0 else None
    metrics = StepMetrics(metrics_log, num_steps=config.num_steps, every=config.log_interval,
                          progress=config.progress)
    guard = FiniteGuard(config.output)
    guard.last_saved = plan.resume_from
    bar = _progress_bar(config, run.start)
    finished = False

    def checkpoint(done: int) -> None:
        guard.check()  # never checkpoint a state past a NaN
        metrics.checkpointed()
        run.save(done)
        guard.last_saved = done

    try:
        with StopOnSignal() as stop:
            for step in range(run.start, config.num_steps):
                if lease is not None:
                    lease.check()  # taken over after going stale: write nothing more
                alpha = float(run.alpha_fn(step))
                micro = run.step(alpha, metrics)
                done = step + 1
                guard.add(done, micro)
                guard.check(keep_newest=True)  # the steps before this one: the device is busy with it
                metrics.step_done(done, micro, alpha, float(run.lr_fn(step)))
                if done % config.checkpoint_every == 0 or done == config.num_steps:
                    checkpoint(done)
                if bar is not None:
                    if metrics.last:
                        bar.set_postfix_str(f"{metrics.last['tokens_per_s']:.0f} tokens/s, loss "
                                            f"{metrics.last['loss']:.4f}", refresh=False)
                    bar.update(1)
                if stop.event.is_set() and done < config.num_steps:  # preempted: save here, a re-run resumes
                    if done % config.checkpoint_every:
                        checkpoint(done)
                    raise TrainingInterrupted(f"stopped by signal {stop.signum} at step {done}; checkpoint saved; "
                                              "re-run the same command to resume")
            guard.check()
            metrics.flush()
        finished = True
    finally:
        if bar is not None:
            bar.close()
        for close in (run.ckpt.close, metrics_log.close if metrics_log is not None else None):
            try:
                if close is not None:
                    close()
            except Exception:  # noqa: BLE001 - after a failure (a full disk) the first error is the one to report
                if finished:
                    raise
    return metrics.last


def _shard(params, mesh, mode: str):
    from ..models import shard_params

    return shard_params(params, mesh, mode)


def _progress_bar(config: TrainConfig, start: int):
    if not config.progress or jax.process_index() != 0:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=config.num_steps, initial=start, desc="train", unit="step", file=sys.stderr,
                dynamic_ncols=True)
