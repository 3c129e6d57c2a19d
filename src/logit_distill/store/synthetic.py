"""Synthetic but well-formed store content, for tests and benchmarks.

Log-probs are a real log-softmax of random logits, so every record satisfies
what verification checks (sorted, normalized, tail consistent).
"""

from __future__ import annotations

import numpy as np


def synthetic_step(manifest: dict, step: int, process: int, seed: int = 0) -> dict:
    """The records of one (step, process), deterministic in (seed, step, process)."""
    shapes, layout = manifest["shapes"], manifest["layout"]
    L, k, V = shapes["seq_len"], shapes["top_k"], shapes["vocab_size"]
    b = layout["examples_per_step"] // layout["num_processes"]
    rng = np.random.default_rng([seed, step, process])
    first = step * layout["examples_per_step"] + process * b
    tokens = rng.integers(0, V, size=(b, L), dtype=np.int32)
    # Two documents and a little padding per row.
    cut = max(1, L // 2)
    pad = L // 8
    segment_ids = np.ones((b, L), np.int32)
    segment_ids[:, cut:] = 2
    positions = np.tile(np.arange(L, dtype=np.int32), (b, 1))
    positions[:, cut:] -= cut
    if pad:
        segment_ids[:, L - pad:] = 0
        positions[:, L - pad:] = 0
    logits = rng.normal(scale=3.0, size=(b, L, V)).astype(np.float32)
    m = logits.max(-1, keepdims=True)
    logprobs = logits - (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))
    ids = np.argsort(-logprobs, axis=-1, kind="stable")[..., :k].astype(np.int32)
    top = np.take_along_axis(logprobs, ids, -1)
    mask = np.ones_like(logprobs, dtype=bool)
    np.put_along_axis(mask, ids, False, -1)
    rest = np.where(mask, logprobs, -np.inf)
    rm = rest.max(-1, keepdims=True)
    tail = (rm + np.log(np.exp(rest - rm).sum(-1, keepdims=True)))[..., 0] if k < V else np.full((b, L), -np.inf)
    return {
        "example_index": np.arange(first, first + b, dtype=np.int64),
        "tokens": tokens,
        "segment_ids": segment_ids,
        "positions": positions,
        "topk_ids": ids,
        "topk_logprobs": top.astype(np.float32),
        "tail_logprob": tail.astype(np.float32),
    }
