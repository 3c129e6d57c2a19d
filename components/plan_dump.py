"""``plan_dump``: name the teacher store before the dump starts.

Computes the store manifest's fingerprint from the pipeline's parameters
(``logit_distill.dump.plan_manifest``: no weights loaded, nothing tokenized)
and returns its dump key and the store's location
``<output_root>/teacher_topk/<dump_key>``. The dump task gets both as string
inputs, so Vertex's cache fingerprint of the dump includes the key, and every
retry, resubmission or clone of a run with the same settings lands on the same
prefix and resumes there.
"""

from typing import NamedTuple

from kfp import dsl

from .image import DEFAULT_IMAGE


def plan_dump(
    teacher: str,
    data: str,
    output_root: str,
    num_steps: int,
    top_k: int = 64,
    seq_len: int = 512,
    batch_size: int = 8,
    steps_per_file: int = 50,
    codec: str = "default",
    selection: str = "topk",
    samples: int = 32,
    proposal_temperature: float = 1.0,
    tail_temperatures: str = "",
    data_seed: int = 0,
    packing: bool = True,
    dtype: str = "float32",
    text_field: str = "text",
    tokenizer: str = "",
    num_processes: int = 1,
) -> NamedTuple("PlanOutputs", [("dump_key", str), ("store_uri", str)]):
    """The dump key (16 hex digits of the store fingerprint) and the store URI for these settings."""
    import collections

    from logit_distill.dump import DumpConfig, plan_manifest
    from logit_distill.store import dump_key as dump_key_of

    if not output_root:
        raise ValueError("output_root is empty: give a local directory or a gs:// prefix")
    config = DumpConfig(
        teacher=teacher, data=data, output="", top_k=top_k, seq_len=seq_len, batch_size=batch_size,
        num_steps=num_steps, steps_per_file=steps_per_file, codec=codec, seed=data_seed, packing=packing,
        selection=selection, samples=samples if selection == "sampled" else None,
        proposal_temperature=proposal_temperature if selection == "sampled" else 1.0,
        tail_temperatures=tuple(float(x) for x in tail_temperatures.split(",") if x.strip()),
        dtype=dtype, text_field=text_field, tokenizer=tokenizer or None, progress=False,
    )
    key = dump_key_of(plan_manifest(config, num_processes=num_processes))
    store_uri = output_root.rstrip("/") + "/teacher_topk/" + key
    print(f"plan_dump: dump key {key}; store {store_uri}")
    outputs = collections.namedtuple("PlanOutputs", ["dump_key", "store_uri"])
    return outputs(key, store_uri)


# Descriptions of the inputs no pipeline parameter feeds (the others come from pipelines/params.py).
INPUTS = {
    "num_processes": "Hosts (JAX processes) of the dump: part of the store's layout, hence of its key.",
}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(plan_dump, INPUTS), base_image=image, install_kfp_package=False)


component = build()
