"""Teacher-relative evaluation: how close the trained student is to a teacher on held-out data.

Two references (``--eval-teacher`` or ``--eval-store``), measured by ``teacher_metrics``:

- a teacher run on ``--eval-data`` (``EvalTeacher``): its whole distribution, so KL(teacher || student)
  over the full vocabulary, top-1 agreement, the student's mass on the teacher's top-k and the
  tail-shape KL outside that top-k;
- a held-out store (``StoreExamples``): its own examples and the teacher's values on them, so the
  KL over the k + 1 bins (a lower bound of the full KL), top-1 agreement and top-k mass of a top-k
  store or of a hybrid store's head (its draws are not read), or the estimate of the full KL from the
  draws of a sampled store.

``open_eval_reference`` checks the reference against the run (vocabulary, sequence length,
tokenizer) in the plan, before any weight is read; the teacher's weights load at evaluation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..errors import InputError
from . import loader

TOPK_DEFAULT = 64  # the top-k of the measures against a teacher when the run's data names none


@dataclasses.dataclass
class EvalTeacher:
    """The teacher run on the evaluation batches (``logits(tokens, positions, segment_ids)``)."""

    spec: str
    k: int  # the teacher's top-k of topk_mass and tail_shape_kl
    model: Any = None

    @property
    def where(self) -> str:
        return f"teacher {self.spec}"

    def load(self, reuse=None):
        """The teacher's weights (``reuse``: an already loaded LoadedModel of the same spec)."""
        if self.model is None:
            from ..models import load_model

            self.model = reuse if reuse is not None else load_model(self.spec)
        return self

    def fields(self, arrays: dict) -> dict:
        import jax

        if not hasattr(self, "_apply"):
            self._apply = jax.jit(self.model.apply)
        return {"teacher_logits": self._apply(self.model.params, arrays["tokens"], arrays["positions"],
                                              arrays["segment_ids"])}


class StoreExamples:
    """A held-out store's records as evaluation examples (``batch(indices)`` like ``ExampleSource``),
    with the teacher's fields of its selection (sampled ids padded to the store's N); every record
    goes through the store's record check."""

    def __init__(self, store):
        from ..store import manifest as manifest_mod
        from ..store.checks import RecordCheck

        self.store = store
        shapes = store.manifest["shapes"]
        self.seq_len = int(shapes["seq_len"])
        self.k = int(shapes["top_k"])
        self.selection = manifest_mod.selection_of(store.manifest)
        self.sample_width = int(shapes["num_samples"]) if self.selection == "sampled" else None
        # a hybrid store is measured on its head, a top-k record: its k + 1 bins (the draws are not read)
        self.teacher_fields = (loader.SAMPLE_FIELDS if self.selection == "sampled"
                               else ("topk_ids", "topk_logprobs", "tail_logprob"))
        self._check = RecordCheck(store.manifest, store.uri)
        self.where = f"store {store.uri}"

    def __len__(self) -> int:
        return len(self.store)

    def batch(self, indices) -> dict:
        keep = loader.MODEL_FIELDS + self.teacher_fields
        recs = [loader._training_fields(self._check(self.store[int(i)]), sample_width=self.sample_width)
                for i in indices]
        return {k: np.stack([r[k] for r in recs]) for k in keep}

    def fields(self, arrays: dict) -> dict:
        return {k: arrays[k] for k in self.teacher_fields}


def open_eval_reference(config, source, eval_examples):
    """The evaluation set of a run with ``--eval-teacher`` or ``--eval-store``: ``(examples,
    reference)``, checked against the run's data ``source`` (nothing is loaded but manifests and
    configs)."""
    if config.eval_store is not None:
        return _held_out_store(config.eval_store, source)
    from ..models import describe_model

    hf_config, _, _ = describe_model(config.eval_teacher)
    V = int(hf_config["vocab_size"])
    if V != source.vocab_size:
        raise InputError(f"--eval-teacher {config.eval_teacher} has a vocabulary of {V}, the run's data "
                         f"{source.vocab_size}; give a teacher of the same vocabulary")
    k = source.top_k if source.selection == "topk" and source.top_k < V else TOPK_DEFAULT
    return eval_examples, EvalTeacher(config.eval_teacher, k=min(k, V - 1))


def _held_out_store(uri: str, source):
    from ..store import manifest as manifest_mod
    from ..store import open_store

    store = open_store(uri)
    store.require_complete()
    shapes = store.manifest["shapes"]
    for name, have, want in (("vocab_size", int(shapes["vocab_size"]), source.vocab_size),
                             ("seq_len", int(shapes["seq_len"]), source.seq_len)):
        if have != want:
            raise InputError(f"--eval-store {uri} has {name} {have}, the run's data {want}; dump the held-out "
                             "store with the training data's teacher and --seq-len")
    if manifest_mod.selection_of(store.manifest) == "sampled" and float(shapes["proposal_temperature"]) != 1.0:
        raise InputError(f"--eval-store {uri} holds draws at proposal temperature {shapes['proposal_temperature']}: "
                         "they estimate the tempered teacher's KL, not the teacher's; dump it at 1")
    sha = manifest_mod.tokenizer_sha256(store.manifest)
    if sha and source.tokenizer_sha256 and sha != source.tokenizer_sha256:
        raise InputError(f"--eval-store {uri} was tokenized with another tokenizer than the run's data; dump it "
                         "with the same teacher")
    examples = StoreExamples(store)
    return examples, examples
