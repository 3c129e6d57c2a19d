"""Shared pieces of the benchmarks: environment, side-by-side timing, model configs, the GCS emulator."""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "bench", "out")


def setup_environment() -> None:
    """Before logit_distill / jax / gcsfs are imported: caches under bench/out, and the GCS
    emulator's variables (gcsfs reads them at import), on a free loopback port."""
    os.makedirs(OUT, exist_ok=True)
    os.environ.setdefault("LOGIT_DISTILL_CACHE", os.path.join(OUT, "cache"))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if not os.environ.get("STORAGE_EMULATOR_HOST"):
        from logit_distill.emulator import free_port  # imports neither jax nor gcsfs

        os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{free_port()}"
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"


def enable_compile_cache() -> None:
    """A persistent XLA cache: functions rebuilt per run (``run_dump`` jits a new closure each
    call) then load their executable instead of compiling it again inside a timed span."""
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.join(OUT, "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def fresh_dir(*parts: str) -> str:
    path = os.path.join(OUT, *parts)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    return path


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- timing


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def interleave(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Run every fn once per round, in turn (A, B, A, B, ...); return each one's wall times.

    Alternating inside one process is what makes a ratio meaningful on a machine shared with
    other work: both sides see the same background load, and medians drop the outliers."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        names = list(fns) if r % 2 == 0 else list(reversed(list(fns)))  # no fixed first/last slot
        for name in names:
            dt, _ = timed(fns[name])
            times[name].append(dt)
    return times


def median(xs) -> float:
    return float(statistics.median(xs))


def summary(xs) -> dict:
    xs = [float(x) for x in xs]
    return {"median_s": median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs), "all_s": xs}


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num[r] / den[r]: each round's two sides ran back to back, so a load that
    drifts over minutes cancels within the round (a ratio of medians would mix rounds)."""
    assert len(num) == len(den) and num, (len(num), len(den))
    return median([n / d for n, d in zip(num, den)])


def ratio(times: dict, num: str, den: str) -> float:
    return paired_ratio(times[num], times[den])


# ----------------------------------------------------------------------------- models


def qwen3_config(*, vocab_size: int, hidden: int, intermediate: int, layers: int, heads: int,
                 kv_heads: int, head_dim: int, max_len: int = 4096) -> dict:
    """A Qwen3-style HF config dict (as Qwen3: qk-norm, tied embeddings, rope_theta 1e6)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


# The bench teacher: 8 layers, width 512, vocabulary 32k.
BENCH_TEACHER = qwen3_config(vocab_size=32000, hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4,
                             head_dim=64)
# The student of the training figures: same vocabulary, width 128, 4 layers.
BENCH_STUDENT = qwen3_config(vocab_size=32000, hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2,
                             head_dim=32)


def forward_flops_per_token(cfg: dict, seq_len: int) -> float:
    """2 x matmul parameters (+ the LM head) + causal attention scores and values, per token."""
    d, f, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    h, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
    attn = 2 * h * hd * seq_len / 2  # QK^T and PV, half the positions on average (causal)
    return 2.0 * (n * per_layer + d * cfg["vocab_size"]) + 2.0 * n * attn


def build(cfg: dict, seed: int):
    from logit_distill.models import build_model, init_params

    return build_model(cfg, init_params(cfg, seed, "float32"), identity={"kind": "bench", "seed": seed})


def save_checkpoint(cfg: dict, seed: int, out_dir: str) -> str:
    """An HF checkpoint directory of ``cfg`` with random weights (no tokenizer: data is pre-tokenized)."""
    from logit_distill.models import save_hf_checkpoint

    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    loaded = build(cfg, seed)
    save_hf_checkpoint(loaded, loaded.params, out_dir)
    return out_dir


def random_documents(num_docs: int, vocab_size: int, min_len: int, max_len: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab_size, size=int(rng.integers(min_len, max_len + 1)), dtype=np.int32)
            for _ in range(num_docs)]


def fake_step(manifest: dict, step: int, process: int = 0, seed: int = 0) -> dict:
    from logit_distill.store.synthetic import synthetic_step

    return synthetic_step(manifest, step, process, seed)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
               if os.path.isfile(os.path.join(path, n)))


# ----------------------------------------------------------------------------- GCS emulator


@contextlib.contextmanager
def gcs_emulator():
    """gcp-storage-emulator on the port of STORAGE_EMULATOR_HOST, in memory."""
    from logit_distill.emulator import gcs_emulator as run_emulator

    with run_emulator(int(os.environ["STORAGE_EMULATOR_HOST"].rsplit(":", 1)[1])) as url:
        yield url


def make_bucket(name: str) -> str:
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon")
    fs.mkdir(name)
    return f"gs://{name}"
