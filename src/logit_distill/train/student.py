"""The student of a training run, whichever kind it is: one ``Student`` for the loop.

- built-in (``preset:NAME[@SEED]`` or an HF checkpoint directory): the decoder of
  ``logit_distill.models``; placed with ``shard_params``; exported in HF format to ``<output>/hf``;
- Flax NNX (``flax:MODULE:FACTORY[?key=value&...]``, ``models.flax_student``): the module's
  ``nnx.Param`` values as a flat dict; placed by its ``nnx.with_partitioning`` annotations;
  exported as ``model.safetensors`` + ``student.json`` to ``<output>/student``.

Both give the loop the same pure pieces: ``params`` (a pytree the optimizer, Orbax and the mesh
handle), ``apply(params, tokens, positions, segment_ids) -> float32 logits [B, L, V]``, ``place``
and ``export``. So there is one training step, one checkpoint format and one evaluation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..errors import InputError, LogitDistillError

HF_DIR = "hf"
FLAX_DIR = "student"


@dataclasses.dataclass
class Student:
    spec: str
    kind: str  # "hf" | "flax"
    vocab_size: int
    params: Any
    apply: Callable
    identity: dict
    tokenizer_path: str | None
    export_name: str  # the folder under the output
    place: Callable  # place(state, mesh, mode) -> state on the mesh
    save: Callable  # save(host params, out_dir, tokenizer_path) -> out_dir


def open_student(spec: str, *, vocab_size: int, seq_len: int, where: str) -> Student:
    """The student of ``spec`` for data of ``vocab_size`` and ``seq_len`` (read from ``where``);
    InputError before any step when it does not fit."""
    from ..models import flax_student

    if flax_student.is_flax_spec(spec):
        fs = flax_student.build(spec, vocab_size=vocab_size, seq_len=seq_len)
        return Student(
            spec=spec, kind="flax", vocab_size=fs.vocab_size, params=fs.params, apply=fs.apply,
            identity=fs.identity, tokenizer_path=None, export_name=FLAX_DIR,
            place=lambda state, mesh, mode: flax_student.place_state(fs, state, mesh, mode),
            save=lambda params, out_dir, tok: flax_student.save_student(fs, params, out_dir, tok),
        )

    from ..models import load_model, save_hf_checkpoint, shard_params

    model = load_model(spec)
    if model.vocab_size != vocab_size:
        raise InputError(
            f"student {spec} has a vocabulary of {model.vocab_size} but {where} has "
            f"{vocab_size}: the student must share the teacher's vocabulary"
        )
    if seq_len > model.max_seq_len:
        raise InputError(f"seq_len {seq_len} exceeds the student's max_position_embeddings {model.max_seq_len}")
    params, model.params = model.params, None  # the training state owns the weights
    return Student(
        spec=spec, kind="hf", vocab_size=model.vocab_size, params=params, apply=model.apply,
        identity=model.identity, tokenizer_path=model.tokenizer_path, export_name=HF_DIR,
        # shard_params decides each array's sharding from its shape alone, so Adam moments land
        # exactly like their parameters.
        place=lambda state, mesh, mode: shard_params(state, mesh, mode),
        save=lambda p, out_dir, tok: save_hf_checkpoint(model, p, out_dir, tokenizer_path=tok),
    )


def store_teacher_tokenizer(manifest: dict) -> str | None:
    """The tokenizer.json of the teacher a store was dumped from (``info.teacher_spec``), when it is
    still readable; None otherwise. A Flax student has no tokenizer of its own: it uses this one."""
    spec = manifest.get("info", {}).get("teacher_spec")
    if not spec:
        return None
    from ..models import describe_model

    try:
        return describe_model(spec)[2]
    except (LogitDistillError, OSError, ValueError):
        return None
