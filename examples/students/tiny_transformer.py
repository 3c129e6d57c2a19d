"""A small pre-norm transformer decoder as a Flax NNX student.

``make(vocab_size, num_layers=3, width=48, num_heads=4, mlp_ratio=3, tie_embeddings=True, seed=0)``. Attention is causal
and stays inside each packed document (``segment_ids``); positions feed rotary embeddings, so
they restart with each document as in the store. Matrices carry ``nnx.with_partitioning``
annotations: the ``fsdp`` axis is split over the devices under ``--param-sharding fsdp``; the
``model`` axis has no mesh axis in training and stays whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from logit_distill.models.flax_student import causal_segment_mask


def _init(axes):
    return nnx.with_partitioning(nnx.initializers.normal(0.02), axes)


def rope(x, positions, theta: float = 10000.0):
    """Rotary embedding of ``x`` [B, L, H, D] at ``positions`` [B, L] (halves rotated)."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [B, L, 1, half]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(nnx.Module):
    def __init__(self, width: int, num_heads: int, mlp_ratio: int, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.norm1 = nnx.RMSNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, use_bias=False, kernel_init=_init(("fsdp", "model")), rngs=rngs)
        self.out = nnx.Linear(width, width, use_bias=False, kernel_init=_init(("model", "fsdp")), rngs=rngs)
        self.norm2 = nnx.RMSNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, mlp_ratio * width, use_bias=False, kernel_init=_init(("fsdp", "model")),
                             rngs=rngs)
        self.down = nnx.Linear(mlp_ratio * width, width, use_bias=False, kernel_init=_init(("model", "fsdp")),
                               rngs=rngs)

    def __call__(self, x, positions, mask):
        B, L, W = x.shape
        H = self.num_heads
        q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(B, L, 3 * H, W // H), 3, axis=2)
        q, k = rope(q, positions), rope(k, positions)
        attn = nnx.dot_product_attention(q, k, v, mask=mask)
        x = x + self.out(attn.reshape(B, L, W))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyTransformer(nnx.Module):
    def __init__(self, vocab_size: int, num_layers: int, width: int, num_heads: int, mlp_ratio: int,
                 tie_embeddings: bool, rngs: nnx.Rngs):
        if width % num_heads or (width // num_heads) % 2:
            raise ValueError(f"width {width} must split into {num_heads} heads of an even size")
        self.embed = nnx.Embed(vocab_size, width, embedding_init=_init((None, "fsdp")), rngs=rngs)
        self.blocks = nnx.List([Block(width, num_heads, mlp_ratio, rngs) for _ in range(num_layers)])
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        # tied by default: the output layer is the embedding (what lets a small student learn a
        # token's row from every position that predicts it)
        self.head = None if tie_embeddings else nnx.Linear(width, vocab_size, use_bias=False,
                                                            kernel_init=_init(("fsdp", None)), rngs=rngs)

    def __call__(self, tokens, positions, segment_ids):
        mask = causal_segment_mask(segment_ids)
        # padding rows (segment 0) see nothing; let them see themselves so softmax stays finite
        mask = mask | jnp.eye(tokens.shape[1], dtype=bool)[None, None]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, mask)
        x = self.norm(x)
        return self.embed.attend(x) if self.head is None else self.head(x)


def make(vocab_size: int, num_layers: int = 3, width: int = 48, num_heads: int = 4, mlp_ratio: int = 3,
         tie_embeddings: bool = True, seed: int = 0) -> TinyTransformer:
    return TinyTransformer(vocab_size, num_layers, width, num_heads, mlp_ratio, tie_embeddings, nnx.Rngs(seed))
