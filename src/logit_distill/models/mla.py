"""DeepSeek-V3's multi-head latent attention (MLA), as transformers' ``DeepseekV3Attention`` computes it.

Queries come through a low-rank path (``q_a_proj`` -> RMSNorm -> ``q_b_proj``,
or one ``q_proj``); keys and values from a shared latent (``kv_a_proj_with_mqa``
gives the latent and one rotary key shared by all heads; RMSNorm; ``kv_b_proj``
expands the latent to per-head non-rotary keys and values). Each head's query
and key are ``[nope | rope]`` (``qk_nope_head_dim + qk_rope_head_dim``), values
have ``v_head_dim``; RoPE touches the rope part only. The latent is expanded
before attention (as transformers does): for a whole-sequence forward this is
the cheaper order; the absorbed form pays off in decoding, which the dump does
not do. The low-rank norms use eps 1e-6 (transformers builds them with the
default, whatever ``rms_norm_eps`` says).
"""

from __future__ import annotations

import jax.numpy as jnp

from . import rope
from .attention import attention_core
from .config import DecoderConfig
from .layers import linear, rms_norm

LORA_NORM_EPS = 1e-6


def expected_tensors(cfg: DecoderConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    m = cfg.mla
    d, h = cfg.hidden_size, cfg.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    out = {}
    if m.q_lora_rank is None:
        out[prefix + "q_proj.weight"] = (h * qk, d)
    else:
        out[prefix + "q_a_proj.weight"] = (m.q_lora_rank, d)
        out[prefix + "q_a_layernorm.weight"] = (m.q_lora_rank,)
        out[prefix + "q_b_proj.weight"] = (h * qk, m.q_lora_rank)
        if cfg.qkv_bias:
            out[prefix + "q_a_proj.bias"] = (m.q_lora_rank,)
    out[prefix + "kv_a_proj_with_mqa.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, d)
    out[prefix + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
    out[prefix + "kv_b_proj.weight"] = (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    out[prefix + "o_proj.weight"] = (d, h * m.v_head_dim)
    if cfg.qkv_bias:
        out[prefix + "kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
    if cfg.o_bias:
        out[prefix + "o_proj.bias"] = (d,)
    return out


def attention(cfg: DecoderConfig, p, x, positions, segment_ids, window, inv_freq, rope_scale, impl, mask=None):
    m = cfg.mla
    B, L, _ = x.shape
    H = cfg.num_heads
    nope, rot = m.qk_nope_head_dim, m.qk_rope_head_dim
    if m.q_lora_rank is None:
        q = linear(x, p["q_proj"])
    else:
        q = linear(rms_norm(linear(x, p["q_a_proj"]), p["q_a_layernorm"]["weight"], LORA_NORM_EPS), p["q_b_proj"])
    q = q.reshape(B, L, H, nope + rot)
    latent = linear(x, p["kv_a_proj_with_mqa"])
    kv = linear(rms_norm(latent[..., :m.kv_lora_rank], p["kv_a_layernorm"]["weight"], LORA_NORM_EPS), p["kv_b_proj"])
    kv = kv.reshape(B, L, H, nope + m.v_head_dim)
    k_rot = latent[..., m.kv_lora_rank:][:, :, None, :]  # one rotary key for every head
    kw = dict(scale=rope_scale, interleave=cfg.rope_interleave)
    q_rot = rope.apply(q[..., nope:], positions, inv_freq, **kw)
    k_rot = rope.apply(k_rot, positions, inv_freq, **kw)
    q = jnp.concatenate([q[..., :nope], q_rot], axis=-1)
    k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rot, (B, L, H, rot))], axis=-1)
    v = kv[..., nope:]
    out = attention_core(cfg, q, k, v, positions, segment_ids, window, impl, mask=mask)
    return linear(out.reshape(B, L, H * m.v_head_dim), p["o_proj"])
