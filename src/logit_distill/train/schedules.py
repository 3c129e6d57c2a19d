"""Schedules for the KD mixing weight ``alpha`` and the learning rate.

Both return Optax-style callables ``step -> value`` that accept Python ints
and traced int32 steps (use inside a jitted train step).
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import optax

ALPHA_KINDS = ("constant", "linear", "cosine")

__all__ = ["ALPHA_KINDS", "alpha_schedule", "learning_rate_schedule"]


def alpha_schedule(
    kind: str, start: float, end: float | None = None, num_steps: int = 0
) -> Callable:
    """``step -> alpha`` going from ``start`` (step 0) to ``end`` (step ``num_steps``
    and after), e.g. MaxText's suggestion for offline top-k: cosine 0.7 -> 0.3.

    - ``constant``: ``start`` at every step (``end``, if given, must equal it).
    - ``linear``: straight line, then held at ``end`` (``optax.linear_schedule``).
    - ``cosine``: ``end + (start - end) * (1 + cos(pi * step / num_steps)) / 2``,
      then held at ``end``. Built on ``optax.cosine_decay_schedule`` as the 1 -> 0
      shape, because its own ``alpha`` argument is the end as a fraction of the
      start, which cannot express a ramp up from 0.
    """
    if kind not in ALPHA_KINDS:
        raise ValueError(f"unknown alpha schedule {kind!r}; expected one of {ALPHA_KINDS}")
    start = float(start)
    end = start if end is None else float(end)
    for name, v in (("start", start), ("end", end)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"alpha schedule {name} must be in [0, 1], got {v}")
    if kind == "constant":
        if end != start:
            raise ValueError(
                f"constant alpha schedule with start={start} != end={end}; "
                "use kind='linear' or 'cosine' to change alpha over training"
            )
        return optax.constant_schedule(start)
    if int(num_steps) <= 0:
        raise ValueError(f"{kind} alpha schedule needs num_steps > 0, got {num_steps}")
    if kind == "linear":
        return optax.linear_schedule(start, end, int(num_steps))
    shape = optax.cosine_decay_schedule(1.0, int(num_steps), alpha=0.0)

    def cosine(step):
        return end + (start - end) * jnp.asarray(shape(step), jnp.float32)

    return cosine


def learning_rate_schedule(
    peak: float, warmup_steps: int, total_steps: int, end_fraction: float = 0.1
) -> Callable:
    """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then cosine decay to
    ``peak * end_fraction`` at ``total_steps`` (warmup included), held after
    (``optax.warmup_cosine_decay_schedule``)."""
    if not peak > 0:
        raise ValueError(f"peak learning rate must be > 0, got {peak}")
    if warmup_steps < 0 or total_steps <= warmup_steps:
        raise ValueError(
            f"need 0 <= warmup_steps < total_steps, got warmup_steps={warmup_steps}, "
            f"total_steps={total_steps}"
        )
    if not 0.0 <= end_fraction <= 1.0:
        raise ValueError(f"end_fraction must be in [0, 1], got {end_fraction}")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=float(peak),
        warmup_steps=int(warmup_steps),
        decay_steps=int(total_steps),
        end_value=float(peak) * float(end_fraction),
    )
