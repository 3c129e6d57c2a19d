"""Decoder configuration, read from an HF ``config.json`` dict.

One frozen dataclass (``DecoderConfig``) describes every family we support:
the dense Qwen3, Qwen2, Llama 3 and Gemma 3 (text), and the mixtures of
experts Qwen3-MoE, gpt-oss, DeepSeek-V3 / Kimi K2 and GLM-4.5.
``from_hf_config`` maps the ``config.json`` keys onto it. Both spellings are
read: the classic one found in published checkpoints (``rope_theta``,
``rope_scaling``, ``rope_local_base_freq``, ``sliding_window_pattern``,
``partial_rotary_factor``, ``num_experts``) and the one transformers 5 writes
(``rope_parameters``, ``layer_types``, ``num_local_experts``).

The mixture-of-experts block (``MoeConfig``) and multi-head latent attention
(``MlaConfig``) are switches beside the dense MLP and the standard attention;
``moe_layers`` says which layers hold an MoE block.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..errors import InputError
from . import rope as rope_mod
from .rope import SUPPORTED_ROPE_TYPES  # noqa: F401 (re-exported)

# architecture name in config.json -> our family name
ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama3",
    "Gemma3ForCausalLM": "gemma3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
}
MODEL_TYPES = {"qwen3": "qwen3", "qwen2": "qwen2", "llama": "llama3", "gemma3_text": "gemma3",
               "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss", "deepseek_v3": "deepseek_v3",
               "kimi_k2": "deepseek_v3", "glm4_moe": "glm4_moe"}
FAMILIES = ("qwen3", "qwen2", "llama3", "gemma3", "qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe")
MOE_FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe")
ROUTERS = ("softmax", "topk_softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts block: router, routed experts, optional shared experts.

    Routers (transformers' code, per family):
    - ``softmax`` (Qwen3-MoE): softmax over all experts, the top-k of it, renormalized if ``norm_topk_prob``.
    - ``topk_softmax`` (gpt-oss): the top-k router logits (with the router's bias), softmax over those k.
    - ``sigmoid`` (DeepSeek-V3, GLM-4.5): sigmoid scores; the choice adds ``e_score_correction_bias`` and
      keeps the ``topk_group`` of ``n_group`` groups with the largest sum of their top-2; the weights are
      the chosen experts' scores (without the bias), renormalized if ``norm_topk_prob``, times
      ``routed_scaling_factor``.

    Expert tensors (``layout``): ``concatenated`` is transformers 5's ``gate_up_proj`` [E, 2I, D] (gate
    rows, then up rows) and ``down_proj`` [E, D, I]; ``interleaved`` is gpt-oss's ``gate_up_proj``
    [E, D, 2I] (gate and up in alternate columns), ``down_proj`` [E, I, D], with biases. ``swiglu_limit``
    set: gpt-oss's clamped SwiGLU (gate clamped above, up clamped both sides, ``(up + 1) * gate *
    sigmoid(1.702 gate)``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    router_bias: bool = False
    score_correction_bias: bool = False
    shared_intermediate_size: int = 0
    layout: str = "concatenated"
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """DeepSeek-V3's multi-head latent attention (``q_lora_rank`` None: a plain ``q_proj``)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Everything the forward pass needs; hashable, so it can be a static jit argument."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection
    mlp_bias: bool
    qk_norm: bool  # RMSNorm over head_dim of q and k (Qwen3, Gemma 3)
    gemma_norms: bool  # (1 + w) RMSNorm, pre/post feedforward norms, embedding scale
    activation: str  # "silu" | "gelu_tanh"
    query_scale: float  # multiplies q k^T
    # per layer: sliding window (None = full attention) and index into rope_inv_freqs
    layer_windows: tuple
    layer_rope: tuple
    # one tuple of float32 inverse frequencies per distinct rope setting (0 = global, 1 = local)
    rope_inv_freqs: tuple
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # per rope setting: the factor on cos and sin (YaRN's attention_factor; 1 otherwise)
    rope_scales: tuple = (1.0,)
    rotary_dim: int | None = None  # rotated dims of each head (None: all; GLM-4.5 rotates half)
    rope_interleave: bool = False  # DeepSeek: rotary pairs are adjacent dims
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins every softmax
    norm_scale_float32: bool = False  # gpt-oss: (w * x) in float32, then cast
    mla: MlaConfig | None = None
    moe: MoeConfig | None = None
    moe_layers: tuple = ()  # per layer: True where the MLP is the MoE block

    def inv_freq(self, i: int) -> np.ndarray:
        return np.asarray(self.rope_inv_freqs[i], dtype=np.float32)

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and bool(self.moe_layers[i])


