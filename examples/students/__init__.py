"""Flax NNX students for ``logit-distill train --student flax:examples.students.MODULE:make``.

- ``tiny_transformer``: a pre-norm decoder (RoPE, causal attention within each packed document),
  3 layers of width 48: a depth and width none of the presets has.
- ``gated_recurrence``: no attention: a gated linear recurrence (``h_t = a_t * h_{t-1} + (1 - a_t) * x_t``,
  ``jax.lax.associative_scan``) reset at each document start, with a gated MLP.

See docs/STUDENTS.md for the protocol these follow.
"""
