"""Tiny model presets with random weights, written as real HF checkpoints.

``load_model("preset:tiny-qwen3")`` (or ``preset:NAME@SEED``) materializes the
preset once into ``$LOGIT_DISTILL_CACHE/presets/`` and then loads it through
the ordinary checkpoint path, so presets exercise the real loader.

The configs keep each family's published settings (rope_theta, rope scaling,
norms, biases, tied embeddings, sliding windows; for the mixtures of experts
the routing, shared experts, dense layers, MLA and sinks) and shrink only the
sizes.
The tokenizer is a byte-level BPE without merges: the 256 byte symbols plus a
few special tokens, built with HF ``tokenizers`` (deterministic, no data).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid

from .. import paths
from ..errors import InputError

_COMMON = {
    "bos_token_id": 256,
    "eos_token_id": 256,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "use_cache": True,
    "torch_dtype": "float32",
}

PRESETS: dict[str, dict] = {
    # Qwen3 (as Qwen3-0.6B: tied embeddings; qk-norm, rope_theta 1e6)
    "tiny-qwen3": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 2,
    },
    # Llama 3.1 (rope_scaling llama3, factor 8, rope_theta 5e5, untied)
    "tiny-llama3": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
    },
    # Qwen2.5 (q/k/v biases, no qk-norm, untied as the 7B)
    "tiny-qwen2": {
        **_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 512,
        "max_window_layers": 2,
    },
    # Gemma 3 text (as gemma-3-1b: local/global layers, qk-norm, (1+w) norms, tied)
    "tiny-gemma3": {
        **_COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "bos_token_id": 256,
        "pad_token_id": 257,
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
    },
    # a slightly bigger Qwen3 for demos (about 3.3M parameters)
    "small-qwen3": {
        **_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 4,
    },
    # Qwen3-MoE (as Qwen3-30B-A3B: 128 experts top-8 -> 8 experts top-2, norm_topk_prob, untied)
    "tiny-qwen3-moe": {
        **_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 192,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "router_aux_loss_coef": 0.001,
    },
    # gpt-oss (as gpt-oss-20b: sinks, alternating 128-token windows -> 8, YaRN, biases, clamped SwiGLU)
    "tiny-gpt-oss": {
        **_COMMON,
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "max_position_embeddings": 131072,
        "initial_context_length": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.9,
    },
    # DeepSeek-V3 / Kimi K2 (MLA, sigmoid routing in groups, a shared expert, dense first layer, YaRN mscale)
    "tiny-deepseek-v3": {
        **_COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 192,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
    },
    # GLM-4.5 (partial rotary 0.5, q/k/v biases, qk-norm, DeepSeek-style routing, shared expert, dense first layer)
    "tiny-glm4-moe": {
        **_COMMON,
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 192,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000,
        "attention_bias": True,
        "tie_word_embeddings": False,
    },
}

# The demo's teacher: tiny-qwen2 (untied) with its output head scaled 25x after the random
# init, so its next-token distributions are peaked (entropy about 2 nats of a possible 6.2)
# yet learnable by a tiny student from a few hundred sampled documents.
PRESETS["demo-teacher"] = dict(PRESETS["tiny-qwen2"])
# Scale factors applied to named tensors after the random init (see materialize_preset).
PRESET_INIT_SCALES = {"demo-teacher": {"lm_head.weight": 25.0}}

# Bump when the way presets are written changes (tokenizer, init), so cached copies are rebuilt.
PRESET_FORMAT = 2

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]  # ids 256, 257


def _bytes_to_unicode() -> list[str]:
    """The GPT-2 byte -> printable symbol table, in byte order (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def build_tokenizer():
    """A byte-level ``tokenizers.Tokenizer``: ids 0..255 are bytes, then SPECIAL_TOKENS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {sym: i for i, sym in enumerate(_bytes_to_unicode())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def write_tokenizer(out_dir: str, max_len: int, vocab_size: int | None = None) -> None:
    """tokenizer.json + tokenizer_config.json into a local directory.

    With ``vocab_size`` the vocabulary is padded with ``<|reserved_i|>`` tokens up to the
    model's (as Llama 3's is), so that every id a model can emit decodes.
    """
    tok = build_tokenizer()
    if vocab_size is not None and vocab_size > tok.get_vocab_size(True):
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - tok.get_vocab_size(True))])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIAL_TOKENS[0],
        "bos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[1],
        "model_max_length": max_len,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2)


def _preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return json.loads(json.dumps(PRESETS[name]))


def materialize_preset(name: str, out_dir: str, seed: int = 0) -> str:
    """Write preset ``name`` with random weights from ``seed`` as an HF checkpoint in ``out_dir``."""
    from .checkpoint import build_model, init_params, save_hf_checkpoint

    hf_config = _preset_config(name)
    params = init_params(hf_config, seed, "float32")
    for tensor, scale in PRESET_INIT_SCALES.get(name, {}).items():
        *parents, leaf = tensor.split(".")
        node = params
        for key in parents:
            node = node[key]
        node[leaf] = node[leaf] * scale
    loaded = build_model(hf_config, params, identity={"kind": "preset", "preset": name, "seed": seed})
    tmp = os.path.join(paths.default_cache_dir("tmp"), f"tok-{uuid.uuid4().hex}")
    os.makedirs(tmp, exist_ok=True)
    try:
        write_tokenizer(tmp, hf_config["max_position_embeddings"], hf_config["vocab_size"])
        save_hf_checkpoint(loaded, params, out_dir, tokenizer_path=os.path.join(tmp, "tokenizer.json"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def preset_dir(name: str, seed: int = 0) -> str:
    """Local checkpoint directory of a preset, materialized on first use (atomic rename)."""
    cfg = _preset_config(name)
    # Everything that changes the materialized files names the cache entry.
    recipe = {"config": cfg, "init_scales": PRESET_INIT_SCALES.get(name, {}), "format": PRESET_FORMAT}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    final = paths.default_cache_dir("presets", f"{name}-{seed}-{digest}")
    if os.path.exists(os.path.join(final, "config.json")):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{final}.tmp-{uuid.uuid4().hex}"
    try:
        materialize_preset(name, tmp, seed)
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.exists(os.path.join(final, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
