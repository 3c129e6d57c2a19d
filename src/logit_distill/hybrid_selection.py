"""Two more selections (prototypes, unchunked): systematic draws, and an exact head plus draws from the tail.

``select_systematic`` draws N ids per position from ``softmax(logits / t)`` by
systematic sampling: one uniform u per position and the N points ``(u + i) / N``
of the cumulative distribution. Each id's count is ``floor(N p)`` or
``ceil(N p)``: its expectation is exactly ``N p`` (so the sampled losses stay
unbiased) while its variance is at most 1/4, against ``N p (1 - p)`` for N
independent draws. The ids with ``p >= 1/N`` are always drawn, and one of
``p < 1/N`` with probability ``N p`` (independent draws: ``1 - (1 - p)^N``, less),
so a position holds somewhat more distinct ids. The record is a sampled record
(ids, counts, log-probs): the codec, the verifier and ``sampled_kl`` read it unchanged.

``select_hybrid`` keeps the teacher's top-k exactly (ids, log-probs, tail mass:
the top-k record) and adds N systematic draws from the tail renormalised (the
distribution outside the top-k). ``losses.hybrid_kl_per_token`` turns them into
an unbiased target whose only noise is in the tail. ``tail_plogp`` (the tail's
``sum p log p``, one value per position) lets a record drop the draws'
log-probs and still give an unbiased KL value.

Both use the dump's keys (``selection.sample_keys``: seed, example index, position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .selection import _distinct, _searchsorted, _uniforms, select_topk


def _systematic_draws(log_weights: jax.Array, num_samples: int, keys: jax.Array) -> jax.Array:
    """``[..., N]`` int32 ids of N systematic draws from ``softmax(log_weights)`` (ascending)."""
    N = int(num_samples)
    w = jnp.exp(log_weights - jax.nn.logsumexp(log_weights, axis=-1, keepdims=True))
    cdf = jnp.cumsum(w, axis=-1)
    u = _uniforms(keys, 1)  # [B, L, 1]
    target = (u + jnp.arange(N, dtype=jnp.float32)) / N * cdf[..., -1:]
    return jnp.minimum(_searchsorted(cdf, target), log_weights.shape[-1] - 1).astype(jnp.int32)


def _plogp(log_p: jax.Array) -> jax.Array:
    """``sum p log p`` over the last axis (0 log 0 = 0)."""
    p = jnp.exp(log_p)
    return jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, log_p, 0.0), 0.0), axis=-1)


def select_systematic(logits: jax.Array, num_samples: int, keys: jax.Array, proposal_temperature: float = 1.0) -> dict:
    """N systematic draws per position from ``softmax(logits / t)`` as a sampled record: ``sample_ids``
    (distinct, ascending, first slots), ``sample_counts`` (summing to N), ``sample_logprobs`` (the
    teacher's untempered log-probs), all ``[B, L, N]``; ``keys`` ``[B, L]``. Also ``tail_plogp``
    ``[B, L]``: ``sum p_t log p_t`` of the tempered teacher (minus its entropy)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp_t = jax.nn.log_softmax(logprobs / proposal_temperature, axis=-1)
    draws = _systematic_draws(lp_t, num_samples, keys)
    return {**_distinct(draws, jnp.take_along_axis(logprobs, draws, axis=-1)), "tail_plogp": _plogp(lp_t)}


def select_hybrid(logits: jax.Array, k: int, num_samples: int, keys: jax.Array,
                  proposal_temperature: float = 1.0) -> dict:
    """The top-k record (``select_topk``; at t != 1 also ``tail_logprob_tempered`` ``[B, L, 1]`` at t)
    plus N systematic draws from the tail tempered at t (``sample_*``, as ``select_systematic``) and
    ``tail_plogp`` ``[B, L]``: ``sum_{v in tail} p_t(v) log p_t(v)`` of the tempered teacher."""
    t = float(proposal_temperature)
    logits = logits.astype(jnp.float32)
    out = select_topk(logits, k, () if t == 1.0 else (t,))
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    lp_t = jax.nn.log_softmax(logprobs / t, axis=-1)
    tail_lp_t = jnp.put_along_axis(lp_t, out["topk_ids"], -jnp.inf, axis=-1, inplace=False)
    draws = _systematic_draws(tail_lp_t, num_samples, keys)
    out.update(_distinct(draws, jnp.take_along_axis(logprobs, draws, axis=-1)))
    out["tail_plogp"] = _plogp(tail_lp_t)
    return out
