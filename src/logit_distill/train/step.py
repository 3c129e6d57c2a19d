"""The pure training step (KD + CE, token-weighted accumulation), its optimizer, and the guard that
stops a run at the first non-finite loss or gradient norm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ..errors import NonFiniteError
from . import checkpointing
from .losses import distill_loss


def make_optimizer(lr_schedule, *, weight_decay: float, max_grad_norm: float | None, grad_accum: int,
                   b1: float = 0.9, b2: float = 0.95):
    """Clip by global norm (unless ``max_grad_norm`` is None), then AdamW (decay on matrices only);
    ``optax.MultiSteps`` for accumulation."""
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(lr_schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask)
    tx = adamw if max_grad_norm is None else optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)
    if grad_accum > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=grad_accum)
    return tx


def make_train_step(apply, tx, *, loss: str, temperature: float, proposal_temperature: float = 1.0,
                    beta: float = 0.5, skew: float = 0.1, allow_biased_temperature: bool = False):
    """``step(state, batch, alpha, scale=1) -> (state, metrics)``, pure.

    ``alpha`` is a traced float32 scalar, so a CE-only run (alpha 0) and a KD
    run compile to the same function (``distill_loss`` picks the branch with
    ``lax.cond``) and their step times compare like for like. ``scale``
    multiplies the loss whose gradient is taken (``losses.accumulation_scales``:
    token-weighted gradient accumulation); the metrics are unscaled. No host syncs. ``beta``, ``skew``
    and ``allow_biased_temperature`` go to ``distill_loss``.
    """

    def loss_fn(params, batch, alpha, scale):
        logits = apply(params, batch["tokens"], batch["positions"], batch["segment_ids"])
        value, aux = distill_loss(logits, batch, kind=loss, alpha=alpha, temperature=temperature,
                                  proposal_temperature=proposal_temperature, beta=beta, skew=skew,
                                  allow_biased_temperature=allow_biased_temperature)
        return value * scale, (value, aux)

    def step(state, batch, alpha, scale=jnp.float32(1.0)):
        (_, (value, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch, alpha, scale)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {
            "loss": value,
            "kd_loss": aux["kd_loss"],
            "ce_loss": aux["ce_loss"],
            "num_tokens": aux["num_tokens"],
            "grad_norm": grad_norm,
            # The host stops the run at the first step where this is false (see FiniteGuard).
            "finite": jnp.isfinite(value) & jnp.isfinite(grad_norm),
        }
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return step


class FiniteGuard:
    """Stops training at the first optimizer step whose loss or gradient norm is not finite.

    The train step returns a device bool ``finite`` per micro-step; ``add`` keeps them and
    ``check`` fetches them: every step for all but the newest (one step behind the device,
    so the check never stalls it) and everything before a checkpoint or the export, so a
    checkpoint never holds a state past a NaN. The last good checkpoint stays the latest.
    """

    def __init__(self, output: str):
        self.output = output
        self.pending: list[tuple[int, list]] = []  # (step, [finite, loss, grad_norm] per micro-step)
        self.last_saved: int | None = None

    def add(self, step: int, micro_metrics: list) -> None:
        self.pending.append((step, [(m["finite"], m["loss"], m["grad_norm"]) for m in micro_metrics]))

    def check(self, keep_newest: bool = False) -> None:
        n = len(self.pending) - 1 if keep_newest else len(self.pending)
        if n <= 0:
            return
        todo, self.pending = self.pending[:n], self.pending[n:]
        for step, micro in jax.device_get(todo):
            for finite, loss, grad_norm in micro:
                if not bool(finite):
                    kept = (f"the last good checkpoint, step {self.last_saved}, is kept in "
                            f"{checkpointing.checkpoint_dir(self.output)}" if self.last_saved is not None
                            else "no checkpoint was saved")
                    raise NonFiniteError(
                        f"non-finite loss or gradient norm at step {step} (loss {float(loss)}, grad norm "
                        f"{float(grad_norm)}); training stopped, {kept}; lower --learning-rate, set "
                        "--max-grad-norm, or check the store (logit-distill verify)"
                    )