def family_of(hf_config: dict) -> str:
    """Our family name for an HF config, or an InputError naming what is unsupported."""
    archs = hf_config.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if not archs and hf_config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf_config["model_type"]]
    what = ", ".join(archs) if archs else f"model_type {hf_config.get('model_type')!r}"
    raise InputError(
        f"unsupported architecture {what}; supported: {', '.join(sorted(ARCHITECTURES))} "
        f"(model_type {', '.join(sorted(MODEL_TYPES))})"
    )


def _rope_settings(hf: dict, family: str) -> tuple[dict, dict | None]:
    """(global rope dict, local rope dict or None) from either config spelling."""
    rp = hf.get("rope_parameters")
    if family == "gemma3":
        if isinstance(rp, dict) and "full_attention" in rp:
            glob = dict(rp["full_attention"])
            loc = dict(rp.get("sliding_attention") or {"rope_theta": 10000.0})
        else:
            glob = {"rope_theta": hf.get("rope_theta", 1_000_000.0)}
            if hf.get("rope_scaling"):
                glob.update(hf["rope_scaling"])
            loc = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
        loc.setdefault("rope_theta", 10000.0)
        glob.setdefault("rope_theta", 1_000_000.0)
        return glob, loc
    if isinstance(rp, dict) and rp:
        glob = dict(rp)
    else:
        glob = {"rope_theta": hf.get("rope_theta", 10000.0)}
        if hf.get("rope_scaling"):
            glob.update(hf["rope_scaling"])
    if hf.get("partial_rotary_factor") is not None:
        glob.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    if family == "glm4_moe":  # transformers' Glm4MoeConfig default
        glob.setdefault("partial_rotary_factor", 0.5)
    return glob, None


def _layer_types(hf: dict, family: str, n: int) -> list[str]:
    lt = hf.get("layer_types")
    if lt:
        if len(lt) != n:
            raise InputError(f"config.json: layer_types has {len(lt)} entries, num_hidden_layers is {n}")
        return list(lt)
    if family == "gemma3":
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if family == "gpt_oss":  # transformers' default: sliding, full, sliding, ...
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if family == "qwen3_moe" and hf.get("use_sliding_window") and hf.get("sliding_window"):
        return ["sliding_attention"] * n
    if family in ("qwen2", "qwen3") and hf.get("use_sliding_window") and hf.get("sliding_window"):
        mwl = int(hf.get("max_window_layers", n))
        return ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def _int(hf: dict, *keys, default=None):
    for key in keys:
        if hf.get(key) is not None:
            return int(hf[key])
    if default is None:
        raise InputError(f"config.json lacks required key {keys[0]!r}")
    return default


def _moe_config(hf: dict, family: str) -> tuple[MoeConfig | None, tuple]:
    """The MoE block and which layers hold it (an empty tuple for dense families)."""
    if family not in MOE_FAMILIES:
        return None, ()
    n = int(hf["num_hidden_layers"])
    num_experts = _int(hf, "num_experts", "num_local_experts", "n_routed_experts")
    top_k = _int(hf, "num_experts_per_tok", "experts_per_token")
    if family == "qwen3_moe":
        step = _int(hf, "decoder_sparse_step", default=1)
        dense = set(hf.get("mlp_only_layers") or [])
        layers = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(n))
        moe = MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=_int(hf, "moe_intermediate_size"),
                        router="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    elif family == "gpt_oss":
        layers = (True,) * n
        moe = MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=_int(hf, "intermediate_size"),
                        router="topk_softmax", router_bias=True, layout="interleaved",
                        swiglu_limit=float(hf.get("swiglu_limit") or 7.0))
    else:  # deepseek_v3, glm4_moe
        first_dense = _int(hf, "first_k_dense_replace", default=0)
        layers = tuple(i >= first_dense for i in range(n))
        n_group = _int(hf, "n_group", default=1)
        if num_experts % n_group:
            raise InputError(f"config.json: n_routed_experts {num_experts} is not divisible by n_group {n_group}")
        moe = MoeConfig(
            num_experts=num_experts, top_k=top_k, intermediate_size=_int(hf, "moe_intermediate_size"),
            router="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0), n_group=n_group,
            topk_group=_int(hf, "topk_group", default=1), score_correction_bias=True,
            shared_intermediate_size=_int(hf, "moe_intermediate_size") * _int(hf, "n_shared_experts", default=0))
    scoring, method = hf.get("scoring_func"), hf.get("topk_method")
    if family == "deepseek_v3" and (scoring not in (None, "sigmoid") or method not in (None, "noaux_tc")):
        raise InputError(f"config.json: scoring_func {scoring!r} / topk_method {method!r} are not supported "
                         "(DeepSeek-V3 and Kimi K2 use sigmoid / noaux_tc)")
    if top_k > num_experts:
        raise InputError(f"config.json: num_experts_per_tok {top_k} exceeds the {num_experts} experts")
    return moe, layers


