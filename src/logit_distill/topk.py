"""On-device selection: float32 log-softmax, then top-k + tail, or tokens sampled from the teacher.

Only ``[B, L, k]`` (or ``[B, L, N]``) arrays and ``[B, L]`` tails leave the
device. Selection runs in float32 whatever the model's dtype (``top_k`` on
bfloat16 input was about 100x slower on CPU, and bfloat16 log-probs are too
coarse). Each selection is one function of a step's logits
(``select_topk``, ``select_sampled``); ``make_teacher_select`` wraps one with
the teacher's forward.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

SELECTIONS = ("topk", "sampled")


def select_topk(logits: jax.Array, k: int, tail_temperatures: Sequence[float] = ()) -> dict:
    """Top-k log-probabilities (sorted descending), their ids, and log of the mass outside them.

    The tail is a logsumexp over the vocabulary with the top-k entries masked
    out, so it stays accurate when the top-k hold nearly all the mass (where
    ``log1p(-sum(p_topk))`` would cancel catastrophically).

    With ``tail_temperatures`` (T_1..T_m), also ``tail_logprob_tempered``
    ``[..., m]``: the log of the tail's mass in the tempered distribution
    ``p^(1/T) / sum p^(1/T)``, one more masked logsumexp per temperature.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    top_values, top_ids = jax.lax.top_k(logits, k)
    rest = jnp.put_along_axis(logits, top_ids, -jnp.inf, axis=-1, inplace=False)
    tail = jax.nn.logsumexp(rest, axis=-1) - lse
    out = {
        "topk_ids": top_ids.astype(jnp.int32),
        "topk_logprobs": top_values - lse[..., None],
        "tail_logprob": tail,
    }
    if tail_temperatures:
        out["tail_logprob_tempered"] = jnp.stack(
            [jax.nn.logsumexp(rest / T, axis=-1) - jax.nn.logsumexp(logits / T, axis=-1)
             for T in tail_temperatures], axis=-1)
    return out


def sample_keys(seed: int, example_index: jax.Array, length: int) -> jax.Array:
    """``[B, L]`` PRNG keys of (seed, example index, position): counter-based, so a position's
    draws depend on nothing else (not the step, batch, device or process that computes it)."""
    base = jax.random.key(seed)

    def row(e):
        k = jax.random.fold_in(base, e)
        return jax.vmap(lambda j: jax.random.fold_in(k, j))(jnp.arange(length, dtype=jnp.uint32))

    return jax.vmap(row)(jnp.asarray(example_index).astype(jnp.uint32))


def select_sampled(logits: jax.Array, num_samples: int, keys: jax.Array,
                   proposal_temperature: float = 1.0) -> dict:
    """N draws with replacement per position from ``softmax(logits / t)``, as distinct ids + counts.

    ``logits`` ``[B, L, V]``, ``keys`` ``[B, L]`` (``sample_keys``). Draws are
    inverse-CDF lookups of N uniforms in the float32 cumulative sum of the
    tempered probabilities (N uniforms per position, not N x V Gumbels).
    Returns ``[B, L, N]`` arrays: ``sample_ids`` (distinct, ascending, in the
    first slots), ``sample_counts`` (summing to N; 0 in unused slots) and
    ``sample_logprobs`` (the teacher's untempered log-prob of each id; 0 in
    unused slots).
    """
    N = int(num_samples)
    logits = logits.astype(jnp.float32)
    logprobs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    q = logprobs / proposal_temperature
    cdf = jnp.cumsum(jnp.exp(q - jax.nn.logsumexp(q, axis=-1, keepdims=True)), axis=-1)
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (N,), jnp.float32)))(keys)
    target = u * cdf[..., -1:]
    V = logits.shape[-1]
    find = jax.vmap(jax.vmap(lambda c, t: jnp.searchsorted(c, t, side="right")))
    draws = jnp.minimum(find(cdf, target), V - 1).astype(jnp.int32)
    s = jnp.sort(draws, axis=-1)
    is_new = jnp.concatenate([jnp.ones_like(s[..., :1], bool), s[..., 1:] != s[..., :-1]], axis=-1)
    slot = jnp.cumsum(is_new, axis=-1) - 1
    onehot = jax.nn.one_hot(slot, N, dtype=jnp.int32)  # [B, L, draw, slot]
    counts = onehot.sum(-2)
    ids = (onehot * jnp.where(is_new, s, 0)[..., None]).sum(-2)
    used = counts > 0
    lp = jnp.where(used, jnp.take_along_axis(logprobs, ids, axis=-1), 0.0)
    return {"sample_ids": ids, "sample_counts": counts, "sample_logprobs": lp}


