"""The model-spec grammar, in one place: what a ``--teacher`` / ``--student`` string names.

  preset:NAME[@SEED]                a tiny built-in model with random weights (``models.presets``)
  flax:MODULE:FACTORY[?key=value&...]
                                    a Flax NNX student built by a factory (``models.flax_student``)
  anything else                     an HF-format checkpoint folder: a local path, file:// or gs:// URI
"""

from __future__ import annotations

import dataclasses

from ..errors import InputError

PRESET = "preset:"
FLAX = "flax:"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    text: str
    kind: str  # "preset" | "flax" | "checkpoint"
    name: str | None = None  # preset
    seed: int = 0  # preset

    @property
    def is_path(self) -> bool:
        """Whether the spec names a place on disk or in a bucket (an input an output must not overlap)."""
        return self.kind == "checkpoint"


def parse_model_spec(text: str) -> ModelSpec:
    """The kind of ``text`` (and a preset's name and seed); InputError when it is malformed. A Flax
    spec's module, factory and arguments are parsed by ``flax_student.parse_spec``."""
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"model spec {text!r} is empty; give a checkpoint folder, preset:NAME or flax:MODULE:FACTORY")
    if text.startswith(PRESET):
        name, _, seed = text[len(PRESET):].partition("@")
        try:
            seed_i = int(seed) if seed else 0
        except ValueError:
            raise InputError(f"bad preset seed in {text!r}: {seed!r} is not an integer") from None
        if not name:
            raise InputError(f"{text!r} names no preset; write preset:NAME[@SEED] (logit-distill preset --list)")
        return ModelSpec(text, "preset", name, seed_i)
    if text.startswith(FLAX):
        return ModelSpec(text, "flax")
    return ModelSpec(text, "checkpoint")


def is_path_spec(text) -> bool:
    """Whether an input's spec names a path (or a glob): not ``preset:`` or ``flax:`` (nor e.g. ``gs:`` typos
    of other schemes, which stay paths)."""
    if not text or not str(text).strip():
        return False
    text = str(text)
    if text.startswith(("gs://", "file://")):
        return True
    return not text.startswith((PRESET, FLAX))
