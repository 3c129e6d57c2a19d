"""One compact pure-JAX decoder for every family we support: Qwen3, Qwen2, Llama 3, Gemma 3 (text),
and the mixtures of experts Qwen3-MoE, gpt-oss, DeepSeek-V3 / Kimi K2 and GLM-4.5.

Why our own and not the Tunix model zoo: see docs/MODELS.md (Tunix 0.1.7
ignores the checkpoint's rope_theta and Llama 3.1 rope scaling, its modules are
stateful Flax NNX objects built from hard-coded presets rather than from
config.json, and its loader fails with a mesh on jax 0.10.2). The families
differ only in switches, all in ``DecoderConfig``: the MoE block (``moe.py``)
beside the dense MLP, multi-head latent attention (``mla.py``) beside the
standard attention, attention sinks, partial rotary, YaRN (``rope.py``).

Parameters are a plain pytree: nested dicts (and a list for the layers) whose
paths are the HF tensor names split at the dots, e.g.
``params["model"]["layers"][3]["self_attn"]["q_proj"]["weight"]``; matrices
keep the HF ``[out, in]`` layout. Experts are held as transformers 5 holds
them, one tensor per layer and projection with the experts first
(``mlp.experts.gate_up_proj`` [E, ...], ``mlp.experts.down_proj``); the loader
stacks checkpoints that store one tensor per expert (``sources.py``).
``apply(cfg, params, tokens, positions, segment_ids, attention="auto")`` is pure
and jit-able; ``hidden`` and ``head_logits`` are its two halves (the final
hidden states, and the float32 logits of a vocabulary slice), so a selection
can run over vocabulary chunks. Attention implementations: ``attention.py``.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from . import mla, moe, rope
from .attention import attention_core, attention_mask, resolve_attention
from .config import DecoderConfig
from .layers import linear as _linear
from .layers import rms_norm

_NEG = float(np.finfo(np.float32).min)


# ----------------------------------------------------------------------------- names


def _moe_tensors(cfg: DecoderConfig, p: str) -> dict[str, tuple[int, ...]]:
    m, d = cfg.moe, cfg.hidden_size
    e, i = m.num_experts, m.intermediate_size
    out = {}
    if m.router == "topk_softmax":
        out[p + "router.weight"] = (e, d)
        out[p + "router.bias"] = (e,)
    else:
        out[p + "gate.weight"] = (e, d)
        if m.score_correction_bias:
            out[p + "gate.e_score_correction_bias"] = (e,)
    if m.layout == "interleaved":  # gpt-oss: [E, in, out], gate and up in alternate columns, with biases
        out[p + "experts.gate_up_proj"] = (e, d, 2 * i)
        out[p + "experts.gate_up_proj_bias"] = (e, 2 * i)
        out[p + "experts.down_proj"] = (e, i, d)
        out[p + "experts.down_proj_bias"] = (e, d)
    else:  # transformers 5: [E, out, in], gate rows then up rows
        out[p + "experts.gate_up_proj"] = (e, 2 * i, d)
        out[p + "experts.down_proj"] = (e, d, i)
    if m.shared_intermediate_size:
        s = m.shared_intermediate_size
        out[p + "shared_experts.gate_proj.weight"] = (s, d)
        out[p + "shared_experts.up_proj.weight"] = (s, d)
        out[p + "shared_experts.down_proj.weight"] = (d, s)
    return out


def expected_tensors(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape: the HF tensor names (transformers 5's, for stacked experts)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qd, kd = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.mla is not None:
            out.update(mla.expected_tensors(cfg, p + "self_attn."))
        else:
            out[p + "self_attn.q_proj.weight"] = (qd, d)
            out[p + "self_attn.k_proj.weight"] = (kd, d)
            out[p + "self_attn.v_proj.weight"] = (kd, d)
            out[p + "self_attn.o_proj.weight"] = (d, qd)
            if cfg.qkv_bias:
                out[p + "self_attn.q_proj.bias"] = (qd,)
                out[p + "self_attn.k_proj.bias"] = (kd,)
                out[p + "self_attn.v_proj.bias"] = (kd,)
            if cfg.o_bias:
                out[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        if cfg.attention_sinks:
            out[p + "self_attn.sinks"] = (cfg.num_heads,)
        if cfg.is_moe_layer(i):
            out.update(_moe_tensors(cfg, p + "mlp."))
        else:
            out[p + "mlp.gate_proj.weight"] = (f, d)
            out[p + "mlp.up_proj.weight"] = (f, d)
            out[p + "mlp.down_proj.weight"] = (d, f)
            if cfg.mlp_bias:
                out[p + "mlp.gate_proj.bias"] = (f,)
                out[p + "mlp.up_proj.bias"] = (f,)
                out[p + "mlp.down_proj.bias"] = (d,)
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (d,)
        if cfg.gemma_norms:
            out[p + "pre_feedforward_layernorm.weight"] = (d,)
            out[p + "post_feedforward_layernorm.weight"] = (d,)
    return out


def tensor_dtype(cfg: DecoderConfig, name: str, dtype) -> np.dtype:
    """The dtype a parameter is held in: ``dtype``, except what transformers keeps in float32 whatever the
    model's dtype (the routers' ``e_score_correction_bias``; gpt-oss's norms)."""
    if name.endswith("e_score_correction_bias"):
        return np.dtype(np.float32)
    if cfg.norm_scale_float32 and name.endswith("norm.weight"):
        return np.dtype(np.float32)
    return np.dtype(dtype)


