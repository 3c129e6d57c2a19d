"""What a dump will write: the store's manifest (hence its fingerprint and dump key), found without
loading the teacher's weights or tokenizing the data.

The pipeline names the store ``<output_root>/teacher_topk/<dump_key>/`` from the plan before the
dump starts, and ``run_dump`` writes exactly the plan's manifest.
"""

from __future__ import annotations

import dataclasses

from .. import store as store_mod
from ..errors import InputError
from ..store import manifest as manifest_mod
from .config import DumpConfig

# How each selection is computed, recorded in the manifest's content (part of the fingerprint).
SELECTION_TEXT = {
    "topk": "float32 log-softmax; jax.lax.top_k; tail = logsumexp outside the top-k",
    "sampled": "float32 log-softmax; N inverse-CDF draws per position from softmax(logits / t), keys "
               "fold_in(fold_in(key(sample_seed), example_index), position); distinct ids ascending + counts",
    "hybrid": "float32 log-softmax; jax.lax.top_k head + tail mass; N systematic draws per position from the tail of "
              "softmax(logits / t) renormalised, one uniform keyed fold_in(fold_in(key(sample_seed), example_index), "
              "position); distinct ids ascending + counts; tail sum p_t log p_t",
}


@dataclasses.dataclass(frozen=True)
class DumpPlan:
    """A dump of ``config`` by ``num_processes`` processes: the manifest it writes and the tokenizer
    its data is tokenized with."""

    config: DumpConfig
    manifest: dict
    num_processes: int
    tokenizer: str | None  # tokenizer.json (file or folder) of the data: --tokenizer or the teacher's

    @property
    def dump_key(self) -> str:
        return manifest_mod.dump_key(self.manifest)

    @property
    def num_steps(self) -> int:
        return self.manifest["layout"]["num_steps"]

    def status(self, uri: str | None = None):
        """The store at ``uri`` (default: the config's output) judged against this plan: a scan of names."""
        from ..store.status import store_status

        return store_status(uri or self.config.output, self.manifest)

    def may_be_complete(self) -> bool:
        """False when the output cannot hold every chunk (a count of names, none parsed)."""
        from ..store.status import may_be_complete

        return may_be_complete(self.config.output, self.manifest)


def plan_dump(config: DumpConfig, *, num_processes: int = 1, available_examples: int | None = None) -> DumpPlan:
    """Plan a dump of ``config``: reads the teacher's config.json and tokenizer and the data files'
    identity (their hashes, cached), nothing else.

    The number of steps is ``config.num_steps``, or, when that is None, every full batch of
    ``available_examples`` (the examples the data gives, known once it is tokenized). When both are
    known, the steps must fit the data.
    """
    from ..data import plan_identity
    from ..models import describe_model

    config.check()
    if config.batch_size % num_processes:
        raise InputError(f"--batch-size {config.batch_size} is not divisible by the {num_processes} processes")
    num_steps = config.num_steps
    if available_examples is not None:
        num_steps = steps_for(config, available_examples)
    if num_steps is None:
        raise InputError("planning a store needs --num-steps")
    hf_config, teacher_identity, teacher_tokenizer = describe_model(config.teacher)
    vocab_size = int(hf_config["vocab_size"])
    max_len = int(hf_config.get("max_position_embeddings") or 0)
    if max_len and config.seq_len > max_len:
        raise InputError(f"--seq-len {config.seq_len} exceeds the teacher's maximum of {max_len} positions "
                         f"(max_position_embeddings in {config.teacher})")
    if config.selection == "topk" and config.top_k > vocab_size:
        raise InputError(f"--top-k {config.top_k} exceeds the teacher's vocabulary of {vocab_size}")
    if config.selection == "hybrid" and config.top_k >= vocab_size:
        raise InputError(f"--selection hybrid: --top-k {config.top_k} leaves no tail to draw from in the teacher's "
                         f"vocabulary of {vocab_size}; lower --top-k")
    tokenizer = config.tokenizer or teacher_tokenizer
    data_identity = plan_identity(config.data, tokenizer, seq_len=config.seq_len, packing=config.packing,
                                  seed=config.seed, text_field=config.text_field, chat=config.chat)
    manifest = store_mod.build_manifest(
        seq_len=config.seq_len, top_k=config.top_k, vocab_size=vocab_size, codec=config.codec,
        num_steps=num_steps, examples_per_step=config.batch_size, steps_per_file=config.steps_per_file,
        num_processes=num_processes, array_record_options=config.array_record_options, masked=True,
        content={"teacher": teacher_identity, "teacher_dtype": config.dtype, "data": data_identity,
                 "selection": SELECTION_TEXT[config.selection]},
        **config.selection_settings(),
    )
    manifest["info"]["teacher_spec"] = config.teacher
    manifest["info"]["data_spec"] = config.data
    return DumpPlan(config=config, manifest=manifest, num_processes=num_processes, tokenizer=tokenizer)


def steps_for(config: DumpConfig, available_examples: int) -> int:
    """The steps of a dump of data that gives ``available_examples`` examples: ``config.num_steps``,
    checked to fit, or every full batch."""
    B = config.batch_size
    available = available_examples // B
    if available < 1:
        raise InputError(f"{config.data} gives {available_examples} examples of {config.seq_len} tokens: fewer than "
                         f"one batch of {B}; lower --batch-size or --seq-len, or add data")
    if config.num_steps is None:
        return available
    if config.num_steps > available:
        raise InputError(f"--num-steps {config.num_steps}: the data gives {available_examples} examples, enough "
                         f"for 1..{available} steps of {B}")
    return config.num_steps