def make_teacher_select(apply: Callable, select: Callable, mesh=None, *, seed: int | None = None) -> Callable:
    """``fn(params, tokens, positions, segment_ids, example_index) -> select's dict``.

    ``select(logits, keys)`` is one of the selections above with its settings
    bound; ``keys`` are ``sample_keys(seed, example_index, L)`` when ``seed``
    is given, else None. The returned function is jitted; the full
    ``[B, L, V]`` logits never leave the device.

    With ``mesh`` (a 1-D ``data`` mesh, parameters replicated), each device runs
    its rows of the batch one example at a time (``lax.map`` inside
    ``shard_map``). Every example then goes through kernels of the same shape
    whatever the device count or batch size, so the dump writes the same bytes
    on 1 device and on 4 (a batched matmul's reduction order may depend on how
    many rows it holds).
    """

    def run(params, tokens, positions, segment_ids, example_index):
        keys = None if seed is None else sample_keys(seed, example_index, tokens.shape[1])
        return select(apply(params, tokens, positions, segment_ids), keys)

    if mesh is None:
        return jax.jit(run)

    from jax.sharding import PartitionSpec as P

    def one_example(params, example):
        out = run(params, *(x[None] for x in example))
        return jax.tree.map(lambda a: a[0], out)

    def local_rows(params, tokens, positions, segment_ids, example_index):
        return jax.lax.map(lambda ex: one_example(params, ex), (tokens, positions, segment_ids, example_index))

    data = P(mesh.axis_names[0])
    return jax.jit(jax.shard_map(local_rows, mesh=mesh, in_specs=(P(), data, data, data, data), out_specs=data))


def make_teacher_topk(apply: Callable, k: int, mesh=None, *, tail_temperatures: Sequence[float] = ()) -> Callable:
    """``fn(params, tokens, positions, segment_ids) -> {topk_ids, topk_logprobs, tail_logprob[, ...]}``."""
    temps = tuple(float(T) for T in tail_temperatures)
    fn = make_teacher_select(apply, lambda logits, _: select_topk(logits, k, temps), mesh)

    def teacher_topk(params, tokens, positions, segment_ids):
        return fn(params, tokens, positions, segment_ids, jnp.zeros(tokens.shape[:1], jnp.int32))

    return teacher_topk


def make_teacher_sampled(apply: Callable, num_samples: int, *, seed: int, proposal_temperature: float = 1.0,
                         mesh=None) -> Callable:
    """``fn(params, tokens, positions, segment_ids, example_index) -> {sample_ids, sample_counts,
    sample_logprobs}``: the same draws for an example wherever and whenever it is computed."""
    t = float(proposal_temperature)
    return make_teacher_select(apply, lambda logits, keys: select_sampled(logits, num_samples, keys, t), mesh,
                               seed=int(seed))


def make_teacher_lse(apply: Callable) -> Callable:
    """Forward + logsumexp only: the baseline of the selection-cost benchmark."""

    @jax.jit
    def teacher_lse(params, tokens, positions, segment_ids):
        return jax.nn.logsumexp(apply(params, tokens, positions, segment_ids).astype(jnp.float32), axis=-1)

    return teacher_lse
