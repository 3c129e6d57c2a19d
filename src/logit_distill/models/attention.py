"""Attention implementations of the decoder, chosen per backend or by name.

Every implementation computes the same thing: causal attention that never
crosses segments (0 = padding; a padding row attends to itself only, so it
stays finite), optionally within a sliding window of positions (Gemma 3's local
layers, gpt-oss's sliding layers), with Gemma's optional logit softcapping and
gpt-oss's attention sinks (a learned logit per head that joins the softmax's
denominator and attends to nothing), scores and softmax in float32. Values may
have another head size than queries and keys (DeepSeek-V3's MLA).

- ``dense``: the reference. Scores ``[B, K, G, L, L]`` in float32: quadratic memory.
- ``blocked``: queries in blocks of ``BLOCK`` rows; each block attends to the
  keys up to its own end only (the causal upper triangle of blocks is never
  computed), with an exact softmax over that prefix. The largest temporary is
  ``[B, K, G, BLOCK, L]``: linear in L. Pure JAX, compiled well by XLA on any
  backend; for L <= BLOCK it is a single block.
- ``pallas_gpu``: the Pallas GPU flash-attention kernel of jax
  (``jax.experimental.pallas.ops.gpu.attention.mha``: causal, segment ids,
  online softmax in SRAM). It has neither sliding windows, softcapping nor
  sinks, so layers that need those fall back to ``blocked``.
- ``pallas_tpu``: jax's splash attention for TPU
  (``jax.experimental.pallas.ops.tpu.splash_attention``: causal, segment ids,
  sliding windows, softcapping, sinks; blocks of the causal mask's upper
  triangle are skipped). Its local mask counts token indices, which are the positions
  within a packed document (positions run by one there; across documents the
  segment ids mask anyway).
- ``auto``: ``pallas_gpu`` on GPU, ``pallas_tpu`` on TPU (L a multiple of 128),
  else ``blocked`` when L > BLOCK, else ``dense``.

Why not ``jax.nn.dot_product_attention``: it takes no segment ids, so packed
examples would need an ``[L, L]`` mask, the very thing this module avoids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("auto", "dense", "blocked", "pallas_gpu", "pallas_tpu")
BLOCK = 256  # query rows per block of ``blocked`` (on CPU 14% faster than 512 at L=4096; 128 no faster)
PALLAS_BLOCK = 128  # query and key rows per block of the Pallas GPU kernel
SPLASH_BLOCK = 512  # query and key rows per block of splash attention (TPU)
_NEG = float(np.finfo(np.float32).min)
_INTERPRET = False  # run the Pallas kernels in interpret mode (tests on CPU)


_KERNEL_BACKENDS = {"pallas_gpu": ("gpu", "cuda", "rocm"), "pallas_tpu": ("tpu",)}


def check_attention(name: str, backend: str | None = None) -> str:
    """``name`` if it is an implementation and, with ``backend``, one that runs there (a Pallas
    kernel only on its own accelerator, unless in interpret mode)."""
    from ..errors import InputError

    if name not in IMPLEMENTATIONS:
        raise InputError(f"unknown attention {name!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    if backend is not None and name in _KERNEL_BACKENDS and backend not in _KERNEL_BACKENDS[name] and not _INTERPRET:
        raise InputError(f"--attention {name} runs on {_KERNEL_BACKENDS[name][0].upper()} only, and JAX's backend "
                         f"here is {backend}; use --attention auto (it picks the kernel of the backend), blocked "
                         "or dense")
    return name


def resolve_attention(name: str, *, L: int, cfg=None, backend: str | None = None) -> str:
    """The implementation ``name`` stands for at sequence length ``L`` on ``backend``."""
    check_attention(name)
    if name != "auto":
        return name
    backend = backend or jax.default_backend()
    if backend in ("gpu", "cuda", "rocm") and L >= 128 and L % 128 == 0:
        return "pallas_gpu"
    if backend == "tpu" and L >= 128 and L % 128 == 0:
        return "pallas_tpu"
    return "blocked" if L > BLOCK else "dense"


def attention_mask(positions, segment_ids, window: int | None = None, q_start: int = 0, q_end: int | None = None,
                   k_end: int | None = None):
    """[B, Lq, Lk] bool for query rows [q_start, q_end) and key columns [0, k_end):
    causal, same nonzero segment, within ``window`` positions; a padding row attends to itself only.
    """
    L = segment_ids.shape[1]
    q_end = L if q_end is None else q_end
    k_end = L if k_end is None else k_end
    seg_q = segment_ids[:, q_start:q_end, None]
    seg_k = segment_ids[:, None, :k_end]
    iq = jnp.arange(q_start, q_end)[None, :, None]
    ik = jnp.arange(k_end)[None, None, :]
    mask = (iq >= ik) & (seg_q == seg_k) & (seg_q > 0)
    if window is not None:
        dist = positions[:, q_start:q_end, None] - positions[:, None, :k_end]
        mask = mask & (dist < window)
    return mask | ((seg_q == 0) & (iq == ik))


def _softmax_attend(cfg, q, k, v, mask, sinks=None):
    """q [B, Lq, K, G, Dh], k [B, Lk, K, Dh], v [B, Lk, K, Dv], mask [B, Lq, Lk], sinks [K, G] or None
    -> [B, Lq, K, G, Dv]."""
    scores = jnp.einsum("blkgd,bskd->bkgls", q, k) * jnp.asarray(cfg.query_scale, q.dtype)
    scores = scores.astype(jnp.float32)
    if cfg.attn_logit_softcapping:
        c = cfg.attn_logit_softcapping
        scores = jnp.tanh(scores / c) * c
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:  # the sink joins the denominator (transformers: softmax over [scores, sink], sink column dropped)
        sink = sinks.astype(jnp.float32)[None, :, :, None, None]
        top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
        e = jnp.exp(scores - top)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    return jnp.einsum("bkgls,bskd->blkgd", probs.astype(v.dtype), v)


def _dense(cfg, q, k, v, positions, segment_ids, window, mask=None, sinks=None):
    if mask is None:
        mask = attention_mask(positions, segment_ids, window)
    return _softmax_attend(cfg, q, k, v, mask, sinks)


def _blocked(cfg, q, k, v, positions, segment_ids, window, block: int | None = None, sinks=None):
    """Query blocks attending to their key prefix. Heads-major layout ``[B, K, G*rows, Dh]``: the
    G query heads of a key/value head are rows of one matmul (XLA's CPU dot ran 2.5x faster so
    than with ``G`` as a batch dimension)."""
    B, L, K, G, Dh = q.shape
    Dv = v.shape[-1]
    block = block or BLOCK
    sink = None if sinks is None else sinks.astype(jnp.float32)[None, :, :, None, None]
    qh = jnp.transpose(q, (0, 2, 3, 1, 4))  # [B, K, G, L, Dh]
    kh = jnp.transpose(k, (0, 2, 1, 3))  # [B, K, L, Dh]
    vh = jnp.transpose(v, (0, 2, 1, 3))
    scale = jnp.asarray(cfg.query_scale, q.dtype)
    outs = []
    for start in range(0, L, block):
        end = min(start + block, L)
        n = end - start
        mask = attention_mask(positions, segment_ids, window, q_start=start, q_end=end, k_end=end)
        qb = qh[:, :, :, start:end].reshape(B, K, G * n, Dh)
        scores = jnp.einsum("bkqd,bksd->bkqs", qb, kh[:, :, :end]) * scale
        scores = scores.astype(jnp.float32).reshape(B, K, G, n, end)
        if cfg.attn_logit_softcapping:
            c = cfg.attn_logit_softcapping
            scores = jnp.tanh(scores / c) * c
        scores = jnp.where(mask[:, None, None], scores, _NEG)
        # softmax normalized after the value matmul: one pass less over the [rows, keys] block
        top = jnp.max(scores, axis=-1, keepdims=True)
        if sink is not None:
            top = jnp.maximum(top, sink)
        e = jnp.exp(scores - top)
        denom = jnp.sum(e, axis=-1, keepdims=True)
        if sink is not None:  # the sink's term in the denominator
            denom = denom + jnp.exp(sink - top)
        denom = denom.reshape(B, K, G * n, 1)
        o = jnp.einsum("bkqs,bksd->bkqd", e.astype(v.dtype).reshape(B, K, G * n, end), vh[:, :, :end],
                       preferred_element_type=jnp.float32)
        outs.append((o / denom).astype(v.dtype).reshape(B, K, G, n, Dv))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    return jnp.transpose(out, (0, 3, 1, 2, 4))  # [B, L, K, G, Dh]


def _pallas_gpu(cfg, q, k, v, positions, segment_ids, window, interpret: bool = False):
    """jax's Pallas flash-attention kernel; q [B, L, K, G, Dh] -> same shape."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    B, L, K, G, Dh = q.shape
    qh = q.reshape(B, L, K * G, Dh)
    # the kernel wants as many k/v heads as q heads
    kh = jnp.repeat(k, G, axis=2)
    vh = jnp.repeat(v, G, axis=2)
    # padding rows (segment 0) attend to each other in the kernel; their outputs are not used
    # downstream except to stay finite, which they are (every row sees at least itself)
    block = min(PALLAS_BLOCK, L)
    out = pallas_attention.mha(
        qh, kh, vh, segment_ids=segment_ids, sm_scale=float(cfg.query_scale), causal=True,
        block_sizes=pallas_attention.BlockSizes(block_q=block, block_k=block),
        interpret=interpret or _INTERPRET,
    )
    return out.reshape(B, L, K, G, Dh)


