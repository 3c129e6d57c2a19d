"""Divergences beyond forward KL, on the k + 1 bins of a top-k store, over the full vocabulary and from a
sampled store's draws; systematic and hybrid selections and the hybrid loss. Values against float64 NumPy
references, gradients against central differences of those references, estimators against the exact
full-vocabulary divergence over many independent draw sets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logit_distill.errors import InputError
from logit_distill.selection import sample_keys, select_hybrid, select_sampled, select_systematic, select_topk
from logit_distill.train import divergences as D
from logit_distill.train import losses as L

BETA, SKEW = 0.3, 0.2


# ------------------------------------------------------------ numpy references


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_div(name, p, q, beta=BETA, skew=SKEW):
    """D(p || q) of probability vectors, float64, from the definitions."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    on_p, on_q = p > 0, q > 0
    if name == "kl":
        return float(np.sum(p[on_p] * np.log(p[on_p] / q[on_p])))
    if name == "reverse_kl":
        pf = np.maximum(p, np.exp(D.REVERSE_KL_LOGP_FLOOR))
        return float(np.sum(q[on_q] * np.log(q[on_q] / pf[on_q])))
    if name == "jsd":
        m = beta * p + (1 - beta) * q
        return float(beta * np.sum(p[on_p] * np.log(p[on_p] / m[on_p]))
                     + (1 - beta) * np.sum(q[on_q] * np.log(q[on_q] / m[on_q])))
    if name == "skew_kl":
        m = skew * p + (1 - skew) * q
        return float(np.sum(p[on_p] * np.log(p[on_p] / m[on_p])))
    if name == "skew_reverse_kl":
        m = skew * q + (1 - skew) * p
        return float(np.sum(q[on_q] * np.log(q[on_q] / m[on_q])))
    return float(0.5 * np.abs(p - q).sum())


def np_from_draws(name, w, r, beta=BETA, skew=SKEW):
    """The estimators of docs/LOSSES.md, float64: weights w (count / N) and ratios r = q(v) / p(v)."""
    w, r = np.asarray(w, np.float64), np.asarray(r, np.float64)
    if name == "kl":
        return float(np.sum(w * -np.log(r)))
    if name == "skew_kl":
        return float(np.sum(w * -np.log(skew + (1 - skew) * r)))
    if name == "skew_reverse_kl":
        return float(-np.log(skew) + np.sum(w * r * np.log(skew * r / (skew * r + 1 - skew))))
    if name == "jsd":
        g = beta * np.log(1 / (beta + (1 - beta) * r)) + (1 - beta) * r * np.log(r / (beta + (1 - beta) * r))
        return float(-(1 - beta) * np.log(1 - beta) + np.sum(w * (g + (1 - beta) * np.log(1 - beta) * r)))
    return float(1 - np.sum(w * np.minimum(1, r)))


def np_grad(f, z, h=1e-6):
    """Central differences of a float64 function of the vector z."""
    z = np.asarray(z, np.float64)
    g = np.zeros_like(z)
    for i in range(z.size):
        e = np.zeros_like(z)
        e[i] = h
        g[i] = (f(z + e) - f(z - e)) / (2 * h)
    return g


def coarse(p, ids):
    """The k + 1 bins of p: its entries at ids, then the rest summed."""
    rest = np.setdiff1d(np.arange(p.size), ids)
    return np.append(p[ids], p[rest].sum())


def np_temper(logits, T):
    return np.exp(np_log_softmax(np.asarray(logits, np.float64) / T))


# ------------------------------------------------------------ test data

Vs, K, LQ = 30, 5, 4


def teacher_and_student(seed, v=Vs, positions=LQ, sharp=2.5):
    rng = np.random.default_rng(seed)
    t = rng.normal(size=(1, positions, v)) * sharp
    z = (rng.normal(size=(1, positions, v)) * 1.5).astype(np.float32)
    return t, z


def per_token_grad(fn, z):
    return np.asarray(jax.jit(jax.grad(lambda zz: fn(zz).sum()))(jnp.asarray(z)))


