"""Rotary position embeddings as transformers computes and applies them.

``inv_freq(dim, rope, max_pos)`` returns the float32 inverse frequencies and the
factor transformers multiplies cos and sin by (YaRN's ``attention_factor``; 1
otherwise) for the RoPE types ``default``, ``linear``, ``llama3`` and ``yarn``,
with the same float32 arithmetic as ``transformers.modeling_rope_utils``.

``apply(x, positions, inv_freq, ...)`` rotates the first ``rotary_dim`` dims of
each head (all of them, or a fraction for GLM-4.5's partial rotary), either as
rotate-half pairs ``(i, i + d/2)`` (Llama, Qwen, gpt-oss, GLM) or, with
``interleave``, as DeepSeek's adjacent pairs ``(2i, 2i + 1)`` whose rotated
halves are written out concatenated (transformers'
``apply_rotary_pos_emb_interleave``: q and k are permuted alike, so q k^T is the
interleaved rotation's).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..errors import InputError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _f32(x) -> np.float32:
    return np.float32(x)


def _default_inv_freq(dim: int, theta: float) -> np.ndarray:
    # same float32 arithmetic as transformers' _compute_default_rope_parameters
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor (transformers' ``get_mscale`` / DeepSeek's ``yarn_get_mscale``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, rope: dict, theta: float, max_pos: int) -> tuple[np.ndarray, float]:
    """transformers' _compute_yarn_parameters, in numpy float32."""
    old_ctx = rope.get("original_max_position_embeddings") or max_pos
    factor = rope.get("factor")
    if factor is None:
        factor = max_pos / old_ctx
    factor = float(factor)
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singularity
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (_f32(factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - _f32(low)) / _f32(high - low), 0, 1).astype(np.float32)
    extrapolation_factor = (np.float32(1.0) - ramp).astype(np.float32)
    inv = interpolation * (np.float32(1.0) - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv.astype(np.float32), float(attention_factor)


def inv_freq(dim: int, rope: dict, max_pos: int) -> tuple[tuple, float]:
    """(inverse frequencies of ``dim`` rotary dims as a tuple of floats, cos/sin factor) for one rope setting."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta", 10000.0))
    scale = 1.0
    if rope_type == "default":
        inv = _default_inv_freq(dim, theta)
    elif rope_type == "linear":
        inv = (_default_inv_freq(dim, theta) / np.float32(rope["factor"])).astype(np.float32)
    elif rope_type == "llama3":
        inv = _default_inv_freq(dim, theta)
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
    elif rope_type == "yarn":
        inv, scale = _yarn(dim, rope, theta, max_pos)
    else:
        raise InputError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return tuple(float(x) for x in inv), scale


def apply(x, positions, inv, *, rotary_dim: int | None = None, scale: float = 1.0, interleave: bool = False):
    """x [B, L, H, Dh] rotated as transformers does (cos/sin in float32, times ``scale``, cast to x's dtype)."""
    inv = jnp.asarray(np.asarray(inv, np.float32))
    freqs = positions.astype(jnp.float32)[..., None] * inv[None, None, :]  # [B, L, R/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos = cos.astype(x.dtype)[:, :, None, :]
    sin = sin.astype(x.dtype)[:, :, None, :]
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
    if interleave:
        a, b = rot[..., 0::2], rot[..., 1::2]
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2:]
    out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out if rest is None else jnp.concatenate([out, rest], axis=-1)
