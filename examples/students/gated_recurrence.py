"""A non-attention Flax NNX student: a gated linear recurrence.

Each block mixes over time with ``h_t = a_t * h_{t-1} + (1 - a_t) * x_t`` (``a_t = sigmoid(W_a u_t)``,
``x_t = W_x u_t``) computed for all ``t`` at once by ``jax.lax.associative_scan``, gated by
``silu(W_g u_t)``, then a gated MLP mixes channels. ``a_t`` is 0 at the first token of each packed
document, so no state crosses a document boundary; positions are not needed.

``make(vocab_size, num_layers=2, width=64, tie_embeddings=True, seed=0)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _init(axes):
    return nnx.with_partitioning(nnx.initializers.normal(0.02), axes)


def linear_recurrence(a, x):
    """``h_t = a_t * h_{t-1} + x_t`` over axis 1 (h_{-1} = 0) by an associative scan."""

    def combine(left, right):
        a_l, x_l = left
        a_r, x_r = right
        return a_l * a_r, a_r * x_l + x_r

    _, h = jax.lax.associative_scan(combine, (a, x), axis=1)
    return h


class RecurrentBlock(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(width, rngs=rngs)
        self.in_x = nnx.Linear(width, width, kernel_init=_init(("fsdp", None)), rngs=rngs)
        self.in_a = nnx.Linear(width, width, kernel_init=_init(("fsdp", None)), rngs=rngs)
        self.in_g = nnx.Linear(width, width, kernel_init=_init(("fsdp", None)), rngs=rngs)
        self.out = nnx.Linear(width, width, kernel_init=_init((None, "fsdp")), rngs=rngs)
        self.norm2 = nnx.RMSNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, kernel_init=_init(("fsdp", None)), rngs=rngs)
        self.down = nnx.Linear(width, width, kernel_init=_init((None, "fsdp")), rngs=rngs)

    def __call__(self, x, starts):
        u = self.norm1(x)
        a = jnp.where(starts[..., None], 0.0, jax.nn.sigmoid(self.in_a(u)))
        h = linear_recurrence(a, (1.0 - a) * self.in_x(u))
        x = x + self.out(h * jax.nn.silu(self.in_g(u)))
        gate, value = jnp.split(self.up(self.norm2(x)), 2, axis=-1)
        return x + self.down(jax.nn.silu(gate) * value)


class GatedRecurrence(nnx.Module):
    def __init__(self, vocab_size: int, num_layers: int, width: int, tie_embeddings: bool, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab_size, width, embedding_init=_init((None, "fsdp")), rngs=rngs)
        self.blocks = nnx.List([RecurrentBlock(width, rngs) for _ in range(num_layers)])
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        # tied by default: the output layer is the embedding (what lets a small student learn a
        # token's row from every position that predicts it)
        self.head = None if tie_embeddings else nnx.Linear(width, vocab_size, use_bias=False,
                                                            kernel_init=_init(("fsdp", None)), rngs=rngs)

    def __call__(self, tokens, positions, segment_ids):
        previous = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
        starts = segment_ids != previous  # first token of a document (and of padding runs)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, starts)
        x = self.norm(x)
        return self.embed.attend(x) if self.head is None else self.head(x)


def make(vocab_size: int, num_layers: int = 2, width: int = 64, tie_embeddings: bool = True,
         seed: int = 0) -> GatedRecurrence:
    return GatedRecurrence(vocab_size, num_layers, width, tie_embeddings, nnx.Rngs(seed))
