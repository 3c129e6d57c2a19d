"""Divergences D(p || q) between a teacher distribution p and a student distribution q
(definitions: docs/LOSSES.md, "Divergences").

Two forms, both pure ``jax.numpy`` over the last axis:

- :func:`exact`: p and q given as log-probabilities over the same bins (the full
  vocabulary, or the k + 1 bins of a top-k store). Every divergence here is an
  f-divergence, so on the k + 1 bins it is a lower bound of its full-vocabulary
  value (data processing).
- :func:`from_draws`: p known only through draws ``v ~ p`` (a sampled store at
  T = 1), with the teacher's log-prob ``log p(v)`` of each. Each estimate is
  ``c + E_{v~p}[h(q(v) / p(v))]`` for a function h that grows at most
  logarithmically, so it is unbiased (in value and gradient: the draws do not
  depend on the student) with a variance that mass the student puts on tokens
  the teacher rarely emits cannot blow up. ``E_p[q / p] = 1`` over the whole
  vocabulary is what lets the linear part of a divergence be taken exactly (a
  control variate). Reverse KL has no such form (its integrand grows like
  ``r log r``): it is refused here.

Written by hand: Optax has dense KL and cross-entropy only; these divergences
(generalized JSD as in GKD, Agarwal et al. 2024; skew KL as in DistiLLM, Ko et
al. 2024; total variation) need the 0 * log 0 convention with -inf bins, and
the estimators from draws exist nowhere we know of.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..errors import InputError

DIVERGENCES = ("kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tv")
# The divergences with an estimator from teacher draws (all but reverse KL).
FROM_DRAWS = ("kl", "jsd", "skew_kl", "skew_reverse_kl", "tv")
# A teacher bin of probability exactly 0 (an empty tail) counts as this log-prob in reverse KL, whose
# student-weighted term would otherwise be +inf for any student: the default codec's floor.
REVERSE_KL_LOGP_FLOOR = -64.0

NO_REVERSE_KL_FROM_DRAWS = (
    "reverse KL has no usable estimator from the teacher's draws: its importance-weighted form "
    "E_p[(q/p) log(q/p)] grows faster than linearly in q/p, so the student's mass on tokens the teacher "
    "rarely emits is invisible in any store of finite size; use skew_reverse_kl (mode-seeking, with a "
    "bounded estimator), jsd, or a top-k store"
)


def check_parameters(divergence: str, *, beta=0.5, skew=0.1) -> None:
    """``InputError`` for an unknown divergence or a concrete ``beta``/``skew`` outside (0, 1)."""
    if divergence not in DIVERGENCES:
        raise InputError(f"unknown divergence {divergence!r}; choose one of {', '.join(DIVERGENCES)}")
    for name, value, used in (("beta", beta, divergence == "jsd"),
                              ("skew", skew, divergence.startswith("skew"))):
        if used and isinstance(value, (int, float)) and not 0.0 < value < 1.0:  # also rejects NaN
            raise InputError(f"{divergence}: {name} must be in (0, 1), got {value!r}")


def _mix(log_a, log_b, weight_a):
    """``log(w a + (1 - w) b)`` from ``log a``, ``log b``; finite inputs where both are -inf (so no
    NaN reaches a gradient through ``logaddexp``), -inf out there."""
    both = (log_a == -jnp.inf) & (log_b == -jnp.inf)
    la = jnp.where(both, 0.0, log_a)
    lb = jnp.where(both, 0.0, log_b)
    w = jnp.asarray(weight_a, jnp.float32)
    out = jnp.logaddexp(jnp.log(w) + la, jnp.log1p(-w) + lb)
    return jnp.where(both, -jnp.inf, out)


def _weighted(weight, log_x, log_y):
    """``sum(weight * (log_x - log_y))`` over the last axis with 0 * (anything) = 0 where weight == 0.

    ``weight != 0``, not ``> 0``: a NaN weight (corrupt teacher data) propagates. Double where: the
    discarded branch may be -inf - -inf."""
    on = weight != 0
    diff = jnp.where(on, log_x - log_y, 0.0)
    return jnp.sum(jnp.where(on, weight * diff, 0.0), axis=-1)


def exact(divergence: str, logp, logq, *, beta=0.5, skew=0.1):
    """``D(p || q)`` summed over the last axis, p = exp(logp) (data: no gradient), q = exp(logq).

    Both must be normalised over that axis (log_softmax). Bins of probability 0
    follow ``0 * log 0 = 0``, in value and gradient.

    ``kl``: sum p log(p/q). ``reverse_kl``: sum q log(q/p) (a teacher bin of
    probability 0 counts as ``REVERSE_KL_LOGP_FLOOR``). ``jsd``: beta KL(p || m)
    + (1 - beta) KL(q || m), m = beta p + (1 - beta) q (GKD's generalized JSD;
    0.5: the Jensen-Shannon divergence). ``skew_kl``: KL(p || skew p + (1 - skew) q).
    ``skew_reverse_kl``: KL(q || skew q + (1 - skew) p). ``tv``: sum |p - q| / 2.
    """
    check_parameters(divergence, beta=beta, skew=skew)
    logp = jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
    logq = jnp.asarray(logq, jnp.float32)
    p, q = jnp.exp(logp), jnp.exp(logq)
    if divergence == "kl":
        return _weighted(p, logp, logq)
    if divergence == "reverse_kl":
        return _weighted(q, logq, jnp.maximum(logp, REVERSE_KL_LOGP_FLOOR))
    if divergence == "jsd":
        logm = _mix(logp, logq, beta)
        return beta * _weighted(p, logp, logm) + (1.0 - beta) * _weighted(q, logq, logm)
    if divergence == "skew_kl":
        return _weighted(p, logp, _mix(logp, logq, skew))
    if divergence == "skew_reverse_kl":
        return _weighted(q, logq, _mix(logq, logp, skew))
    return 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)  # tv


def from_draws(divergence: str, weights, log_ratio, *, beta=0.5, skew=0.1):
    """Unbiased estimate of ``D(p || q)`` from draws of p: over the last axis (the draws' distinct
    ids), ``weights`` (count / N; 0 in unused slots) and ``log_ratio = log q(v) - log p(v)``.

    Per divergence (r = q(v) / p(v), E over v ~ p)::

        kl               E[-log r]
        skew_kl          E[-log(skew + (1 - skew) r)]
        skew_reverse_kl  -log(skew) + E[-r softplus(log((1 - skew) / skew) - log r)]
        jsd              -(1 - beta) log(1 - beta) + E[-beta log(beta + (1 - beta) r)
                                                    - (1 - beta) r softplus(log(beta / (1 - beta)) - log r)]
        tv               1 - E[min(1, r)]

    (the constant is each divergence's linear part, ``a E_p[r] = a``, taken
    exactly). Each integrand is bounded above and falls at most like ``log r``.
    ``reverse_kl`` raises ``InputError`` (``NO_REVERSE_KL_FROM_DRAWS``).
    """
    if divergence == "reverse_kl":
        raise InputError(NO_REVERSE_KL_FROM_DRAWS)
    check_parameters(divergence, beta=beta, skew=skew)
    w = jax.lax.stop_gradient(jnp.asarray(weights, jnp.float32))
    used = w != 0
    logr = jnp.where(used, jnp.asarray(log_ratio, jnp.float32), 0.0)
    r = jnp.exp(logr)
    if divergence == "kl":
        h, const = -logr, 0.0
    elif divergence == "skew_kl":
        h, const = -_mix(jnp.zeros_like(logr), logr, skew), 0.0
    elif divergence == "skew_reverse_kl":
        h = -r * jax.nn.softplus(jnp.log((1.0 - skew) / skew) - logr)
        const = -jnp.log(jnp.asarray(skew, jnp.float32))
    elif divergence == "jsd":
        h = (-beta * _mix(jnp.zeros_like(logr), logr, beta)
             - (1.0 - beta) * r * jax.nn.softplus(jnp.log(beta / (1.0 - beta)) - logr))
        const = -(1.0 - beta) * jnp.log1p(-jnp.asarray(beta, jnp.float32))
    else:  # tv
        h, const = -jnp.exp(jnp.minimum(logr, 0.0)), 1.0
    return const + jnp.sum(jnp.where(used, w * h, 0.0), axis=-1)
