"""Sampled stores: on-device draws, their codec, dump resume/refusal, verify, the sampled loss
(unbiasedness against the full-distribution KL gradient), online sampling, exact tempered tails
and token-weighted gradient accumulation; float64 NumPy references throughout."""

import functools
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dump_helpers import chunk_bytes, cli, dump_args, teacher_dir, write_corpus
from logit_distill import codec, store
from logit_distill.dump import DumpConfig, run_dump
from logit_distill.errors import ConfigMismatchError, InputError
from logit_distill.selection import sample_keys, select_sampled, select_topk
from logit_distill.train import losses as L
from logit_distill.train.losses import training_mask
from logit_distill.verify import VerifyConfig
from logit_distill.train import TrainConfig


def np_log_softmax(x, axis=-1):
    x = np.asarray(x, np.float64)
    m = x.max(axis, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis, keepdims=True))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled")
    return {"teacher": teacher_dir(root), "data": write_corpus(root / "corpus.jsonl"), "root": root}


def _config(setup, output, **kw):
    base = dict(teacher=setup["teacher"], data=setup["data"], output=output, seq_len=32, batch_size=4,
                num_steps=6, steps_per_file=2, progress=False, selection="sampled", samples=16)
    base.update(kw)
    return DumpConfig(**base)


# ------------------------------------------------------------------ selection and codec


@pytest.mark.slow
def test_draws_are_keyed_by_example_and_position_and_follow_the_teacher():
    rng = np.random.default_rng(0)
    V, N = 12, 16
    logits = jnp.asarray(rng.normal(size=(1, 1, V)) * 1.5, jnp.float32)
    # One position seen by 3000 examples: the pooled draws follow softmax(logits).
    many = jnp.broadcast_to(logits, (3000, 1, V))
    out = jax.jit(select_sampled, static_argnums=1)(many, N, sample_keys(5, jnp.arange(3000), 1))
    ids, counts, lp = (np.asarray(out[k]) for k in ("sample_ids", "sample_counts", "sample_logprobs"))
    assert (counts.sum(-1) == N).all()
    used = counts > 0
    assert all((np.diff(ids[i, 0][used[i, 0]]) > 0).all() for i in range(50))  # distinct, ascending
    p = np.exp(np_log_softmax(np.asarray(logits[0, 0])))
    np.testing.assert_allclose(lp[used], np.log(p)[ids[used]], atol=1e-5)
    freq = np.bincount(ids[used], weights=counts[used], minlength=V) / (3000 * N)
    se = np.sqrt(p * (1 - p) / (3000 * N))
    assert (np.abs(freq - p) < 4 * se + 1e-9).all(), (freq, p)
    # The draws of (seed, example, position) do not depend on the batch they are computed in.
    single = select_sampled(logits, N, sample_keys(5, jnp.array([7]), 1))
    np.testing.assert_array_equal(np.asarray(single["sample_ids"][0]), ids[7])
    other_seed = select_sampled(logits, N, sample_keys(6, jnp.array([7]), 1))
    assert not np.array_equal(np.asarray(other_seed["sample_counts"][0]), counts[7])


@pytest.mark.slow
@pytest.mark.parametrize("codec_name", ["exact", "default"])
def test_sampled_record_round_trip(codec_name):
    rng = np.random.default_rng(1)
    Lq, V, N = 9, 300, 32
    out = select_sampled(jnp.asarray(rng.normal(size=(1, Lq, V)) * 3, jnp.float32), N,
                         sample_keys(0, jnp.array([4]), Lq))
    ids, counts, lp = (np.asarray(out[k][0]) for k in ("sample_ids", "sample_counts", "sample_logprobs"))
    raw = codec.encode_record(codec_name, example_index=4, tokens=rng.integers(0, V, Lq), segment_ids=np.ones(Lq),
                              positions=np.arange(Lq), vocab_size=V, sample_ids=ids, sample_counts=counts,
                              sample_logprobs=lp, num_samples=N)
    rec = codec.decode_record(raw)
    S = int((counts > 0).sum(-1).max())
    assert rec["sample_ids"].shape == (Lq, S) and codec.decode_header(raw)["selection"] == "sampled"
    assert codec.decode_header(raw)["top_k"] == N
    np.testing.assert_array_equal(rec["sample_ids"], ids[:, :S])
    np.testing.assert_array_equal(rec["sample_counts"], counts[:, :S])
    tol = 0 if codec_name == "exact" else codec.SAMPLED_LOGPROB_MAX_ERROR
    assert np.abs(rec["sample_logprobs"] - lp[:, :S]).max() <= tol + 1e-7
    with pytest.raises(Exception):
        codec.decode_record(raw[:-1])
    holes = counts.copy()
    holes[0, 0] = 0  # an unused slot before a used one
    with pytest.raises(ValueError, match="must come first"):
        codec.encode_record(codec_name, example_index=4, tokens=np.zeros(Lq), segment_ids=np.ones(Lq),
                            positions=np.arange(Lq), vocab_size=V, sample_ids=ids, sample_counts=holes,
                            sample_logprobs=lp, num_samples=N)


