"""The decoder's small shared pieces: RMSNorm variants and a linear layer on HF-layout weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x, w, eps: float, *, gemma: bool = False, float32_scale: bool = False):
    """RMSNorm over the last axis, normalized in float32.

    Llama/Qwen: cast back, then scale by ``w``; ``float32_scale`` (gpt-oss): scale in float32, then
    cast; ``gemma``: ``(1 + w)`` in float32, then cast."""
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if gemma:
        return (y * (1.0 + w.astype(jnp.float32))).astype(dtype)
    if float32_scale:
        return (w.astype(jnp.float32) * y).astype(dtype)
    return w * y.astype(dtype)


def linear(x, p):
    """``x @ W^T (+ b)`` for an HF ``[out, in]`` weight."""
    y = jnp.einsum("...i,oi->...o", x, p["weight"])
    if "bias" in p:
        y = y + p["bias"]
    return y
