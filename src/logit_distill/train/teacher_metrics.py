"""How close a student is to its teacher: per-position measures, pure ``jax.numpy``
(definitions: docs/LOSSES.md, "Teacher-relative evaluation").

With the teacher's whole distribution (an online teacher: ``teacher_logits``
``[B, L, V]``):

- ``kl``: KL(teacher || student) over the full vocabulary;
- ``top1_agreement``: 1 where the student's most likely token is the teacher's;
- ``topk_mass``: the student's probability mass on the teacher's top-k ids;
- ``tail_shape_kl``: KL between teacher and student both renormalised outside
  the teacher's top-k (how the tail is spread, which no k + 1 bin sees).

From a held-out store: ``kl_bins`` (KL over the k + 1 bins of a top-k record: a
lower bound of the full KL), top-1 agreement and top-k mass (the record's ids
are the teacher's top-k, sorted), and ``kl_draws`` (a sampled record: an
unbiased estimate of the full KL, draws at proposal temperature 1).

``sums`` turns the per-position values into sums over the next-token mask (to
accumulate over evaluation batches), ``means`` divides them by the count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import losses


def _log_softmax(x) -> jax.Array:
    return jax.nn.log_softmax(jnp.asarray(x).astype(jnp.float32), axis=-1)


def kl(teacher_logits, student_logits) -> jax.Array:
    """float32 ``[B, L]``: KL(p || q) over the full vocabulary, p and q the softmax of the logits."""
    return losses.full_divergence_per_token(student_logits, teacher_logits, divergence="kl")


def top1_agreement(teacher_top1, student_logits) -> jax.Array:
    """float32 ``[B, L]``: 1 where ``argmax(student_logits)`` equals ``teacher_top1`` (int ids), else 0."""
    return (jnp.argmax(student_logits, axis=-1) == jnp.asarray(teacher_top1)).astype(jnp.float32)


def topk_mass(topk_ids, student_logits) -> jax.Array:
    """float32 ``[B, L]``: the student's probability on the ids ``topk_ids`` ``[B, L, k]``."""
    logq = _log_softmax(student_logits)
    return jnp.sum(jnp.exp(jnp.take_along_axis(logq, jnp.asarray(topk_ids, jnp.int32), axis=-1)), axis=-1)


def tail_shape_kl(teacher_logits, student_logits, k: int) -> jax.Array:
    """float32 ``[B, L]``: KL(p~ || q~), p~ and q~ the teacher and the student restricted to the ids
    outside the teacher's top-k and renormalised there."""
    t = jnp.asarray(teacher_logits).astype(jnp.float32)
    _, ids = jax.lax.top_k(t, int(k))
    outside = lambda x: jnp.put_along_axis(x, ids, -jnp.inf, axis=-1, inplace=False)  # noqa: E731
    s = jnp.asarray(student_logits).astype(jnp.float32)
    return losses.divergences.exact("kl", _log_softmax(outside(t)), _log_softmax(outside(s)))


def kl_bins(student_logits, topk_ids, topk_logprobs, tail_logprob) -> jax.Array:
    """float32 ``[B, L]``: KL over the k + 1 bins of a top-k record (T = 1)."""
    return losses.topk_tail_kl_per_token(student_logits, topk_ids, topk_logprobs, tail_logprob)


def kl_draws(student_logits, sample_ids, sample_counts, sample_logprobs) -> jax.Array:
    """float32 ``[B, L]``: the sampled estimate of the full KL (draws at T = t = 1: unbiased)."""
    return losses.sampled_kl_per_token(student_logits, sample_ids, sample_counts, sample_logprobs)


def per_position(student_logits, teacher: dict, *, k: int = 64) -> dict:
    """The measures available from ``teacher``: ``{"teacher_logits"}`` (online: every measure, the
    top-k of ``k``), a top-k record's fields, or a sampled record's. float32 ``[B, L]`` each."""
    if "teacher_logits" in teacher:
        t = teacher["teacher_logits"]
        _, ids = jax.lax.top_k(jnp.asarray(t).astype(jnp.float32), int(k))
        return {"kl": kl(t, student_logits), "top1_agreement": top1_agreement(ids[..., 0], student_logits),
                "topk_mass": topk_mass(ids, student_logits), "tail_shape_kl": tail_shape_kl(t, student_logits, k)}
    if "topk_ids" in teacher:
        ids = teacher["topk_ids"]
        return {"kl_bins": kl_bins(student_logits, ids, teacher["topk_logprobs"], teacher["tail_logprob"]),
                "top1_agreement": top1_agreement(ids[..., 0], student_logits),
                "topk_mass": topk_mass(ids, student_logits)}
    return {"kl_draws": kl_draws(student_logits, teacher["sample_ids"], teacher["sample_counts"],
                                 teacher["sample_logprobs"])}


def sums(values: dict, mask) -> dict:
    """Sums of each ``[B, L]`` value over ``mask`` (bool ``[B, L]``: the supervised positions,
    ``losses.training_mask``), and ``count`` (positions)."""
    out = {name: jnp.sum(jnp.where(mask, v, 0.0)) for name, v in values.items()}
    out["count"] = jnp.sum(mask, dtype=jnp.int32)
    return out


def means(total: dict) -> dict:
    """``sums`` (added over batches) as means per position; ``count`` kept."""
    n = max(int(total["count"]), 1)
    return {**{k: float(v) / n for k, v in total.items() if k != "count"}, "count": int(total["count"])}