# ------------------------------------------------------------ exact: full vocabulary and k + 1 bins


def all_divergences(fn):
    """One jitted ``z -> {divergence: (per-token values, d(sum)/dz)}`` over every divergence."""
    return jax.jit(lambda z: {d: (fn(d, z), jax.grad(lambda zz: fn(d, zz).sum())(z)) for d in D.DIVERGENCES})


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_full_vocabulary_divergences_value_and_gradient(T):
    t, z = teacher_and_student(1)
    got = all_divergences(lambda d, zz: L.full_divergence_per_token(zz, t, divergence=d, temperature=T,
                                                                       beta=BETA, skew=SKEW))(z)
    for name, (value, grad) in got.items():
        for j in range(LQ):
            ref = lambda zz: T * T * np_div(name, np_temper(t[0, j], T), np_temper(zz, T))  # noqa: E731
            np.testing.assert_allclose(value[0, j], ref(z[0, j]), rtol=2e-5, atol=2e-6, err_msg=name)
            np.testing.assert_allclose(grad[0, j], np_grad(ref, z[0, j]), rtol=2e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_topk_tail_divergences_are_exact_on_the_bins(T):
    t, z = teacher_and_student(2)
    sel = {k: np.asarray(v) for k, v in select_topk(jnp.asarray(t), K, (T,)).items()}
    tempered = None if T == 1.0 else sel["tail_logprob_tempered"][..., 0]
    got = all_divergences(lambda d, zz: L.topk_tail_divergence_per_token(
        zz, sel["topk_ids"], sel["topk_logprobs"], sel["tail_logprob"], divergence=d, temperature=T,
        tempered_tail=tempered, beta=BETA, skew=SKEW))(z)
    for name, (value, grad) in got.items():
        for j in range(LQ):
            ids = sel["topk_ids"][0, j]
            P = coarse(np_temper(t[0, j], T), ids)  # the tempered teacher's bins, from its full distribution
            ref = lambda zz: T * T * np_div(name, P, coarse(np_temper(zz, T), ids))  # noqa: E731
            np.testing.assert_allclose(value[0, j], ref(z[0, j]), rtol=1e-4, atol=2e-6, err_msg=name)
            np.testing.assert_allclose(grad[0, j], np_grad(ref, z[0, j]), rtol=1e-3, atol=3e-5, err_msg=name)
            # data processing: the bins never see more than the full vocabulary
            assert value[0, j] <= T * T * np_div(name, np_temper(t[0, j], T), np_temper(z[0, j], T)) + 1e-5


def test_divergences_are_zero_at_the_teacher_and_finite_with_an_empty_tail():
    t, _ = teacher_and_student(3)
    sel = select_topk(jnp.asarray(t), K)
    same = all_divergences(lambda d, zz: L.topk_tail_divergence_per_token(
        zz, sel["topk_ids"], sel["topk_logprobs"], sel["tail_logprob"], divergence=d))(jnp.asarray(t + 4.0))
    for name, (value, _) in same.items():
        assert np.abs(np.asarray(value)).max() < 1e-5, name
    # k = V: the teacher's tail is -inf (probability 0) and so is the student's; one teacher id at -inf too.
    t6, z6 = teacher_and_student(4, v=6)
    sel = {k: np.array(v) for k, v in select_topk(jnp.asarray(t6), 6).items()}
    sel["topk_logprobs"][..., -1] = -np.inf
    got = all_divergences(lambda d, zz: L.topk_tail_divergence_per_token(
        zz, sel["topk_ids"], sel["topk_logprobs"], sel["tail_logprob"], divergence=d, beta=BETA, skew=SKEW))(z6)
    for name, (value, grad) in got.items():
        assert np.all(np.isfinite(np.asarray(value))) and np.all(np.isfinite(np.asarray(grad))), name


def test_parameters_are_checked():
    t, z = teacher_and_student(5)
    for name, kw in (("jsd", {"beta": 0.0}), ("jsd", {"beta": 1.0}), ("skew_kl", {"skew": 1.5}),
                     ("skew_reverse_kl", {"skew": float("nan")}), ("hellinger", {})):
        with pytest.raises(InputError):
            L.full_divergence_per_token(z, t, divergence=name, **kw)


# ------------------------------------------------------------ from draws


def draws(t, n, seed, count):
    """``count`` independent sample sets of n draws of one position's teacher ``t`` [V]."""
    many = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (count, 1, t.shape[-1]))
    out = select_sampled(many, n, sample_keys(seed, jnp.arange(count), 1))
    return {k: np.asarray(v) for k, v in out.items()}


