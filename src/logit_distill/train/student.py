"""The student of a training run, whichever kind it is: one ``Student`` for the loop.

- built-in (``preset:NAME[@SEED]`` or an HF checkpoint directory): the decoder of
  ``logit_distill.models``; placed with ``shard_params``; exported in HF format to ``<output>/hf``;
- Flax NNX (``flax:MODULE:FACTORY[?key=value&...]``, ``models.flax_student``): the module's
  ``nnx.Param`` values as a flat dict; placed by its ``nnx.with_partitioning`` annotations;
  exported as ``model.safetensors`` + ``student.json`` to ``<output>/student``.

``describe_student`` checks a student against the data without reading a weight (the plan);
``open_student`` gives the loop the same pure pieces for both kinds: ``params`` (a pytree the
optimizer, Orbax and the mesh handle), ``apply(params, tokens, positions, segment_ids) -> float32
logits [B, L, V]``, ``place`` and ``save``. So there is one training step, one checkpoint format
and one evaluation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..errors import InputError

HF_DIR = "hf"
FLAX_DIR = "student"


@dataclasses.dataclass(frozen=True)
class StudentSpec:
    """A student as the plan sees it: checked against the data, no weights read."""

    spec: str
    kind: str  # "hf" | "flax"
    vocab_size: int
    identity: dict
    tokenizer_path: str | None  # its own tokenizer.json (HF checkpoints), else None

    @property
    def export_name(self) -> str:
        """The folder under the output the trained student is exported to."""
        return HF_DIR if self.kind == "hf" else FLAX_DIR


@dataclasses.dataclass
class Student:
    spec: StudentSpec
    params: Any
    apply: Callable
    place: Callable  # place(state, mesh, mode) -> state on the mesh
    save: Callable  # save(host params, out_dir, tokenizer_path) -> out_dir


def describe_student(spec: str, *, vocab_size: int, seq_len: int, where: str) -> StudentSpec:
    """The student of ``spec`` for data of ``vocab_size`` and ``seq_len`` (read from ``where``); InputError
    before any weight is read when it does not fit."""
    from ..models import flax_student
    from ..models.specs import parse_model_spec

    if parse_model_spec(spec).kind == "flax":
        d = flax_student.describe(spec, vocab_size=vocab_size, seq_len=seq_len)
        return StudentSpec(spec=spec, kind="flax", vocab_size=d.vocab_size, identity=d.identity, tokenizer_path=None)
    from ..models import describe_model

    hf_config, identity, tokenizer = describe_model(spec)
    have = int(hf_config["vocab_size"])
    if have != vocab_size:
        raise InputError(f"student {spec} has a vocabulary of {have} but {where} has {vocab_size}: the student "
                         "must share the teacher's vocabulary")
    max_len = int(hf_config.get("max_position_embeddings") or 0)
    if max_len and seq_len > max_len:
        raise InputError(f"seq_len {seq_len} of {where} exceeds the student's max_position_embeddings {max_len}")
    return StudentSpec(spec=spec, kind="hf", vocab_size=have, identity=identity, tokenizer_path=tokenizer)


def open_student(described: StudentSpec, *, seq_len: int) -> Student:
    """The student's weights and functions."""
    from ..models import flax_student

    if described.kind == "flax":
        fs = flax_student.build(described.spec, vocab_size=described.vocab_size, seq_len=seq_len)
        return Student(
            spec=dataclasses.replace(described, identity=fs.identity), params=fs.params, apply=fs.apply,
            place=lambda state, mesh, mode: flax_student.place_state(fs, state, mesh, mode),
            save=lambda params, out_dir, tok: flax_student.save_student(fs, params, out_dir, tok),
        )
    from ..models import load_model, save_hf_checkpoint, shard_params

    model = load_model(described.spec)
    if model.identity != described.identity:
        raise InputError(f"student {described.spec} changed while it was being loaded; run again")
    params, model.params = model.params, None  # the training state owns the weights
    return Student(
        spec=described, params=params, apply=model.apply,
        # shard_params decides each array's sharding from its shape alone, so Adam moments land
        # exactly like their parameters.
        place=lambda state, mesh, mode: shard_params(state, mesh, mode),
        save=lambda p, out_dir, tok: save_hf_checkpoint(model, p, out_dir, tokenizer_path=tok),
    )


def check_tokenizer(student: StudentSpec, reference_file: str | None, reference_sha: str | None, reference: str, *,
                    allow: bool) -> str | None:
    """The student's tokenizer.json must be the one the data was tokenized with (same SHA-256); a warning
    line (to print) when ``allow`` lets a mismatch pass, else None.

    Vocabularies of equal size can still be different tokenizers (many 32000-token ones are): a
    student trained on ids it reads otherwise learns garbage, and its export would ship the wrong
    tokenizer. The error lists the first differing ids when ``reference_file`` is known. Nothing to
    check when either side has no tokenizer recorded (pre-tokenized data without one, synthetic
    stores, a checkpoint without tokenizer.json, a Flax student).
    """
    from ..data.tokenizer import differing_ids, file_sha256

    if student.tokenizer_path is None or reference_sha is None:
        return None
    have = file_sha256(student.tokenizer_path)
    if have == reference_sha:
        return None
    detail = ""
    if reference_file is not None:
        first, count = differing_ids(reference_file, student.tokenizer_path)
        if first:
            shown = ", ".join(f"{i} ({a!r} vs {b!r})" for i, a, b in first)
            detail = f"; {count} ids differ, the first: {shown}"
        else:
            detail = "; the vocabularies are equal, the rules (merges, normalizer, pre-tokenizer) differ"
    what = (f"student {student.spec} has another tokenizer than {reference} (tokenizer.json SHA-256 "
            f"{have[:12]}... vs {reference_sha[:12]}...){detail}")
    if not allow:
        raise InputError(f"{what}; give the student the teacher's tokenizer.json, or pass "
                         "--allow-tokenizer-mismatch to train anyway")
    return f"warning: {what}; training anyway (--allow-tokenizer-mismatch): the export ships the student's tokenizer"
