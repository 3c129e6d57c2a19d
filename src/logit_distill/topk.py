"""On-device selection: float32 log-softmax, top-k and the tail mass outside the top-k.

Only ``[B, L, k]`` ids and log-probs and the ``[B, L]`` tail leave the device.
Selection runs in float32 whatever the model's dtype (``top_k`` on bfloat16
input was about 100x slower on CPU, and bfloat16 log-probs are too coarse).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def select_topk(logits: jax.Array, k: int) -> dict:
    """Top-k log-probabilities (sorted descending), their ids, and log of the mass outside them.

    The tail is a logsumexp over the vocabulary with the top-k entries masked
    out, so it stays accurate when the top-k hold nearly all the mass (where
    ``log1p(-sum(p_topk))`` would cancel catastrophically).
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    top_values, top_ids = jax.lax.top_k(logits, k)
    rest = jnp.put_along_axis(logits, top_ids, -jnp.inf, axis=-1, inplace=False)
    tail = jax.nn.logsumexp(rest, axis=-1) - lse
    return {
        "topk_ids": top_ids.astype(jnp.int32),
        "topk_logprobs": top_values - lse[..., None],
        "tail_logprob": tail,
    }


def make_teacher_topk(apply: Callable, k: int, mesh=None) -> Callable:
    """``fn(params, tokens, positions, segment_ids) -> {topk_ids, topk_logprobs, tail_logprob}``.

    The returned function is jitted; the full ``[B, L, V]`` logits never leave the device.

    With ``mesh`` (a 1-D ``data`` mesh, parameters replicated), each device runs
    its rows of the batch one example at a time (``lax.map`` inside
    ``shard_map``). Every example then goes through kernels of the same shape
    whatever the device count or batch size, so the dump writes the same bytes
    on 1 device and on 4 (a batched matmul's reduction order may depend on how
    many rows it holds).
    """
    if mesh is None:
        @jax.jit
        def teacher_topk(params, tokens, positions, segment_ids):
            return select_topk(apply(params, tokens, positions, segment_ids), k)

        return teacher_topk

    from jax.sharding import PartitionSpec as P

    def one_example(params, example):
        tokens, positions, segment_ids = (x[None] for x in example)
        out = select_topk(apply(params, tokens, positions, segment_ids), k)
        return jax.tree.map(lambda a: a[0], out)

    def local_rows(params, tokens, positions, segment_ids):
        return jax.lax.map(lambda ex: one_example(params, ex), (tokens, positions, segment_ids))

    data = P(mesh.axis_names[0])
    return jax.jit(jax.shard_map(local_rows, mesh=mesh, in_specs=(P(), data, data, data), out_specs=data))


def make_teacher_lse(apply: Callable) -> Callable:
    """Forward + logsumexp only: the baseline of the selection-cost benchmark."""

    @jax.jit
    def teacher_lse(params, tokens, positions, segment_ids):
        return jax.nn.logsumexp(apply(params, tokens, positions, segment_ids).astype(jnp.float32), axis=-1)

    return teacher_lse