def _pallas_tpu(cfg, q, k, v, positions, segment_ids, window, interpret: bool = False, sinks=None):
    """jax's splash attention (TPU); q [B, L, K, G, Dh] -> same shape. Each key/value head runs its
    G query heads as one multi-query kernel, vmapped over heads and examples."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    B, L, K, G, Dh = q.shape
    if window is None:
        head_mask = masks.CausalMask((L, L))
    else:  # positions within window - 1 before, and causal
        head_mask = masks.LocalMask((L, L), window_size=(window - 1, 0), offset=0)
    block = min(SPLASH_BLOCK, L)
    kernel = splash.make_splash_mqa_single_device(
        masks.MultiHeadMask([head_mask] * G),
        block_sizes=splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block),
        attn_logits_soft_cap=cfg.attn_logit_softcapping or None, interpret=interpret or _INTERPRET)
    qh = jnp.transpose(q * jnp.asarray(cfg.query_scale, q.dtype), (0, 2, 3, 1, 4))  # [B, K, G, L, Dh]
    kh = jnp.transpose(k, (0, 2, 1, 3))  # [B, K, L, Dh]
    vh = jnp.transpose(v, (0, 2, 1, 3))

    sinks_kg = (jnp.zeros((K, G), jnp.float32) if sinks is None else sinks.astype(jnp.float32))

    def example(qe, ke, ve, seg):
        ids = splash.SegmentIds(q=seg, kv=seg)
        # padding rows (segment 0) attend to each other: finite, and their outputs are not used
        if sinks is None:
            return jax.vmap(lambda a, b, c: kernel(a, b, c, segment_ids=ids))(qe, ke, ve)
        return jax.vmap(lambda a, b, c, s: kernel(a, b, c, segment_ids=ids, sinks=s))(qe, ke, ve, sinks_kg)

    out = jax.vmap(example)(qh, kh, vh, segment_ids)  # [B, K, G, L, Dh]
    return jnp.transpose(out, (0, 3, 1, 2, 4))


def attention_core(cfg, q, k, v, positions, segment_ids, window, impl: str, mask=None, interpret: bool = False,
                   sinks=None):
    """q [B, L, H, Dh] (rotated), k [B, L, K, Dh], v [B, L, K, Dv], sinks [H] or None -> [B, L, H, Dv]."""
    B, L, H, Dh = q.shape
    K = k.shape[2]
    Dv = v.shape[-1]
    q = q.reshape(B, L, K, H // K, Dh)
    sinks = None if sinks is None else sinks.reshape(K, H // K)
    if impl == "pallas_gpu" and (window is not None or cfg.attn_logit_softcapping or sinks is not None
                                 or L % min(PALLAS_BLOCK, L)):
        impl = "blocked"
    if impl == "pallas_tpu" and L % min(SPLASH_BLOCK, L):
        impl = "blocked"
    if impl in ("pallas_gpu", "pallas_tpu") and Dv != Dh:  # the kernels want one head size: pad the values
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, Dh - Dv)]) if Dv < Dh else v
        if v.shape[-1] != Dh:
            impl = "blocked"
    if impl == "dense":
        out = _dense(cfg, q, k, v, positions, segment_ids, window, mask, sinks=sinks)
    elif impl == "blocked":
        out = _blocked(cfg, q, k, v, positions, segment_ids, window, sinks=sinks)
    elif impl == "pallas_gpu":
        out = _pallas_gpu(cfg, q, k, v, positions, segment_ids, window, interpret=interpret)
    elif impl == "pallas_tpu":
        out = _pallas_tpu(cfg, q, k, v, positions, segment_ids, window, interpret=interpret, sinks=sinks)
    else:
        raise ValueError(impl)
    return out[..., :Dv].reshape(B, L, H, Dv)
