"""Sample documents from a model: data on which that model is the best possible predictor.

The demo and the tests use it so that distillation has something to show: a
student that learns the teacher's distribution beats one that only sees the
sampled tokens. Sampling recomputes the prefix per token (no KV cache): simple,
and fast enough for the short documents of tiny models. The prefix is cut to the
shortest of a few lengths that holds it (a causal model's logits at position t
depend on the tokens up to t only): a quarter of the document, a half, three
quarters or all of it, one compiled program each, so a document costs about
0.6 of full-length forwards (less where attention's quadratic part shows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_PREFIX_BUCKETS = 4  # prefix lengths compiled: doc_len * i / 4 for i = 1..4


def sample_documents(loaded, *, num_docs: int, doc_len: int, seed: int = 0, temperature: float = 1.0,
                     batch_size: int = 256, bos_id: int | None = None) -> list[np.ndarray]:
    """``num_docs`` token sequences of ``doc_len`` tokens sampled autoregressively from ``loaded``.

    The first token of each document is ``bos_id`` if given, else uniform over
    the vocabulary. Deterministic in ``seed``.
    """
    if doc_len < 2 or num_docs < 1:
        raise ValueError("need num_docs >= 1 and doc_len >= 2")
    apply, params, V = loaded.apply, loaded.params, loaded.vocab_size

    @functools.partial(jax.jit, static_argnums=4)
    def with_next_token(params, tokens, t, key, prefix):
        """``tokens`` with position ``t + 1`` drawn from the model's logits over ``tokens[:, :prefix]``
        (``t < prefix``; ``t`` traced: one program per prefix length)."""
        B = tokens.shape[0]
        positions = jnp.broadcast_to(jnp.arange(prefix, dtype=jnp.int32), (B, prefix))
        segment_ids = (positions <= t).astype(jnp.int32)  # the unwritten future is padding
        logits = apply(params, tokens[:, :prefix], positions, segment_ids)
        logits = jnp.take(logits, t, axis=1).astype(jnp.float32)
        new = jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)
        return jax.lax.dynamic_update_slice_in_dim(tokens, new[:, None], t + 1, axis=1)

    prefixes = sorted({max(1, -(-doc_len * i // _PREFIX_BUCKETS)) for i in range(1, _PREFIX_BUCKETS + 1)})

    docs = []
    key = jax.random.key(seed)
    for start in range(0, num_docs, batch_size):
        n = min(batch_size, num_docs - start)
        key, first_key = jax.random.split(key)
        tokens = jnp.zeros((n, doc_len), jnp.int32)
        first = (jnp.full((n,), bos_id, jnp.int32) if bos_id is not None
                 else jax.random.randint(first_key, (n,), 0, V, jnp.int32))
        tokens = tokens.at[:, 0].set(first)
        for t in range(doc_len - 1):
            key, sub = jax.random.split(key)
            prefix = next(p for p in prefixes if p > t)
            tokens = with_next_token(params, tokens, jnp.int32(t), sub, prefix)
        docs.extend(np.asarray(tokens))
    return docs
