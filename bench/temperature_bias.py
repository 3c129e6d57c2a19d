"""``python -m bench.temperature_bias``: how biased ``sampled_kl`` is when the training temperature T differs
from the store's proposal temperature t (self-normalised importance weights), and how biased its value (the
``kd_loss`` metric) is at T = t != 1 (log Z_T from the draws). Figures quoted in docs/LOSSES.md.

For a teacher p and a student q (random logits; the student the teacher's logits plus noise, so that
KL(p_T || q_T) is what a student part-way through training has), M independent sets of N draws from
p_t give M gradients of ``sampled_kl``; against the exact KD gradient ``g = T (q_T - p_T)``:

    relative bias   = || mean of the M gradients - g || / || g ||
    noise floor     = || their standard errors || / || g ||    (a bias below it is not resolved)

and the value's bias ``mean(kd_loss) - T^2 KL(p_T || q_T)`` with its standard error.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def measure(V: int, sigma: float, noise: float, N: int, T: float, t: float, M: int = 4000, seed: int = 0) -> dict:
    import jax
    import jax.numpy as jnp

    from logit_distill.selection import sample_keys, select_sampled
    from logit_distill.train.losses import sampled_kl_per_token

    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(V,)) * sigma
    student = teacher + rng.normal(size=(V,)) * noise
    out = select_sampled(jnp.broadcast_to(jnp.asarray(teacher, jnp.float32), (M, 1, V)), N,
                         sample_keys(seed + 1, jnp.arange(M), 1), proposal_temperature=t)
    z = jnp.broadcast_to(jnp.asarray(student, jnp.float32), (M, 1, V))

    def per(zz):
        return sampled_kl_per_token(zz, out["sample_ids"], out["sample_counts"], out["sample_logprobs"],
                                    temperature=T, proposal_temperature=t, allow_biased_temperature=True)

    values, grads = jax.jit(lambda zz: (per(zz)[:, 0], jax.grad(lambda y: per(y).sum())(zz)[:, 0]))(z)
    values, grads = np.asarray(values, np.float64), np.asarray(grads, np.float64)

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    pT, qT = softmax(teacher / T), softmax(student / T)
    g = T * (qT - pT)
    kl = T * T * float(np.sum(pT * (np.log(pT) - np.log(qT))))
    mean, se = grads.mean(0), grads.std(0, ddof=1) / np.sqrt(M)
    return {"V": V, "N": N, "T": T, "t": t, "teacher_entropy": float(-(softmax(teacher) * np.log(softmax(teacher))).sum()),
            "kl_T": kl, "relative_gradient_bias": float(np.linalg.norm(mean - g) / np.linalg.norm(g)),
            "noise_floor": float(np.linalg.norm(se) / np.linalg.norm(g)),
            "value_bias": float(values.mean() - kl), "value_bias_se": float(values.std(ddof=1) / np.sqrt(M))}


def main() -> int:
    rows = []
    for V, sigma, noise in ((64, 1.5, 0.7), (4096, 3.3, 1.0)):
        for T, t in ((2.0, 1.0), (1.0, 2.0), (2.0, 2.0), (1.0, 1.0)):
            for N in (4, 16, 32, 64):
                r = measure(V, sigma, noise, N, T, t)
                rows.append(r)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
