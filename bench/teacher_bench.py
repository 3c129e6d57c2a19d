"""Teacher figures: teacher_flop_utilization_{1024,4096}, attention_temp_bytes_ratio_8192_over_2048,
load_over_read_ratio, moe_teacher_flop_utilization, moe_over_dense_step_ratio.

Utilization is model FLOPs per second of the dump's jitted teacher step (forward + float32 top-k
selection, exactly the function the dump runs) over the FLOPs per second of a dense matmul of the
same dtype, the two timed alternately in this one process. Attention FLOPs are counted causal (half
the square); the selection's work is not counted (it is not FLOPs, it is the price of the output).
A mixture of experts counts its active parameters: the router, the k experts a token goes to, the
shared experts.
"""

from __future__ import annotations

import os
import time

import numpy as np

from . import common
from .common import BENCH_TEACHER, log


def _teacher_step(model, config_kw: dict):
    """The dump's teacher step (``dump.TeacherStep``) for a bench model, on every local device."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from logit_distill.dump import DumpConfig, TeacherStep
    from logit_distill.dump.teacher_step import dump_mesh

    config = DumpConfig(teacher="", data="", output="", **{"selection": "topk", **config_kw})
    compute = TeacherStep(model, config, dump_mesh(config))
    sharding = NamedSharding(compute.mesh, P("data"))

    def run(tokens, positions, segment_ids):
        index = np.arange(tokens.shape[0], dtype=np.int32)
        args = [jax.device_put(a, sharding) for a in (tokens, positions, segment_ids, index)]
        return compute.fn(compute.params, *args)

    return compute, run


# A 1.7B-parameter Qwen3-style teacher (Qwen3-1.7B's shapes) for the accelerator run.
DEVICE_TEACHER = common.qwen3_config(vocab_size=151936, hidden=2048, intermediate=6144, layers=28, heads=16,
                                     kv_heads=8, head_dim=128, max_len=8192)
# dense bfloat16 peaks from the vendors' data sheets (no sparsity), FLOP/s
_BF16_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "v5e": 197e12, "v5p": 459e12,
               "v6e": 918e12, "v4": 275e12}


def _random_params(cfg: dict, dtype: str):
    """Random weights made on the device (host numpy would take minutes at 1-2B parameters)."""
    import zlib

    import jax
    import jax.numpy as jnp

    from logit_distill.models import build_model, decoder, from_hf_config

    dc = from_hf_config(cfg)
    flat = {}
    for name, shape in decoder.expected_tensors(dc).items():
        if name.endswith("norm.weight"):
            flat[name] = jnp.ones(shape, dtype)
        else:
            key = jax.random.key(zlib.crc32(name.encode()))
            flat[name] = (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return build_model(cfg, decoder.unflatten(dc, flat), dtype=dtype, identity={"kind": "bench"})


def _inputs(B: int, L: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (B, L), dtype=np.int32)
    positions = np.tile(np.arange(L, dtype=np.int32), (B, 1))
    segment_ids = np.ones((B, L), np.int32)
    return tokens, positions, segment_ids


def _matmul_fn(n: int, dtype: str):
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), dtype)
    b = jnp.asarray(np.random.default_rng(1).normal(size=(n, n)), dtype)
    f = jax.jit(lambda a, b: a @ b)
    return lambda: jax.block_until_ready(f(a, b)), 2.0 * n**3


def utilization(size: dict, cfg: dict = BENCH_TEACHER, dtype: str = "float32", matmul_n: int | None = None,
                shapes=None, repeats: int | None = None, extra: dict | None = None) -> dict:
    """teacher_flop_utilization_<L> for each (B, L) of ``shapes``."""
    import jax

    from logit_distill.models import build_model, init_params

    shapes = shapes or size["teacher_shapes"]
    repeats = repeats or size["teacher_repeats"]
    matmul_n = matmul_n or size["teacher_matmul_n"]
    if jax.default_backend() == "cpu":
        model = build_model(cfg, init_params(cfg, 0, dtype), dtype=dtype, identity={"kind": "bench"})
    else:
        model = _random_params(cfg, dtype)
    mm, mm_flops = _matmul_fn(matmul_n, dtype)
    mm()
    out = {}
    for B, L in shapes:
        compute, run = _teacher_step(model, {"top_k": 64, "seq_len": L, "batch_size": B, "dtype": dtype,
                                             **(extra or {})})
        args = _inputs(B, L, cfg["vocab_size"])
        rounds = size.get(f"teacher_repeats_{L}", repeats)
        step = lambda: jax.block_until_ready(run(*args))  # noqa: E731
        t0 = time.perf_counter()
        step()
        compile_s = time.perf_counter() - t0
        t_step, _ = common.timed(step)
        t_mm, _ = common.timed(mm)
        # the matmul side repeated to last about as long as a step, so both sides of a round see the
        # same stretch of background load
        reps = max(1, round(t_step / max(t_mm, 1e-9)))
        mm_block = lambda: [mm() for _ in range(reps)]  # noqa: E731
        log(f"teacher: B={B} L={L}: {rounds} interleaved rounds (compile {compile_s:.1f} s, matmul x{reps})")
        times = common.interleave({"teacher_step": step, "matmul": mm_block}, rounds)
        times["matmul"] = [t / reps for t in times["matmul"]]
        flops = common.forward_flops_per_token(cfg, L) * B * L
        per_round = [(flops / t) / (mm_flops / m) for t, m in zip(times["teacher_step"], times["matmul"])]
        step_s = common.median(times["teacher_step"])
        mm_s = common.median(times["matmul"])
        out[f"teacher_flop_utilization_{L}"] = {
            "value": common.median(per_round),
            "details": {
                "teacher": _describe(cfg), "dtype": dtype, "batch": B, "seq_len": L, "top_k": 64,
                "devices": jax.device_count(), "backend": jax.default_backend(),
                "model_flops_per_step": flops, "teacher_step": common.summary(times["teacher_step"]),
                "matmul": {**common.summary(times["matmul"]), "size": matmul_n, "repeats_per_round": reps},
                "teacher_gflops_per_s": flops / step_s / 1e9, "matmul_gflops_per_s": mm_flops / mm_s / 1e9,
                "tokens_per_s": B * L / step_s, "compile_s": compile_s,
                "attention": compute.attention, "device_batch": compute.device_batch,
                **_spec_mfu(flops / step_s),
            },
        }
    return out


def moe_config(*, vocab_size: int, hidden: int, moe_intermediate: int, experts: int, top_k: int, layers: int,
               heads: int, kv_heads: int, head_dim: int, max_len: int = 4096, dense_intermediate: int = 0) -> dict:
    """A Qwen3-MoE-style HF config dict (as Qwen3-30B-A3B: every layer sparse, norm_topk_prob, qk-norm)."""
    cfg = common.qwen3_config(vocab_size=vocab_size, hidden=hidden, intermediate=dense_intermediate or 4 * hidden,
                              layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_len=max_len)
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", moe_intermediate_size=moe_intermediate,
               num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[])
    return cfg


# The MoE bench teacher: the bench teacher's attention and vocabulary with 64 experts, top-8, of 192 columns:
# a token's 8 x 192 active expert columns are the dense bench teacher's 1536 MLP columns (same active FLOPs).
MOE_BENCH_TEACHER = moe_config(vocab_size=32000, hidden=512, moe_intermediate=192, experts=64, top_k=8, layers=8,
                               heads=8, kv_heads=4, head_dim=64)
# The accelerator's MoE teacher: Qwen3-30B-A3B's shapes (48 layers, 128 experts top-8 of 768 columns, 3.3B
# active of 30.5B parameters), random bfloat16 weights.
DEVICE_MOE_TEACHER = moe_config(vocab_size=151936, hidden=2048, moe_intermediate=768, experts=128, top_k=8, layers=48,
                                heads=32, kv_heads=4, head_dim=128, max_len=8192, dense_intermediate=6144)


def moe_flops_per_token(cfg: dict, seq_len: int) -> float:
    """Active-parameter forward FLOPs per token: attention and head as ``common.forward_flops_per_token``,
    the router, the k experts of every MoE layer (no dense MLP in these configs)."""
    d, n, e, k, i = (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"],
                     cfg["moe_intermediate_size"])
    dense_mlp = 2.0 * n * 3 * d * cfg["intermediate_size"]
    return common.forward_flops_per_token(cfg, seq_len) - dense_mlp + 2.0 * n * (d * e + k * 3 * d * i)


def moe(size: dict, want: set) -> dict:
    """moe_teacher_flop_utilization (and on CPU moe_over_dense_step_ratio): the dump's teacher step of the
    MoE bench teacher, the dense bench teacher's and a dense matmul, alternated in one process."""
    import jax

    from logit_distill.models import build_model, init_params

    device = size.get("teacher_model") == "device"
    cfg = DEVICE_MOE_TEACHER if device else MOE_BENCH_TEACHER
    dtype = "bfloat16" if device else "float32"
    B, L = size["moe_shape"]
    repeats = size["teacher_repeats"]
    extra = {"attention": os.environ.get("LOGIT_DISTILL_BENCH_ATTENTION", "auto")} if device else {}
    if device:
        models = {"moe": _random_params(cfg, dtype)}
    else:  # the dense bench teacher too, for the ratio
        models = {"moe": build_model(cfg, init_params(cfg, 0, dtype), dtype=dtype, identity={"kind": "bench"}),
                  "dense": build_model(BENCH_TEACHER, init_params(BENCH_TEACHER, 0, dtype), dtype=dtype,
                                       identity={"kind": "bench"})}
    mm, mm_flops = _matmul_fn(size["teacher_matmul_n"], dtype)
    mm()
    steps, compile_s, computes = {}, {}, {}
    args = _inputs(B, L, cfg["vocab_size"])
    for name, model in models.items():
        compute, run = _teacher_step(model, {"top_k": 64, "seq_len": L, "batch_size": B, "dtype": dtype, **extra})
        steps[name] = (lambda run: lambda: jax.block_until_ready(run(*args)))(run)
        t0 = time.perf_counter()
        steps[name]()
        compile_s[name] = time.perf_counter() - t0
        computes[name] = compute
    t_step, _ = common.timed(steps["moe"])
    t_mm, _ = common.timed(mm)
    reps = max(1, round(t_step / max(t_mm, 1e-9)))
    log(f"moe teacher: B={B} L={L}: {repeats} interleaved rounds (compile {compile_s}, matmul x{reps})")
    times = common.interleave({**{f"{n}_step": f for n, f in steps.items()},
                               "matmul": lambda: [mm() for _ in range(reps)]}, repeats)
    times["matmul"] = [t / reps for t in times["matmul"]]
    flops = moe_flops_per_token(cfg, L) * B * L
    per_round = [(flops / t) / (mm_flops / m) for t, m in zip(times["moe_step"], times["matmul"])]
    step_s = common.median(times["moe_step"])
    mm_s = common.median(times["matmul"])
    details = {
        "teacher": _describe_moe(cfg), "dtype": dtype, "batch": B, "seq_len": L, "top_k": 64,
        "devices": jax.device_count(), "backend": jax.default_backend(),
        "active_flops_per_step": flops, "moe_step": common.summary(times["moe_step"]),
        "matmul": {**common.summary(times["matmul"]), "size": size["teacher_matmul_n"], "repeats_per_round": reps},
        "teacher_gflops_per_s": flops / step_s / 1e9, "matmul_gflops_per_s": mm_flops / mm_s / 1e9,
        "tokens_per_s": B * L / step_s, "compile_s": compile_s["moe"], "attention": computes["moe"].attention,
        "device_batch": computes["moe"].device_batch, **_spec_mfu(flops / step_s),
    }
    out = {"moe_teacher_flop_utilization": {"value": common.median(per_round), "details": details}}
    if "dense" in steps and "moe_over_dense_step_ratio" in want:
        dense_flops = common.forward_flops_per_token(BENCH_TEACHER, L) * B * L
        out["moe_over_dense_step_ratio"] = {
            "value": common.ratio(times, "moe_step", "dense_step"),
            "details": {"moe": _describe_moe(cfg), "dense": _describe(BENCH_TEACHER), "batch": B, "seq_len": L,
                        "moe_step": common.summary(times["moe_step"]),
                        "dense_step": common.summary(times["dense_step"]),
                        "active_flops_per_step_moe": flops, "flops_per_step_dense": dense_flops,
                        "what": "the dump's teacher step (forward + top-k) of the MoE bench teacher over the dense "
                                "bench teacher's, same active FLOPs per token, alternated in one process"},
        }
    return out


