"""The teacher at speed: attention implementations, vocabulary-chunked selection, device batch,
tensor parallelism and streamed sharded loading, each against the reference computation."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logit_distill.errors import InputError
from logit_distill.models import PRESETS, build_model, decoder, init_params
from logit_distill.models import attention as attention_mod
from logit_distill.selection import (_uniforms, make_teacher_hybrid, make_teacher_sampled, make_teacher_topk,
                                     sample_keys, select_hybrid, select_hybrid_chunked, select_sampled,
                                     select_sampled_chunked, select_topk, select_topk_chunked, top_k_by_blocks)

from cpu_devices import env_with_cpu_devices

# every family, weights large enough for peaked attention; Gemma 3 with both softcaps as well
CONFIGS = {name: dict(PRESETS[f"tiny-{name}"], initializer_range=0.15)
           for name in ("qwen3", "qwen2", "llama3", "gemma3")}
CONFIGS["gemma3-softcaps"] = dict(CONFIGS["gemma3"], attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


def _model(name):
    cfg = CONFIGS[name]
    return build_model(cfg, init_params(cfg, 0, "float32"))


def _packed_batch(vocab, L=48, seed=0, lengths=((1, 13), (2, 20), (3, 9)), row1=40):
    """Row 0: three packed documents (segment, length) and padding; row 1: one document of ``row1``
    tokens at positions from 100, and padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (2, L)).astype(np.int32)
    seg = np.zeros((2, L), np.int32)
    pos = np.zeros((2, L), np.int32)
    at = 0
    for s, n in lengths:
        seg[0, at:at + n] = s
        pos[0, at:at + n] = np.arange(n)
        at += n
    seg[1, :row1] = 1
    pos[1, :row1] = np.arange(row1) + 100
    return tokens, pos, seg


def _logits(m, impl, batch):
    return np.asarray(jax.jit(functools.partial(decoder.apply, m.config, attention=impl))(m.params, *batch))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_blocked_attention_matches_dense(name, monkeypatch):
    """Several query blocks, packed and windowed, within 1e-5 in float32 (padding rows included)."""
    monkeypatch.setattr(attention_mod, "BLOCK", 16)
    m = _model(name)
    batch = _packed_batch(m.vocab_size)
    ref = _logits(m, "dense", batch)
    assert np.abs(ref).max() > 1.0
    assert np.abs(_logits(m, "blocked", batch) - ref).max() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma3"])
def test_pallas_gpu_kernel_matches_dense(name, monkeypatch):
    """jax's Pallas GPU flash kernel in interpret mode (Gemma's windowed layers fall back to blocked).
    Padding rows attend to each other in the kernel: finite, not compared (their values are unused)."""
    monkeypatch.setattr(attention_mod, "PALLAS_BLOCK", 16)
    monkeypatch.setattr(attention_mod, "_INTERPRET", True)
    m = _model(name)
    batch = _packed_batch(m.vocab_size)
    got = _logits(m, "pallas_gpu", batch)
    assert np.isfinite(got).all()
    real = batch[2] > 0
    assert np.abs(got - _logits(m, "dense", batch))[real].max() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_splash_attention_matches_dense(name, monkeypatch):
    """jax's splash attention (TPU) in interpret mode, every family: Gemma 3's sliding windows and both
    softcaps run in the kernel too. Padding rows attend to each other there: finite, not compared."""
    monkeypatch.setattr(attention_mod, "SPLASH_BLOCK", 128)  # the kernel's smallest block: 2 blocks
    monkeypatch.setattr(attention_mod, "_INTERPRET", True)
    m = _model(name)
    batch = _packed_batch(m.vocab_size, L=256, lengths=[(1, 70), (2, 100), (3, 60)], row1=230)
    got = _logits(m, "pallas_tpu", batch)
    assert np.isfinite(got).all()
    real = batch[2] > 0
    assert np.abs(got - _logits(m, "dense", batch))[real].max() <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_dump_step_runs_the_pallas_kernels(impl, monkeypatch):
    """The dump's jitted step (``shard_map`` over the batch, examples one at a time) with each Pallas
    kernel in interpret mode: the same top-k ids as with ``blocked``, log-probs within 1e-5."""
    from logit_distill.dump import DumpConfig, TeacherStep
    from logit_distill.dump.teacher_step import dump_mesh

    monkeypatch.setattr(attention_mod, "_INTERPRET", True)
    monkeypatch.setattr(attention_mod, "SPLASH_BLOCK", 128)
    m = _model("qwen3")
    tokens, pos, seg = _packed_batch(m.vocab_size, L=256, lengths=[(1, 256)], row1=256)
    out = {}
    for name in ("blocked", impl):
        config = DumpConfig(teacher="", data="", output="", selection="topk", top_k=8, seq_len=256, batch_size=2,
                            attention=name)
        compute = TeacherStep(m, config, dump_mesh(config))
        out[name] = compute.fetch(compute.dispatch({"tokens": tokens, "positions": pos, "segment_ids": seg},
                                                   np.arange(2)))
    np.testing.assert_array_equal(out[impl]["topk_ids"], out["blocked"]["topk_ids"])
    assert np.abs(out[impl]["topk_logprobs"] - out["blocked"]["topk_logprobs"]).max() <= 1e-5