# ------------------------------------------------------------------ dump, resume, verify


# The stores that draw: sampled (N draws), hybrid (the exact top-4 head + N draws from the rest; exact codec,
# so that training on it can be held against float64).
DRAWING = {"sampled": {}, "hybrid": {"top_k": 4, "codec": "exact"}}


@pytest.fixture(scope="module")
def hybrid_store(setup, tmp_path_factory):
    """A hybrid store (exact codec) of the module's teacher and data: 6 steps of 4 examples."""
    uri = str(tmp_path_factory.mktemp("hybrid") / "store")
    run_dump(_config(setup, uri, selection="hybrid", **DRAWING["hybrid"]))
    return uri


@pytest.mark.slow
@pytest.mark.parametrize("selection", list(DRAWING))
def test_drawing_dump_resumes_to_the_same_bytes_and_verifies(setup, tmp_path, selection, capsys, request):
    from logit_distill.cli import main as cli_main
    from logit_distill.verify import verify_store

    head = DRAWING[selection]
    out = str(tmp_path / "s")
    if selection == "hybrid":
        ref = request.getfixturevalue("hybrid_store")
    else:
        ref = str(tmp_path / "ref")
        r = run_dump(_config(setup, ref, selection=selection, **head))
        assert r.complete and r.bytes_per_position > 0
    before = chunk_bytes(ref)
    # Killed (SIGKILL once a chunk is committed) and re-run: the same bytes as uninterrupted.
    args = dump_args(setup["teacher"], setup["data"], out, selection=selection, samples=16, num_steps=6,
                     **{"top-k": head.get("top_k"), "codec": head.get("codec")})
    proc = subprocess.Popen([sys.executable, "-m", "logit_distill.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (
            os.path.isdir(out) and any(n.startswith("chunk-") for n in os.listdir(out))):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    assert chunk_bytes(out) == before
    s = store.open_store(ref)
    if s.manifest["codec"]["name"] == "default":
        assert s.manifest["codec"]["sampled_layout"] == codec.SAMPLED_LAYOUT
    rec = s.read(5)  # N draws at each position the record holds (its loss mask), none elsewhere
    np.testing.assert_array_equal(rec["sample_counts"].sum(-1), np.where(rec["loss_mask"], 16, 0))
    if selection == "hybrid":  # the head is the teacher's top-4; the draws lie outside it
        assert rec["topk_ids"].shape == (32, 4) and "sample_logprobs" not in rec
        drawn = (rec["sample_ids"][..., :, None] == rec["topk_ids"][..., None, :]).any(-1) & (rec["sample_counts"] > 0)
        assert rec["loss_mask"].sum() > 16 and not drawn.any()
    report = verify_store(VerifyConfig(store=ref, teacher=setup["teacher"], spot_check=2, progress=False))
    assert report.passed, report.failure_line()
    # Another N or selection is refused; nothing changes.
    with pytest.raises(ConfigMismatchError, match="shapes.num_samples"):
        run_dump(_config(setup, ref, selection=selection, samples=8, **head))
    with pytest.raises(ConfigMismatchError, match="shapes.selection"):
        run_dump(_config(setup, ref, selection="topk", samples=None, top_k=8))
    with pytest.raises(InputError, match="--samples"):  # sampled: none given; hybrid (default 16): out of range
        run_dump(_config(setup, str(tmp_path / "x"), selection=selection,
                         samples=None if selection == "sampled" else 0, **head))
    assert chunk_bytes(ref) == before
    # A flipped byte in a chunk: verify fails naming it; training refuses the store, exit 4 in one line.
    name = sorted(before)[1]
    data = bytearray(before[name])
    data[len(data) // 3] ^= 0x10
    with open(os.path.join(out, name), "wb") as f:
        f.write(bytes(data))
    report = verify_store(VerifyConfig(store=out, progress=False))
    assert not report.passed and "checksum mismatch" in report.failure_line() and name in report.failure_line()
    capsys.readouterr()
    assert cli_main(["train", "--store", out, "--student", "preset:tiny-qwen3@1", "--output", str(tmp_path / "t"),
                     "--num-steps", "1", "--batch-size", "4", "--no-progress"]) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("logit-distill train: error:") and "checksum mismatch" in err[0], err


def test_verify_catches_counts_that_do_not_sum_to_n(tmp_path):
    from logit_distill.verify import verify_store

    manifest = store.build_manifest(seq_len=8, top_k=4, vocab_size=50, codec="exact", num_steps=1,
                                    examples_per_step=2, steps_per_file=1, selection="sampled", num_samples=4,
                                    content={"teacher": "synthetic"})
    uri = str(tmp_path / "s")
    store.init_store(uri, manifest)
    ids = np.tile(np.array([3, 9, 0, 0], np.int32), (2, 8, 1))
    counts = np.tile(np.array([1, 3, 0, 0], np.int32), (2, 8, 1))
    lp = np.tile(np.array([-2.0, -0.5, 0, 0], np.float32), (2, 8, 1))
    counts[1, 5] = [1, 2, 0, 0]  # sums to 3, not 4
    step = {"tokens": np.zeros((2, 8), np.int32), "segment_ids": np.ones((2, 8), np.int32),
            "positions": np.tile(np.arange(8, dtype=np.int32), (2, 1)), "sample_ids": ids, "sample_counts": counts,
            "sample_logprobs": lp, "example_index": np.arange(2)}
    store.write_examples(uri, manifest, 0, {0: step})
    report = verify_store(VerifyConfig(store=uri, progress=False))
    assert not report.passed and "do not sum to N = 4" in report.failure_line()
    assert "example 1" in report.failure_line() and "position 5" in report.failure_line()


def _hybrid_step(V=50, L=8):
    """Two examples of a sound hybrid record: head [5, 7] of mass 0.6 + 0.2, 4 tail draws, the tail's
    sum p log p of a tail spread evenly over 10 ids."""
    head_lp = np.log([0.6, 0.2]).astype(np.float32)
    step = {"tokens": np.zeros((2, L), np.int32), "segment_ids": np.ones((2, L), np.int32),
            "positions": np.tile(np.arange(L, dtype=np.int32), (2, 1)), "example_index": np.arange(2),
            "topk_ids": np.tile(np.array([5, 7], np.int32), (2, L, 1)), "topk_logprobs": np.tile(head_lp, (2, L, 1)),
            "tail_logprob": np.full((2, L), np.log(0.2), np.float32),
            "sample_ids": np.tile(np.array([3, 9, 0, 0], np.int32), (2, L, 1)),
            "sample_counts": np.tile(np.array([1, 3, 0, 0], np.int32), (2, L, 1)),
            "tail_plogp": np.full((2, L), 0.2 * np.log(0.02), np.float32)}
    return step


@pytest.mark.parametrize("damage,found", [
    (None, None),
    (lambda s: s["sample_counts"][1, 5].__setitem__(1, 2), "do not sum to N = 4"),
    (lambda s: s["sample_ids"][1, 5].__setitem__(1, 7), "a tail draw is one of the head's top-k ids"),
    (lambda s: s["tail_plogp"].__setitem__((1, 5), -2.0), "tail sum p log p outside"),
    (lambda s: s["tail_logprob"].__setitem__((1, 5), -0.5), "do not sum to 1"),
])
def test_verify_judges_hybrid_records(tmp_path, damage, found):
    from logit_distill.verify import verify_store

    manifest = store.build_manifest(seq_len=8, top_k=2, vocab_size=50, codec="exact", num_steps=1,
                                    examples_per_step=2, steps_per_file=1, selection="hybrid", num_samples=4,
                                    content={"teacher": "synthetic"})
    uri = str(tmp_path / "s")
    store.init_store(uri, manifest)
    step = _hybrid_step()
    if damage is not None:
        damage(step)
    store.write_examples(uri, manifest, 0, {0: step})
    report = verify_store(VerifyConfig(store=uri, progress=False))
    if found is None:
        assert report.passed, report.failure_line()
        f = report.figures  # per position (2 x 8), and per entry: the head's 2 and the 4 draws of each position
        assert f["bytes_per_position"] == pytest.approx(f["bytes"] / 16)
        assert f["bytes_per_entry"] == pytest.approx(f["bytes"] / (16 * (2 + 4)))
        return
    assert not report.passed and found in report.failure_line()
    assert "example 1" in report.failure_line() and "position 5" in report.failure_line()
    # The training loader's record check stops at the same record.
    from logit_distill.store.checks import RecordCheck
    from logit_distill.errors import StoreError

    s = store.open_store(uri)
    RecordCheck(s.manifest, uri)(s.read(0))
    with pytest.raises(StoreError, match="example 1 holds .* at position 5"):
        RecordCheck(s.manifest, uri)(s.read(1))


# ------------------------------------------------------------------ the sampled loss


@pytest.mark.slow
def test_sampled_kl_matches_float64_reference():
    rng = np.random.default_rng(3)
    V, N, Lq = 40, 16, 5
    t_logits = rng.normal(size=(1, Lq, V)) * 2
    z = rng.normal(size=(1, Lq, V)).astype(np.float32)
    out = select_sampled(jnp.asarray(t_logits, jnp.float32), N, sample_keys(1, jnp.array([0]), Lq))
    ids, counts, lp = (np.asarray(out[k][0]) for k in ("sample_ids", "sample_counts", "sample_logprobs"))
    for T, t in ((1.0, 1.0), (2.0, 2.0), (2.0, 1.0)):
        got = np.asarray(L.sampled_kl_per_token(z, ids[None], counts[None], lp[None], temperature=T,
                                                proposal_temperature=t, allow_biased_temperature=T != t))[0]
        for j in range(Lq):
            u = counts[j] > 0
            lpj = lp[j][u].astype(np.float64)
            c = counts[j][u].astype(np.float64)
            w = c * np.exp((1 / T - 1 / t) * lpj)
            w /= w.sum()
            log_z = np.log((c * np.exp((1 / T - 1 / t) * lpj)).sum() / (c * np.exp((1 - 1 / t) * lpj)).sum())
            log_q = np_log_softmax(z[0, j] / T)[ids[j][u]]
            want = T * T * (w * (lpj / T - log_z - log_q)).sum()
            np.testing.assert_allclose(got[j], want, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_sampled_kl_gradient_is_unbiased_and_topk_kl_is_not():
    rng = np.random.default_rng(4)
    V, N, K, draws = 20, 8, 5, 4000
    teacher = jnp.asarray(rng.normal(size=(V,)) * 1.5, jnp.float32)
    z = rng.normal(size=(V,)).astype(np.float32)
    p = np.exp(np_log_softmax(np.asarray(teacher)))
    full_grad = np.exp(np_log_softmax(z)) - p  # d KL(p || softmax(z)) / dz
    # `draws` independent sample sets: one position each of `draws` examples.
    out = select_sampled(jnp.broadcast_to(teacher, (draws, 1, V)), N, sample_keys(9, jnp.arange(draws), 1))
    zs = jnp.broadcast_to(jnp.asarray(z), (draws, 1, V))
    per = lambda zz: L.sampled_kl_per_token(zz, out["sample_ids"], out["sample_counts"],  # noqa: E731
                                            out["sample_logprobs"]).sum()
    g = np.asarray(jax.jit(jax.grad(per))(zs))[:, 0]  # [draws, V]
    mean, se = g.mean(0), g.std(0, ddof=1) / np.sqrt(draws)
    assert (np.abs(mean - full_grad) <= 3 * se).all(), np.abs(mean - full_grad) / se
    sel = select_topk(teacher[None, None], K)
    g_topk = np.asarray(jax.grad(lambda zz: L.topk_kl_per_token(zz, sel["topk_ids"], sel["topk_logprobs"]).sum())(
        jnp.asarray(z)[None, None]))[0, 0]
    assert (np.abs(g_topk - full_grad) > 3 * se).any()
    assert np.abs(g_topk - full_grad).max() > 10 * se.max()


# ------------------------------------------------------------------ tempered tails


@pytest.mark.parametrize("T", [2.0, 4.0, 0.5])
def test_topk_tail_kl_with_stored_tempered_tail_is_exact(T):
    rng = np.random.default_rng(5)
    V, K, Lq = 60, 6, 4
    t_logits = rng.normal(size=(1, Lq, V)) * 2
    z = (rng.normal(size=(1, Lq, V)) * 2).astype(np.float32)
    sel = {k: np.asarray(v) for k, v in select_topk(jnp.asarray(t_logits, jnp.float32), K, (T,)).items()}
    got = np.asarray(L.topk_tail_kl_per_token(z, sel["topk_ids"], sel["topk_logprobs"], sel["tail_logprob"],
                                              temperature=T, tempered_tail=sel["tail_logprob_tempered"][..., 0]))[0]
    for j in range(Lq):
        pt = np.exp(np_log_softmax(t_logits[0, j] / T))  # the tempered teacher, float64
        qt = np.exp(np_log_softmax(z[0, j].astype(np.float64) / T))
        ids = sel["topk_ids"][0, j]
        rest = np.setdiff1d(np.arange(V), ids)
        P = np.append(pt[ids], pt[rest].sum())
        Q = np.append(qt[ids], qt[rest].sum())
        np.testing.assert_allclose(np.log(pt[rest].sum()), sel["tail_logprob_tempered"][0, j, 0], atol=1e-5)
        np.testing.assert_allclose(got[j], T * T * (P * np.log(P / Q)).sum(), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ gradient accumulation


@pytest.mark.slow
def test_accumulation_is_token_weighted():
    from logit_distill.train.step import make_train_step

    rng = np.random.default_rng(6)
    V, Lq = 11, 8

    def apply(params, tokens, positions, segment_ids):
        return params["emb"][tokens]

    params = {"emb": jnp.asarray(rng.normal(size=(V, V)), jnp.float32)}
    seg_a = np.zeros((1, Lq), np.int32)
    seg_a[0, :2] = 1  # one valid token
    seg_b = np.ones((1, Lq), np.int32)  # seven next tokens, three of them supervised (loss_mask)
    mask_b = np.zeros((1, Lq), bool)
    mask_b[0, 2:5] = True
    batches = []
    for s, mask in ((seg_a, np.ones((1, Lq), bool)), (seg_b, mask_b)):
        sel = select_topk(jnp.asarray(rng.normal(size=(1, Lq, V)), jnp.float32), 3)
        batches.append({"tokens": rng.integers(0, V, (1, Lq)).astype(np.int32), "segment_ids": s,
                        "positions": np.zeros((1, Lq), np.int32), "topk_ids": np.asarray(sel["topk_ids"]),
                        "topk_logprobs": np.asarray(sel["topk_logprobs"]), "loss_mask": mask})
    one = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

    def run(tx, bs, scales):
        step = jax.jit(make_train_step(apply, tx, loss="topk_kl", temperature=1.0))
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.int32(0)}
        for b, s in zip(bs, scales):
            state, _ = step(state, b, jnp.float32(0.5), s)
        return np.asarray(state["params"]["emb"])

    sgd = optax.sgd(1.0)
    want = run(sgd, [one], [jnp.float32(1.0)])
    scales = L.accumulation_scales(batches)
    np.testing.assert_allclose([float(s) for s in scales], [2 * 1 / 4, 2 * 3 / 4])
    got = run(optax.MultiSteps(sgd, every_k_schedule=2), batches, scales)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plain = run(optax.MultiSteps(sgd, every_k_schedule=2), batches, [jnp.float32(1.0)] * 2)
    assert np.abs(plain - want).max() > 1e-3  # the unweighted mean of means differs


def test_teacher_outputs_at_prompt_positions_change_nothing():
    """Online, the teacher computes every position; a prompt's (``loss_mask`` 0) never reaches the loss
    or the gradient, whatever the teacher says there, for every loss."""
    rng = np.random.default_rng(8)
    V, Lq = 13, 10
    segment_ids = np.array([[1] * 6 + [2] * 4, [1] * 8 + [0] * 2], np.int32)
    loss_mask = np.zeros((2, Lq), bool)
    loss_mask[0, 2:5] = loss_mask[0, 7:9] = loss_mask[1, 4:7] = True  # the assistant's tokens
    teacher = rng.normal(size=(2, Lq, V)).astype(np.float32)
    altered = np.where(loss_mask[..., None], teacher, 5 * rng.normal(size=teacher.shape)).astype(np.float32)
    at_target = teacher.copy()
    at_target[0, 3] += 3 * rng.normal(size=V).astype(np.float32)  # a supervised position: this one counts
    student = jnp.asarray(rng.normal(size=(2, Lq, V)), jnp.float32)
    base = {"tokens": rng.integers(0, V, (2, Lq)).astype(np.int32), "segment_ids": segment_ids,
            "loss_mask": loss_mask}
    keys = sample_keys(0, jnp.arange(2), Lq)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_grad(kind, logits):
        sel = (select_sampled(logits, 6, keys) if kind.startswith("sampled") else
               {"teacher_logits": logits} if kind.startswith("full") else select_topk(logits, 4))
        batch = {**base, **{k: sel[k] for k in L.FIELDS[kind]}}
        return jax.value_and_grad(lambda s: L.distill_loss(s, batch, kind=kind, alpha=0.6)[0])(
            student)

    def loss_and_grad(kind, logits):
        value, grad = value_and_grad(kind, jnp.asarray(logits))
        return float(value), np.asarray(grad)

    for kind in ("topk_kl", "topk_tail_kl", "topk_tail_jsd", "sampled_kl", "sampled_tv", "full_kl", "full_jsd"):
        value, grad = loss_and_grad(kind, teacher)
        value_altered, grad_altered = loss_and_grad(kind, altered)
        assert value_altered == pytest.approx(value, rel=1e-6), kind
        np.testing.assert_allclose(grad_altered, grad, rtol=1e-5, atol=1e-7, err_msg=kind)
        assert not grad[~loss_mask].any(), kind
        assert loss_and_grad(kind, at_target)[0] != pytest.approx(value, rel=1e-4), kind


# ------------------------------------------------------------------ training


@pytest.mark.slow
def test_train_offline_and_online_sampled(setup, tmp_path, capfd, monkeypatch):
    from logit_distill.train import epochs, teacher_metrics, train_student
    from logit_distill.train.loader import OnlineSource
    from logit_distill.selection import make_teacher_sampled
    from logit_distill.models import load_model
    from logit_distill.data import ExampleSource

    ref = str(tmp_path / "ref")
    run_dump(_config(setup, ref, codec="exact"))
    common = dict(student="preset:tiny-qwen3@1", num_steps=2, batch_size=4, progress=False, grad_accum=2)
    r = train_student(TrainConfig(store=ref, output=str(tmp_path / "off"), eval_store=ref, max_eval_examples=8,
                                  **common))
    assert np.isfinite(r.metrics["kd_loss"]) and r.metrics["kd_loss"] > 0
    assert "--eval-store is the training store" in capfd.readouterr().err
    # --eval-store on a sampled store: the KL estimated from its draws, as teacher_metrics computes it.
    s = store.open_store(ref)
    width = s.manifest["shapes"]["num_samples"]
    recs = [s.read(i) for i in range(8)]
    pad = lambda x: np.pad(x, ((0, 0), (0, width - x.shape[-1])))  # noqa: E731
    b = {k: np.stack([rec[k] if k in ("tokens", "positions", "segment_ids", "loss_mask") else pad(rec[k]) for rec in recs])
         for k in ("tokens", "positions", "segment_ids", "loss_mask", "sample_ids", "sample_counts", "sample_logprobs")}
    student = load_model(r.hf_dir)
    values = teacher_metrics.per_position(jax.jit(student.apply)(student.params, b["tokens"], b["positions"],
                                                        b["segment_ids"]), b)
    want = teacher_metrics.means(jax.device_get(teacher_metrics.sums(values, training_mask(b))))
    assert r.eval["teacher"]["kl_draws"] == pytest.approx(want["kl_draws"], rel=1e-4)
    assert r.eval["teacher"]["count"] == want["count"]
    with pytest.raises(InputError, match="does not fit"):
        train_student(TrainConfig(store=ref, output=str(tmp_path / "bad"), loss="topk_tail_jsd", **common))
    with pytest.raises(InputError, match="does not fit"):
        train_student(TrainConfig(store=ref, output=str(tmp_path / "bad"), loss="topk_tail_kl", **common))
    with pytest.raises(InputError, match="biased"):  # T != the store's proposal temperature
        train_student(TrainConfig(store=ref, output=str(tmp_path / "hot"), temperature=2.0, **common))
    assert not os.path.exists(tmp_path / "hot")
    capfd.readouterr()
    with pytest.raises(InputError, match="sampled_jsd needs temperature 1"):
        train_student(TrainConfig(store=ref, output=str(tmp_path / "hot"), temperature=2.0, loss="sampled_jsd",
                                  allow_biased_temperature=True, **common))
    assert not os.path.exists(tmp_path / "hot")
    from logit_distill.train.plan import plan_training

    hot = plan_training(TrainConfig(store=ref, output=str(tmp_path / "hot2"), temperature=2.0,
                                    allow_biased_temperature=True, **common))  # accepted, with the measured bias
    assert hot.settings["allow_biased_temperature"] and any("gradient is biased by about" in w for w in hot.warnings)
    # Online sampling with the dump's keys gives the stored draws (at the positions the masked store holds).
    teacher = load_model(setup["teacher"])
    ex = ExampleSource.open(setup["data"], teacher.tokenizer_path, seq_len=32, packing=True, seed=0)
    src = OnlineSource(ex)
    fn = make_teacher_sampled(teacher.apply, 16, seed=0)
    recs = [src[i] for i in (3, 9)]
    out = fn(teacher.params, *(np.stack([r[k] for r in recs]) for k in ("tokens", "positions", "segment_ids")),
             np.array([3, 9], np.int32))
    s = store.open_store(ref)
    for j, i in enumerate((3, 9)):
        rec = s.read(i)
        S, held = rec["sample_ids"].shape[1], rec["loss_mask"]
        assert held.sum() > len(held) // 2
        np.testing.assert_array_equal(np.asarray(out["sample_ids"][j])[held, :S], rec["sample_ids"][held])
        np.testing.assert_array_equal(np.asarray(out["sample_counts"][j])[held, :S], rec["sample_counts"][held])
    # Online draws change per epoch: 16 examples read from 8, the second epoch keyed as examples 8..15.
    seen = []
    draw_index = epochs.draw_index
    monkeypatch.setattr(epochs, "draw_index", lambda *a: seen.append((np.asarray(a[0]), draw_index(*a))) or seen[-1][1])
    on = train_student(TrainConfig(teacher=setup["teacher"], data=setup["data"], seq_len=32, samples=16, loss="sampled_kl",
                       num_examples=8, output=str(tmp_path / "on"), **common))
    assert np.isfinite(on.metrics["kd_loss"])
    examples = np.concatenate([e for e, _ in seen])
    keys = np.concatenate([k for _, k in seen]).astype(np.int64)
    assert len(examples) == 16 and sorted(examples[:8]) == list(range(8)) and sorted(examples[8:]) == list(range(8))
    np.testing.assert_array_equal(keys[:8], examples[:8])  # epoch 0: the dump's draws
    np.testing.assert_array_equal(keys[8:], examples[8:] + 8)


@pytest.mark.slow
def test_train_from_a_hybrid_store_is_hybrid_kl_against_float64(setup, hybrid_store, tmp_path):
    """One step on every example of a tiny hybrid store: its kd_loss is hybrid_kl of the student's
    initial logits, computed in float64 from the teacher's own logits and the stored draws."""
    from test_divergences import np_hybrid_kl
    from logit_distill.models import load_model
    from logit_distill.train import train_student
    from logit_distill.train.plan import plan_training

    ref = hybrid_store
    common = dict(student="preset:tiny-qwen3@1", num_steps=1, batch_size=24, progress=False)
    r = train_student(TrainConfig(store=ref, output=str(tmp_path / "off"), eval_store=ref, max_eval_examples=8,
                                  **common))
    # --eval-store on a hybrid store: its head's k + 1 bins, as a top-k store's (the draws are not read)
    assert {"kl_bins", "top1_agreement", "topk_mass"} <= set(r.eval["teacher"]) and r.eval["teacher"]["k"] == 4
    assert "kl_draws" not in r.eval["teacher"]
    import json

    with open(tmp_path / "off" / "train_config.json") as f:
        assert json.load(f)["loss"] == "hybrid_kl"  # the default loss of a hybrid store
    s = store.open_store(ref)
    recs = [s.read(i) for i in range(len(s))]
    b = {k: np.stack([rec[k] for rec in recs]) for k in ("tokens", "positions", "segment_ids", "loss_mask")}
    student, teacher = load_model("preset:tiny-qwen3@1"), load_model(setup["teacher"])
    z, t = (np.asarray(jax.jit(m.apply)(m.params, b["tokens"], b["positions"], b["segment_ids"]), np.float64)
            for m in (student, teacher))
    mask = np.asarray(training_mask(b))
    values = [np_hybrid_kl(z[e, j], t[e, j], {k: recs[e][k][None] for k in ("topk_ids", "sample_ids", "sample_counts")},
                           j, plogp=True) for e, j in zip(*np.nonzero(mask))]
    assert r.metrics["num_tokens"] == len(values) > 100
    assert r.metrics["kd_loss"] == pytest.approx(np.mean(values), rel=1e-4)
    # The head is a top-k record: the top-k losses read it; a sampled loss, T != t or an online run do not fit.
    assert plan_training(TrainConfig(store=ref, output=str(tmp_path / "p"), loss="topk_tail_kl", **common))
    for kw, match in ((dict(loss="sampled_kl"), "does not fit"), (dict(temperature=2.0), "biased"),
                      (dict(loss="topk_tail_kl", temperature=2.0), "or dump with --proposal-temperature 2$")):
        with pytest.raises(InputError, match=match):
            train_student(TrainConfig(store=ref, output=str(tmp_path / "bad"), **kw, **common))
    assert not os.path.exists(tmp_path / "bad")
    with pytest.raises(InputError, match="reads a hybrid store"):
        TrainConfig(teacher=setup["teacher"], data=setup["data"], seq_len=32, top_k=4, loss="hybrid_kl",
                    output=str(tmp_path / "on"), **common).check()


@pytest.mark.slow
def test_tempered_tail_store_and_refusal(setup, tmp_path, capfd):
    from logit_distill.train import train_student

    out = str(tmp_path / "t")
    run_dump(_config(setup, out, selection="topk", samples=None, top_k=8, tail_temperatures=(2.0,)))
    rec = store.open_store(out).read(0)
    assert rec["tail_logprob_tempered"].shape == (32, 1)
    common = dict(student="preset:tiny-qwen3@1", num_steps=1, batch_size=4, progress=False)
    r = train_student(TrainConfig(store=out, output=str(tmp_path / "a"), temperature=2.0, **common))
    assert np.isfinite(r.metrics["kd_loss"])
    with pytest.raises(InputError, match="holds it at 2"):
        train_student(TrainConfig(store=out, output=str(tmp_path / "b"), temperature=4.0, **common))
    capfd.readouterr()
    train_student(TrainConfig(store=out, output=str(tmp_path / "c"), loss="topk_kl", alpha=1.0, **common))
    assert "warning: --loss topk_kl with --alpha 1" in capfd.readouterr().err


def test_bad_sampled_flags_are_one_line_errors(setup, tmp_path, capsys):
    from logit_distill.cli import main as cli_main

    out = str(tmp_path / "s")
    r = cli(*dump_args(setup["teacher"], setup["data"], out, selection="sampled"))
    assert r.returncode == 2 and "--samples" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    # The hybrid selection's flags, in this process (nothing is loaded before the refusal).
    for flags, said in ((dict(selection="hybrid", samples=0), "needs --samples"),
                        (dict(selection="hybrid", samples=16, top_k=300), "--top-k must be <= 255"),
                        (dict(selection="hybrid", samples=16, tail_temperatures=2), "holds its tail mass at")):
        capsys.readouterr()
        assert cli_main(dump_args(setup["teacher"], setup["data"], out, **flags)) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("logit-distill dump: error: ") and said in err[0], err
    assert not os.path.exists(out)