def unflatten(cfg: DecoderConfig, flat: dict) -> dict:
    """{HF name: array} -> params pytree (layers as a list)."""
    params: dict = {"model": {"layers": [{} for _ in range(cfg.num_layers)]}}
    for name, arr in flat.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            node = params["model"]["layers"][int(parts[2])]
            parts = parts[3:]
        else:
            node = params
        for k in parts[:-1]:
            node = node.setdefault(k, {})
        node[parts[-1]] = arr
    return params


def flatten(params: dict) -> dict:
    """params pytree -> {HF name: array}."""
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{prefix}.{i}")
        else:
            out[prefix] = node

    walk(params, "")
    return out


# ----------------------------------------------------------------------------- init


def init_flat(cfg: DecoderConfig, seed: int, dtype, initializer_range: float = 0.02) -> dict:
    """Deterministic random weights, by name: N(0, initializer_range) matrices,
    norms at identity (1, or 0 for Gemma's (1 + w) norms), zero biases.

    Host-side numpy with one generator per tensor name, so a tensor's values do
    not depend on the other tensors or on the device.
    """
    out = {}
    for name, shape in expected_tensors(cfg).items():
        if name.endswith("norm.weight"):
            a = np.zeros(shape, np.float32) if cfg.gemma_norms else np.ones(shape, np.float32)
        elif name.endswith("bias"):  # .bias, the experts' _bias, e_score_correction_bias
            a = np.zeros(shape, np.float32)
        else:
            rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
            a = rng.normal(0.0, initializer_range, size=shape).astype(np.float32)
        out[name] = jnp.asarray(a, dtype=tensor_dtype(cfg, name, dtype))
    return out


# ----------------------------------------------------------------------------- forward


def _rms_norm(cfg: DecoderConfig, x, w):
    return rms_norm(x, w, cfg.rms_norm_eps, gemma=cfg.gemma_norms, float32_scale=cfg.norm_scale_float32)


def _rope(x, positions, inv_freq):
    """x [B, L, H, Dh]; rotate-half RoPE as in transformers (cos/sin in float32)."""
    return rope.apply(x, positions, inv_freq)


def _attention(cfg: DecoderConfig, p, x, positions, segment_ids, window, inv_freq, rope_scale, impl, mask=None):
    B, L, _ = x.shape
    H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = _linear(x, p["q_proj"]).reshape(B, L, H, Dh)
    k = _linear(x, p["k_proj"]).reshape(B, L, K, Dh)
    v = _linear(x, p["v_proj"]).reshape(B, L, K, Dh)
    if cfg.qk_norm:
        q = _rms_norm(cfg, q, p["q_norm"]["weight"])
        k = _rms_norm(cfg, k, p["k_norm"]["weight"])
    kw = dict(rotary_dim=cfg.rotary_dim, scale=rope_scale)
    q = rope.apply(q, positions, inv_freq, **kw)
    k = rope.apply(k, positions, inv_freq, **kw)
    out = attention_core(cfg, q, k, v, positions, segment_ids, window, impl, mask=mask, sinks=p.get("sinks"))
    return _linear(out.reshape(B, L, H * Dh), p["o_proj"])


