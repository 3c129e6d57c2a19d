"""Decoder configuration, read from an HF ``config.json`` dict.

One frozen dataclass (``DecoderConfig``) describes every family we support
(Qwen3, Qwen2, Llama 3, Gemma 3 text); ``from_hf_config`` maps the published
``config.json`` keys onto it. Both spellings of the RoPE settings are read:
the classic one found in published checkpoints (``rope_theta``,
``rope_scaling``, ``rope_local_base_freq``, ``sliding_window_pattern``) and the
``rope_parameters`` / ``layer_types`` one that transformers 5 writes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..errors import InputError

# architecture name in config.json -> our family name
ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama3",
    "Gemma3ForCausalLM": "gemma3",
}
MODEL_TYPES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama3", "gemma3_text": "gemma3"}
FAMILIES = ("qwen3", "qwen2", "llama3", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Everything the forward pass needs; hashable, so it can be a static jit argument."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over head_dim of q and k (Qwen3, Gemma 3)
    gemma_norms: bool  # (1 + w) RMSNorm, pre/post feedforward norms, embedding scale
    activation: str  # "silu" | "gelu_tanh"
    query_scale: float  # multiplies q k^T
    # per layer: sliding window (None = full attention) and index into rope_inv_freqs
    layer_windows: tuple
    layer_rope: tuple
    # one tuple of float32 inverse frequencies per distinct rope setting (0 = global, 1 = local)
    rope_inv_freqs: tuple
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def inv_freq(self, i: int) -> np.ndarray:
        return np.asarray(self.rope_inv_freqs[i], dtype=np.float32)


def family_of(hf_config: dict) -> str:
    """Our family name for an HF config, or an InputError naming what is unsupported."""
    archs = hf_config.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if not archs and hf_config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf_config["model_type"]]
    what = ", ".join(archs) if archs else f"model_type {hf_config.get('model_type')!r}"
    raise InputError(
        f"unsupported architecture {what}; supported: {', '.join(sorted(ARCHITECTURES))} "
        f"(model_type {', '.join(sorted(MODEL_TYPES))})"
    )


def _inv_freq(head_dim: int, rope: dict, max_pos: int) -> tuple:
    """Inverse RoPE frequencies as transformers computes them (float32)."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta", 10000.0))
    # same float32 arithmetic as transformers' _compute_default_rope_parameters
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv = (inv / np.float32(rope["factor"])).astype(np.float32)
    elif rope_type == "llama3":
        factor = float(rope["factor"])
        low = float(rope["low_freq_factor"])
        high = float(rope["high_freq_factor"])
        old_ctx = float(rope.get("original_max_position_embeddings") or max_pos)
        low_wl = old_ctx / low
        high_wl = old_ctx / high
        wavelen = (2 * math.pi / inv).astype(np.float32)
        inv_l = np.where(wavelen > low_wl, inv / factor, inv).astype(np.float32)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, inv_l).astype(np.float32)
    else:
        raise InputError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return tuple(float(x) for x in inv)


def _rope_settings(hf: dict, family: str) -> tuple[dict, dict | None]:
    """(global rope dict, local rope dict or None) from either config spelling."""
    rp = hf.get("rope_parameters")
    if family == "gemma3":
        if isinstance(rp, dict) and "full_attention" in rp:
            glob = dict(rp["full_attention"])
            loc = dict(rp.get("sliding_attention") or {"rope_theta": 10000.0})
        else:
            glob = {"rope_theta": hf.get("rope_theta", 1_000_000.0)}
            if hf.get("rope_scaling"):
                glob.update(hf["rope_scaling"])
            loc = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        loc.setdefault("rope_theta", 10000.0)
        glob.setdefault("rope_theta", 1_000_000.0)
        return glob, loc
    if isinstance(rp, dict) and rp:
        glob = dict(rp)
    else:
        glob = {"rope_theta": hf.get("rope_theta", 10000.0)}
        if hf.get("rope_scaling"):
            glob.update(hf["rope_scaling"])
    return glob, None


def _layer_types(hf: dict, family: str, n: int) -> list[str]:
    lt = hf.get("layer_types")
    if lt:
        if len(lt) != n:
            raise InputError(f"config.json: layer_types has {len(lt)} entries, num_hidden_layers is {n}")
        return list(lt)
    if family == "gemma3":
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if family in ("qwen2", "qwen3") and hf.get("use_sliding_window") and hf.get("sliding_window"):
        mwl = int(hf.get("max_window_layers", n))
        return ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def from_hf_config(hf: dict) -> DecoderConfig:
    family = family_of(hf)
    try:
        hidden = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        n_layers = int(hf["num_hidden_layers"])
        cfg_vocab = int(hf["vocab_size"])
        inter = int(hf["intermediate_size"])
    except KeyError as e:
        raise InputError(f"config.json lacks required key {e.args[0]!r}") from None
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or hidden // n_heads)
    max_pos = int(hf.get("max_position_embeddings") or 0)
    eps = float(hf.get("rms_norm_eps", 1e-6))
    tie = bool(hf.get("tie_word_embeddings", family == "gemma3"))
    attention_bias = bool(hf.get("attention_bias", False))

    glob, loc = _rope_settings(hf, family)
    types = _layer_types(hf, family, n_layers)
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        window = None
    freqs = [_inv_freq(head_dim, glob, max_pos)]
    if loc is not None:
        freqs.append(_inv_freq(head_dim, loc, max_pos))
    layer_windows, layer_rope = [], []
    for t in types:
        sliding = t == "sliding_attention" and window is not None
        layer_windows.append(int(window) if sliding else None)
        layer_rope.append(1 if (sliding and loc is not None) else 0)

    if family == "gemma3":
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        qpas = hf.get("query_pre_attn_scalar") or head_dim
        query_scale = float(qpas) ** -0.5
    else:
        act = hf.get("hidden_act", "silu")
        query_scale = head_dim**-0.5
    acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    if act not in acts:
        raise InputError(f"unsupported activation {act!r}; supported: {', '.join(acts)}")

    return DecoderConfig(
        family=family,
        vocab_size=cfg_vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=eps,
        tie_embeddings=tie,
        max_position_embeddings=max_pos,
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)) if family == "llama3" else False,
        qk_norm=family in ("qwen3", "gemma3"),
        gemma_norms=family == "gemma3",
        activation=acts[act],
        query_scale=query_scale,
        layer_windows=tuple(layer_windows),
        layer_rope=tuple(layer_rope),
        rope_inv_freqs=tuple(freqs),
        attn_logit_softcapping=(
            float(hf["attn_logit_softcapping"]) if hf.get("attn_logit_softcapping") else None
        ),
        final_logit_softcapping=(
            float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping") else None
        ),
    )
