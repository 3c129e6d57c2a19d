"""``plan_dump``: name the teacher store before the dump starts, and say whether it is needed.

Computes the store manifest's fingerprint from the pipeline's parameters
(``logit_distill.dump.plan_dump``: no weights loaded, nothing tokenized)
and returns its dump key and the store's location
``<output_root>/teacher_topk/<dump_key>``. The dump task gets both, so every
retry, resubmission or clone of a run with the same settings lands on the same
prefix and resumes there. ``job_display_name`` names the dump's custom job
after the run and the key.

It also scans the store's names (no teacher, no chunk read): ``complete``
tells the pipeline to skip the dump task entirely, and ``store_state`` (a
digest of the committed chunk names, which carry their checksums) is part of
verify's cache key. The number of processes that write the store is the job's
replica count times the hosts of its TPU slice (``tpu_topology``), the same
number the dump finds in ``jax.process_count()``.

It has no artifact output: the pipeline imports the store as a ``Dataset`` by
its URI and state (``dsl.importer``, ``reimport=False``) once it is complete,
so that every run over the same store hands verify and the training the same
artifact (part of their cache key), and no task but the dump makes an artifact
at the store's URI. A bad setting (exit 2) fails this CPU task with the tool's
one line, before any accelerator job.
"""
from typing import NamedTuple

from kfp import dsl

from .image import DEFAULT_IMAGE


def plan_dump(
    teacher: str,
    data: str,
    output_root: str,
    num_steps: int,
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
    run_name: str = "",
) -> NamedTuple("PlanOutputs", [("dump_key", str), ("store_uri", str), ("complete", bool), ("store_state", str),
                                ("job_display_name", str)]):
    """The dump key (16 hex digits of the store fingerprint), the store URI for these settings, whether the
    store there is already complete (a scan of names) and its state (a digest of its committed chunk names)."""
    inputs = dict(locals())  # the arguments: DumpConfig.from_component takes the store's settings among them
    import collections
    import sys

    from logit_distill.distributed import planned_processes
    from logit_distill.dump import DumpConfig, plan_dump
    from logit_distill.errors import InputError, LogitDistillError
    from logit_distill.failures import describe

    try:
        if not output_root:
            raise InputError("output_root is empty: give a local directory or a gs:// prefix")
        config = DumpConfig.from_component(inputs, output="", progress=False)
        processes = planned_processes(num_processes, tpu_topology, machine_type)
        plan = plan_dump(config, num_processes=processes)
        manifest, key = plan.manifest, plan.dump_key
        store_uri = output_root.rstrip("/") + "/teacher_topk/" + key
        status = plan.status(store_uri)
    except LogitDistillError as e:  # a CPU task without retries: the run fails with this line
        code, line = describe(e)
        print(f"logit-distill dump: {line}", file=sys.stderr, flush=True)
        raise SystemExit(code)
    state = "complete" if status.complete else f"{status.present} of {status.expected} chunks present"
    print(f"plan_dump: dump key {key} (fingerprint {manifest['fingerprint']}); store {store_uri} ({state}; "
          f"{processes} process(es))", flush=True)
    name = "-".join(part for part in (run_name, "dump", key) if part)[:128]
    outputs = collections.namedtuple("PlanOutputs", ["dump_key", "store_uri", "complete", "store_state",
                                                     "job_display_name"])
    return outputs(key, store_uri, bool(status.complete), status.state, name)


# Descriptions of the inputs no pipeline parameter feeds (the others come from pipelines/params.py).
INPUTS = {
    "num_processes": "Replicas of the dump job (hosts, or TPU slices): with the slice's hosts, the number of "
                     "processes that write the store, part of its layout, hence of its key.",
    "tpu_topology": "TPU slice topology of each replica (e.g. 4x4); empty for GPU or CPU machines.",
    "machine_type": "Machine type of the dump hosts (ct5lp-hightpu-4t: 4 TPU chips per host).",
    "run_name": "The pipeline run's name (Vertex's {{$.pipeline_job_name}}): part of the dump job's display "
                "name.",
}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(plan_dump, INPUTS), base_image=image, install_kfp_package=False)


component = build()