def _mlp(cfg: DecoderConfig, p, x):
    g = _linear(x, p["gate_proj"])
    act = jax.nn.silu(g) if cfg.activation == "silu" else jax.nn.gelu(g, approximate=True)
    return _linear(act * _linear(x, p["up_proj"]), p["down_proj"])


def _feed_forward(cfg: DecoderConfig, i: int, p, x, experts: str, expert_mesh):
    if not cfg.is_moe_layer(i):
        return _mlp(cfg, p, x)
    shared = (lambda h: _mlp(cfg, p["shared_experts"], h)) if "shared_experts" in p else None
    return moe.block(cfg.moe, p, x, experts, expert_mesh, shared=shared)


def hidden(cfg: DecoderConfig, params, tokens, positions, segment_ids, *, attention: str = "auto",
           experts: str = "auto", expert_mesh: moe.ExpertMesh | None = None):
    """The final normed hidden states [B, L, D] (the output head's input).

    ``experts``: the MoE blocks' grouped matmuls (``models.moe``); ``expert_mesh``: run them split over
    a mesh (data parallel, and experts over a mesh axis), as the dump's sharded modes do."""
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    m = params["model"]
    embed = m["embed_tokens"]["weight"]
    x = jnp.take(embed, tokens, axis=0)
    if cfg.gemma_norms:
        x = x * jnp.asarray(cfg.hidden_size**0.5, embed.dtype)
    impl = resolve_attention(attention, L=tokens.shape[1], cfg=cfg)
    masks = ({w: attention_mask(positions, segment_ids, w) for w in set(cfg.layer_windows)}
             if impl == "dense" else {})
    attend = mla.attention if cfg.mla is not None else _attention
    for i, lp in enumerate(m["layers"]):
        window = cfg.layer_windows[i]
        r = cfg.layer_rope[i]
        inv, scale = cfg.inv_freq(r), cfg.rope_scales[r]
        h = _rms_norm(cfg, x, lp["input_layernorm"]["weight"])
        h = attend(cfg, lp["self_attn"], h, positions, segment_ids, window, inv, scale, impl, mask=masks.get(window))
        if cfg.gemma_norms:
            h = _rms_norm(cfg, h, lp["post_attention_layernorm"]["weight"])
            x = x + h
            h = _rms_norm(cfg, x, lp["pre_feedforward_layernorm"]["weight"])
            h = _mlp(cfg, lp["mlp"], h)
            h = _rms_norm(cfg, h, lp["post_feedforward_layernorm"]["weight"])
            x = x + h
        else:
            x = x + h
            h = _rms_norm(cfg, x, lp["post_attention_layernorm"]["weight"])
            x = x + _feed_forward(cfg, i, lp["mlp"], h, experts, expert_mesh)
    return _rms_norm(cfg, x, m["norm"]["weight"])


def head_logits(cfg: DecoderConfig, params, x, start=0, size: int | None = None):
    """float32 logits of vocabulary entries [start, start + size) (default: to the end) for hidden states
    ``x`` [B, L, D]; ``start`` may be traced (a loop over vocabulary chunks) when ``size`` is given."""
    head = params["model"]["embed_tokens"]["weight"] if cfg.tie_embeddings else params["lm_head"]["weight"]
    if isinstance(start, jax.Array):
        head = jax.lax.dynamic_slice_in_dim(head, start, size, axis=0)
    elif start != 0 or (size is not None and size != head.shape[0]):
        head = jax.lax.slice_in_dim(head, start, head.shape[0] if size is None else start + size, axis=0)
    # float32 accumulation for the logits whatever the weight dtype
    logits = jnp.einsum("bld,vd->blv", x, head, preferred_element_type=jnp.float32)
    if cfg.final_logit_softcapping:
        c = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / c) * c
    return logits.astype(jnp.float32)


def apply(cfg: DecoderConfig, params, tokens, positions, segment_ids, *, attention: str = "auto",
          experts: str = "auto", expert_mesh: moe.ExpertMesh | None = None):
    """float32 logits [B, L, V] for int32 tokens/positions/segment_ids [B, L].

    ``attention``: how attention is computed (``models.attention``); ``experts``: how the MoE blocks'
    experts are (``models.moe``); every choice gives the same logits up to float rounding.
    """
    x = hidden(cfg, params, tokens, positions, segment_ids, attention=attention, experts=experts,
               expert_mesh=expert_mesh)
    return head_logits(cfg, params, x)
