"""Synthetic but well-formed store content, for tests and benchmarks.

Every record satisfies what verification checks: distinct ids, log-probs
sorted descending, top-k mass plus tail mass equal to one; each row holds two
documents and some padding (and, in a masked store, a loss mask of supervised stretches). Cheap at any vocabulary size (no [L, V] logits).
"""

from __future__ import annotations

import numpy as np

from ..codec import next_token_mask
from .layout import StoreLayout
from .manifest import masked_of


def synthetic_step(manifest: dict, step: int, process: int = 0, seed: int = 0) -> dict:
    """The records of one (step, process), deterministic in (seed, step, process)."""
    shapes, layout = manifest["shapes"], StoreLayout.of(manifest)
    L, k, V = shapes["seq_len"], shapes["top_k"], shapes["vocab_size"]
    b = layout.examples_per_process
    rng = np.random.default_rng([seed, step, process])
    tokens = rng.integers(0, V, size=(b, L), dtype=np.int32)
    cut, pad = max(1, L // 2), L // 8
    segment_ids = np.ones((b, L), np.int32)
    segment_ids[:, cut:] = 2
    positions = np.tile(np.arange(L, dtype=np.int32), (b, 1))
    positions[:, cut:] -= cut
    if pad:
        segment_ids[:, L - pad:] = 0
        positions[:, L - pad:] = 0
    stride = max(1, V // k)  # k ids spaced by stride: distinct
    ids = ((rng.integers(0, V, size=(b, L, 1)) + np.arange(k) * stride) % V).astype(np.int32)
    z = -np.sort(-rng.normal(scale=3.0, size=(b, L, k)), axis=-1)
    z = z - z.max(-1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(-1, keepdims=True))
    tail_mass = rng.uniform(0.01, 0.3, size=(b, L)) if k < V else np.zeros((b, L))
    with np.errstate(divide="ignore"):
        tail = np.log(tail_mass)
    out = {
        "example_index": layout.step_examples(step, process),
        "tokens": tokens,
        "segment_ids": segment_ids,
        "positions": positions,
        "topk_ids": ids,
        "topk_logprobs": (log_softmax + np.log1p(-tail_mass)[..., None]).astype(np.float32),
        "tail_logprob": tail.astype(np.float32),
    }
    if masked_of(manifest):  # a masked store: supervised stretches of 4 positions, about half of them
        out["loss_mask"] = next_token_mask(segment_ids) & np.repeat(rng.random((b, L // 4 + 1)) < 0.5, 4, -1)[:, :L]
    return out