def estimators(fn):
    """One jitted ``z -> {divergence: (per-token estimates, d(sum)/dz)}`` over the estimators from draws."""
    return jax.jit(lambda z: {d: (fn(d, z), jax.grad(lambda zz: fn(d, zz).sum())(z)) for d in D.FROM_DRAWS})


def test_estimators_from_draws_match_their_formula():
    t, z = teacher_and_student(6)
    out = select_sampled(jnp.asarray(t), 8, sample_keys(3, jnp.array([0]), LQ))
    ids, counts, lp = (np.asarray(out[k]) for k in ("sample_ids", "sample_counts", "sample_logprobs"))
    got = estimators(lambda d, zz: L.sampled_divergence_per_token(zz, ids, counts, lp, divergence=d,
                                                                  beta=BETA, skew=SKEW))(z)
    for name, (value, grad) in got.items():
        for j in range(LQ):
            u = counts[0, j] > 0
            w = counts[0, j][u] / counts[0, j].sum()

            def ref(zz):
                r = np.exp(np_log_softmax(zz)[ids[0, j][u]] - lp[0, j][u].astype(np.float64))
                return np_from_draws(name, w, r)

            np.testing.assert_allclose(value[0, j], ref(z[0, j]), rtol=2e-5, atol=3e-6, err_msg=name)
            np.testing.assert_allclose(grad[0, j], np_grad(ref, z[0, j]), rtol=1e-3, atol=3e-5, err_msg=name)


def test_estimators_from_draws_are_unbiased_in_value_and_gradient():
    rng = np.random.default_rng(7)
    V, N, M = 16, 8, 2000
    t = rng.normal(size=(V,)) * 1.5
    z = (rng.normal(size=(V,)) * 1.5).astype(np.float32)
    out = draws(t, N, 11, M)
    got = estimators(lambda d, zz: L.sampled_divergence_per_token(
        zz, out["sample_ids"], out["sample_counts"], out["sample_logprobs"], divergence=d, beta=BETA,
        skew=SKEW))(jnp.broadcast_to(jnp.asarray(z), (M, 1, V)))
    p = np.exp(np_log_softmax(t))
    for name, (value, grad) in got.items():
        vals, g = np.asarray(value)[:, 0], np.asarray(grad)[:, 0]
        exact = lambda zz: np_div(name, p, np.exp(np_log_softmax(zz)))  # noqa: E731
        se = vals.std(ddof=1) / np.sqrt(M)
        assert abs(vals.mean() - exact(z)) <= 4 * se + 1e-6, (name, vals.mean(), exact(z), se)
        g_se = g.std(0, ddof=1) / np.sqrt(M)
        assert np.all(np.abs(g.mean(0) - np_grad(exact, z)) <= 4 * g_se + 1e-6), name


def test_reverse_kl_and_tempered_divergences_from_draws_are_refused():
    t, z = teacher_and_student(8)
    out = select_sampled(jnp.asarray(t, jnp.float32), 8, sample_keys(0, jnp.array([0]), LQ))
    args = (z, out["sample_ids"], out["sample_counts"], out["sample_logprobs"])
    with pytest.raises(InputError, match="reverse KL has no usable estimator"):
        L.sampled_divergence_per_token(*args, divergence="reverse_kl")
    with pytest.raises(InputError, match="reverse KL"):
        L.distill_loss(z, {"tokens": np.zeros((1, LQ), np.int32), "segment_ids": np.ones((1, LQ), np.int32)},
                       kind="sampled_reverse_kl")
    for T, t_ in ((2.0, 2.0), (2.0, 1.0), (1.0, 2.0)):
        with pytest.raises(InputError, match="temperature 1"):
            L.sampled_divergence_per_token(*args, divergence="jsd", temperature=T, proposal_temperature=t_)


