"""``run_dump(config)``: check, plan, hold the store's lease, load, then run the steps still missing.

Resume is a scan: on start the committed chunks are listed, and every chunk range that is missing
(gaps included, not just the tail) is computed again; the data order is a pure function of its
inputs, so reaching step N is a seek, not a replay. A SIGTERM/SIGINT stops taking steps, lets the
chunks that are complete commit, drops the chunk in flight and exits non-zero.

Multi-host (JAX multi-controller): the batch of a step is split over processes in order
(``StoreLayout``: process p owns examples [p*b, (p+1)*b) of each step) and each process writes
its own chunks. Every process lists the same committed chunks after a barrier, so all agree on
which steps run; a process whose chunk for a range already exists computes along (the forward is
SPMD) but writes nothing. Every process checks every step's teacher output for NaN/inf (scalars
reduced over the whole batch inside the step): a bad example of any process stops all of them at
that step with the same error.
"""

from __future__ import annotations

import logging
import sys
import time

from .. import outputs, paths
from .. import store as store_mod
from ..distributed import barrier, process_info
from ..signals import Interrupted, StopOnSignal
from ..store import manifest as manifest_mod
from ..store.layout import StoreLayout
from ..store.lease import Lease
from .config import DumpConfig
from .plan import DumpPlan, plan_dump, steps_for
from .result import DumpResult, dump_result
from .teacher_step import TeacherStep, check_layout, dump_attention, dump_mesh

log = logging.getLogger("logit_distill.dump")


class DumpInterrupted(Interrupted):
    """The dump stopped on a signal; committed chunks are kept and a re-run resumes."""


def run_dump(config: DumpConfig) -> DumpResult:
    """Dump the teacher's selection for ``config`` into ``config.output``; resume what is there."""
    import jax

    t_start = time.perf_counter()
    outputs.require_nonblank(config.output, "--output")
    config.check()
    dump_attention(config, jax.default_backend())  # settings that depend on this machine
    paths.check_inputs_reachable(config.inputs)  # gs://: one line within seconds, not a minute of retries
    outputs.check_output(config.output, "--output", kind="dir", own_store=True, inputs=config.inputs)
    process, num_processes = process_info()
    plan = None
    if config.num_steps is not None:
        plan = plan_dump(config, num_processes=num_processes)
        if plan.may_be_complete():
            status = plan.status()
            if status.complete:  # every chunk is there: no teacher is loaded, nothing is written
                _say(process, f"{config.output}: nothing to do: all {status.expected} chunks present "
                              "(the teacher was not loaded)")
                return dump_result(config.output, plan.manifest, present=status.present, chunks_written=0,
                                   steps_run=0, resumed_from=plan.num_steps, elapsed_compute=0.0,
                                   t_start=t_start, first_step_at=None)
    lease = None
    if process == 0:  # process 0 holds the store's lease for every process of the job (the others never look)
        lease = Lease(config.output, timeout_s=config.lease_timeout_s, force_takeover=config.force_takeover,
                      wait_for_stale=config.wait_for_stale_lease)
        lease.acquire()  # before the teacher loads: a second dump refuses at once, not after minutes of loading
    had_manifest = lease is None or paths.exists(paths.join(config.output, manifest_mod.MANIFEST_NAME))
    try:
        mesh = dump_mesh(config)
        check_layout(config, mesh)
        teacher, source, plan = load_teacher_and_data(config, mesh, plan=plan, num_processes=num_processes)
        return _run(plan, teacher, source, mesh, lease, t_start)
    except BaseException:
        if not had_manifest:
            store_mod.forget_unused_manifest(config.output)
        raise
    finally:
        if lease is not None:
            lease.release()


def load_teacher_and_data(config: DumpConfig, mesh, *, plan: DumpPlan | None = None, num_processes: int = 1):
    """(teacher on ``mesh``, data, plan): checked against each other and against the plan (planned now
    when ``plan`` is None: the steps may follow from the data)."""
    from ..data import ExampleSource, settings_identity
    from ..errors import InputError
    from ..models import load_model

    teacher = load_model(config.teacher, dtype=config.dtype, mesh=mesh, shard_mode=config.sharding)
    if config.seq_len > teacher.max_seq_len:
        raise InputError(f"--seq-len {config.seq_len} exceeds the teacher's maximum of {teacher.max_seq_len} "
                         f"positions (max_position_embeddings in {config.teacher})")
    source = ExampleSource.open(config.data, config.tokenizer or teacher.tokenizer_path, seq_len=config.seq_len,
                                packing=config.packing, seed=config.seed, text_field=config.text_field,
                                chat=config.chat)
    source.check_vocab(teacher.vocab_size)
    if plan is None:  # the steps follow from the data
        plan = plan_dump(config, num_processes=num_processes, available_examples=len(source))
    else:
        steps_for(config, len(source))
    # The plan and what was loaded must describe the same teacher and data.
    assert plan.manifest["content"]["teacher"] == teacher.identity, "teacher identity changed while loading"
    assert plan.manifest["content"]["data"] == settings_identity(source.identity), "data identity mismatch"
    return teacher, source, plan