def from_hf_config(hf: dict) -> DecoderConfig:
    family = family_of(hf)
    try:
        hidden = int(hf["hidden_size"])
        n_heads = int(hf["num_attention_heads"])
        n_layers = int(hf["num_hidden_layers"])
        cfg_vocab = int(hf["vocab_size"])
        inter = int(hf["intermediate_size"])
    except KeyError as e:
        raise InputError(f"config.json lacks required key {e.args[0]!r}") from None
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    max_pos = int(hf.get("max_position_embeddings") or 0)
    eps = float(hf.get("rms_norm_eps", 1e-6))
    tie = bool(hf.get("tie_word_embeddings", family == "gemma3"))
    attention_bias = bool(hf.get("attention_bias", family == "gpt_oss"))

    mla = None
    if family == "deepseek_v3":
        mla = MlaConfig(q_lora_rank=int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
                        kv_lora_rank=_int(hf, "kv_lora_rank"), qk_nope_head_dim=_int(hf, "qk_nope_head_dim"),
                        qk_rope_head_dim=_int(hf, "qk_rope_head_dim"), v_head_dim=_int(hf, "v_head_dim"))
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim  # of q and k; values have v_head_dim
        n_kv = n_heads  # every head has its own keys and values (expanded from the latent)
    else:
        head_dim = int(hf.get("head_dim") or hidden // n_heads)

    glob, loc = _rope_settings(hf, family)
    rope_dim = mla.qk_rope_head_dim if mla else int(head_dim * float(glob.get("partial_rotary_factor", 1.0)))
    types = _layer_types(hf, family, n_layers)
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window"):
        window = None
    if family in ("deepseek_v3", "glm4_moe"):
        window = None
    freqs, scales = zip(*[rope_mod.inv_freq(rope_dim, r, max_pos) for r in ([glob] if loc is None else [glob, loc])])
    layer_windows, layer_rope = [], []
    for t in types:
        sliding = t == "sliding_attention" and window is not None
        layer_windows.append(int(window) if sliding else None)
        layer_rope.append(1 if (sliding and loc is not None) else 0)

    if family == "gemma3":
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        qpas = hf.get("query_pre_attn_scalar") or head_dim
        query_scale = float(qpas) ** -0.5
    else:
        act = hf.get("hidden_act", "silu")
        query_scale = head_dim**-0.5
    if mla is not None and (glob.get("rope_type") or glob.get("type") or "default") != "default":
        # DeepSeek-V3: YaRN's mscale_all_dim also tempers the softmax (transformers' DeepseekV3Attention)
        if glob.get("mscale_all_dim"):
            mscale = rope_mod.yarn_mscale(float(glob["factor"]), float(glob["mscale_all_dim"]))
            query_scale = query_scale * mscale * mscale
    acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    if act not in acts:
        raise InputError(f"unsupported activation {act!r}; supported: {', '.join(acts)}")

    moe, moe_layers = _moe_config(hf, family)
    if family == "qwen2":
        qkv_bias, o_bias = True, False
    elif family == "glm4_moe":  # GLM-4.5: q/k/v biases, no o_proj bias
        qkv_bias, o_bias = attention_bias, False
    else:
        qkv_bias, o_bias = attention_bias, attention_bias
    return DecoderConfig(
        family=family,
        vocab_size=cfg_vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=eps,
        tie_embeddings=tie,
        max_position_embeddings=max_pos,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)) if family == "llama3" else False,
        qk_norm=family in ("qwen3", "gemma3", "qwen3_moe") or (family == "glm4_moe" and bool(hf.get("use_qk_norm"))),
        gemma_norms=family == "gemma3",
        activation=acts[act],
        query_scale=query_scale,
        layer_windows=tuple(layer_windows),
        layer_rope=tuple(layer_rope),
        rope_inv_freqs=tuple(freqs),
        attn_logit_softcapping=(
            float(hf["attn_logit_softcapping"]) if hf.get("attn_logit_softcapping") else None
        ),
        final_logit_softcapping=(
            float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping") else None
        ),
        rope_scales=tuple(scales),
        rotary_dim=None if (mla or rope_dim == head_dim) else rope_dim,
        rope_interleave=mla is not None and bool(hf.get("rope_interleave", True)),
        attention_sinks=family == "gpt_oss",
        norm_scale_float32=family == "gpt_oss",
        mla=mla,
        moe=moe,
        moe_layers=moe_layers,
    )