# ------------------------------------------------------------ systematic and hybrid selections


def test_systematic_counts_are_unbiased_with_low_variance():
    rng = np.random.default_rng(9)
    V, N, M = 40, 16, 2000
    t = rng.normal(size=(V,)) * 2.0
    p = np.exp(np_log_softmax(t))
    many = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (M, 1, V))
    keys = sample_keys(2, jnp.arange(M), 1)
    sys_ = {k: np.asarray(v)[:, 0] for k, v in select_systematic(many, N, keys).items()}
    mult = {k: np.asarray(v)[:, 0] for k, v in select_sampled(many, N, keys).items()}
    assert (sys_["sample_counts"].sum(-1) == N).all()
    used = sys_["sample_counts"] > 0
    assert all((np.diff(sys_["sample_ids"][i][used[i]]) > 0).all() for i in range(100))
    np.testing.assert_allclose(sys_["sample_logprobs"][used], np.log(p)[sys_["sample_ids"][used]], atol=1e-5)
    np.testing.assert_allclose(sys_["tail_plogp"], (p * np.log(p)).sum(), atol=1e-5)

    def freq(rec):  # [M, V] count / N
        f = np.zeros((M, V))
        for i in range(M):
            u = rec["sample_counts"][i] > 0
            f[i, rec["sample_ids"][i][u]] = rec["sample_counts"][i][u] / N
        return f

    fs, fm = freq(sys_), freq(mult)
    se = fs.std(0, ddof=1) / np.sqrt(M)
    assert np.all(np.abs(fs.mean(0) - p) <= 4 * se + 1e-4)
    # each count is floor(N p) or ceil(N p); its variance at most 1/4 (vs N p (1 - p) for independent draws)
    assert np.all(np.abs(fs * N - N * p) < 1 + 1e-4)
    assert (fs * N).var(0).max() <= 0.25 + 0.02 and (fm * N).var(0).sum() > 3 * (fs * N).var(0).sum()
    # an id of p < 1/N is drawn with probability N p (independent draws: 1 - (1 - p)^N, less)
    distinct = used.sum(-1)
    assert abs(distinct.mean() - np.minimum(1, N * p).sum()) <= 4 * distinct.std() / np.sqrt(M)


def np_hybrid_kl(z, t, sel, j, T=1.0, plogp=False):
    """float64 reference of hybrid_kl at one position: p_hat (exact head + m_T * count / N) against q_T."""
    ids, counts = sel["sample_ids"][0, j], sel["sample_counts"][0, j]
    u = counts > 0
    pT = np_temper(t, T)
    head = sel["topk_ids"][0, j]
    m = 1.0 - pT[head].sum()
    lq = np.log(np_temper(z, T))
    value = float(np.sum(pT[head] * (np.log(pT[head]) - lq[head])))
    w = m * counts[u] / counts.sum()
    tail = np.setdiff1d(np.arange(t.size), head)
    if plogp:
        return T * T * (value + float((pT[tail] * np.log(pT[tail])).sum()) - float(np.sum(w * lq[ids[u]])))
    return T * T * (value + float(np.sum(w * (np.log(pT[ids[u]]) - lq[ids[u]]))))