def _describe_moe(cfg: dict) -> str:
    return (f"Qwen3-MoE-style, {cfg['num_hidden_layers']} layers, width {cfg['hidden_size']}, "
            f"{cfg['num_experts']} experts top-{cfg['num_experts_per_tok']} of {cfg['moe_intermediate_size']} "
            f"columns, {cfg['num_attention_heads']} heads of {cfg['head_dim']}, vocab {cfg['vocab_size']}, "
            "random weights")


def _spec_mfu(flops_per_s: float) -> dict:
    """MFU against the data-sheet dense bfloat16 peak of a known accelerator (none on CPU)."""
    import jax

    kind = jax.devices()[0].device_kind
    for name, peak in _BF16_PEAKS.items():
        if name.lower() in kind.lower():
            return {"device_kind": kind, "datasheet_bf16_peak_flops": peak,
                    "mfu_vs_datasheet_bf16_peak": flops_per_s / peak}
    return {"device_kind": kind}


def _describe(cfg: dict) -> str:
    return (f"Qwen3-style, {cfg['num_hidden_layers']} layers, width {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']} heads of {cfg['head_dim']}, vocab {cfg['vocab_size']}, random weights")


def temp_bytes(size: dict, extra: dict | None = None) -> dict:
    """XLA's compiled memory analysis of the dump's teacher step: temporaries at L=8192 over L=2048."""
    import jax

    model = common.build(BENCH_TEACHER, 0)
    temps = {}
    for L in (2048, 8192):
        compute, run = _teacher_step(model, {"top_k": 64, "seq_len": L, "batch_size": 1, **(extra or {})})
        inputs = (*_inputs(1, L, BENCH_TEACHER["vocab_size"]), np.zeros(1, np.int32))  # + example_index
        args = [jax.device_put(a, jax.sharding.NamedSharding(compute.mesh, jax.sharding.PartitionSpec("data")))
                for a in inputs]
        compiled = compute.fn.lower(compute.params, *args).compile()
        temps[L] = int(compiled.memory_analysis().temp_size_in_bytes)
        attention = compute.attention
    return {
        "attention_temp_bytes_ratio_8192_over_2048": {
            "value": temps[8192] / temps[2048],
            "details": {"temp_bytes_2048": temps[2048], "temp_bytes_8192": temps[8192], "batch": 1,
                        "attention": attention, "teacher": _describe(BENCH_TEACHER),
                        "what": "compiled.memory_analysis().temp_size_in_bytes of the dump's teacher step; "
                                "linear memory gives 4, quadratic 16"},
        }
    }


