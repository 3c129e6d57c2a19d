"""``dump_teacher_topk``: run the teacher once over the data into the logit store (resumable).

A thin wrapper over ``logit_distill.dump.run_dump``. The store lives at
``store_uri`` (``<output_root>/teacher_topk/<dump_key>``, from ``plan_dump``),
not under the task's own output folder, so a task retried by ``set_retry``, a
resubmitted or cloned run, or a run with caching off all land on the same
prefix and resume from the chunk scan; a complete store is a no-op. The output
``Dataset`` artifact's URI is set to that store.

On a multi-host Vertex custom job (replica count > 1, or a multi-host TPU
slice) every host runs this function; JAX's multi-controller runtime is
initialized from Vertex's ``CLUSTER_SPEC`` (GPU hosts) or by JAX's own
detection (TPU slices). Only process 0 writes the task's outputs (artifact
metadata, metrics, return values); the others exit 0 once the store is
complete. ``store_state`` (a digest of the committed chunk names) feeds
verify's cache key. A store already complete returns at once, without
loading the teacher.

A deterministic failure of the tool (bad input, exit 2; non-finite teacher
values, 3; a damaged store, 4) does not fail the task: a retry would fail the
same way, on a new accelerator job. The task succeeds with the one-line error
in ``error`` and its code in ``exit_code`` (0 when it worked), and the
pipeline's ``fail_on_error`` task fails the run with that line, unretried.
Anything else (a preemption, a crash, a lost connection) fails the task, which
its retry policy runs again.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output

from .image import DEFAULT_IMAGE


def dump_teacher_topk(
    teacher: str,
    data: str,
    store_uri: str,
    dump_key: str,
    num_steps: int,
    store: Output[Dataset],
    metrics: Output[Metrics],
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
    sharding: str = "replicate",
    model_parallel: int = 0,
    attention: str = "auto",
    device_batch: int = 0,
    vocab_chunk: int = 0,
    lease_timeout_s: float = 120.0,
    resources: dict = {},
) -> NamedTuple("DumpOutputs", [("resumed_from_step", int), ("complete", bool), ("store_state", str),
                                ("error", str), ("exit_code", int)]):
    """Dump the teacher's selection into ``store_uri``; resume whatever is already committed there."""
    inputs = dict(locals())  # the arguments: DumpConfig.from_component takes the store's settings among them
    import collections
    import sys

    from logit_distill.distributed import init_from_environment
    from logit_distill.dump import DumpConfig, plan_dump, run_dump
    from logit_distill.errors import InputError, LogitDistillError
    from logit_distill.failures import describe

    from logit_distill.logs import configure_from_environment

    configure_from_environment()
    init_from_environment()
    import jax

    outputs = collections.namedtuple("DumpOutputs", ["resumed_from_step", "complete", "store_state", "error",
                                                     "exit_code"])
    try:
        config = DumpConfig.from_component(
            inputs, output=store_uri, sharding=sharding, progress=False, model_parallel=model_parallel,
            attention=attention, device_batch=device_batch, vocab_chunk=vocab_chunk,
            # A retry after preemption runs on another machine: the lease of the dead one cannot be proven
            # dead, only stale (not refreshed for its timeout). The retry may start sooner than that (the task
            # backs off 60 s first), so a lease not yet stale is waited for, once, and taken over if nobody
            # refreshed it meanwhile; a live lease (another run dumping the same store right now) is refused.
            force_takeover=True, wait_for_stale_lease=True, lease_timeout_s=lease_timeout_s,
        )
        # The store's name must be the fingerprint of what goes into it: a stale or hand-made key fails here,
        # before anything is written.
        plan = plan_dump(config, num_processes=jax.process_count())
        planned = plan.dump_key
        if dump_key and planned != dump_key:
            raise InputError(f"dump_key {dump_key} does not match these settings (their key is {planned}); "
                             "give the key plan_dump computes for them")
        if dump_key and not store_uri.rstrip("/").endswith(dump_key):
            raise InputError(f"store_uri {store_uri} does not end with the dump key {dump_key}; give the "
                             "store_uri plan_dump computes")

        result = run_dump(config)
    except LogitDistillError as e:  # deterministic: recorded for fail_on_error, not retried
        code, line = describe(e)
        line = f"logit-distill dump: {line}"
        print(line, file=sys.stderr, flush=True)
        if jax.process_index() != 0:
            raise SystemExit(0)
        return outputs(0, False, "", line, code)
    if not result.complete:
        raise RuntimeError(f"store {store_uri} is incomplete after the dump; a retry resumes it")
    if jax.process_index() != 0:
        raise SystemExit(0)  # the store is complete; process 0 writes the task's outputs
    print(f"dump_teacher_topk: {result.summary()}", flush=True)
    state = plan.status().state

    store.uri = result.store
    store.metadata.update({
        "dump_key": result.dump_key, "fingerprint": result.fingerprint, "num_steps": result.num_steps,
        "examples": result.examples, "positions": result.positions, "selection": config.selection,
        "top_k": config.top_k, "samples": config.samples or 0, "seq_len": seq_len,
        "codec": codec, "teacher": teacher, "data": data, "store_bytes": result.store_bytes,
        "chunks": result.chunks_expected, "processes": jax.process_count(), "store_state": state,
        "resources_requested": dict(resources),
    })
    for name, value in (
        ("examples", result.examples),
        ("positions", result.positions),
        ("chunks_written_this_attempt", result.chunks_written),
        ("chunks_present_at_start", result.chunks_present_at_start),
        ("resumed_from_step", result.resumed_from_step),
        ("steps_run_this_attempt", result.steps_run),
        ("tokens_per_s", round(result.tokens_per_s, 1)),
        ("bytes_per_entry", round(result.bytes_per_entry, 4)),
        ("store_mb", round(result.store_bytes / 1e6, 3)),
        ("elapsed_s", round(result.elapsed_s, 2)),
    ):
        metrics.log_metric(name, value)
    return outputs(int(result.resumed_from_step), bool(result.complete), state, "", 0)


# Descriptions of the inputs no pipeline parameter feeds (the others come from pipelines/params.py).
INPUTS = {
    "store_uri": "Where the store is written (from plan_dump): <output_root>/teacher_topk/<dump_key>.",
    "dump_key": "The store's key from plan_dump; the dump refuses a key that is not its settings' fingerprint.",
    "store": "The store (its URI is store_uri).",
    "metrics": "What this attempt did: examples, positions, chunks written now, resumed-from step, tokens/s.",
    "resources": "The resources the pipeline requested for the task (recorded in the store's metadata).",
    "error": "The tool's one-line error when it failed deterministically (exit 2, 3, 4), else empty.",
    "exit_code": "That error's exit code (docs/ERRORS.md); 0 when the dump completed the store.",
}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(dump_teacher_topk, INPUTS), base_image=image, install_kfp_package=False)


component = build()
