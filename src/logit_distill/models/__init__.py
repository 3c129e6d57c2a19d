"""Teacher and student decoders: Qwen3, Qwen2, Llama 3, Gemma 3 (text), and the mixture-of-experts teachers
Qwen3-MoE, gpt-oss, DeepSeek-V3 / Kimi K2 and GLM-4.5.

- ``load_model(spec, *, dtype="float32")``: an HF checkpoint dir/URI or ``preset:NAME[@SEED]``
  (the spec grammar: ``specs``).
- ``LoadedModel.apply(params, tokens, positions, segment_ids) -> float32 logits [B, L, V]``:
  pure, jit-able; attention is causal and never crosses segments (0 = padding).
- ``init_params`` / ``build_model``: a random student for an HF config.
- ``save_hf_checkpoint``: config.json + model.safetensors (+ tokenizer) for transformers.
- ``shard_params``: place params on a mesh (``replicate`` | ``fsdp`` | ``tensor`` | ``fsdp+tensor`` |
  ``expert`` | ``fsdp+expert``).
- ``moe``: routing and the experts' grouped matmuls (``tiles`` on CPU, ``ragged`` on accelerators);
  ``mla``: DeepSeek's latent attention; ``sources`` / ``quantized``: checkpoint layouts, FP8 and MXFP4.
- ``attention``: the attention implementations (``dense``, ``blocked``, ``pallas_gpu``, ``pallas_tpu``, ``auto``).
- ``load_student(dir)``: the Flax NNX student exported by training (``flax_student``,
  docs/STUDENTS.md).

See docs/MODELS.md.
"""

import importlib

# name -> the module defining it. Imported on first use (PEP 562), so that light modules such as
# ``models.specs`` import without JAX.
_EXPORTS = {
    "LoadedModel": "checkpoint", "build_model": "checkpoint", "checkpoint_identity": "checkpoint",
    "init_params": "checkpoint", "save_hf_checkpoint": "checkpoint",
    "ARCHITECTURES": "config", "FAMILIES": "config", "DecoderConfig": "config", "from_hf_config": "config",
    "apply": "decoder", "attention_mask": "decoder",
    "describe_model": "loading", "load_model": "loading",
    "PRESETS": "presets", "materialize_preset": "presets",
    "shard_params": "sharding",
    "load_student": "flax_student",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