def test_dump_attention_per_sharding_mode():
    """The Pallas kernels run in the replicated mode (inside shard_map); the sharded modes run blocked
    under auto and refuse an explicit kernel in one line."""
    from logit_distill.dump import DumpConfig
    from logit_distill.dump.teacher_step import dump_attention

    def pick(attention, sharding, backend, L=4096):
        return dump_attention(DumpConfig(teacher="", data="", output="", seq_len=L, attention=attention,
                                         sharding=sharding), backend)

    assert pick("auto", "replicate", "gpu") == "pallas_gpu"
    assert pick("auto", "replicate", "tpu") == "pallas_tpu"
    assert pick("auto", "replicate", "cpu") == "blocked"
    for sharding in ("fsdp", "tensor", "fsdp+tensor"):
        assert pick("auto", sharding, "gpu") == "blocked"
        assert pick("auto", sharding, "tpu", L=128) == "dense"
        assert pick("dense", sharding, "tpu") == "dense"
        with pytest.raises(InputError, match=re.escape("--attention pallas_tpu runs with --sharding replicate only") + ".*"
                           + re.escape(f"with --sharding {sharding} use --attention auto")):
            pick("pallas_tpu", sharding, "tpu")


def test_auto_attention_choice():
    r = attention_mod.resolve_attention
    assert r("auto", L=256, backend="cpu") == "dense"
    assert r("auto", L=4096, backend="cpu") == "blocked"
    assert r("auto", L=4096, backend="gpu") == "pallas_gpu"
    assert r("auto", L=4096, backend="tpu") == "pallas_tpu"
    assert r("auto", L=100, backend="tpu") == "dense"
    assert r("auto", L=100, backend="gpu") == "dense"
    assert r("dense", L=4096, backend="gpu") == "dense"
    with pytest.raises(InputError, match="unknown attention"):
        r("flash", L=16)


def _selection_cases(rng):
    V = 5000
    normal = rng.normal(size=(3, 40, V)) * 3
    ties = np.round(rng.normal(size=(2, 30, V)) * 2)  # thousands of equal logits, ties at the k-th
    peaked = np.full((1, 4, V), -100.0)
    peaked[..., :16] = 0.0  # the top-k hold all but e^-100 of the mass
    one_outside = rng.normal(size=(1, 4, V)) * 0.01 - np.log(V)
    one_outside[..., :16] = 5.0
    one_outside[..., 16] = 0.0  # a tail of about one entry's mass
    masked = rng.normal(size=(1, 4, V))
    masked[..., 100:] = -np.inf  # most of the vocabulary -inf; the tail is 84 finite entries
    all_masked_outside = np.full((1, 2, V), -np.inf)
    all_masked_outside[..., 7:23] = rng.normal(size=(1, 2, 16))  # exactly k finite entries: tail -inf
    odd = rng.normal(size=(2, 5, 4099))  # not a multiple of the block
    return dict(normal=normal, ties=ties, peaked=peaked, one_outside=one_outside, masked=masked,
                all_masked_outside=all_masked_outside, odd=odd)


