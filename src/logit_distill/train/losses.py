"""Distillation losses for the offline student (definitions: docs/LOSSES.md).

All functions are pure ``jax.numpy``, jit-able and differentiable with respect
to the student ``logits``. Shapes follow the logit store: ``[B, L]`` per
position, ``[B, L, k]`` per top-k entry and ``[B, L, V]`` for student logits.
Teacher position ``j`` describes the token at ``j + 1``; see
:func:`next_token_mask` and :func:`training_mask` for which positions count
(a batch's ``loss_mask``, e.g. the assistant's tokens of a conversation,
narrows them).

Logits may be bfloat16; everything is computed in float32.

Written by hand: Optax has ``softmax_cross_entropy`` / ``kl_divergence`` on
dense distributions, but nothing for a sparse teacher (top-k ids + a tail bin),
the packed next-token mask, or the 0 * log 0 convention with a -inf tail.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

KINDS = ("topk_kl", "topk_tail_kl", "sampled_kl")
# The default loss of each store selection (docs/LOSSES.md, "Which loss").
DEFAULT_LOSS = {"topk": "topk_tail_kl", "sampled": "sampled_kl"}

__all__ = [
    "KINDS",
    "next_token_mask",
    "next_token_targets",
    "training_mask",
    "topk_kl_per_token",
    "topk_tail_kl_per_token",
    "sampled_kl_per_token",
    "cross_entropy_per_token",
    "topk_kl",
    "topk_tail_kl",
    "sampled_kl",
    "cross_entropy",
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


def _kl_from_bin_logits(t: jax.Array, s: jax.Array, temperature) -> jax.Array:
    """``T^2 * KL(softmax(t / T) || softmax(s / T))`` over the last axis.

    ``t`` are teacher bin log-weights (data; no gradient), ``s`` student bin
    logits. Both are renormalised (log_softmax), so the teacher bins need not
    sum exactly to 1 (float32 / lossy codec rounding). Bins where the teacher
    has zero probability contribute 0 (the 0 * log 0 = 0 convention), also in
    the gradient.
    """
    t = jax.lax.stop_gradient(t)
    logp = jax.nn.log_softmax(t / temperature, axis=-1)
    logq = jax.nn.log_softmax(s / temperature, axis=-1)
    p = jnp.exp(logp)
    # `p != 0`, not `p > 0`: a NaN teacher entry (corrupt data) must propagate,
    # not be dropped silently. Double where: the discarded branch is NaN
    # (-inf - -inf) where p == 0, so keep it finite before multiplying too.
    pos = p != 0
    diff = jnp.where(pos, logp - logq, 0.0)
    kl = jnp.sum(jnp.where(pos, p * diff, 0.0), axis=-1)
    return kl * (temperature * temperature)


def _gather(logits: jax.Array, ids: jax.Array) -> jax.Array:
    # mode="fill": an id >= V (teacher/student vocab mismatch) gives NaN, not a
    # silently clipped index.
    return jnp.take_along_axis(logits, ids.astype(jnp.int32), axis=-1, mode="fill").astype(
        jnp.float32
    )


# ------------------------------------------------------------------ per token


def topk_kl_per_token(logits, topk_ids, topk_logprobs, *, temperature=1.0) -> jax.Array:
    """float32 ``[B, L]``: ``T^2 * KL(p_T || q_T)`` with both sides renormalised
    over the teacher's k ids: ``p_T = softmax(topk_logprobs / T)``,
    ``q_T = softmax(logits[topk_ids] / T)``. No mask applied."""
    s = _gather(logits, topk_ids)  # gather first: only [B, L, k] is upcast
    t = jnp.asarray(topk_logprobs, jnp.float32)
    return _kl_from_bin_logits(t, s, temperature)


def _student_tail_logit(logits: jax.Array, topk_ids: jax.Array) -> jax.Array:
    """log of the student's T=1 softmax numerator mass outside the k ids:
    ``logsumexp(logits[v] for v not in topk_ids)``, exact (no 1 - sum cancellation)."""
    z = jnp.asarray(logits).astype(jnp.float32)
    z_out = jnp.put_along_axis(z, topk_ids.astype(jnp.int32), -jnp.inf, axis=-1, inplace=False)
    return _safe_logsumexp(z_out, axis=-1)


def topk_tail_kl_per_token(
    logits, topk_ids, topk_logprobs, tail_logprob, *, temperature=1.0, tempered_tail=None
) -> jax.Array:
    """float32 ``[B, L]``: ``T^2 * KL`` over k + 1 bins (the k ids + "everything else").

    With ``tempered_tail`` (the teacher's stored ``log sum_{tail} p_T``, its
    tail mass at temperature T, from ``dump --tail-temperatures``) the bins are
    exact coarse-grainings of the tempered distributions: teacher
    ``[log p_T(i_1..i_k), log p_T(tail)]``, student ``[log q_T(i_1..i_k),
    log q_T(tail)]`` with ``q_T = softmax(logits / T)`` over the full vocabulary.

    Without it, bin log-weights at T = 1 (teacher ``[topk_logprobs,
    tail_logprob]``, student ``[logits[topk_ids], logsumexp(logits outside)]``)
    are divided by T, which tempers the tail as if it were one token: exact at
    T = 1 only (the training loop refuses T != 1 without the stored value). The
    loss is 0 iff the student's k+1 bins equal the teacher's. No mask applied.
    """
    z_ids = _gather(logits, topk_ids)
    if tempered_tail is None:
        s = jnp.concatenate([z_ids, _student_tail_logit(logits, topk_ids)[..., None]], axis=-1)
        t = jnp.concatenate(
            [
                jnp.asarray(topk_logprobs, jnp.float32),
                jnp.asarray(tail_logprob, jnp.float32)[..., None],
            ],
            axis=-1,
        )
        return _kl_from_bin_logits(t, s, temperature)
    T = jnp.asarray(temperature, jnp.float32)
    # Student: tempered logits; its tail bin is logsumexp of the tempered logits outside the ids.
    z_t = jnp.asarray(logits).astype(jnp.float32) / T
    s = jnp.concatenate([z_ids / T, _student_tail_logit(z_t, topk_ids)[..., None]], axis=-1)
    # Teacher: the top-k ids share the tempered mass 1 - m_T in proportion to p^(1/T).
    lp_t = jnp.asarray(topk_logprobs, jnp.float32) / T
    log_m = jnp.minimum(jnp.asarray(tempered_tail, jnp.float32), 0.0)
    log_rest = jnp.log(-jnp.expm1(log_m))  # log(1 - m_T), exact also when m_T is small
    top = lp_t - _safe_logsumexp(lp_t, axis=-1)[..., None] + log_rest[..., None]
    t = jnp.concatenate([top, log_m[..., None]], axis=-1)
    return _kl_from_bin_logits(t, s, 1.0) * (T * T)


def sampled_kl_per_token(
    logits, sample_ids, sample_counts, sample_logprobs, *, temperature=1.0, proposal_temperature=1.0
) -> jax.Array:
    """float32 ``[B, L]``: importance-weighted estimate of ``T^2 * KL(p_T || q_T)`` from samples.

    Per position the store holds S slots: distinct ids drawn (with replacement,
    N draws) from the teacher tempered by the proposal temperature t, their
    counts (0 in unused slots) and the teacher's untempered log-probs ``l``.
    Weights (self-normalized; exactly ``count / N`` when t = T)::

        w_v = count_v * p(v)^(1/T - 1/t) / sum_u count_u * p(u)^(1/T - 1/t)

    Estimate: ``T^2 * sum_v w_v (log p_T(v) - log q_T(v))`` with
    ``q_T = softmax(logits / T)`` over the full vocabulary and ``log p_T(v) =
    l_v / T - log Z_T``, ``Z_T`` estimated from the same samples (exactly 0
    at T = 1). Its gradient with respect to the logits, ``T * (q_T - sum_v w_v
    e_v)``, is an unbiased estimate of the full-distribution KD gradient
    ``T * (q_T - p_T)`` when t = T. No mask applied; a position needs at least
    one slot with a count > 0.
    """
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


def _sanitize_teacher(mask, topk_ids, topk_logprobs, tail_logprob=None):
    """Replace teacher fields at masked positions (padding: may be garbage) by
    harmless finite values, so they cannot reach the value or the gradient."""
    m = jnp.asarray(mask, bool)
    ids = jnp.where(m[..., None], jnp.asarray(topk_ids, jnp.int32), 0)
    lp = jnp.where(m[..., None], jnp.asarray(topk_logprobs, jnp.float32), 0.0)
    tail = None
    if tail_logprob is not None:
        tail = jnp.where(m, jnp.asarray(tail_logprob, jnp.float32), 0.0)
    return ids, lp, tail


def topk_kl(logits, topk_ids, topk_logprobs, mask, *, temperature=1.0):
    """Mean of :func:`topk_kl_per_token` over ``mask``; returns ``(loss, count)``.

    ``count`` is the int32 number of positions in ``mask``; loss is 0 when it is 0."""
    ids, lp, _ = _sanitize_teacher(mask, topk_ids, topk_logprobs)
    return _masked_mean(topk_kl_per_token(logits, ids, lp, temperature=temperature), mask)


def topk_tail_kl(logits, topk_ids, topk_logprobs, tail_logprob, mask, *, temperature=1.0,
                 tempered_tail=None):
    """Mean of :func:`topk_tail_kl_per_token` over ``mask``; returns ``(loss, count)``."""
    ids, lp, tail = _sanitize_teacher(mask, topk_ids, topk_logprobs, tail_logprob)
    if tempered_tail is not None:
        tempered_tail = jnp.where(jnp.asarray(mask, bool), jnp.asarray(tempered_tail, jnp.float32), -1.0)
    per = topk_tail_kl_per_token(logits, ids, lp, tail, temperature=temperature, tempered_tail=tempered_tail)
    return _masked_mean(per, mask)


def sampled_kl(logits, sample_ids, sample_counts, sample_logprobs, mask, *, temperature=1.0,
               proposal_temperature=1.0):
    """Mean of :func:`sampled_kl_per_token` over ``mask``; returns ``(loss, count)``."""
    m = jnp.asarray(mask, bool)
    ids = jnp.where(m[..., None], jnp.asarray(sample_ids, jnp.int32), 0)
    lp = jnp.where(m[..., None], jnp.asarray(sample_logprobs, jnp.float32), 0.0)
    # A masked position gets one harmless slot (count 1), so nothing there is NaN.
    first = jnp.arange(jnp.shape(sample_counts)[-1]) == 0
    counts = jnp.where(m[..., None], jnp.asarray(sample_counts, jnp.int32), first.astype(jnp.int32))
    per = sampled_kl_per_token(logits, ids, counts, lp, temperature=temperature,
                               proposal_temperature=proposal_temperature)
    return _masked_mean(per, mask)


def cross_entropy(logits, tokens, mask):
    """Mean next-token cross-entropy over ``mask``; returns ``(loss, count)``.

    ``tokens`` are the input tokens ``[B, L]``; the target at ``j`` is
    ``tokens[:, j + 1]`` (``mask`` must exclude the last column, as
    :func:`next_token_mask` does)."""
    targets = jnp.where(jnp.asarray(mask, bool), next_token_targets(tokens), 0)
    return _masked_mean(cross_entropy_per_token(logits, targets), mask)


# ---------------------------------------------------------------- combined


# Teacher fields each loss reads from the batch (``tail_logprob_tempered`` is optional).
FIELDS = {
    "topk_kl": ("topk_ids", "topk_logprobs"),
    "topk_tail_kl": ("topk_ids", "topk_logprobs", "tail_logprob"),
    "sampled_kl": ("sample_ids", "sample_counts", "sample_logprobs"),
}


def _kd(kind, logits, batch, mask, temperature, proposal_temperature):
    if kind == "topk_kl":
        return topk_kl(
            logits, batch["topk_ids"], batch["topk_logprobs"], mask, temperature=temperature
        )[0]
    if kind == "sampled_kl":
        return sampled_kl(
            logits, batch["sample_ids"], batch["sample_counts"], batch["sample_logprobs"], mask,
            temperature=temperature, proposal_temperature=proposal_temperature,
        )[0]
    return topk_tail_kl(
        logits,
        batch["topk_ids"],
        batch["topk_logprobs"],
        batch["tail_logprob"],
        mask,
        temperature=temperature,
        tempered_tail=batch.get("tail_logprob_tempered"),
    )[0]


def distill_loss(
    logits: jax.Array,
    batch: Mapping[str, Any],
    *,
    kind: str = "topk_kl",
    alpha=0.5,
    temperature=1.0,
    proposal_temperature=1.0,
):
    """``loss = alpha * kd + (1 - alpha) * ce``; returns ``(loss, metrics)``.

    ``batch`` holds ``tokens``, ``segment_ids``, optionally ``loss_mask`` (the
    positions that count are :func:`training_mask`'s) and (unless ``alpha`` is a
    Python/NumPy 0) the teacher fields of ``kind`` (``FIELDS``):
    ``topk_ids``, ``topk_logprobs`` and, for ``topk_tail_kl``,
    ``tail_logprob`` (plus ``tail_logprob_tempered`` at T != 1); for
    ``sampled_kl`` ``sample_ids``, ``sample_counts``, ``sample_logprobs``
    (drawn at ``proposal_temperature``). ``metrics`` = ``{"kd_loss", "ce_loss", "num_tokens"}``
    (``kd_loss`` is unscaled by alpha, and already includes the T^2 factor).

    ``alpha`` may be a traced scalar (a schedule). When it is 0 the loss and its
    gradient are exactly the CE ones, whatever the teacher fields hold: the KD
    term is then only evaluated for the metric, without gradient (``lax.cond``
    runs one branch). When ``alpha`` is a concrete 0 and the teacher fields are
    absent, ``kd_loss`` is NaN ("not computed").
    """
    if kind not in KINDS:
        raise ValueError(f"unknown distillation loss kind {kind!r}; expected one of {KINDS}")
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if isinstance(alpha, (int, float)) and not 0.0 <= alpha <= 1.0:  # also rejects NaN
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")

    mask = training_mask(batch)
    ce, count = cross_entropy(logits, batch["tokens"], mask)

    needed = FIELDS[kind]
    missing = [k for k in needed if k not in batch]
    try:
        concrete_zero = float(alpha) == 0.0
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
        concrete_zero = False  # traced alpha (a schedule under jit)
    if missing:
        if not concrete_zero:
            raise KeyError(
                f"distill_loss(kind={kind!r}, alpha={alpha!r}) needs batch fields {missing}"
            )
        metrics = {"kd_loss": jnp.float32(jnp.nan), "ce_loss": ce, "num_tokens": count}
        return ce, metrics

    alpha = jnp.asarray(alpha, jnp.float32)

    def ce_only(z):
        kd = _kd(kind, jax.lax.stop_gradient(z), batch, mask, temperature, proposal_temperature)
        return ce, kd

    def mixed(z):
        kd = _kd(kind, z, batch, mask, temperature, proposal_temperature)
        return alpha * kd + (1.0 - alpha) * ce, kd

    loss, kd = jax.lax.cond(alpha == 0.0, ce_only, mixed, logits)
    return loss, {"kd_loss": kd, "ce_loss": ce, "num_tokens": count}


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
