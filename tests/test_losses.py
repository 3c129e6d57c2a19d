"""Distillation losses and schedules against independent float64 NumPy references."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logit_distill.errors import InputError
from logit_distill.train import losses as L
from logit_distill.train import schedules as S

V, K = 37, 5

# Packed rows: several documents, a one-token document, padding, a full row.
SEGMENTS = np.array(
    [
        [1, 1, 1, 1, 2, 2, 2, 3, 3, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        [1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 0, 0],
    ],
    dtype=np.int32,
)


# ------------------------------------------------------------ numpy references


def np_mask(seg):
    b, l = seg.shape
    m = np.zeros((b, l), bool)
    for i in range(b):
        for j in range(l - 1):
            m[i, j] = seg[i, j] != 0 and seg[i, j + 1] == seg[i, j]
    return m


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    mx = np.max(x)
    return x - (mx + math.log(np.sum(np.exp(x - mx))))


def np_kl(p, q):
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)


def np_topk_kl(logits, ids, lp, mask, T):
    vals = []
    for b, j in zip(*np.nonzero(mask)):
        p = np.exp(np_log_softmax(lp[b, j].astype(np.float64) / T))
        q = np.exp(np_log_softmax(logits[b, j, ids[b, j]].astype(np.float64) / T))
        vals.append(T * T * np_kl(p, q))
    return np.mean(vals) if vals else 0.0


def np_temper(bins, T):
    """Tempered distribution over bins with probabilities ``bins``: ∝ bins**(1/T)."""
    w = np.array([b ** (1.0 / T) if b > 0 else 0.0 for b in bins])
    return w / w.sum()


def np_topk_tail_kl(logits, ids, lp, tail, mask, T, tempered=None):
    """T^2 KL over the k + 1 bins: the teacher's (at T != 1: its top-k tempered and sharing 1 - m_T,
    m_T = exp(tempered) its tempered tail mass) against the student's tempered distribution's bins."""
    vals = []
    for b, j in zip(*np.nonzero(mask)):
        if T == 1.0:
            pt = np.append(np.exp(lp[b, j].astype(np.float64)), math.exp(float(tail[b, j])))
            pt = pt / pt.sum()
        else:
            m = math.exp(float(tempered[b, j]))
            pt = np.append(np_temper(np.exp(lp[b, j].astype(np.float64)), T) * (1 - m), m)
        full = np.exp(np_log_softmax(logits[b, j].astype(np.float64) / T))
        qk = full[ids[b, j]]
        rest = np.delete(full, ids[b, j]).sum()  # mass outside the k ids, summed directly
        vals.append(T * T * np_kl(pt, list(qk) + [rest]))
    return np.mean(vals) if vals else 0.0


def np_sampled_kl(logits, ids, counts, lp, mask, T, t=1.0):
    """Self-normalized importance-weighted KL estimate (docs/LOSSES.md, sampled_kl)."""
    vals = []
    for b, j in zip(*np.nonzero(mask)):
        u = counts[b, j] > 0
        c, l = counts[b, j][u].astype(np.float64), lp[b, j][u].astype(np.float64)
        w = c * np.exp((1 / T - 1 / t) * l)
        log_z = math.log(w.sum() / (c * np.exp((1 - 1 / t) * l)).sum())
        w = w / w.sum()
        log_q = np_log_softmax(logits[b, j].astype(np.float64) / T)[ids[b, j][u]]
        vals.append(T * T * float((w * (l / T - log_z - log_q)).sum()))
    return np.mean(vals) if vals else 0.0


def np_ce(logits, tokens, mask):
    vals = [-np_log_softmax(logits[b, j])[tokens[b, j + 1]] for b, j in zip(*np.nonzero(mask))]
    return np.mean(vals) if vals else 0.0


# -------------------------------------------------------- jitted entry points
# Jitted once per kind (alpha, temperature traced): eager op-by-op dispatch
# would make these tests several times slower.


@functools.lru_cache(maxsize=None)
def _jit_vg(kind, T, allow):
    return jax.jit(
        jax.value_and_grad(
            lambda z, b, a: L.distill_loss(z, b, kind=kind, alpha=a, temperature=T, allow_biased_temperature=allow),
            has_aux=True,
        )
    )


def jit_vg(kind):
    """jitted ``(z, batch, alpha, T) -> ((loss, metrics), dloss/dz)``; T is static (a Python number, as
    training passes it), alpha traced. A sampled loss at T != t (the draws here are at t = 1) is
    allowed: these tests are about values and masking; the refusal has its own test."""
    return lambda z, b, a, t: _jit_vg(kind, float(t), True)(z, b, a)


def jit_loss(kind):
    return lambda z, b, a, t: jit_vg(kind)(z, b, a, t)[0]


def jit_grad(kind):
    return lambda z, b, a, t: jit_vg(kind)(z, b, a, t)[1]


topk_kl = jax.jit(L.topk_kl)  # temperature (a keyword) is traced: one compile per shape
# T static: at T != 1 the tempered tail is required, which needs a concrete T to check
topk_tail_kl = jax.jit(L.topk_tail_kl, static_argnames=("temperature",))
cross_entropy = jax.jit(L.cross_entropy)
topk_kl_per_token = jax.jit(L.topk_kl_per_token)
topk_tail_kl_per_token = jax.jit(L.topk_tail_kl_per_token, static_argnames=("temperature",))


# ---------------------------------------------------------------- test data


def make_batch(seed=0, segments=SEGMENTS, v=V, k=K, sharp=3.0):
    """A teacher with a full distribution over V, stored as top-k + tail, and a student."""
    rng = np.random.default_rng(seed)
    b, l = segments.shape
    teacher_logits = rng.normal(size=(b, l, v)) * sharp
    full_lp = np.stack(
        [np.stack([np_log_softmax(teacher_logits[i, j]) for j in range(l)]) for i in range(b)]
    )
    ids = np.argsort(-full_lp, axis=-1)[..., :k]
    lp = np.take_along_axis(full_lp, ids, axis=-1)
    with np.errstate(divide="ignore"):  # k == V: no tail, log(0) = -inf
        tail = np.log1p(-np.minimum(np.exp(lp).sum(-1), 1.0))
    batch = {
        "tokens": rng.integers(0, v, size=(b, l)).astype(np.int32),
        "segment_ids": segments.astype(np.int32),
        "positions": np.zeros((b, l), np.int32),
        "topk_ids": ids.astype(np.int32),
        "topk_logprobs": lp.astype(np.float32),
        "tail_logprob": tail.astype(np.float32),
    }
    # N = 8 draws per position from the teacher: distinct ids ascending first, then empty slots.
    n = 8
    sids, scounts, slp = (np.zeros((b, l, n), dt) for dt in (np.int32, np.int32, np.float32))
    for i in range(b):
        for j in range(l):
            u, c = np.unique(rng.choice(v, size=n, p=np.exp(full_lp[i, j]) / np.exp(full_lp[i, j]).sum()),
                             return_counts=True)
            sids[i, j, :u.size], scounts[i, j, :u.size], slp[i, j, :u.size] = u, c, full_lp[i, j, u]
    batch.update(sample_ids=sids, sample_counts=scounts, sample_logprobs=slp)
    student = (rng.normal(size=(b, l, v)) * 2.0).astype(np.float32)
    # Every batch has the same fields (so the jitted losses compile once): the tail tempered at T = 2
    # (tests at another T replace it) and the full teacher.
    batch = {**tempered(batch, full_lp, 2.0), "teacher_logits": full_lp.astype(np.float32)}
    return batch, student, full_lp


def tempered(batch, full_lp, T):
    """``batch`` with ``tail_logprob_tempered`` at T (float64 from the teacher's full distribution):
    log of the mass outside the top-k ids of the teacher tempered at T (T = 1: the tail itself)."""
    if T == 1.0:
        return {**batch, "tail_logprob_tempered": batch["tail_logprob"]}
    lt = full_lp / T
    lt = lt - np.log(np.exp(lt).sum(-1, keepdims=True))
    outside = np.ones(full_lp.shape, bool)
    np.put_along_axis(outside, batch["topk_ids"], False, axis=-1)
    with np.errstate(divide="ignore"):  # k == V: no tail
        tail_t = np.log(np.where(outside, np.exp(lt), 0.0).sum(-1))
    return {**batch, "tail_logprob_tempered": tail_t.astype(np.float32)}


def poison_masked(batch):
    """Garbage teacher fields wherever the mask is off (padding and document ends)."""
    m = np_mask(batch["segment_ids"])
    out = dict(batch)
    out["topk_ids"] = np.where(m[..., None], batch["topk_ids"], 10**6).astype(np.int32)
    out["topk_logprobs"] = np.where(m[..., None], batch["topk_logprobs"], np.nan).astype(np.float32)
    out["tail_logprob"] = np.where(m, batch["tail_logprob"], np.nan).astype(np.float32)
    if "tail_logprob_tempered" in batch:
        out["tail_logprob_tempered"] = np.where(m, batch["tail_logprob_tempered"], np.nan).astype(np.float32)
    if "teacher_logits" in batch:
        out["teacher_logits"] = np.where(m[..., None], batch["teacher_logits"], np.nan).astype(np.float32)
    out["sample_ids"] = np.where(m[..., None], batch["sample_ids"], 10**6).astype(np.int32)
    out["sample_counts"] = np.where(m[..., None], batch["sample_counts"], 0).astype(np.int32)
    out["sample_logprobs"] = np.where(m[..., None], batch["sample_logprobs"], np.nan).astype(np.float32)
    return out


# ------------------------------------------------------------------- mask


def test_mask_hand_checked():
    seg = np.array([[1, 1, 1, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3]], np.int32)
    expected = np.array(
        [[1, 1, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]], bool
    )  # row 0: 0->1, 1->2 in doc 1; 2 is doc 1's last token; 3->4 in doc 2; 4 -> padding
    np.testing.assert_array_equal(np.asarray(L.next_token_mask(seg)), expected)
    np.testing.assert_array_equal(np_mask(seg), expected)

    tokens = np.array([[5, 6, 7, 8, 9, 0, 0], [1, 2, 3, 4, 5, 6, 7]], np.int32)
    logits = np.random.default_rng(1).normal(size=(2, 7, 10)).astype(np.float32)
    ce, count = cross_entropy(logits, tokens, L.next_token_mask(seg))
    assert int(count) == 9
    pairs = [(0, 0, 6), (0, 1, 7), (0, 3, 9)] + [(1, j, j + 2) for j in range(6)]
    want = np.mean([-np_log_softmax(logits[b, j])[t] for b, j, t in pairs])
    np.testing.assert_allclose(float(ce), want, rtol=1e-5)


def test_targets_are_next_tokens():
    tok = np.array([[4, 5, 6]], np.int32)
    np.testing.assert_array_equal(np.asarray(L.next_token_targets(tok)), [[5, 6, 0]])


def test_empty_mask_gives_zero_not_nan():
    batch, student, _ = make_batch(segments=np.zeros((2, 6), np.int32))
    for fn in (
        lambda: topk_kl(student, batch["topk_ids"], batch["topk_logprobs"], np.zeros((2, 6), bool)),
        lambda: cross_entropy(student, batch["tokens"], np.zeros((2, 6), bool)),
    ):
        loss, count = fn()
        assert int(count) == 0 and float(loss) == 0.0


# ------------------------------------------------------------ against numpy


@pytest.mark.parametrize("T", [1.0, 0.5, 2.0])
def test_topk_kl_matches_numpy(T):
    batch, student, _ = make_batch(seed=2)
    mask = np_mask(SEGMENTS)
    got, count = topk_kl(
        student, batch["topk_ids"], batch["topk_logprobs"], mask, temperature=T
    )
    assert int(count) == mask.sum()
    want = np_topk_kl(student, batch["topk_ids"], batch["topk_logprobs"], mask, T)
    np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1.0, 0.5, 2.0])
def test_topk_tail_kl_matches_numpy(T):
    batch, student, full_lp = make_batch(seed=3)
    batch = tempered(batch, full_lp, T)
    mask = np_mask(SEGMENTS)
    got, count = topk_tail_kl(
        student, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask,
        temperature=T, tempered_tail=batch.get("tail_logprob_tempered"),
    )
    assert int(count) == mask.sum()
    want = np_topk_tail_kl(
        student, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask, T,
        batch.get("tail_logprob_tempered"),
    )
    np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-6)


def test_cross_entropy_matches_numpy():
    batch, student, _ = make_batch(seed=4)
    mask = np_mask(SEGMENTS)
    got, count = cross_entropy(student, batch["tokens"], mask)
    assert int(count) == mask.sum()
    np.testing.assert_allclose(float(got), np_ce(student, batch["tokens"], mask), rtol=1e-5)


# one kind of each representation (and of each divergence family)
# The three original kinds (test_divergences covers the divergences of each representation).
BASE_KINDS = ("topk_kl", "topk_tail_kl", "sampled_kl")
MASKING_KINDS = BASE_KINDS + ("full_skew_reverse_kl",)


@pytest.mark.slow
def test_garbage_at_masked_positions_is_ignored():
    batch, student, full_lp = make_batch(seed=5)
    bad = poison_masked(batch)
    mask = L.next_token_mask(SEGMENTS)
    for kind in MASKING_KINDS:
        T = 2.0
        clean = jit_loss(kind)(student, batch, 0.5, T)[0]
        dirty = jit_loss(kind)(student, bad, 0.5, T)[0]
        assert np.isfinite(float(dirty))
        np.testing.assert_allclose(float(dirty), float(clean), rtol=1e-6)
        g = np.asarray(jit_grad(kind)(student, bad, 0.5, T))
        assert np.all(np.isfinite(g))
        # No gradient reaches a masked position (padding, document ends, last column).
        assert np.all(g[~np.asarray(mask)] == 0.0)
    del mask


def test_neg_inf_tail_no_nan():
    # Teacher puts all its mass on the top-k: tail = -inf (and one top-k entry also -inf).
    batch, student, _ = make_batch(seed=6)
    lp = batch["topk_logprobs"].astype(np.float64)
    lp[..., -1] = -np.inf
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    batch["topk_logprobs"] = lp.astype(np.float32)
    batch["tail_logprob"] = np.full(SEGMENTS.shape, -np.inf, np.float32)
    batch["tail_logprob_tempered"] = batch["tail_logprob"]  # no tail at any temperature
    mask = np_mask(SEGMENTS)
    for T in (1.0, 2.0):
        got, _ = topk_tail_kl(
            student, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask,
            temperature=T, tempered_tail=batch["tail_logprob_tempered"],
        )
        want = np_topk_tail_kl(
            student, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask, T,
            batch["tail_logprob_tempered"],
        )
        np.testing.assert_allclose(float(got), want, rtol=1e-5)
        got2, _ = topk_kl(student, batch["topk_ids"], batch["topk_logprobs"], mask, temperature=T)
        np.testing.assert_allclose(
            float(got2), np_topk_kl(student, batch["topk_ids"], batch["topk_logprobs"], mask, T),
            rtol=1e-5,
        )
        for kind in BASE_KINDS if T != 1.0 else ():  # at T = 2: the same compiled steps as the other tests
            g = jit_grad(kind)(student, batch, 0.7, T)
            assert np.all(np.isfinite(np.asarray(g)))


def test_student_tail_zero_when_k_equals_vocab():
    # k == V: the student has no mass outside the ids; teacher tail -inf. Finite value and grad.
    seg = np.array([[1, 1, 1, 0]], np.int32)
    batch, student, _ = make_batch(seed=7, segments=seg, v=6, k=6)
    batch["tail_logprob"] = np.full(seg.shape, -np.inf, np.float32)
    mask = np_mask(seg)
    f = jax.jit(
        lambda z: topk_tail_kl(
            z, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask,
            temperature=1.5, tempered_tail=batch["tail_logprob"],  # no tail at any temperature
        )[0]
    )
    assert np.isfinite(float(f(student)))
    assert np.all(np.isfinite(np.asarray(jax.jit(jax.grad(f))(student))))
    np.testing.assert_allclose(
        float(f(student)),
        np_topk_kl(student, batch["topk_ids"], batch["topk_logprobs"], mask, 1.5),
        rtol=1e-5,
    )


def test_bf16_logits_upcast():
    batch, student, full_lp = make_batch(seed=8)
    batch = tempered(batch, full_lp, 2.0)
    s16 = jnp.asarray(student, jnp.bfloat16)
    s32 = np.asarray(s16.astype(jnp.float32))  # the same values, exactly, in float32
    mask = np_mask(SEGMENTS)
    # topk_kl gathers the k logits before upcasting; the others upcast [B, L, V].
    a = topk_kl(s16, batch["topk_ids"], batch["topk_logprobs"], mask, temperature=2.0)[0]
    b = topk_kl(s32, batch["topk_ids"], batch["topk_logprobs"], mask, temperature=2.0)[0]
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    (a, _), g = jit_vg("topk_tail_kl")(s16, batch, 0.5, 2.0)
    (b, _), _ = jit_vg("topk_tail_kl")(s32, batch, 0.5, 2.0)
    assert a.dtype == jnp.float32
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    assert g.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(g, np.float32)))


def test_vocab_mismatch_is_nan_not_silent():
    batch, student, _ = make_batch(seed=9)
    batch["topk_ids"] = batch["topk_ids"].copy()
    batch["topk_ids"][1, 3, 0] = V + 5  # a teacher id the student vocab lacks, at a valid position
    loss, _ = topk_kl(student, batch["topk_ids"], batch["topk_logprobs"], np_mask(SEGMENTS))
    assert np.isnan(float(loss))


# ------------------------------------------------------------- properties


@pytest.mark.parametrize("T", [1.0, 3.0])
def test_kl_nonnegative(T):
    for seed in range(3):
        batch, student, full_lp = make_batch(seed=10 + seed)
        batch = tempered(batch, full_lp, T)
        a = topk_kl_per_token(student, batch["topk_ids"], batch["topk_logprobs"], temperature=T)
        b = topk_tail_kl_per_token(
            student, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], temperature=T,
            tempered_tail=batch.get("tail_logprob_tempered"),
        )
        assert float(jnp.min(a)) >= -1e-6 and float(jnp.min(b)) >= -1e-6


@pytest.mark.parametrize("T", [1.0, 0.5, 2.0])
def test_topk_kl_zero_when_student_matches_on_topk(T):
    batch, student, full_lp = make_batch(seed=20)
    batch = tempered(batch, full_lp, T)
    rng = np.random.default_rng(0)
    z = student.copy()
    shift = rng.normal(size=SEGMENTS.shape + (1,)) * 5  # per-position constant: softmax-invariant
    np.put_along_axis(z, batch["topk_ids"], batch["topk_logprobs"] + shift, axis=-1)
    mask = np_mask(SEGMENTS)
    loss, _ = topk_kl(z, batch["topk_ids"], batch["topk_logprobs"], mask, temperature=T)
    assert abs(float(loss)) < 1e-5
    # ... but the tail loss sees that the student's mass outside the top-k is wrong.
    tail_loss, _ = topk_tail_kl(
        z, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], np_mask(SEGMENTS),
        temperature=T, tempered_tail=batch.get("tail_logprob_tempered"),
    )
    assert float(tail_loss) > 1e-2


@pytest.mark.parametrize("T", [1.0, 0.5, 2.0])
def test_topk_tail_kl_zero_when_student_matches_bins(T):
    batch, _, full_lp = make_batch(seed=21)
    batch = tempered(batch, full_lp, T)
    mask = np_mask(SEGMENTS)
    # The teacher's own full distribution (shifted) as student: all k+1 bins match.
    z = (full_lp + 3.0).astype(np.float32)
    loss, _ = topk_tail_kl(
        z, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask, temperature=T,
        tempered_tail=batch.get("tail_logprob_tempered"),
    )
    assert abs(float(loss)) < 1e-5
    if T != 1.0:  # tempered, the tail's mass depends on how it is spread
        return
    # At T = 1 a different spread of the same tail mass over the non-top-k ids is still a match.
    rng = np.random.default_rng(1)
    z2 = full_lp.copy()
    for b, j in zip(*np.nonzero(mask)):
        out = np.setdiff1d(np.arange(V), batch["topk_ids"][b, j])
        w = rng.dirichlet(np.ones(out.size))
        z2[b, j, out] = np.log(w) + batch["tail_logprob"][b, j]
    loss2, _ = topk_tail_kl(
        z2.astype(np.float32), batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask,
    )
    assert abs(float(loss2)) < 1e-5


def test_tail_loss_equals_topk_loss_when_teacher_and_student_have_no_tail():
    batch, student, _ = make_batch(seed=22, v=K, k=K)
    batch["tail_logprob"] = np.full(SEGMENTS.shape, -np.inf, np.float32)
    mask = np_mask(SEGMENTS)
    a, _ = topk_kl(student, batch["topk_ids"], batch["topk_logprobs"], mask, temperature=2.0)
    b, _ = topk_tail_kl(
        student, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask,
        temperature=2.0, tempered_tail=batch["tail_logprob"],  # no tail at any temperature
    )
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)


# ------------------------------------------------------------- distill_loss


@pytest.mark.parametrize("kind", BASE_KINDS)
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_distill_loss_mixing(kind, alpha):
    batch, student, full_lp = make_batch(seed=30)
    T = 2.0
    batch = tempered(batch, full_lp, T)
    mask = np_mask(SEGMENTS)
    loss, m = jit_loss(kind)(student, batch, alpha, T)
    ce = np_ce(student, batch["tokens"], mask)
    if kind == "topk_kl":
        kd = np_topk_kl(student, batch["topk_ids"], batch["topk_logprobs"], mask, T)
    elif kind == "sampled_kl":
        kd = np_sampled_kl(student, batch["sample_ids"], batch["sample_counts"], batch["sample_logprobs"], mask, T)
    else:
        kd = np_topk_tail_kl(
            student, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask, T,
            batch["tail_logprob_tempered"],
        )
    assert int(m["num_tokens"]) == mask.sum()
    np.testing.assert_allclose(float(m["ce_loss"]), ce, rtol=1e-5)
    np.testing.assert_allclose(float(m["kd_loss"]), kd, rtol=1e-5)
    np.testing.assert_allclose(float(loss), alpha * kd + (1 - alpha) * ce, rtol=1e-5)


@pytest.mark.parametrize("kind", BASE_KINDS)
def test_alpha_zero_is_exactly_ce_even_with_invalid_teacher(kind):
    batch, student, full_lp = make_batch(seed=31)
    batch = tempered(batch, full_lp, 2.0)
    mask = np_mask(SEGMENTS)
    bad = dict(batch)
    bad["topk_logprobs"] = np.full_like(batch["topk_logprobs"], np.nan)
    bad["tail_logprob"] = np.full_like(batch["tail_logprob"], np.nan)
    bad["tail_logprob_tempered"] = np.full_like(batch["tail_logprob"], np.nan)
    bad["topk_ids"] = np.full_like(batch["topk_ids"], 10**6)
    bad["sample_ids"] = np.full_like(batch["sample_ids"], 10**6)
    bad["sample_logprobs"] = np.full_like(batch["sample_logprobs"], np.nan)

    ce_fn = lambda z: L.cross_entropy(z, batch["tokens"], mask)[0]  # noqa: E731
    ce, g_ce = jax.jit(jax.value_and_grad(ce_fn))(student)

    # Traced alpha (a schedule under jit): value and gradient are exactly CE's.
    (loss, m), g = jit_vg(kind)(student, bad, 0.0, 2.0)
    assert float(loss) == float(ce) and float(m["ce_loss"]) == float(ce)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ce), rtol=1e-6, atol=1e-9)
    assert np.isnan(float(m["kd_loss"]))  # the metric is honest about the bad teacher
    # ... which is really used when alpha > 0.
    assert np.isnan(float(jit_loss(kind)(student, bad, 0.5, 2.0)[0]))

    # Concrete alpha 0 without any teacher field.
    plain = {k: batch[k] for k in ("tokens", "segment_ids", "positions")}
    loss, m = L.distill_loss(student, plain, kind=kind, alpha=0.0)
    assert float(loss) == float(ce) and np.isnan(float(m["kd_loss"]))
    with pytest.raises(KeyError):
        L.distill_loss(student, plain, kind=kind, alpha=0.5)


def test_distill_loss_traced_temperature_and_bad_args():
    batch, student, full_lp = make_batch(seed=32)
    batch = tempered(batch, full_lp, 1.7)
    mask = np_mask(SEGMENTS)
    traced = jax.jit(lambda z, b, a, t: L.distill_loss(z, b, kind="topk_tail_kl", alpha=a, temperature=t))
    got = traced(student, batch, 0.5, 1.7)[0]  # alpha and T both traced
    kd = np_topk_tail_kl(
        student, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"], mask, 1.7,
        batch["tail_logprob_tempered"],
    )
    want = 0.5 * kd + 0.5 * np_ce(student, batch["tokens"], mask)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    with pytest.raises(ValueError, match="kind"):
        L.distill_loss(student, batch, kind="reverse_kl")
    with pytest.raises(ValueError, match="temperature"):
        L.distill_loss(student, batch, temperature=0.0)
    with pytest.raises(ValueError, match="alpha"):
        L.distill_loss(student, batch, alpha=1.5)


# ------------------------------------------------------------- no silent bias


def test_topk_tail_kl_at_t_not_1_without_the_tempered_tail_raises():
    batch, student, full_lp = make_batch(seed=33)
    batch = {k: v for k, v in batch.items() if k != "tail_logprob_tempered"}
    mask = np_mask(SEGMENTS)
    args = (student, batch["topk_ids"], batch["topk_logprobs"], batch["tail_logprob"])
    for call in (lambda: topk_tail_kl(*args, mask, temperature=2.0),
                 lambda: L.topk_tail_kl_per_token(*args, temperature=0.5),
                 lambda: L.topk_tail_divergence_per_token(*args, divergence="jsd", temperature=2.0),
                 lambda: L.distill_loss(student, batch, kind="topk_tail_kl", alpha=1.0, temperature=2.0),
                 lambda: jax.jit(lambda t: L.topk_tail_kl(*args, mask, temperature=t))(1.0)):  # traced: unknown T
        with pytest.raises(InputError, match="tempered"):
            call()
    # T = 1 needs nothing more; with the tempered tail any T works.
    assert np.isfinite(float(topk_tail_kl(*args, mask)[0]))
    batch = tempered(batch, full_lp, 2.0)
    assert np.isfinite(float(L.distill_loss(student, batch, kind="topk_tail_kl", alpha=1.0, temperature=2.0)[0]))


def test_sampled_kl_at_t_not_proposal_t_is_refused_unless_allowed():
    batch, student, _ = make_batch(seed=34)
    mask = np_mask(SEGMENTS)
    args = (student, batch["sample_ids"], batch["sample_counts"], batch["sample_logprobs"])
    for call in (lambda **kw: L.sampled_kl(*args, mask, temperature=2.0, **kw),
                 lambda **kw: L.sampled_kl_per_token(*args, temperature=1.0, proposal_temperature=2.0, **kw),
                 lambda **kw: L.distill_loss(student, batch, kind="sampled_kl", alpha=1.0, temperature=2.0, **kw)):
        with pytest.raises(InputError, match="biased"):
            call()
        value = call(allow_biased_temperature=True)
        assert np.all(np.isfinite(np.asarray(jax.tree.leaves(value)[0])))
    with pytest.raises(InputError, match="Python numbers"):  # a traced T cannot be checked
        jax.jit(lambda t: L.sampled_kl(*args, mask, temperature=t))(1.0)
    L.check_sampled_temperature(2.0, 2.0)  # T = t: unbiased
    with pytest.raises(InputError, match="biased"):
        L.check_sampled_temperature(1.0, 2.0)


def test_kd_metric_note_says_what_the_metric_is():
    assert L.kd_metric_note("topk_tail_kl", 2.0) == "exact"
    assert L.kd_metric_note("full_jsd") == "exact"
    assert L.kd_metric_note("sampled_kl").startswith("unbiased estimate")
    assert L.kd_metric_note("sampled_kl", 2.0, 2.0).startswith("biased estimate (log Z_T")
    assert L.kd_metric_note("sampled_kl", 2.0, 1.0).startswith("biased estimate (self-normalised")
    assert L.kd_metric_note("hybrid_kl", 2.0, 2.0).startswith("unbiased estimate")
    with pytest.raises(InputError, match="reverse KL"):
        L.kd_metric_note("sampled_reverse_kl")


def test_sampled_kl_value_is_unbiased_at_t_1_and_an_estimate_at_t_2():
    """The kd_loss metric of a sampled store over many independent draw sets: its mean is the exact
    KL at T = t = 1; at T = t = 2 log Z_T comes from the draws and the mean misses (kd_metric_note)."""
    from logit_distill.selection import sample_keys, select_sampled

    rng = np.random.default_rng(35)
    v, n, m = 30, 2, 4000
    t_logits = rng.normal(size=(v,)) * 2.0
    z = jnp.broadcast_to(jnp.asarray(rng.normal(size=(v,)), jnp.float32), (m, 1, v))
    for T, biased in ((1.0, False), (2.0, True)):
        @jax.jit
        def values(teacher, keys):
            out = select_sampled(teacher, n, keys, proposal_temperature=T)
            return L.sampled_kl_per_token(z, out["sample_ids"], out["sample_counts"], out["sample_logprobs"],
                                          temperature=T, proposal_temperature=T)

        vals = np.asarray(values(jnp.broadcast_to(jnp.asarray(t_logits, jnp.float32), (m, 1, v)),
                                 sample_keys(3, jnp.arange(m), 1)))[:, 0]
        p = np.exp(np_log_softmax(t_logits / T))
        q = np.exp(np_log_softmax(np.asarray(z[0, 0], np.float64) / T))
        exact = T * T * np_kl(p, q)
        off = abs(vals.mean() - exact) / (vals.std(ddof=1) / np.sqrt(m))
        assert (off > 5) if biased else (off < 4), (T, vals.mean(), exact, off)


def test_online_draws_change_per_epoch_and_keep_the_dumps_in_epoch_0():
    import grain

    from logit_distill.selection import sample_keys, select_sampled
    from logit_distill.train import epochs
    from logit_distill.train.loader import build_dataset

    class Indices(grain.sources.RandomAccessDataSource):  # a source whose records are their own index
        def __len__(self):
            return 7

        def __getitem__(self, i):
            return {"example_index": np.int64(i), "tokens": np.zeros(2, np.int32),
                    "segment_ids": np.ones(2, np.int32), "positions": np.arange(2, dtype=np.int32)}

    n, rows, steps = 7, 3, 9
    full = [int(build_dataset(Indices(), seed=4, batch_size=1, num_batches=60)[j]["example_index"][0])
            for j in range(60)]  # the repeated order itself, one element per batch
    for p, P in ((0, 1), (1, 2)):
        ds = build_dataset(Indices(), seed=4, batch_size=rows * P, num_batches=steps, process_index=p,
                           process_count=P)
        for i in range(steps):
            got = epochs.row_epochs(i, rows, n, process_index=p, process_count=P)
            for r, (e, k) in enumerate(zip(ds[i]["example_index"], got)):
                element = (i * rows + r) * P + p
                assert full[element] == e
                assert full[:element].count(e) == k  # each epoch holds every example once
    idx = epochs.draw_index(np.array([0, 3, 6]), np.array([0, 1, 2]), n)
    np.testing.assert_array_equal(idx, [0, 10, 20])
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 50)) * 2, jnp.float32)
    select = jax.jit(lambda keys: select_sampled(logits, 16, keys)["sample_ids"])
    draw = lambda i: np.asarray(select(sample_keys(5, jnp.asarray([i]), 4)))  # noqa: E731
    np.testing.assert_array_equal(draw(int(epochs.draw_index(3, 0, n))), draw(3))  # epoch 0: the dump's draws
    assert not np.array_equal(draw(int(epochs.draw_index(3, 1, n))), draw(3))


# ---------------------------------------------------------------- schedules


def test_alpha_schedules():
    c = S.alpha_schedule("constant", 0.5)
    assert [float(c(s)) for s in (0, 10, 10**6)] == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError):
        S.alpha_schedule("constant", 0.5, 0.3, 100)

    lin = S.alpha_schedule("linear", 0.7, 0.3, 100)
    np.testing.assert_allclose(
        [float(lin(s)) for s in (0, 50, 100, 500)], [0.7, 0.5, 0.3, 0.3], atol=1e-6
    )

    cos = S.alpha_schedule("cosine", 0.7, 0.3, 100)
    want = [0.7, 0.3 + 0.4 * (1 + math.cos(math.pi * 0.25)) / 2, 0.5, 0.3, 0.3]
    np.testing.assert_allclose([float(cos(s)) for s in (0, 25, 50, 100, 500)], want, atol=1e-6)

    up = S.alpha_schedule("cosine", 0.0, 0.5, 10)  # ramp up from 0
    np.testing.assert_allclose([float(up(s)) for s in (0, 5, 10)], [0.0, 0.25, 0.5], atol=1e-6)

    # Traced steps inside jit.
    vals = jax.jit(jax.vmap(cos))(jnp.array([0, 50, 100], jnp.int32))
    np.testing.assert_allclose(np.asarray(vals), [0.7, 0.5, 0.3], atol=1e-6)

    for bad in (("sigmoid", 0.5, 0.5, 10), ("linear", 0.5, 0.1, 0), ("linear", 1.5, 0.1, 10)):
        with pytest.raises(ValueError):
            S.alpha_schedule(*bad)


def test_learning_rate_schedule():
    lr = S.learning_rate_schedule(1e-3, warmup_steps=10, total_steps=110, end_fraction=0.1)
    np.testing.assert_allclose(float(lr(0)), 0.0, atol=1e-12)
    np.testing.assert_allclose(float(lr(5)), 5e-4, rtol=1e-5)
    np.testing.assert_allclose(float(lr(10)), 1e-3, rtol=1e-5)
    np.testing.assert_allclose(float(lr(60)), 1e-4 + 0.9e-3 * 0.5, rtol=1e-5)  # cosine midpoint
    np.testing.assert_allclose(float(lr(110)), 1e-4, rtol=1e-5)
    np.testing.assert_allclose(float(lr(1000)), 1e-4, rtol=1e-5)
    with pytest.raises(ValueError):
        S.learning_rate_schedule(1e-3, warmup_steps=10, total_steps=10)