def _run(plan: DumpPlan, teacher, source, mesh, lease, t_start: float) -> DumpResult:
    config, manifest, uri = plan.config, plan.manifest, plan.config.output
    process, _ = process_info()
    if process == 0:
        store_mod.init_store(uri, manifest)
    barrier("logit-distill-dump-init")
    if process != 0:
        store_mod.init_store(uri, manifest)  # checks the manifest process 0 wrote or found
    scan = store_mod.scan(uri, manifest)
    if process == 0:
        store_mod.remove_leftovers(uri, scan)
        if source.tokenizer is not None:  # the store keeps its tokenizer: students are checked against it
            store_mod.put_tokenizer(uri, manifest, source.tokenizer, chat_template=source.chat_template_text)
    barrier("logit-distill-dump-scan")

    todo = scan.steps_missing()
    resumed_from = todo[0] if todo else plan.num_steps
    if not todo:
        msg = f"nothing to do: all {scan.num_expected} chunks present"
    elif scan.num_present:
        msg = f"resuming at step {resumed_from} ({scan.num_present} of {scan.num_expected} chunks present)"
    else:
        msg = f"starting at step 0 ({scan.num_expected} chunks to write)"
    _say(process, f"{uri}: {msg}; {config.describe_selection()}")
    t_compute = time.perf_counter()
    steps_run, committed, first_step_at = 0, [], None
    if todo:
        mine = {s for start, end in scan.missing[process] for s in range(start, end)}
        steps_run, committed, first_step_at = _run_steps(plan, TeacherStep(teacher, config, mesh), source, todo,
                                                         mine, lease)
    elapsed_compute = time.perf_counter() - t_compute
    barrier("logit-distill-dump-done")
    return dump_result(uri, manifest, present=scan.num_present, chunks_written=len(committed), steps_run=steps_run,
                       resumed_from=resumed_from, elapsed_compute=elapsed_compute, t_start=t_start,
                       first_step_at=first_step_at, skipped_unsupervised=source.skipped_unsupervised)


def _run_steps(plan: DumpPlan, step_fn: TeacherStep, source, todo: list[int], mine: set[int], lease):
    """Compute the steps ``todo`` (writing those in ``mine``): each step is dispatched before the
    previous one is fetched, so the device never waits for the host. Returns (steps run, chunks
    committed, when the first step reached the writer)."""
    config, manifest = plan.config, plan.manifest
    process, _ = process_info()
    layout = StoreLayout.of(manifest)
    writer = store_mod.BackgroundWriter(config.output, manifest, process, max_pending_steps=config.max_pending_steps,
                                        on_commit=lambda info: log.info("committed %s", info.name))
    bar = _progress(config, len(todo), plan.num_steps, process)
    state = {"steps_run": 0, "first_step_at": None}

    def finish(step, local, out):
        # Every process checks every step (its own and the others'): all stop at the same step.
        step_fn.refuse_nonfinite(step, out)
        if step in mine:
            records = step_fn.fetch(out)
            records.update(local)
            records["example_index"] = layout.step_examples(step, process)
            writer.submit(step, records)
            if state["first_step_at"] is None:
                state["first_step_at"] = time.perf_counter()
        state["steps_run"] += 1
        bar.update(config.batch_size * config.seq_len)

    try:
        with StopOnSignal() as stop:
            pending = None
            for step in todo:
                if stop.event.is_set():
                    break
                if lease is not None:
                    lease.check()  # taken over after going stale: write nothing more
                index = layout.step_examples(step, process)
                local = source.batch(index)
                out = step_fn.dispatch(local, index)  # asynchronous: overlaps with the previous step's host work
                if pending is not None:
                    finish(*pending)
                pending = (step, local, out)
            if stop.event.is_set():
                writer.abort()
                raise DumpInterrupted(
                    f"stopped by signal {stop.signum} after {state['steps_run']} steps; {len(writer.committed)} "
                    "chunks committed in this run; re-run the same command to resume")
            if pending is not None:
                finish(*pending)
        committed = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    return state["steps_run"], committed, state["first_step_at"]


def _say(process: int, line: str) -> None:
    if process == 0:
        print(f"logit-distill dump: {line}", file=sys.stderr, flush=True)


def _progress(config: DumpConfig, total: int, num_steps: int, process: int):
    from tqdm import tqdm

    # Counted in tokens, so the rate reads as tokens/s; one update per step.
    tokens_per_step = config.batch_size * config.seq_len
    return tqdm(total=total * tokens_per_step, unit="tok", unit_scale=True, desc="dump",
                disable=not config.progress or process != 0, file=sys.stderr, dynamic_ncols=True,
                postfix=f"{total} of {num_steps} steps to run, {tokens_per_step} tokens/step")
