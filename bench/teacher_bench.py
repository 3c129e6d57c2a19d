"""Teacher figures: teacher_flop_utilization_{1024,4096}, attention_temp_bytes_ratio_8192_over_2048,
load_over_read_ratio.

Utilization is model FLOPs per second of the dump's jitted teacher step (forward + float32 top-k
selection, exactly the function the dump runs) over the FLOPs per second of a dense matmul of the
same dtype, the two timed alternately in this one process. Attention FLOPs are counted causal (half
the square); the selection's work is not counted (it is not FLOPs, it is the price of the output).
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

    config = DumpConfig(teacher="", data="", output="", **config_kw)
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
        log(f"teacher: B={B} L={L}: {repeats} interleaved rounds (compile {compile_s:.1f} s, matmul x{reps})")
        times = common.interleave({"teacher_step": step, "matmul": mm_block}, repeats)
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
        args = [jax.device_put(a, jax.sharding.NamedSharding(compute.mesh, jax.sharding.PartitionSpec("data")))
                for a in _inputs(1, L, BENCH_TEACHER["vocab_size"])]
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
    return out