def _selection_reference(x, k, T):
    """float64 numpy: ids by a stable sort (lower id first on ties), log-probs, tail and tempered tail."""
    ids = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    x64 = x.astype(np.float64)

    def lse(a):
        m = np.max(a, axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        with np.errstate(divide="ignore"):
            return np.log(np.exp(a - m).sum(-1)) + m[..., 0]

    rest = x64.copy()
    np.put_along_axis(rest, ids, -np.inf, -1)
    return (ids, np.take_along_axis(x64, ids, -1) - lse(x64)[..., None], lse(rest) - lse(x64),
            lse(rest / T) - lse(x64 / T))


@pytest.mark.parametrize("case", ["normal", "ties", "peaked", "one_outside", "masked", "all_masked_outside", "odd"])
def test_topk_selection_matches_numpy(case):
    """``select_topk`` (block top-k, one pass per sum) against float64 numpy: the same ids (ties to the
    lower id, as ``lax.top_k``), log-probs and tails within 5e-6, -inf tails where nothing is outside."""
    x = _selection_cases(np.random.default_rng(0))[case].astype(np.float32)
    k, T = 16, 2.0
    got = {key: np.asarray(v) for key, v in jax.jit(lambda a: select_topk(a, k, (T,)))(x).items()}
    ids, lp, tail, tail_t = _selection_reference(x, k, T)
    np.testing.assert_array_equal(got["topk_ids"], ids)
    np.testing.assert_allclose(got["topk_logprobs"], lp, rtol=0, atol=5e-6)
    for key, want in (("tail_logprob", tail), ("tail_logprob_tempered", tail_t)):
        value = got[key] if key == "tail_logprob" else got[key][..., 0]
        assert np.array_equal(np.isneginf(value), np.isneginf(want)), key
        finite = np.isfinite(want)
        np.testing.assert_allclose(value[finite], want[finite], rtol=0, atol=5e-6, err_msg=key)


@pytest.mark.parametrize("k", [1, 16, 65])
def test_block_top_k_is_lax_top_k(k):
    """Values and ids bit for bit those of ``jax.lax.top_k``, ties included (rounded logits, and equal
    maxima in many blocks), with a vocabulary that is not a multiple of the block."""
    rng = np.random.default_rng(k)
    for x in (rng.normal(size=(3, 50, 32003)), np.round(rng.normal(size=(3, 50, 32003))),
              np.repeat(np.round(rng.normal(size=(2, 8, 2001)) * 2), 16, axis=-1)):
        x = x.astype(np.float32)
        want = jax.jit(lambda a: jax.lax.top_k(a, k))(x)
        got = jax.jit(lambda a: top_k_by_blocks(a, k))(x)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3", "gemma3-softcaps"])
def test_vocabulary_chunked_selection_matches_full(name):
    """Chunks of 100 of a 512 vocabulary (6 chunks): the same ids; log-probs and tail within 3e-6 (a few float32
    ulps at these magnitudes) of the unchunked selection and no further than it (+3e-6) from float64;
    one chunk: bit for bit."""
    m = _model(name)
    batch = _packed_batch(m.vocab_size)
    k = 16
    logits = np.asarray(jax.jit(m.apply)(m.params, *batch))
    # the unchunked selection in one program with the forward, as the dump runs it
    ref = {key: np.asarray(v) for key, v in
           jax.jit(lambda p: select_topk(m.apply(p, *batch), k, (2.0,)))(m.params).items()}
    x64 = logits.astype(np.float64)
    lse = np.log(np.exp(x64 - x64.max(-1, keepdims=True)).sum(-1)) + x64.max(-1)
    rest = x64.copy()
    np.put_along_axis(rest, ref["topk_ids"], -np.inf, -1)
    tail64 = np.log(np.exp(rest - rest.max(-1, keepdims=True)).sum(-1)) + rest.max(-1) - lse
    lp64 = np.take_along_axis(x64, ref["topk_ids"], -1) - lse[..., None]
    split = dict(features=functools.partial(decoder.hidden, m.config),
                 head=functools.partial(decoder.head_logits, m.config), vocab_size=m.vocab_size)
    for chunk in (m.vocab_size, 100):
        got = make_teacher_topk(None, k, vocab_chunk=chunk, tail_temperatures=(2.0,), **split)(
            m.params, *batch, np.zeros(batch[0].shape[:1], np.int32))
        got = {key: np.asarray(v) for key, v in got.items()}
        np.testing.assert_array_equal(got["topk_ids"], ref["topk_ids"])
        assert np.abs(got["tail_logprob_tempered"] - ref["tail_logprob_tempered"]).max() <= 3e-6, chunk
        for key, f64 in (("topk_logprobs", lp64), ("tail_logprob", tail64)):
            if chunk == m.vocab_size:
                np.testing.assert_array_equal(got[key], ref[key])  # one chunk: the unchunked computation
            assert np.abs(got[key] - ref[key]).max() <= 3e-6, (chunk, key)
            # as close to float64 as the unchunked selection, give or take 3e-6 (the head's matmul over a
            # vocabulary slice rounds differently from the matmul over the whole vocabulary)
            assert np.abs(got[key] - f64).max() <= np.abs(ref[key] - f64).max() + 3e-6, (chunk, key)


@pytest.mark.slow
@pytest.mark.parametrize("name,t", [("qwen3", 1.0), ("gemma3-softcaps", 0.7)])
def test_vocabulary_chunked_sampling_matches_full(name, t):
    """The chunked sampled (and hybrid) selection draws the same ids with the same counts as the unchunked one for the
    same keys, chunks dividing the vocabulary of 512 or not; one chunk: bit for bit. Over the same logits
    (a head that slices them) log-probs agree within 1e-6; through the model's head within 5e-6 (a few float32
    ulps near -8: its matmul over a vocabulary slice rounds differently from the whole, by 2.2e-6 on some CPUs)."""
    m = _model(name)
    batch = _packed_batch(m.vocab_size)
    example_index = np.array([3, 11], np.int32)
    N = 32
    ref = make_teacher_sampled(m.apply, N, seed=7, proposal_temperature=t)(m.params, *batch, example_index)
    ref = {key: np.asarray(v) for key, v in ref.items()}
    assert (ref["sample_counts"] > 0).sum() > 2 * 48 * 2  # several distinct ids per position
    logits = jax.jit(m.apply)(m.params, *batch)
    keys = sample_keys(7, jnp.asarray(example_index), batch[0].shape[1])
    same_logits = {key: np.asarray(v) for key, v in jax.jit(lambda x: select_sampled(x, N, keys, t))(logits).items()}
    split = dict(features=functools.partial(decoder.hidden, m.config),
                 head=functools.partial(decoder.head_logits, m.config), vocab_size=m.vocab_size)
    for chunk in (m.vocab_size, 128, 100):
        got = make_teacher_sampled(None, N, seed=7, proposal_temperature=t, vocab_chunk=chunk, **split)(
            m.params, *batch, example_index)
        sliced = jax.jit(lambda x: select_sampled_chunked(
            lambda x, s, n: jax.lax.dynamic_slice_in_dim(x, s, n, axis=-1), x, m.vocab_size, N, keys, chunk, t))(
            logits)
        for out, lp_ref, bound in ((got, ref, 5e-6), (sliced, same_logits, 1e-6)):
            out = {key: np.asarray(v) for key, v in out.items()}
            np.testing.assert_array_equal(out["sample_ids"], lp_ref["sample_ids"], err_msg=str(chunk))
            np.testing.assert_array_equal(out["sample_counts"], lp_ref["sample_counts"], err_msg=str(chunk))
            if chunk == m.vocab_size:
                np.testing.assert_array_equal(out["sample_logprobs"], lp_ref["sample_logprobs"])
            assert np.abs(out["sample_logprobs"] - lp_ref["sample_logprobs"]).max() <= bound, chunk
    # the hybrid selection (head k = 16, 16 draws from the tail): the same head, draws and counts; one chunk bit
    # for bit (the dump's store bytes are then those of the unchunked selection)
    hyb = {key: np.asarray(v) for key, v in make_teacher_hybrid(m.apply, 16, 16, seed=7, proposal_temperature=t)(
        m.params, *batch, example_index).items()}
    for chunk in (m.vocab_size, 100):
        got = make_teacher_hybrid(None, 16, 16, seed=7, proposal_temperature=t, vocab_chunk=chunk, **split)(
            m.params, *batch, example_index)
        assert set(got) == set(hyb)
        for key, v in got.items():
            if chunk == m.vocab_size or hyb[key].dtype.kind == "i":
                np.testing.assert_array_equal(np.asarray(v), hyb[key], err_msg=f"{chunk} {key}")
            assert np.abs(np.asarray(v) - hyb[key]).max() <= 5e-6, (chunk, key)


@pytest.mark.slow
def test_vocabulary_chunked_sampling_memory_does_not_grow_with_the_vocabulary():
    """XLA's compiled memory analysis: the chunked selections' temporaries (sampled, top-k, hybrid) stay flat
    from V = 4096 to 16384 (chunks of 1024), while the unchunked selection's grow with V."""
    B, L, D, N = 1, 128, 32, 16

    def temp_bytes(V, chunk, topk=False):
        def f(W, x, example_index):
            keys = sample_keys(0, example_index, L)
            head = lambda x, s, n: jnp.einsum("bld,vd->blv", x, jax.lax.dynamic_slice_in_dim(W, s, n))
            if topk == "hybrid":
                if chunk is None:
                    return select_hybrid(head(x, 0, V), 8, N, keys)
                return select_hybrid_chunked(head, x, V, 8, N, keys, chunk)
            if topk:
                return select_topk_chunked(head, x, V, 8, chunk)
            if chunk is None:
                return select_sampled(head(x, 0, V), N, keys)
            return select_sampled_chunked(head, x, V, N, keys, chunk)

        shapes = [jax.ShapeDtypeStruct(s, d) for s, d in (((V, D), jnp.float32), ((B, L, D), jnp.float32),
                                                          ((B,), jnp.int32))]
        return jax.jit(f).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    full = [temp_bytes(V, None) for V in (4096, 16384)]
    chunked = [temp_bytes(V, 1024) for V in (4096, 16384)]
    assert full[1] > 3 * full[0]
    assert chunked[1] < 1.2 * chunked[0], chunked
    assert chunked[1] < full[1] / 3, (chunked, full)
    topk = [temp_bytes(V, 1024, topk=True) for V in (4096, 16384)]
    assert topk[1] < 1.2 * topk[0], topk
    hybrid = [temp_bytes(V, 1024, topk="hybrid") for V in (4096, 16384)]
    full_hybrid = temp_bytes(16384, None, topk="hybrid")
    assert hybrid[1] < 1.2 * hybrid[0] and hybrid[1] < full_hybrid / 3, (hybrid, full_hybrid)


@pytest.mark.slow
def test_device_batch_groups_examples_with_the_same_results():
    m = _model("qwen3")
    tokens, pos, seg = _packed_batch(m.vocab_size)
    tokens, pos, seg = (np.concatenate([a, a[::-1]]) for a in (tokens, pos, seg))  # 4 rows
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    index = np.arange(tokens.shape[0], dtype=np.int32)
    outs = [make_teacher_topk(m.apply, 8, mesh=mesh, device_batch=db)(m.params, tokens, pos, seg, index)
            for db in (1, 2)]
    for out in outs[1:]:
        np.testing.assert_allclose(np.asarray(out["topk_logprobs"]), np.asarray(outs[0]["topk_logprobs"]),
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("args,message", [
    (["--device-batch", "3"], "--device-batch 3 does not divide the 4 examples each device gets"),
    (["--model-parallel", "2"], "--model-parallel 2 needs --sharding tensor, fsdp+tensor, expert or fsdp+expert, not "
                                "replicate"),
    (["--sharding", "tensor", "--model-parallel", "3"], "--model-parallel 3 does not divide the 1 devices"),
    (["--attention", "pallas_tpu"], "--attention pallas_tpu runs on TPU only, and JAX's backend here is cpu"),
    (["--attention", "pallas_gpu"], "--attention pallas_gpu runs on GPU only, and JAX's backend here is cpu"),
])
def test_bad_settings_are_one_line_and_create_nothing(tmp_path, capsys, args, message):
    from logit_distill.cli import main

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": "abc " * 40}) for _ in range(8)))
    code = main(["dump", "--teacher", "preset:tiny-qwen3", "--data", str(data), "--output", str(tmp_path / "o"),
                 "--top-k", "4", "--seq-len", "16", "--batch-size", "4", "--num-steps", "1", "--quiet", *args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("logit-distill dump: error: ") and message in lines[-1], err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- 8 devices

_TP_SCRIPT = textwrap.dedent(
    """
    import json, sys, uuid, numpy as np, jax, gcsfs
    from logit_distill.dump import DumpConfig, TeacherStep
    from logit_distill.dump.teacher_step import dump_mesh
    from logit_distill.models import load_model, materialize_preset, shard_params, safetensors_io
    from logit_distill.models.sharding import make_mesh
    from logit_distill.selection import sample_keys, select_sampled, select_topk
    assert jax.device_count() == 8
    local = sys.argv[1]
    materialize_preset("tiny-qwen3", local)
    fs = gcsfs.GCSFileSystem(token="anon")
    bucket = "tp-" + uuid.uuid4().hex[:10]
    fs.mkdir(bucket)
    fs.put(local, f"{bucket}/teacher", recursive=True)
    gs = f"gs://{bucket}/teacher"

    m = load_model(local)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (4, 32)).astype(np.int32)
    positions = np.tile(np.arange(32, dtype=np.int32), (4, 1))
    seg = np.ones((4, 32), np.int32)
    seg[1, 20:] = 2
    ref = np.asarray(jax.jit(m.apply)(m.params, tokens, positions, seg))
    ref_sel = {k: np.asarray(v) for k, v in jax.jit(lambda p: select_topk(m.apply(p, tokens, positions, seg), 8))(m.params).items()}
    out = {}
    mesh = make_mesh(jax.devices(), 4)
    out["mesh"] = dict(mesh.shape)
    for mode in ("tensor", "fsdp+tensor"):
        p = shard_params(m.params, mesh, mode)
        got = np.asarray(jax.jit(m.apply)(p, tokens, positions, seg))
        out[mode] = float(np.abs(got - ref).max())
        lp = p["model"]["layers"][0]
        out[mode + "_specs"] = [str(lp["self_attn"]["q_proj"]["weight"].sharding.spec),
                                str(lp["mlp"]["down_proj"]["weight"].sharding.spec)]
        # the dump's step, 2-way data x 4-way model, the head over vocabulary chunks (of the sharded rows)
        config = DumpConfig(teacher="", data="", output="", selection="topk", top_k=8, seq_len=32, batch_size=4,
                            sharding=mode,
                            model_parallel=4, vocab_chunk=100)
        c = TeacherStep(m, config, dump_mesh(config))
        sel = c.fetch(c.dispatch({"tokens": tokens, "positions": positions, "segment_ids": seg}, np.arange(4)))
        out[mode + "_dump_logprobs"] = float(np.abs(sel["topk_logprobs"] - ref_sel["topk_logprobs"]).max())
        out[mode + "_dump_top1"] = bool((sel["topk_ids"][..., 0] == ref_sel["topk_ids"][..., 0]).all())
        config = DumpConfig(teacher="", data="", output="", seq_len=32, batch_size=4, sharding=mode,
                            model_parallel=4, vocab_chunk=100, selection="sampled", samples=16, seed=3)
        c = TeacherStep(m, config, dump_mesh(config))
        sel = c.fetch(c.dispatch({"tokens": tokens, "positions": positions, "segment_ids": seg}, np.arange(4)))
        ref_s = select_sampled(ref, 16, sample_keys(3, np.arange(4), 32))
        out[mode + "_dump_sampled_same"] = bool(all((np.asarray(ref_s[k]) == sel[k]).all()
                                                    for k in ("sample_ids", "sample_counts")))
        out[mode + "_dump_sampled_logprobs"] = float(np.abs(sel["sample_logprobs"] - ref_s["sample_logprobs"]).max())

    # streamed loading from gs:// straight into shards: each tensor's bytes read once per process
    read = {"bytes": 0}
    orig = safetensors_io.read_rows
    def counting(*a, **k):
        arr = orig(*a, **k)
        read["bytes"] += arr.nbytes
        return arr
    safetensors_io.read_rows = counting
    total = sum(a.nbytes for a in jax.tree.leaves(m.params))
    for mode in ("fsdp", "fsdp+tensor", "replicate"):
        read["bytes"] = 0
        m2 = load_model(gs, mesh=make_mesh(jax.devices(), 4 if "tensor" in mode else 1), shard_mode=mode)
        same = all(np.array_equal(np.asarray(a), np.asarray(b))
                   for a, b in zip(jax.tree.leaves(m2.params), jax.tree.leaves(m.params)))
        out["load_" + mode] = {"same": same, "read_over_total": read["bytes"] / total,
                               "embed_spec": str(m2.params["model"]["embed_tokens"]["weight"].sharding.spec)}
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_tensor_parallel_and_streamed_loading_on_eight_devices(tmp_path, gcs_emulator):
    env = env_with_cpu_devices(8)
    proc = subprocess.run([sys.executable, "-c", _TP_SCRIPT, str(tmp_path / "teacher")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    res = json.loads(line[len("RESULT"):])
    assert res["mesh"] == {"data": 2, "model": 4}
    for mode in ("tensor", "fsdp+tensor"):
        assert res[mode] <= 1e-5, res
        assert res[mode + "_dump_logprobs"] <= 1e-5 and res[mode + "_dump_top1"], res
        assert res[mode + "_dump_sampled_same"] and res[mode + "_dump_sampled_logprobs"] <= 1e-5, res
        q_spec, down_spec = res[mode + "_specs"]
        assert q_spec.startswith("P('model'") and down_spec.endswith("'model')"), res
    assert "data" in res["fsdp+tensor_specs"][0], res
    for mode in ("fsdp", "fsdp+tensor", "replicate"):
        assert res["load_" + mode]["same"], res
        # every byte read once (no whole-file or per-device re-reads)
        assert res["load_" + mode]["read_over_total"] == 1.0, res
    assert res["load_fsdp+tensor"]["embed_spec"] == "P('model', 'data')", res


def _np_tail_draws(logits, head, u, N, t):
    """float64: the systematic draws of ``(u + i) / N`` in the tail's tempered CDF, and each target's distance
    to the nearest step of it."""
    w = logits.astype(np.float64) / t
    w[head] = -np.inf
    w = np.exp(w - w.max())
    cdf = np.cumsum(w / w.sum())
    target = (u + np.arange(N)) / N
    draws = np.minimum(np.searchsorted(cdf, target, side="right"), np.flatnonzero(w > 0)[-1])
    return draws, np.abs(target[:, None] - cdf[None, :]).min()


def test_vocabulary_chunked_hybrid_matches_full():
    """The chunked hybrid selection over the same logits (a head that slices them), a vocabulary of 500 in
    chunks of 12 (fewer than the head's k = 16; not dividing 500): the same head; its log-probs, tails and
    tail_plogp within 1e-5 (42 chunks' logaddexps); the same draws and counts as the unchunked selection and
    float64 at every position where no target lies within 3e-6 of a step of the tail's cumulative distribution
    (there the chunks' sums, rounding differently, may move a draw to the neighbouring id); a position without
    a tail (k finite entries) draws id 0 N times in both. Tempered at
    t = 0.7; t = 1, one chunk and the model's head: test_vocabulary_chunked_sampling_matches_full."""
    B, L, V, k, N, chunk, t = 2, 32, 500, 16, 32, 12, 0.7
    x = (np.random.default_rng(3).normal(size=(B, L, V)) * 3.0).astype(np.float32)
    x[0, 0, k:] = -np.inf  # no tail: every draw on id 0, as unchunked
    logits = jnp.asarray(x)
    keys = sample_keys(7, jnp.arange(B), L)
    sliced = lambda x, s, n: jax.lax.dynamic_slice_in_dim(x, s, n, axis=-1)  # noqa: E731
    ref = {key: np.asarray(v) for key, v in jax.jit(lambda x: select_hybrid(x, k, N, keys, t))(logits).items()}
    got = {key: np.asarray(v) for key, v in
           jax.jit(lambda x: select_hybrid_chunked(sliced, x, V, k, N, keys, chunk, t))(logits).items()}
    assert set(got) == set(ref)
    np.testing.assert_array_equal(got["topk_ids"], ref["topk_ids"])
    for key in ("topk_logprobs", "tail_logprob", "tail_logprob_tempered", "tail_plogp"):
        np.testing.assert_allclose(got[key], ref[key], rtol=0, atol=1e-5, err_msg=key)
    for key in ("sample_ids", "sample_counts"):
        np.testing.assert_array_equal(got[key][0, 0], ref[key][0, 0], err_msg=key)
    np.testing.assert_allclose(got["sample_logprobs"][0, 0], ref["sample_logprobs"][0, 0], rtol=0, atol=1e-5)
    assert ref["sample_counts"][0, 0, 0] == N and ref["sample_ids"][0, 0, 0] == 0
    u = np.asarray(_uniforms(keys, 1))[..., 0].astype(np.float64)
    near = 0
    for b in range(B):
        for j in range(L):
            if (b, j) == (0, 0):
                continue
            draws, gap = _np_tail_draws(x[b, j], ref["topk_ids"][b, j], u[b, j], N, t)
            if gap < 3e-6:
                near += 1
                continue
            ids, counts = np.unique(draws, return_counts=True)
            for out in (ref, got):
                used = out["sample_counts"][b, j] > 0
                np.testing.assert_array_equal(out["sample_ids"][b, j][used], ids, err_msg=f"{b} {j}")
                np.testing.assert_array_equal(out["sample_counts"][b, j][used], counts, err_msg=f"{b} {j}")
            np.testing.assert_array_equal(got["sample_ids"][b, j], ref["sample_ids"][b, j])
            assert np.abs(got["sample_logprobs"][b, j] - ref["sample_logprobs"][b, j]).max() <= 1e-5
    assert near <= B * L // 4, near
