"""Teacher and student decoders: Qwen3, Qwen2, Llama 3, Gemma 3 (text), and the mixture-of-experts teachers
Qwen3-MoE, gpt-oss, DeepSeek-V3 / Kimi K2 and GLM-4.5.

- ``load_model(spec, *, dtype="float32")``: an HF checkpoint dir/URI or ``preset:NAME[@SEED]``.
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

from .checkpoint import (
    LoadedModel,
    build_model,
    checkpoint_identity,
    describe_model,
    forward_logits,
    init_params,
    load_model,
    save_hf_checkpoint,
)
from .config import ARCHITECTURES, FAMILIES, DecoderConfig, from_hf_config
from .decoder import apply, attention_mask
from .presets import PRESETS, materialize_preset
from .sharding import shard_params

__all__ = [
    "ARCHITECTURES",
    "FAMILIES",
    "PRESETS",
    "DecoderConfig",
    "LoadedModel",
    "apply",
    "attention_mask",
    "build_model",
    "checkpoint_identity",
    "describe_model",
    "forward_logits",
    "from_hf_config",
    "init_params",
    "load_model",
    "load_student",
    "materialize_preset",
    "save_hf_checkpoint",
    "shard_params",
]


def __getattr__(name):
    # Lazy: Flax is imported only when a Flax NNX student is used.
    if name == "load_student":
        from .flax_student import load_student

        return load_student
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