@pytest.mark.parametrize("T", [1.0, 2.0])
def test_hybrid_kl_matches_float64_reference(T):
    t, z = teacher_and_student(10)
    keys = sample_keys(4, jnp.array([0]), LQ)
    sel = {k: np.asarray(v) for k, v in
           select_hybrid(jnp.asarray(t), K, 12, keys, proposal_temperature=T).items()}
    for j in range(LQ):  # the draws come from the tail only
        drawn = sel["sample_ids"][0, j][sel["sample_counts"][0, j] > 0]
        assert not np.isin(drawn, sel["topk_ids"][0, j]).any()

    def fn(plogp, zz):  # the record with the draws' log-probs, or with the tail's sum p log p instead
        return L.hybrid_kl_per_token(
            zz, sel["topk_ids"], sel["topk_logprobs"], sel["tail_logprob"], sel["sample_ids"], sel["sample_counts"],
            None if plogp else sel["sample_logprobs"], tail_plogp=sel["tail_plogp"] if plogp else None,
            temperature=T, proposal_temperature=T, tempered_tail=None if T == 1.0 else sel["tail_logprob_tempered"][..., 0])

    both = jax.jit(lambda zz: {p: (fn(p, zz), jax.grad(lambda y: fn(p, y).sum())(zz)) for p in (False, True)})(z)
    for plogp, (value, grad) in both.items():
        for j in range(LQ):
            ref = lambda zz: np_hybrid_kl(zz, t[0, j], sel, j, T, plogp)  # noqa: E731
            np.testing.assert_allclose(value[0, j], ref(z[0, j]), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(grad[0, j], np_grad(ref, z[0, j]), rtol=1e-3, atol=3e-5)


def test_hybrid_kl_is_unbiased_and_its_noise_is_only_in_the_tail():
    rng = np.random.default_rng(12)
    V, k, N, M = 24, 4, 8, 2000
    t = rng.normal(size=(V,)) * 2.0
    z = (rng.normal(size=(V,)) * 1.5).astype(np.float32)
    many = jnp.broadcast_to(jnp.asarray(t, jnp.float32), (M, 1, V))
    sel = select_hybrid(many, k, N, sample_keys(5, jnp.arange(M), 1))
    zs = jnp.broadcast_to(jnp.asarray(z), (M, 1, V))
    fn = lambda zz: L.hybrid_kl_per_token(zz, sel["topk_ids"], sel["topk_logprobs"], sel["tail_logprob"],  # noqa
                                          sel["sample_ids"], sel["sample_counts"], sel["sample_logprobs"])
    vals = np.asarray(jax.jit(fn)(zs))[:, 0]
    g = np.asarray(jax.jit(jax.grad(lambda zz: fn(zz).sum()))(zs))[:, 0]
    p, q = np.exp(np_log_softmax(t)), np.exp(np_log_softmax(z))
    se = vals.std(ddof=1) / np.sqrt(M)
    assert abs(vals.mean() - np_div("kl", p, q)) <= 4 * se + 1e-6
    g_se = g.std(0, ddof=1) / np.sqrt(M)
    assert np.all(np.abs(g.mean(0) - (q - p)) <= 4 * g_se + 2e-5)  # 2e-5: float32 rounding of the head
    head = np.asarray(sel["topk_ids"])[0, 0]
    assert np.all(g.std(0)[head] < 1e-5)  # the head's gradient is exact


def test_hybrid_without_head_is_the_sampled_loss():
    t, z = teacher_and_student(13)
    keys = sample_keys(6, jnp.array([0]), LQ)
    sel = select_systematic(jnp.asarray(t, jnp.float32), 16, keys)
    empty = jnp.zeros((1, LQ, 0))
    h = lambda zz: L.hybrid_kl_per_token(zz, empty.astype(jnp.int32), empty, jnp.zeros((1, LQ)),  # noqa: E731
                                         sel["sample_ids"], sel["sample_counts"], tail_plogp=sel["tail_plogp"])
    s = lambda zz: L.sampled_kl_per_token(zz, sel["sample_ids"], sel["sample_counts"],  # noqa: E731
                                          sel["sample_logprobs"])
    np.testing.assert_allclose(per_token_grad(h, z), per_token_grad(s, z), atol=1e-6)
    p, logq = np.exp(np_log_softmax(t[0])), np_log_softmax(z[0])
    c = np.asarray(sel["sample_counts"][0])
    want = [(p[j] * np.log(p[j])).sum() - (c[j] / 16 * logq[j][np.asarray(sel["sample_ids"][0, j])]).sum()
            for j in range(LQ)]
    np.testing.assert_allclose(np.asarray(h(z))[0], want, rtol=1e-5, atol=1e-5)
