"""The mixture-of-experts families against HF transformers (PyTorch, CPU, float32): Qwen3-MoE, gpt-oss,
DeepSeek-V3 (and a Kimi-K2-like variant), GLM-4.5; their quantized checkpoints (MXFP4, FP8 block scales)
against transformers' own dequantizing loads; the grouped matmuls against each other and float64 numpy.

Tiny random checkpoints keep each family's published settings (routing, shared experts, dense layers,
MLA, sinks, windows, YaRN, partial rotary) and shrink only the sizes; every parameter and buffer is
re-drawn so that routing, sinks and biases matter.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from logit_distill.errors import InputError  # noqa: E402
from logit_distill.models import load_model, moe, quantized, safetensors_io, save_hf_checkpoint  # noqa: E402
from test_models import _hf_logits, _hf_model  # noqa: E402  (random everything: weights, sinks, router biases)

TOL = 1e-4
V = 300
_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
         "original_max_position_embeddings": 64, "rope_theta": 10000.0}

HF_CONFIGS = {
    # Qwen/Qwen3-30B-A3B, sizes shrunk; a dense layer among the sparse ones (mlp_only_layers)
    "qwen3_moe": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=V, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False),
    # openai/gpt-oss-20b: sinks, sliding / full layers (window 128 -> 4), YaRN (original context 4096 -> 64)
    "gpt_oss": dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=V, hidden_size=64,
        intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=4, max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={**_YARN, "rope_theta": 150000.0, "truncate": False}, tie_word_embeddings=False),
    # deepseek-ai/DeepSeek-V3: MLA (q_lora), groups 8 of top-4 -> 4 of top-2, a shared expert, dense first
    # layer, YaRN with mscale / mscale_all_dim (here unequal, so both the rope and the softmax scale move);
    # dims multiples of 16 for the FP8 test's 16 x 16 blocks
    "deepseek_v3": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=V, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32,
        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, rope_interleave=True,
        rope_parameters={**_YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.8},
        max_position_embeddings=163840, tie_word_embeddings=False),
    # moonshotai/Kimi-K2 shape of DeepSeek-V3: one group, no q_lora (as DeepSeek-V2-Lite), rotate-half rope
    "deepseek_v3-kimi": dict(
        model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=V, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        rope_interleave=False, rope_theta=50000.0, max_position_embeddings=131072, tie_word_embeddings=False),
    # zai-org/GLM-4.5: partial rotary 0.5, q/k/v biases, qk-norm, sigmoid routing, shared expert, dense first
    "glm4_moe": dict(
        model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=V, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, attention_bias=True, use_qk_norm=True, rope_theta=1000000.0,
        max_position_embeddings=131072, tie_word_embeddings=False),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """name -> (checkpoint dir, HF model)."""
    out = {}
    for name, hf_config in HF_CONFIGS.items():
        d = tmp_path_factory.mktemp(name)
        model = _hf_model(hf_config)
        model.save_pretrained(d)
        out[name] = (str(d), model)
    return out


def _batch(B=2, L=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (B, L)).astype(np.int32)
    positions = np.tile(np.arange(L, dtype=np.int32), (B, 1))
    positions[1:] += 3000  # far positions: YaRN's interpolated frequencies matter there
    return tokens, positions, np.ones((B, L), np.int32)


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


def _assert_matches(ours, ref, k=8):
    assert np.abs(ref).max() > 1.0  # logits not trivially small
    lp, lp_ref = _log_softmax(ours), _log_softmax(ref)
    assert np.abs(lp - lp_ref).max() <= TOL
    np.testing.assert_array_equal(np.argsort(-lp, -1, kind="stable")[..., :k], np.argsort(-lp_ref, -1, kind="stable")[..., :k])


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_parity_with_transformers(ckpts, name):
    d, hf = ckpts[name]
    m = load_model(d)
    assert m.family == name.split("-")[0] and m.config.moe is not None
    # RoPE frequencies and YaRN's cos/sin factor exactly as transformers computes them
    np.testing.assert_allclose(m.config.inv_freq(0), hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-6)
    assert m.config.rope_scales[0] == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-6)
    tokens, positions, seg = _batch()
    ref = _hf_logits(hf, tokens, positions)
    ours = np.asarray(jax.jit(m.apply)(m.params, tokens, positions, seg))  # experts "auto": tiles on CPU
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    _assert_matches(ours, ref)


@pytest.mark.parametrize("name,attention", [("qwen3_moe", "dense"), ("glm4_moe", "dense"), ("gpt_oss", "dense"),
                                            ("gpt_oss", "blocked"), ("deepseek_v3", "blocked")])
def test_packed_documents_match_separate_runs(ckpts, name, attention, monkeypatch):
    from logit_distill.models import attention as attention_mod

    monkeypatch.setattr(attention_mod, "BLOCK", 8)  # blocked: 3 query blocks of the 20 positions
    d, hf = ckpts[name]
    m = load_model(d)
    rng = np.random.default_rng(1)
    la, lb, pad = 9, 7, 4  # gpt-oss window 4 < both lengths
    doc_a, doc_b = rng.integers(0, V, la), rng.integers(0, V, lb)
    tokens = np.concatenate([doc_a, doc_b, np.zeros(pad, int)])[None].astype(np.int32)
    positions = np.concatenate([np.arange(la), np.arange(lb), np.zeros(pad, int)])[None].astype(np.int32)
    seg = np.concatenate([np.full(la, 1), np.full(lb, 2), np.zeros(pad, int)])[None].astype(np.int32)
    ours = np.asarray(jax.jit(lambda p, t, q, s: m.apply(p, t, q, s, attention=attention))(m.params, tokens, positions, seg))
    assert np.isfinite(ours).all()  # padding rows too
    np.testing.assert_allclose(ours[0, :la], _hf_logits(hf, doc_a[None])[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(ours[0, la:la + lb], _hf_logits(hf, doc_b[None])[0], atol=TOL, rtol=0)


# ----------------------------------------------------------------------------- grouped matmuls


def _numpy_experts(cfg, ex, x, ids, weights):
    """float64: each token through each of its experts, one at a time."""
    ex = {k: np.asarray(v, np.float64) for k, v in ex.items()}
    out = np.zeros(x.shape, np.float64)
    limit = cfg.swiglu_limit
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[n, j]
            if cfg.layout == "interleaved":
                gu = x[n] @ ex["gate_up_proj"][e] + ex["gate_up_proj_bias"][e]
                g, u = gu[0::2], gu[1::2]
            else:
                gu = ex["gate_up_proj"][e] @ x[n]
                g, u = np.split(gu, 2)
            if limit is None:
                h = g / (1 + np.exp(-g)) * u
            else:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
                h = (u + 1) * g / (1 + np.exp(-cfg.swiglu_alpha * g))
            y = (h @ ex["down_proj"][e] + ex["down_proj_bias"][e]) if cfg.layout == "interleaved" \
                else ex["down_proj"][e] @ h
            out[n] += weights[n, j] * y
    return out


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_grouped_matmuls_agree_with_each_other_and_numpy(ckpts, name):
    m = load_model(ckpts[name][0])
    layer = 0
    p = m.params["model"]["layers"][layer]["mlp"]
    cfg = m.config.moe
    rng = np.random.default_rng(2)
    x = rng.normal(size=(61, m.config.hidden_size)).astype(np.float32)  # 122 pairs over 8 experts
    weights, ids = moe.route(cfg, p, x)
    ref = _numpy_experts(cfg, p["experts"], x.astype(np.float64), np.asarray(ids), np.asarray(weights, np.float64))
    flat = np.asarray(ids).reshape(-1)
    outs = {}

    @jax.jit
    def run_all(p, x):
        out = {f"tiles{tile}": moe.experts_tiles(cfg, p["experts"], x, flat, tile=tile).reshape(61, 2, -1)
               for tile in (4, 16, 128)}  # several tiles per expert, partial ones, one tile for all
        out = {k: jax.numpy.einsum("nkd,nk->nd", v, weights) for k, v in out.items()}
        out["ragged"] = moe.routed_experts(cfg, p, x, "ragged")
        # the share of a device holding experts 4..7 only: the other pairs contribute nothing
        half = {k: v[4:] for k, v in p["experts"].items()}
        out["part"] = moe.routed_experts(cfg, {**p, "experts": half}, x, "tiles", expert_offset=4)
        return out

    outs = {k: np.asarray(v) for k, v in run_all(p, x).items()}
    part = outs.pop("part")
    for key, got in outs.items():
        assert np.abs(got - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max()), key
    mask = np.asarray(ids) >= 4
    ref_part = _numpy_experts(cfg, p["experts"], x.astype(np.float64), np.asarray(ids),
                              np.where(mask, np.asarray(weights, np.float64), 0.0))
    assert np.abs(part - ref_part).max() <= 1e-5 * max(1.0, np.abs(ref_part).max())


def test_routing_ties_go_to_the_lower_expert():
    cfg = moe.MoeConfig(num_experts=8, top_k=3, intermediate_size=4, router="softmax")
    x = np.ones((2, 4), np.float32)
    w = np.zeros((8, 4), np.float32)
    w[[2, 5, 6]] = 1.0  # experts 2, 5, 6 tie at the top, the rest tie below
    _, ids = moe.route(cfg, {"gate": {"weight": w}}, x)
    np.testing.assert_array_equal(np.asarray(ids), [[2, 5, 6]] * 2)
    w[[2, 5, 6]] = 0.0  # all tie: the lowest indices
    _, ids = moe.route(cfg, {"gate": {"weight": w}}, x)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2]] * 2)


def test_bfloat16_load_keeps_the_routers_float32_parts(ckpts):
    d, hf = ckpts["deepseek_v3"]
    m = load_model(d, dtype="bfloat16")
    lp = m.params["model"]["layers"][1]["mlp"]
    assert lp["gate"]["e_score_correction_bias"].dtype == np.float32  # as transformers keeps it
    assert lp["experts"]["gate_up_proj"].dtype == jax.numpy.bfloat16
    tokens, positions, seg = _batch()
    ours = np.asarray(jax.jit(m.apply)(m.params, tokens, positions, seg))
    ref = _hf_logits(hf, tokens, positions)
    assert np.isfinite(ours).all() and (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


# ----------------------------------------------------------------------------- layouts


def test_fused_and_per_expert_layouts_load_alike(ckpts, tmp_path):
    """Qwen3-MoE as published (one tensor per expert) and with transformers 5's fused expert tensors."""
    d, hf = ckpts["qwen3_moe"]
    per_expert = load_model(d)
    names = safetensors_io.tensor_names(os.path.join(d, "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names  # transformers 5 saves per expert
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(os.path.join(d, "config.json"), fused / "config.json")
    from logit_distill.models import decoder

    safetensors_io.write_file(str(fused / "model.safetensors"),
                              {k: np.asarray(v) for k, v in decoder.flatten(per_expert.params).items()})
    loaded = load_model(str(fused))
    for a, b in zip(jax.tree.leaves(per_expert.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # an expert missing is named
    tensors = dict(safetensors_io.read_tensors(os.path.join(d, "model.safetensors")))
    del tensors["model.layers.2.mlp.experts.3.down_proj.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(os.path.join(d, "config.json"), broken / "config.json")
    safetensors_io.write_file(str(broken / "model.safetensors"), tensors)
    with pytest.raises(InputError, match=r"missing \(1\): model.layers.2.mlp.experts.down_proj.*"
                                         r"unexpected \(7\): model.layers.2.mlp.experts.0.down_proj.weight"):
        load_model(str(broken))


def test_multi_token_prediction_layers_are_ignored(ckpts, tmp_path):
    """DeepSeek-V3 publishes its MTP module as layer 61 (one past the last); transformers ignores it."""
    d, _ = ckpts["deepseek_v3"]
    out = tmp_path / "mtp"
    shutil.copytree(d, out)
    st = str(out / "model.safetensors")
    tensors = dict(safetensors_io.read_tensors(st))
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    safetensors_io.write_file(st, tensors)
    load_model(str(out))
    tensors["model.layers.2.extra.weight"] = np.zeros((2, 2), np.float32)
    safetensors_io.write_file(st, tensors)
    with pytest.raises(InputError, match=r"unexpected \(1\): model.layers.2.extra.weight"):
        load_model(str(out))


def test_export_loads_in_transformers(ckpts, tmp_path):
    """Experts written one tensor each, as transformers 5 writes and reads them."""
    d, _ = ckpts["qwen3_moe"]
    m = load_model(d)
    out = str(tmp_path / "export")
    save_hf_checkpoint(m, m.params, out)
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    tokens, positions, seg = _batch()
    np.testing.assert_allclose(_hf_logits(hf2.eval(), tokens, positions),
                               np.asarray(jax.jit(m.apply)(m.params, tokens, positions, seg)), atol=TOL, rtol=0)


# ----------------------------------------------------------------------------- quantized checkpoints

_FP4 = quantized.FP4_VALUES



def _assert_quantized_load_matches(ckpt: str, hf, hf_unquantized):
    """Our load of a quantized checkpoint against transformers' (dequantizing) load of it; the quantization
    moves the logits (the comparison is not of the unquantized model with itself)."""
    m = load_model(ckpt)
    tokens, positions, seg = _batch()
    ours = np.asarray(jax.jit(m.apply)(m.params, tokens, positions, seg))
    ref = _hf_logits(hf, tokens, positions)
    _assert_matches(ours, ref)
    assert np.abs(ref - _hf_logits(hf_unquantized, tokens, positions)).max() > 1e-2

def _quantize_mxfp4(w: np.ndarray):
    """float [..., n] -> (blocks [..., n/32, 16] uint8, exponents [..., n/32] uint8): each block's scale is
    the power of two that puts its largest magnitude at or under 6, each value the nearest E2M1."""
    x = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(x).max(-1)
    e = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    idx = np.abs((x / np.ldexp(1.0, e)[..., None])[..., None] - _FP4).argmin(-1).astype(np.uint8)
    return np.ascontiguousarray(idx[..., 0::2] | (idx[..., 1::2] << 4)), np.ascontiguousarray((e + 127).astype(np.uint8))


def test_mxfp4_checkpoint_matches_transformers(ckpts, tmp_path):
    """gpt-oss as published: experts in MXFP4 ``*_blocks`` / ``*_scales`` ([E, out, in/32, 16])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    d, hf_f32 = ckpts["gpt_oss"]
    out = tmp_path / "mxfp4"
    out.mkdir()
    tensors = {}
    for name, a in safetensors_io.read_tensors(os.path.join(d, "model.safetensors")):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantize_mxfp4(np.swapaxes(a, 1, 2))  # [E, in, out] -> blocks along "in"
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            np.testing.assert_array_equal(np.swapaxes(quantized.dequantize_mxfp4(blocks, scales), 1, 2), ref.numpy())
        else:
            tensors[name] = np.array(a)
    safetensors_io.write_file(str(out / "model.safetensors"), tensors)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(out / "config.json", "w"))
    # transformers dequantizes to bfloat16 on CPU (exact: E2M1 times a power of two); compare in float32
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), attn_implementation="eager", dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).float().eval()
    _assert_quantized_load_matches(str(out), hf, hf_f32)


def _quantize_fp8(w: np.ndarray, block: int):
    """[rows, cols] float -> (float8_e4m3fn weight, float32 scale_inv per block), as DeepSeek's checkpoints."""
    import ml_dtypes

    r, c = w.shape
    t = w.reshape(r // block, block, c // block, block)
    scale = 448.0 / np.abs(t).max(axis=(1, 3))
    q = np.clip(t * scale[:, None, :, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).reshape(r, c)
    return q, (1.0 / scale).astype(np.float32)


def test_fp8_checkpoint_matches_transformers(ckpts, tmp_path):
    """DeepSeek-V3 as published: every linear weight of the layers in FP8 with ``weight_scale_inv`` block
    scales (16 x 16 here; 128 x 128 published), experts one tensor each."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    d, hf_f32 = ckpts["deepseek_v3"]
    block = 16
    out = tmp_path / "fp8"
    out.mkdir()
    tensors = {}
    for name, a in safetensors_io.read_tensors(os.path.join(d, "model.safetensors")):
        quantize = (name.startswith("model.layers.") and name.endswith(".weight") and a.ndim == 2
                    and "norm" not in name and not name.endswith("mlp.gate.weight"))
        if quantize:
            q, s = _quantize_fp8(np.asarray(a), block)
            tensors[name], tensors[name[: -len("weight")] + "weight_scale_inv"] = q, s
            ref = Fp8Dequantize(None)._dequantize_one(torch.from_numpy(q.astype(np.float32)).to(torch.float8_e4m3fn),
                                                       torch.from_numpy(s), torch.float32)
            np.testing.assert_array_equal(quantized.dequantize_fp8(q, s, (block, block)), ref.numpy())
        else:
            tensors[name] = np.array(a)
    safetensors_io.write_file(str(out / "model.safetensors"), tensors)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [block, block]}
    json.dump(cfg, open(out / "config.json", "w"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), attn_implementation="eager", dtype=torch.float32,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(block, block))).eval()
    _assert_quantized_load_matches(str(out), hf, hf_f32)


def test_fp8_partial_blocks_and_row_ranges():
    """DeepSeek-V3's kv_a_proj_with_mqa is [576, 7168]: 4.5 blocks of 128 rows (transformers' Fp8Dequantize
    refuses shapes that do not divide; DeepSeek's own weight_dequant takes the last block partial)."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    rows, cols, block = 40, 24, (16, 16)
    q = rng.normal(size=(rows, cols)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2.0, size=(3, 2)).astype(np.float32)
    ref = np.array([[float(q[i, j]) * s[i // 16, j // 16] for j in range(cols)] for i in range(rows)])
    np.testing.assert_array_equal(quantized.dequantize_fp8(q, s, block), ref.astype(np.float32))
    part = quantized.dequantize_fp8(q[13:35], s, block, row_start=13, total_rows=rows)  # one shard's rows
    np.testing.assert_array_equal(part, ref[13:35].astype(np.float32))
    with pytest.raises(ValueError, match="FP8 scales"):
        quantized.dequantize_fp8(q, s[:2], block)


def test_unsupported_quantization_is_one_line(ckpts, tmp_path):
    d, _ = ckpts["qwen3_moe"]
    out = tmp_path / "awq"
    shutil.copytree(d, out)
    cfg = json.load(open(out / "config.json"))
    cfg["quantization_config"] = {"quant_method": "awq"}
    json.dump(cfg, open(out / "config.json", "w"))
    with pytest.raises(InputError, match="quant_method 'awq' is not supported"):
        load_model(str(out))


# ----------------------------------------------------------------------------- attention kernels

@pytest.mark.slow  # the kernels in interpret mode
@pytest.mark.parametrize("preset,impl", [("tiny-gpt-oss", "pallas_tpu"), ("tiny-deepseek-v3", "pallas_tpu"),
                                         ("tiny-deepseek-v3", "pallas_gpu")])
def test_pallas_kernels_with_sinks_and_latent_attention(preset, impl, monkeypatch):
    """The Pallas kernels in interpret mode: splash attention with gpt-oss's sinks (and its window), and
    DeepSeek's MLA (values of another head size, zero-padded for the kernels), against ``dense``.
    Padding rows attend to each other in the kernels: finite, not compared."""
    import functools

    from logit_distill.models import PRESETS, attention as attention_mod, build_model, decoder, init_params

    monkeypatch.setattr(attention_mod, "SPLASH_BLOCK", 128)
    monkeypatch.setattr(attention_mod, "PALLAS_BLOCK", 16)
    monkeypatch.setattr(attention_mod, "_INTERPRET", True)
    cfg = dict(PRESETS[preset], initializer_range=0.15)  # peaked attention
    m = build_model(cfg, init_params(cfg, 0, "float32"))
    L = 256 if impl == "pallas_tpu" else 48
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (1, L)).astype(np.int32)
    seg = np.zeros((1, L), np.int32)
    pos = np.zeros((1, L), np.int32)
    at = 0
    for s, n in ((1, L // 3), (2, L // 2)):
        seg[0, at:at + n], pos[0, at:at + n] = s, np.arange(n)
        at += n

    def logits(impl):
        return np.asarray(jax.jit(functools.partial(decoder.apply, m.config, attention=impl))(m.params, tokens, pos, seg))

    got, ref = logits(impl), logits("dense")
    assert np.isfinite(got).all() and np.abs(ref).max() > 1.0
    assert np.abs(got - ref)[seg > 0].max() <= 1e-5
