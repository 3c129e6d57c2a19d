"""Teacher-relative evaluation measures against float64 NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from logit_distill.selection import sample_keys, select_sampled, select_topk
from logit_distill.train import teacher_metrics as M
from logit_distill.train.losses import next_token_mask

V, K = 40, 6
SEG = np.array([[1, 1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1]], np.int32)


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_kl(p, q):
    on = p > 0
    return float(np.sum(p[on] * np.log(p[on] / q[on])))


def data(seed=0):
    rng = np.random.default_rng(seed)
    t = rng.normal(size=SEG.shape + (V,)) * 2.5
    z = (t + rng.normal(size=t.shape) * 1.5).astype(np.float32)  # a student near the teacher
    return t.astype(np.float32), z


def test_online_measures_match_numpy():
    t, z = data(1)
    got = {k: np.asarray(v) for k, v in jax.jit(M.per_position, static_argnames="k")(z, {"teacher_logits": t}, k=K).items()}
    assert set(got) == {"kl", "top1_agreement", "topk_mass", "tail_shape_kl"}
    for b, j in np.ndindex(SEG.shape):
        p, q = np.exp(np_log_softmax(t[b, j])), np.exp(np_log_softmax(z[b, j]))
        top = np.argsort(-p, kind="stable")[:K]
        rest = np.setdiff1d(np.arange(V), top)
        np.testing.assert_allclose(got["kl"][b, j], np_kl(p, q), rtol=1e-5, atol=1e-6)
        assert got["top1_agreement"][b, j] == float(np.argmax(p) == np.argmax(q))
        np.testing.assert_allclose(got["topk_mass"][b, j], q[top].sum(), rtol=1e-5)
        want = np_kl(p[rest] / p[rest].sum(), q[rest] / q[rest].sum())
        np.testing.assert_allclose(got["tail_shape_kl"][b, j], want, rtol=1e-4, atol=1e-6)
    assert 0 < got["top1_agreement"].mean() < 1  # both outcomes occur in this data


def test_store_measures_match_numpy_and_bound_the_full_kl():
    t, z = data(2)
    sel = {k: np.asarray(v) for k, v in jax.jit(select_topk, static_argnums=1)(jnp.asarray(t), K).items()}
    got = {k: np.asarray(v) for k, v in jax.jit(M.per_position)(z, sel).items()}
    full = np.asarray(jax.jit(M.kl)(t, z))
    for b, j in np.ndindex(SEG.shape):
        p, q = np.exp(np_log_softmax(t[b, j])), np.exp(np_log_softmax(z[b, j]))
        ids = sel["topk_ids"][b, j]
        rest = np.setdiff1d(np.arange(V), ids)
        want = np_kl(np.append(p[ids], p[rest].sum()), np.append(q[ids], q[rest].sum()))
        np.testing.assert_allclose(got["kl_bins"][b, j], want, rtol=1e-4, atol=1e-6)
        assert got["kl_bins"][b, j] <= full[b, j] + 1e-6
        assert got["top1_agreement"][b, j] == float(np.argmax(p) == np.argmax(q))
        np.testing.assert_allclose(got["topk_mass"][b, j], q[ids].sum(), rtol=1e-5)
    # a sampled record (draws at t = 1): the importance-weighted estimate, sum (c / N) log(p / q)
    out = {k: np.asarray(v) for k, v in jax.jit(select_sampled, static_argnums=1)(
        jnp.asarray(t), 8, sample_keys(0, jnp.array([0, 1]), 7)).items()}
    est = np.asarray(jax.jit(M.per_position)(z, out)["kl_draws"])
    for b, j in np.ndindex(SEG.shape):
        u = out["sample_counts"][b, j] > 0
        lq = np_log_softmax(z[b, j])[out["sample_ids"][b, j][u]]
        want = np.sum(out["sample_counts"][b, j][u] / 8 * (out["sample_logprobs"][b, j][u] - lq))
        np.testing.assert_allclose(est[b, j], want, rtol=1e-5, atol=1e-6)


def test_sums_and_means_follow_the_next_token_mask():
    t, z = data(3)
    values = jax.jit(M.per_position, static_argnames="k")(z, {"teacher_logits": t}, k=K)
    total = {k: np.asarray(v) for k, v in M.sums(values, next_token_mask(SEG)).items()}
    mask = np.zeros(SEG.shape, bool)
    mask[0, [0, 1, 2, 4]] = True  # row 0: doc 1's last token (3), doc 2's (5) and padding are out
    mask[1, :6] = True
    assert int(total["count"]) == mask.sum()
    out = M.means(total)
    for k, v in values.items():
        np.testing.assert_allclose(out[k], np.asarray(v)[mask].mean(), rtol=1e-5)
