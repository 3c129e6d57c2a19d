"""``load_model(spec)`` / ``describe_model(spec)`` for any spec of ``models.specs``: a preset (materialized
once into the cache, then loaded like any checkpoint) or an HF checkpoint folder."""

from __future__ import annotations

from .checkpoint import LoadedModel, checkpoint_identity, load_checkpoint, local_tokenizer, read_hf_config
from .specs import parse_model_spec


def load_model(spec: str, *, dtype: str = "float32", mesh=None, shard_mode: str = "fsdp") -> LoadedModel:
    """``spec``: an HF checkpoint directory / URI, or ``preset:NAME`` / ``preset:NAME@SEED``.

    With ``mesh`` each tensor is placed straight onto the mesh (``shard_mode``, see ``models.sharding``)
    as it is read.
    """
    parsed = parse_model_spec(spec)
    if parsed.kind == "preset":
        from .presets import preset_dir

        loaded = load_checkpoint(preset_dir(parsed.name, parsed.seed), dtype=dtype, mesh=mesh, shard_mode=shard_mode)
        # The weights' fingerprint too: a preset whose definition changes is another teacher.
        loaded.identity = _preset_identity(parsed, loaded.identity)
        loaded.source = spec
        return loaded
    _refuse_flax(parsed)
    return load_checkpoint(spec, dtype=dtype, mesh=mesh, shard_mode=shard_mode)


def describe_model(spec: str) -> tuple[dict, dict, str | None]:
    """(hf_config, identity, local tokenizer path) of ``spec`` without reading the weights.

    The identity equals ``load_model(spec).identity``: a store can be named (planned) before a large
    teacher is loaded.
    """
    parsed = parse_model_spec(spec)
    if parsed.kind == "preset":
        from .presets import preset_dir

        hf_config, identity, tokenizer = describe_model(preset_dir(parsed.name, parsed.seed))
        return hf_config, _preset_identity(parsed, identity), tokenizer
    _refuse_flax(parsed)
    uri = spec.rstrip("/")
    return read_hf_config(uri), checkpoint_identity(uri), local_tokenizer(uri)


def _preset_identity(parsed, checkpoint: dict) -> dict:
    return {"kind": "preset", "preset": parsed.name, "seed": parsed.seed, "fingerprint": checkpoint["fingerprint"]}


def _refuse_flax(parsed) -> None:
    if parsed.kind == "flax":
        from ..errors import InputError

        raise InputError(f"{parsed.text}: a Flax NNX module can be a student only (a teacher is an HF checkpoint "
                         "folder or preset:NAME)")
