"""Distillation losses for the offline student (definitions: docs/LOSSES.md).

All functions are pure ``jax.numpy``, jit-able and differentiable with respect
to the student ``logits``. Shapes follow the logit store: ``[B, L]`` per
position, ``[B, L, k]`` per top-k entry and ``[B, L, V]`` for student logits.
Teacher position ``j`` describes the token at ``j + 1``; see
:func:`next_token_mask` and :func:`training_mask` for which positions count
(a batch's ``loss_mask``, e.g. the assistant's tokens of a conversation,
narrows them).

Logits may be bfloat16; everything is computed in float32.

A loss kind names what the teacher gave and the divergence taken on it:
``topk_kl`` (renormalised top-k), ``topk_tail_<d>`` (the k + 1 bins of a top-k
store), ``sampled_<d>`` (draws of a sampled store), ``full_<d>`` (the whole
vocabulary: an online teacher) and ``hybrid_kl`` (an exact top-k head plus
draws from the rest); ``d`` is one of ``divergences.DIVERGENCES``.

Written by hand: Optax has ``softmax_cross_entropy`` / ``kl_divergence`` on
dense distributions, but nothing for a sparse teacher (top-k ids + a tail bin),
the packed next-token mask, or the 0 * log 0 convention with a -inf tail.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from ..errors import InputError
from . import divergences
from .divergences import DIVERGENCES

# Every kind distill_loss computes: (what the teacher gave, divergence).
KIND_PARTS = {
    "topk_kl": ("topk", "kl"),
    **{f"topk_tail_{d}": ("topk_tail", d) for d in DIVERGENCES},
    **{f"sampled_{d}": ("sampled", d) for d in divergences.FROM_DRAWS},
    **{f"full_{d}": ("full", d) for d in DIVERGENCES},
    "hybrid_kl": ("hybrid", "kl"),
}
ALL_KINDS = tuple(KIND_PARTS)
# The losses `train --loss` offers.
KINDS = ALL_KINDS


def representation(kind: str) -> str:
    """What the teacher gave a loss kind: "topk", "topk_tail", "sampled", "full" or "hybrid"."""
    return KIND_PARTS[kind][0]
# The default loss of each store selection (docs/LOSSES.md, "Which loss").
DEFAULT_LOSS = {"topk": "topk_tail_kl", "sampled": "sampled_kl", "hybrid": "hybrid_kl"}

__all__ = [
    "KINDS",
    "ALL_KINDS",
    "representation",
    "next_token_mask",
    "next_token_targets",
    "training_mask",
    "topk_kl_per_token",
    "topk_tail_kl_per_token",
    "topk_tail_divergence_per_token",
    "sampled_kl_per_token",
    "sampled_divergence_per_token",
    "full_divergence_per_token",
    "hybrid_kl_per_token",
    "cross_entropy_per_token",
    "topk_kl",
    "topk_tail_kl",
    "sampled_kl",
    "cross_entropy",
    "kd_loss",
    "check_sampled_temperature",
    "check_sampled_divergence",
    "kd_metric_note",
    "accumulation_scales",
    "distill_loss",
]


# --------------------------------------------------------------------------- mask


def next_token_mask(segment_ids: jax.Array) -> jax.Array:
    """bool ``[B, L]``: position ``j`` counts iff ``j + 1 < L``,
    ``segment_ids[j] != 0`` and ``segment_ids[j + 1] == segment_ids[j]``.

    So padding, the last position of the row and the last token of every
    packed document (whose "next token" belongs to another document) are out.
    """
    seg = jnp.asarray(segment_ids)
    same_next = (seg[:, :-1] != 0) & (seg[:, 1:] == seg[:, :-1])
    return jnp.concatenate([same_next, jnp.zeros_like(seg[:, :1], dtype=bool)], axis=1)


def training_mask(batch: Mapping[str, Any]) -> jax.Array:
    """bool ``[B, L]``: the positions KD and CE are computed over, ``next_token_mask(segment_ids) &
    loss_mask`` (the batch's supervised positions: a conversation's assistant tokens; without a
    ``loss_mask``, every next-token position)."""
    mask = next_token_mask(batch["segment_ids"])
    if "loss_mask" in batch:
        mask = mask & jnp.asarray(batch["loss_mask"], bool)
    return mask


def next_token_targets(tokens: jax.Array) -> jax.Array:
    """int32 ``[B, L]``: ``tokens[:, j + 1]`` at ``j``; the last column is 0 (always masked)."""
    tok = jnp.asarray(tokens).astype(jnp.int32)
    return jnp.concatenate([tok[:, 1:], jnp.zeros_like(tok[:, :1])], axis=1)


# ---------------------------------------------------------------- numerics helpers


def _safe_logsumexp(x: jax.Array, axis: int = -1) -> jax.Array:
    """logsumexp that returns -inf (value) and 0 (gradient) when every entry is -inf.

    ``jax.nn.logsumexp`` returns -inf there too but its gradient is NaN, which
    would poison the whole step even under a ``where``.
    """
    m = jnp.max(x, axis=axis, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    s = jnp.sum(jnp.exp(x - m), axis=axis)
    pos = s > 0
    out = jnp.squeeze(m, axis) + jnp.log(jnp.where(pos, s, 1.0))
    return jnp.where(pos, out, -jnp.inf)


def _gather(logits: jax.Array, ids: jax.Array) -> jax.Array:
    # mode="fill": an id >= V (teacher/student vocab mismatch) gives NaN, not a
    # silently clipped index.
    return jnp.take_along_axis(logits, ids.astype(jnp.int32), axis=-1, mode="fill").astype(
        jnp.float32
    )


# ------------------------------------------------------------------ per token


def _concrete(x) -> float | None:
    """``x`` as a Python float, or None when it is traced (under jit)."""
    try:
        return float(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
        return None


def _require_tempered_tail(temperature, tempered_tail, what: str) -> None:
    """The k + 1 bins at T != 1 need the teacher's tail mass tempered at T, which only the dump can
    compute: tempering the stored T = 1 tail as if it were one token is another objective."""
    T = _concrete(temperature)
    if tempered_tail is None and T != 1.0:
        at = "a traced temperature" if T is None else f"temperature {T:g}"
        raise InputError(
            f"{what} at {at} needs the teacher's tail mass tempered at that temperature (tempered_tail=, "
            "batch field tail_logprob_tempered: dump --selection topk --tail-temperatures T); without it the tail bin would be "
            "tempered as if it were one token, which optimises another objective")


def check_sampled_temperature(temperature, proposal_temperature, *, allow_biased_temperature=False,
                              where: str = "") -> None:
    """``InputError`` unless draws made at ``proposal_temperature`` (t) give an unbiased signal at the
    training ``temperature`` (T): T == t, both Python numbers. At T != t the importance weights are
    self-normalised, a bias that shrinks only about as fast as the draws' noise (docs/LOSSES.md);
    ``allow_biased_temperature`` accepts it. ``where`` (e.g. "store gs://...") goes into the message."""
    if allow_biased_temperature:
        return
    T, t = _concrete(temperature), _concrete(proposal_temperature)
    if T is None or t is None:
        raise InputError("a sampled loss needs the temperature and the proposal temperature as Python numbers "
                         "(a traced value cannot be checked for T == t); or pass allow_biased_temperature=True")
    if T != t:
        raise InputError(
            f"a sampled loss at temperature {T:g} from draws made at proposal temperature {t:g}"
            f"{f' ({where})' if where else ''} is biased "
            f"(self-normalised importance weights, docs/LOSSES.md); train at temperature {t:g}, dump the store "
            f"at --proposal-temperature {T:g}, or accept the bias explicitly (allow_biased_temperature)")


def topk_kl_per_token(logits, topk_ids, topk_logprobs, *, temperature=1.0) -> jax.Array:
    """float32 ``[B, L]``: ``T^2 * KL(p_T || q_T)`` with both sides renormalised
    over the teacher's k ids: ``p_T = softmax(topk_logprobs / T)``,
    ``q_T = softmax(logits[topk_ids] / T)``. No mask applied."""
    s = _gather(logits, topk_ids)  # gather first: only [B, L, k] is upcast
    t = jnp.asarray(topk_logprobs, jnp.float32)
    logp = jax.nn.log_softmax(t / temperature, axis=-1)
    logq = jax.nn.log_softmax(s / temperature, axis=-1)
    return divergences.exact("kl", logp, logq) * (temperature * temperature)


def _student_tail_logit(logits: jax.Array, topk_ids: jax.Array) -> jax.Array:
    """log of the student's T=1 softmax numerator mass outside the k ids:
    ``logsumexp(logits[v] for v not in topk_ids)``, exact (no 1 - sum cancellation)."""
    z = jnp.asarray(logits).astype(jnp.float32)
    z_out = jnp.put_along_axis(z, topk_ids.astype(jnp.int32), -jnp.inf, axis=-1, inplace=False)
    return _safe_logsumexp(z_out, axis=-1)


def _tempered_head(topk_logprobs, log_tail_mass, T):
    """Log-probs of the k ids in the teacher tempered at T, given its tail mass ``m_T`` there: the ids
    share ``1 - m_T`` in proportion to ``p^(1/T)``; returns (those log-probs, ``log m_T`` clamped to <= 0)."""
    lp_t = jnp.asarray(topk_logprobs, jnp.float32) / T
    log_m = jnp.minimum(jnp.asarray(log_tail_mass, jnp.float32), 0.0)
    if lp_t.shape[-1] == 0:  # no head (k = 0): everything is tail
        return lp_t, log_m
    log_rest = jnp.log(-jnp.expm1(log_m))  # log(1 - m_T), exact also when m_T is small
    return lp_t - _safe_logsumexp(lp_t, axis=-1)[..., None] + log_rest[..., None], log_m


def _topk_tail_bins(logits, topk_ids, topk_logprobs, tail_logprob, temperature, tempered_tail):
    """(teacher, student) log-probs over the k + 1 bins of the distributions tempered at T."""
    _require_tempered_tail(temperature, tempered_tail, "a loss on the k + 1 bins of a top-k store")
    T = jnp.asarray(temperature, jnp.float32)
    z_t = jnp.asarray(logits).astype(jnp.float32) / T
    s = jnp.concatenate([_gather(z_t, topk_ids), _student_tail_logit(z_t, topk_ids)[..., None]], axis=-1)
    if tempered_tail is None:  # T = 1 (checked above): the stored bins themselves
        t = jnp.concatenate([jnp.asarray(topk_logprobs, jnp.float32),
                             jnp.asarray(tail_logprob, jnp.float32)[..., None]], axis=-1)
    else:
        head, log_m = _tempered_head(topk_logprobs, tempered_tail, T)
        t = jnp.concatenate([head, log_m[..., None]], axis=-1)
    # renormalised: float32 / lossy-codec rounding must not make the loss negative
    return jax.nn.log_softmax(t, axis=-1), jax.nn.log_softmax(s, axis=-1)


def topk_tail_divergence_per_token(logits, topk_ids, topk_logprobs, tail_logprob, *, divergence="kl",
                                   temperature=1.0, tempered_tail=None, beta=0.5, skew=0.1) -> jax.Array:
    """float32 ``[B, L]``: ``T^2 * D(C(p_T) || C(q_T))`` over k + 1 bins (the k ids + "everything
    else"), ``C`` the coarse-graining, ``q_T = softmax(logits / T)`` over the full vocabulary.

    At T != 1 ``tempered_tail`` (the teacher's ``log sum_{tail} p_T``, from
    ``dump --tail-temperatures``) is required (``InputError`` otherwise): the
    bins are then exact. ``divergence`` and its ``beta``/``skew``: see
    ``divergences.exact``. No mask applied.
    """
    t, s = _topk_tail_bins(logits, topk_ids, topk_logprobs, tail_logprob, temperature, tempered_tail)
    return divergences.exact(divergence, t, s, beta=beta, skew=skew) * (temperature * temperature)


def topk_tail_kl_per_token(logits, topk_ids, topk_logprobs, tail_logprob, *, temperature=1.0,
                           tempered_tail=None) -> jax.Array:
    """float32 ``[B, L]``: ``T^2 * KL`` over k + 1 bins (the k ids + "everything else").

    The bins are exact coarse-grainings of the tempered distributions: teacher
    ``[log p_T(i_1..i_k), log p_T(tail)]``, student ``[log q_T(i_1..i_k),
    log q_T(tail)]`` with ``q_T = softmax(logits / T)`` over the full vocabulary.
    At T != 1 that needs ``tempered_tail`` (the teacher's stored ``log
    sum_{tail} p_T``, from ``dump --tail-temperatures``): ``InputError`` without
    it. The loss is 0 iff the student's k+1 bins equal the teacher's. No mask applied.
    """
    return topk_tail_divergence_per_token(logits, topk_ids, topk_logprobs, tail_logprob, divergence="kl",
                                          temperature=temperature, tempered_tail=tempered_tail)


def full_divergence_per_token(logits, teacher_logits, *, divergence="kl", temperature=1.0, beta=0.5,
                              skew=0.1) -> jax.Array:
    """float32 ``[B, L]``: ``T^2 * D(p_T || q_T)`` over the full vocabulary, ``p_T =
    softmax(teacher_logits / T)`` (teacher logits or log-probs, ``[B, L, V]``; no gradient),
    ``q_T = softmax(logits / T)``. The online reference of every other kind. No mask applied."""
    logp = jax.nn.log_softmax(jnp.asarray(teacher_logits, jnp.float32) / temperature, axis=-1)
    logq = jax.nn.log_softmax(jnp.asarray(logits).astype(jnp.float32) / temperature, axis=-1)
    return divergences.exact(divergence, logp, logq, beta=beta, skew=skew) * (temperature * temperature)


def sampled_kl_per_token(logits, sample_ids, sample_counts, sample_logprobs, *, temperature=1.0,
                         proposal_temperature=1.0, allow_biased_temperature=False) -> jax.Array:
    """float32 ``[B, L]``: importance-weighted estimate of ``T^2 * KL(p_T || q_T)`` from samples.

    Per position the store holds S slots: distinct ids drawn (with replacement,
    N draws) from the teacher tempered by the proposal temperature t, their
    counts (0 in unused slots) and the teacher's untempered log-probs ``l``.
    With T = t the weights are ``count / N`` and the gradient with respect to
    the logits, ``T * (q_T - sum_v w_v e_v)``, is an unbiased estimate of the
    full-distribution KD gradient ``T * (q_T - p_T)``. T != t raises
    ``InputError`` unless ``allow_biased_temperature``: the weights are then
    self-normalised (biased)::

        w_v = count_v * p(v)^(1/T - 1/t) / sum_u count_u * p(u)^(1/T - 1/t)

    Estimate: ``T^2 * sum_v w_v (log p_T(v) - log q_T(v))`` with
    ``q_T = softmax(logits / T)`` over the full vocabulary and ``log p_T(v) =
    l_v / T - log Z_T``, ``Z_T`` estimated from the same samples (exactly 0
    at T = 1; so the value is unbiased at T = t = 1 only, see
    :func:`kd_metric_note`). No mask applied; a position needs at least one
    slot with a count > 0.
    """
    check_sampled_temperature(temperature, proposal_temperature, allow_biased_temperature=allow_biased_temperature)
    T = jnp.asarray(temperature, jnp.float32)
    t = jnp.asarray(proposal_temperature, jnp.float32)
    c = jnp.asarray(sample_counts, jnp.float32)
    lp = jax.lax.stop_gradient(jnp.asarray(sample_logprobs, jnp.float32))
    used = c > 0
    log_c = jnp.where(used, jnp.log(jnp.where(used, c, 1.0)), -jnp.inf)
    logw = jnp.where(used, log_c + (1.0 / T - 1.0 / t) * lp, -jnp.inf)
    log_norm = _safe_logsumexp(logw, axis=-1)
    w = jnp.exp(logw - log_norm[..., None])
    log_z = log_norm - _safe_logsumexp(jnp.where(used, log_c + (1.0 - 1.0 / t) * lp, -jnp.inf), axis=-1)
    z = jnp.asarray(logits).astype(jnp.float32) / T
    log_q = _gather(z, sample_ids) - _safe_logsumexp(z, axis=-1)[..., None]
    diff = jnp.where(used, lp / T - log_z[..., None] - log_q, 0.0)
    return jnp.sum(jnp.where(used, w * diff, 0.0), axis=-1) * (T * T)


def _draw_weights(sample_counts):
    """``count / N`` per slot (N: the position's total count), 0 in unused slots."""
    c = jnp.asarray(sample_counts, jnp.float32)
    return c / jnp.maximum(jnp.sum(c, axis=-1, keepdims=True), 1.0)


def sampled_divergence_per_token(logits, sample_ids, sample_counts, sample_logprobs, *, divergence="kl",
                                 temperature=1.0, proposal_temperature=1.0, beta=0.5, skew=0.1,
                                 allow_biased_temperature=False) -> jax.Array:
    """float32 ``[B, L]``: an estimate of ``T^2 * D(p_T || q_T)`` from a sampled store's draws.

    ``kl`` is :func:`sampled_kl_per_token`. The others use
    ``divergences.from_draws`` (unbiased, in value and gradient; their
    integrands grow at most like ``log(q/p)``), which needs the teacher's
    log-probs at T itself: T = t = 1 only (``InputError`` otherwise; a
    tempered one would need the teacher's normaliser ``Z_T``, which a sampled
    record lacks). ``reverse_kl`` has no estimator (``InputError``). No mask applied.
    """
    if divergence == "kl":
        return sampled_kl_per_token(logits, sample_ids, sample_counts, sample_logprobs, temperature=temperature,
                                    proposal_temperature=proposal_temperature,
                                    allow_biased_temperature=allow_biased_temperature)
    if divergence == "reverse_kl":
        raise InputError(divergences.NO_REVERSE_KL_FROM_DRAWS)
    check_sampled_divergence(divergence, temperature, proposal_temperature)
    z = jnp.asarray(logits).astype(jnp.float32)
    log_q = _gather(z, sample_ids) - _safe_logsumexp(z, axis=-1)[..., None]
    lp = jnp.asarray(sample_logprobs, jnp.float32)
    w = _draw_weights(sample_counts)
    log_ratio = jnp.where(w != 0, log_q - lp, 0.0)
    return divergences.from_draws(divergence, w, log_ratio, beta=beta, skew=skew)


def hybrid_kl_per_token(logits, topk_ids, topk_logprobs, tail_logprob, sample_ids, sample_counts,
                        sample_logprobs=None, *, tail_plogp=None, temperature=1.0, tempered_tail=None,
                        proposal_temperature=1.0, allow_biased_temperature=False) -> jax.Array:
    """float32 ``[B, L]``: ``T^2 * KL(p_T || q_T)`` from an exact head and draws from the rest.

    The record holds the teacher's top-k (ids, log-probs: the head), its tail
    mass ``m`` (``tail_logprob``; at T != 1 ``tempered_tail``, the tail's mass
    tempered at T) and N draws from the tail renormalised (at T = t: ``sample_ids``
    distinct, ``sample_counts`` summing to N). The target

        p_hat = sum_b p_T(i_b) e_{i_b} + m_T * sum_v (count_v / N) e_v

    has expectation p_T exactly, so the gradient ``T * (q_T - p_hat)`` is
    unbiased with variance from the tail only. The value is ``T^2 * sum
    p_hat (log p_T - log q_T)``: the tail draws' ``log p_T(v) = l_v / T - log
    Z_T`` come from their untempered ``sample_logprobs`` (``Z_T`` is exact, from
    the head and m_T), or, in a record without them, the tail's ``sum p_T log
    p_T`` is given as ``tail_plogp`` (exact). Either makes the value an unbiased
    estimate of the KL. With k = 0 (no head, ``tail_logprob`` 0) it is a
    sampled store's KL. No mask applied.
    """
    check_sampled_temperature(temperature, proposal_temperature, allow_biased_temperature=allow_biased_temperature)
    _require_tempered_tail(temperature, tempered_tail, "hybrid_kl")
    if (sample_logprobs is None) == (tail_plogp is None):
        raise InputError("hybrid_kl needs exactly one of sample_logprobs (the tail draws' log-probs) and "
                         "tail_plogp (the tail's sum p log p)")
    if jnp.shape(topk_ids)[-1] == 0 and sample_logprobs is not None and _concrete(temperature) != 1.0:
        raise InputError("hybrid_kl without a head at T != 1 needs tail_plogp: the teacher's normaliser Z_T "
                         "comes from the head")
    T = jnp.asarray(temperature, jnp.float32)
    head, log_m = _tempered_head(topk_logprobs, tail_logprob if tempered_tail is None else tempered_tail, T)
    z = jnp.asarray(logits).astype(jnp.float32) / T
    lse = _safe_logsumexp(z, axis=-1)[..., None]
    head_kl = divergences.exact("kl", head, _gather(z, topk_ids) - lse) if head.shape[-1] else 0.0
    w = jnp.exp(log_m)[..., None] * _draw_weights(sample_counts)
    used = w != 0
    log_q = jnp.where(used, _gather(z, sample_ids) - lse, 0.0)
    if tail_plogp is not None:
        tail = jnp.asarray(tail_plogp, jnp.float32) - jnp.sum(jnp.where(used, w * log_q, 0.0), axis=-1)
    else:
        # log Z_T from the head: p_T(i_b) = p_b^(1/T) / Z_T; 0 at T = 1 (the log-probs are normalised)
        if head.shape[-1] == 0:  # T = 1 (checked above): the draws' log-probs are normalised
            log_z = jnp.zeros_like(log_m)
        else:
            log_z = jnp.where(T == 1.0, 0.0, _safe_logsumexp(jnp.asarray(topk_logprobs, jnp.float32) / T, axis=-1)
                              - jnp.log(-jnp.expm1(log_m)))
        log_p = jnp.asarray(sample_logprobs, jnp.float32) / T - log_z[..., None]
        tail = jnp.sum(jnp.where(used, w * jnp.where(used, log_p - log_q, 0.0), 0.0), axis=-1)
    return (head_kl + tail) * (T * T)


def cross_entropy_per_token(logits, targets) -> jax.Array:
    """float32 ``[B, L]``: ``logsumexp(logits) - logits[target]`` over the full vocab.

    ``targets`` are already the next tokens (see :func:`next_token_targets`)."""
    z = jnp.asarray(logits).astype(jnp.float32)
    lse = _safe_logsumexp(z, axis=-1)
    zt = jnp.take_along_axis(z, targets.astype(jnp.int32)[..., None], axis=-1, mode="fill")
    return lse - zt[..., 0]


# -------------------------------------------------------------- masked means


def _masked_mean(values: jax.Array, mask: jax.Array):
    mask = jnp.asarray(mask, bool)
    count = jnp.sum(mask, dtype=jnp.int32)
    total = jnp.sum(jnp.where(mask, values, 0.0))
    return total / jnp.maximum(count, 1).astype(jnp.float32), count


def _where(mask, x, fill, dtype):
    m = jnp.asarray(mask, bool)
    x = jnp.asarray(x, dtype)
    return jnp.where(m.reshape(m.shape + (1,) * (x.ndim - m.ndim)), x, jnp.asarray(fill, dtype))


def _sanitize(mask, batch: Mapping[str, Any], fields) -> dict:
    """The teacher ``fields`` of ``batch`` with harmless finite values at masked positions
    (padding: may be garbage), so they reach neither the value nor the gradient. A masked
    position of a sampled record gets one slot of count 1."""
    out = {}
    for name in fields:
        if name not in batch or batch[name] is None:
            continue
        x = batch[name]
        if name.endswith("_ids"):
            out[name] = _where(mask, x, 0, jnp.int32)
        elif name == "sample_counts":
            first = (jnp.arange(jnp.shape(x)[-1]) == 0).astype(jnp.int32)
            m = jnp.asarray(mask, bool)[..., None]
            out[name] = jnp.where(m, jnp.asarray(x, jnp.int32), first)
        elif name == "tail_logprob_tempered":
            out[name] = _where(mask, x, -1.0, jnp.float32)
        else:
            out[name] = _where(mask, x, 0.0, jnp.float32)
    return out


def topk_kl(logits, topk_ids, topk_logprobs, mask, *, temperature=1.0):
    """Mean of :func:`topk_kl_per_token` over ``mask``; returns ``(loss, count)``.

    ``count`` is the int32 number of positions in ``mask``; loss is 0 when it is 0."""
    return kd_loss("topk_kl", logits, {"topk_ids": topk_ids, "topk_logprobs": topk_logprobs}, mask,
                   temperature=temperature)


def topk_tail_kl(logits, topk_ids, topk_logprobs, tail_logprob, mask, *, temperature=1.0,
                 tempered_tail=None):
    """Mean of :func:`topk_tail_kl_per_token` over ``mask``; returns ``(loss, count)``."""
    batch = {"topk_ids": topk_ids, "topk_logprobs": topk_logprobs, "tail_logprob": tail_logprob,
             "tail_logprob_tempered": tempered_tail}
    return kd_loss("topk_tail_kl", logits, batch, mask, temperature=temperature)


def sampled_kl(logits, sample_ids, sample_counts, sample_logprobs, mask, *, temperature=1.0,
               proposal_temperature=1.0, allow_biased_temperature=False):
    """Mean of :func:`sampled_kl_per_token` over ``mask``; returns ``(loss, count)``."""
    batch = {"sample_ids": sample_ids, "sample_counts": sample_counts, "sample_logprobs": sample_logprobs}
    return kd_loss("sampled_kl", logits, batch, mask, temperature=temperature,
                   proposal_temperature=proposal_temperature, allow_biased_temperature=allow_biased_temperature)


def cross_entropy(logits, tokens, mask):
    """Mean next-token cross-entropy over ``mask``; returns ``(loss, count)``.

    ``tokens`` are the input tokens ``[B, L]``; the target at ``j`` is
    ``tokens[:, j + 1]`` (``mask`` must exclude the last column, as
    :func:`next_token_mask` does)."""
    targets = jnp.where(jnp.asarray(mask, bool), next_token_targets(tokens), 0)
    return _masked_mean(cross_entropy_per_token(logits, targets), mask)


def check_sampled_divergence(divergence, temperature, proposal_temperature) -> None:
    """``InputError`` unless draws give ``divergence``'s estimate at these temperatures: ``kl`` at any
    (``check_sampled_temperature`` judges T != t), the others at T = t = 1 only."""
    T, t = _concrete(temperature), _concrete(proposal_temperature)
    if divergence != "kl" and (T != 1.0 or t != 1.0):
        raise InputError(f"sampled_{divergence} needs temperature 1 and draws at proposal temperature 1 (got T = "
                         f"{temperature}, t = {proposal_temperature}): the teacher's tempered log-probs need its "
                         "normaliser, which a sampled record does not hold; use sampled_kl at T = t")


# ---------------------------------------------------------------- combined


# Teacher fields each loss reads from the batch (``tail_logprob_tempered`` is optional; ``hybrid_kl``
# reads ``tail_plogp``, what a hybrid store holds, or instead the draws' ``sample_logprobs``).
_REPRESENTATION_FIELDS = {
    "topk": ("topk_ids", "topk_logprobs"),
    "topk_tail": ("topk_ids", "topk_logprobs", "tail_logprob"),
    "sampled": ("sample_ids", "sample_counts", "sample_logprobs"),
    "full": ("teacher_logits",),
    "hybrid": ("topk_ids", "topk_logprobs", "tail_logprob", "sample_ids", "sample_counts", "tail_plogp"),
}
FIELDS = {kind: _REPRESENTATION_FIELDS[rep] for kind, (rep, _) in KIND_PARTS.items()}
_OPTIONAL_FIELDS = ("tail_logprob_tempered",)


def _fields_of(kind: str, batch: Mapping[str, Any]) -> tuple:
    """The teacher fields ``kind`` reads from ``batch``: ``FIELDS[kind]``, with a hybrid batch's draws'
    ``sample_logprobs`` in place of ``tail_plogp`` when it holds those instead."""
    fields = FIELDS[kind]
    if KIND_PARTS[kind][0] == "hybrid" and "tail_plogp" not in batch and "sample_logprobs" in batch:
        fields = tuple("sample_logprobs" if f == "tail_plogp" else f for f in fields)
    return fields


def _unknown_kind(kind: str) -> InputError:
    if kind == "sampled_reverse_kl":
        return InputError(f"sampled_reverse_kl: {divergences.NO_REVERSE_KL_FROM_DRAWS}")
    return InputError(f"unknown distillation loss kind {kind!r}; expected one of {', '.join(ALL_KINDS)}")


def _per_token(kind, logits, b, temperature, proposal_temperature, beta, skew, allow_biased_temperature):
    rep, div = KIND_PARTS[kind]
    if rep == "topk":
        return topk_kl_per_token(logits, b["topk_ids"], b["topk_logprobs"], temperature=temperature)
    if rep == "topk_tail":
        return topk_tail_divergence_per_token(
            logits, b["topk_ids"], b["topk_logprobs"], b["tail_logprob"], divergence=div, temperature=temperature,
            tempered_tail=b.get("tail_logprob_tempered"), beta=beta, skew=skew)
    if rep == "full":
        return full_divergence_per_token(logits, b["teacher_logits"], divergence=div, temperature=temperature,
                                         beta=beta, skew=skew)
    if rep == "sampled":
        return sampled_divergence_per_token(
            logits, b["sample_ids"], b["sample_counts"], b["sample_logprobs"], divergence=div,
            temperature=temperature, proposal_temperature=proposal_temperature, beta=beta, skew=skew,
            allow_biased_temperature=allow_biased_temperature)
    return hybrid_kl_per_token(
        logits, b["topk_ids"], b["topk_logprobs"], b["tail_logprob"], b["sample_ids"], b["sample_counts"],
        b.get("sample_logprobs"), tail_plogp=b.get("tail_plogp"), temperature=temperature,
        tempered_tail=b.get("tail_logprob_tempered"), proposal_temperature=proposal_temperature,
        allow_biased_temperature=allow_biased_temperature)


def kd_loss(kind, logits, batch: Mapping[str, Any], mask, *, temperature=1.0, proposal_temperature=1.0,
            beta=0.5, skew=0.1, allow_biased_temperature=False):
    """Mean over ``mask`` of the per-token loss of ``kind`` (``ALL_KINDS``) on the teacher fields of
    ``batch`` (``FIELDS[kind]``); returns ``(loss, count)``: 0 when ``count`` is 0."""
    if kind not in KIND_PARTS:
        raise _unknown_kind(kind)
    fields = _fields_of(kind, batch) + _OPTIONAL_FIELDS
    clean = _sanitize(mask, batch, fields)
    per = _per_token(kind, logits, clean, temperature, proposal_temperature, beta, skew, allow_biased_temperature)
    return _masked_mean(per, mask)


def kd_metric_note(kind: str, temperature=1.0, proposal_temperature=1.0) -> str:
    """What the ``kd_loss`` metric of ``kind`` is: "exact" (a function of the store's values), or
    the kind of estimate it is (sampled stores: the draws are random)."""
    rep, _ = KIND_PARTS[kind] if kind in KIND_PARTS else (None, None)
    if rep is None:
        raise _unknown_kind(kind)
    if rep in ("topk", "topk_tail", "full"):
        return "exact"
    T, t = _concrete(temperature), _concrete(proposal_temperature)
    if T != t:
        return "biased estimate (self-normalised importance weights at T != t)"
    if rep == "sampled" and T != 1.0:
        return "biased estimate (log Z_T from the draws; the gradient is unbiased)"
    return "unbiased estimate (from the draws)"


def distill_loss(
    logits: jax.Array,
    batch: Mapping[str, Any],
    *,
    kind: str = "topk_kl",
    alpha=0.5,
    temperature=1.0,
    proposal_temperature=1.0,
    beta=0.5,
    skew=0.1,
    allow_biased_temperature=False,
):
    """``loss = alpha * kd + (1 - alpha) * ce``; returns ``(loss, metrics)``.

    ``batch`` holds ``tokens``, ``segment_ids``, optionally ``loss_mask`` (the
    positions that count are :func:`training_mask`'s) and (unless ``alpha`` is a
    Python/NumPy 0) the teacher fields of ``kind`` (``FIELDS``, one of
    ``ALL_KINDS``): ``topk_ids``, ``topk_logprobs`` and, for ``topk_tail_*``,
    ``tail_logprob`` (plus ``tail_logprob_tempered`` at T != 1, required);
    for ``sampled_*`` ``sample_ids``, ``sample_counts``, ``sample_logprobs``
    (drawn at ``proposal_temperature``, which must equal ``temperature``
    unless ``allow_biased_temperature``); for ``full_*`` ``teacher_logits``
    ``[B, L, V]``; for ``hybrid_kl`` the top-k and the tail's draws.
    ``beta`` (``*_jsd``) and ``skew`` (``*_skew_*``) parametrise the
    divergence. ``metrics`` = ``{"kd_loss", "ce_loss", "num_tokens"}``
    (``kd_loss`` is unscaled by alpha, already includes the T^2 factor, and is
    what :func:`kd_metric_note` says it is).

    ``alpha`` may be a traced scalar (a schedule). When it is 0 the loss and its
    gradient are exactly the CE ones, whatever the teacher fields hold: the KD
    term is then only evaluated for the metric, without gradient (``lax.cond``
    runs one branch). When ``alpha`` is a concrete 0 and the teacher fields are
    absent, ``kd_loss`` is NaN ("not computed").
    """
    if kind not in KIND_PARTS:
        raise _unknown_kind(kind)
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise InputError(f"temperature must be > 0, got {temperature!r}")
    if isinstance(alpha, (int, float)) and not 0.0 <= alpha <= 1.0:  # also rejects NaN
        raise InputError(f"alpha must be in [0, 1], got {alpha!r}")
    divergences.check_parameters(KIND_PARTS[kind][1], beta=beta, skew=skew)

    mask = training_mask(batch)
    ce, count = cross_entropy(logits, batch["tokens"], mask)

    needed = _fields_of(kind, batch)
    missing = [k for k in needed if k not in batch]
    concrete_zero = _concrete(alpha) == 0.0
    if missing:
        if not concrete_zero:
            raise KeyError(
                f"distill_loss(kind={kind!r}, alpha={alpha!r}) needs batch fields {missing}"
            )
        metrics = {"kd_loss": jnp.float32(jnp.nan), "ce_loss": ce, "num_tokens": count}
        return ce, metrics

    alpha = jnp.asarray(alpha, jnp.float32)

    def kd(z):
        return kd_loss(kind, z, batch, mask, temperature=temperature, proposal_temperature=proposal_temperature,
                       beta=beta, skew=skew, allow_biased_temperature=allow_biased_temperature)[0]

    def ce_only(z):
        return ce, kd(jax.lax.stop_gradient(z))

    def mixed(z):
        value = kd(z)
        return alpha * value + (1.0 - alpha) * ce, value

    loss, value = jax.lax.cond(alpha == 0.0, ce_only, mixed, logits)
    return loss, {"kd_loss": value, "ce_loss": ce, "num_tokens": count}


# ------------------------------------------------------- gradient accumulation


def accumulation_scales(batches) -> list:
    """Loss scales that make ``optax.MultiSteps`` token-weighted.

    MultiSteps averages the gradients of ``n`` micro-batches, each the gradient
    of a mean over that micro-batch's trained tokens ``c_i`` (its
    :func:`training_mask`: supervised tokens only). Scaling micro-batch ``i``'s
    loss by ``n * c_i / sum_j c_j`` turns the average into the gradient of (sum
    of per-token losses over all micro-batches) / (their total trained tokens),
    as if they were one batch. ``batches``: the micro-batches (mappings with
    ``segment_ids`` and optionally ``loss_mask``). Returns float32 scalars
    (traced-safe: global arrays give global counts).
    """
    counts = [jnp.sum(training_mask(b), dtype=jnp.int32).astype(jnp.float32) for b in batches]
    total = sum(counts)
    n = len(counts)
    return [jnp.where(total > 0, n * c / jnp.maximum(total, 1.0), 1.0) for c in counts]