# ~96M parameters, 384 MB of float32 in 46 tensors of 2-16 MB (published checkpoints hold tensors of
# 10-500 MB; the bench teacher's 0.25-1.5 MB tensors would measure Python's per-tensor overhead instead)
LOAD_TEACHER = common.qwen3_config(vocab_size=32000, hidden=1024, intermediate=4096, layers=4, heads=8, kv_heads=4,
                                   head_dim=128)


def load_over_read(size: dict) -> dict:
    """load_model of a checkpoint (every tensor on the device) over reading its files' bytes raw."""
    import jax
    from jax.sharding import Mesh

    from logit_distill.models import load_model

    path = common.save_checkpoint(LOAD_TEACHER, 0, os.path.join(common.OUT, "models", "load-teacher-w1024"))
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    nbytes = sum(os.path.getsize(f) for f in files)

    mesh = Mesh(np.array(jax.devices()), ("data",))

    def load():  # as the dump loads: onto its mesh, tensor by tensor
        m = load_model(path, mesh=mesh, shard_mode="replicate")
        jax.block_until_ready(m.params)

    def read():
        held = []  # every byte into one fresh host buffer per file, all held to the end like a loaded model
        for name in files:
            buf = np.empty(os.path.getsize(name), np.uint8)
            with open(name, "rb", buffering=0) as f:
                assert f.readinto(memoryview(buf)) == buf.size
            held.append(buf)
        return held

    load()
    read()
    times = common.interleave({"load": load, "read": read}, size["load_repeats"])
    return {
        "load_over_read_ratio": {
            "value": common.ratio(times, "load", "read"),
            "details": {"checkpoint_bytes": nbytes, "load": common.summary(times["load"]),
                        "read": common.summary(times["read"]), "storage": "local disk (page cache warm)",
                        "what": "load_model onto the dump's mesh (config, identity, headers, byte-range reads "
                                "into aligned buffers, placement) over one readinto per file of every "
                                "safetensors byte into a fresh host buffer, held to the end of the call as a "
                                "loaded model is"},
        }
    }


def teacher(size: dict, want: set) -> dict:
    out = {}
    if size.get("teacher_model") == "device":  # the accelerator run: 1.7B bfloat16 teacher at L=4096
        if want & {"teacher_flop_utilization_4096", "teacher_flop_utilization_1024"}:
            out.update(utilization(size, cfg=DEVICE_TEACHER, dtype="bfloat16",
                                   extra={"attention": os.environ.get("LOGIT_DISTILL_BENCH_ATTENTION", "auto")}))
    elif want & {"teacher_flop_utilization_1024", "teacher_flop_utilization_4096"}:
        out.update(utilization(size))
    if "attention_temp_bytes_ratio_8192_over_2048" in want:
        out.update(temp_bytes(size))
    if "load_over_read_ratio" in want:
        out.update(load_over_read(size))
    if want & {"moe_teacher_flop_utilization", "moe_over_dense_step_ratio"}:
        out.update(moe(size, want))
    return out
