"""Held-out evaluation of a student: next-token cross-entropy and perplexity, and with a reference
(``teacher_eval``: a teacher or a held-out store) the teacher-relative measures of ``teacher_metrics``.

The evaluation data is read with ``ExampleSource`` (JSONL or Parquet text or
conversations, or pre-tokenized ArrayRecord) at the store's ``seq_len`` and
packing, with the chat options the training data was read with, in order (no
shuffle). The mean is over the supervised positions (``losses.training_mask``:
every position that predicts a token of its own document, and for
conversations only the assistant's tokens), so padding, document boundaries and
prompts do not count.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..data import ChatOptions, ExampleSource
from ..errors import InputError
from . import teacher_metrics
from .losses import cross_entropy_per_token, next_token_targets, training_mask

FIELDS = ("tokens", "positions", "segment_ids")


def open_eval_data(path: str, tokenizer_path: str | None, *, seq_len: int, packing: bool,
                   vocab_size: int, text_field: str = "text", chat: ChatOptions | None = None) -> ExampleSource:
    """``ExampleSource`` over the held-out data, checked against the student's vocabulary."""
    examples = ExampleSource.open(path, tokenizer_path, seq_len=seq_len, packing=packing, seed=0,
                                  text_field=text_field, chat=chat)
    examples.check_vocab(vocab_size)
    if len(examples) == 0:
        raise InputError(f"evaluation data {path} holds no examples")
    return examples


def make_eval_step(apply, k: int = 64):
    """``fn(params, tokens, positions, segment_ids, loss_mask, teacher={}) -> (sum of CE, number of
    positions, sums of the teacher-relative measures)``, jitted, over the supervised positions;
    ``teacher``: the reference's fields of the batch (``teacher_metrics.per_position``, top-k ``k`` for
    a full teacher), none for CE only."""

    @jax.jit
    def eval_step(params, tokens, positions, segment_ids, loss_mask, teacher):
        logits = apply(params, tokens, positions, segment_ids)
        mask = training_mask({"segment_ids": segment_ids, "loss_mask": loss_mask})
        targets = jnp.where(mask, next_token_targets(tokens), 0)
        per = cross_entropy_per_token(logits, targets)
        sums = teacher_metrics.sums(teacher_metrics.per_position(logits, teacher, k=k), mask) if teacher else {}
        return jnp.sum(jnp.where(mask, per, 0.0)), jnp.sum(mask, dtype=jnp.int32), sums

    return eval_step


def evaluate(apply, params, examples, *, batch_size: int, put=None, max_examples: int | None = None,
             process_index: int = 0, process_count: int = 1, reference=None) -> dict:
    """Cross-entropy (nats per token) and perplexity of ``params`` on ``examples``; with ``reference``
    (``teacher_eval.EvalTeacher`` or ``StoreExamples``) also ``"teacher"``: the means per position of
    the measures against it, where it is (``against``) and its top-k (``k``).

    ``batch_size`` is global; the last batch is padded with padding rows
    (segment id 0, masked out). Only supervised positions (``loss_mask``) count. ``put(dict of numpy [b, L]) -> dict of arrays``
    places this process's rows of a batch on devices (default: ``jnp.asarray``).
    """
    n = len(examples) if max_examples is None else min(len(examples), int(max_examples))
    per_process = batch_size // process_count
    L = examples.seq_len
    k = 64 if reference is None else reference.k
    step = make_eval_step(apply, k)
    put = put or (lambda b: {k: jnp.asarray(v) for k, v in b.items()})
    fields = FIELDS + ("loss_mask",) + tuple(getattr(examples, "teacher_fields", ()))
    total, count, teacher_total = 0.0, 0, None
    for start in range(0, n, batch_size):
        lo = start + process_index * per_process
        idx = [i for i in range(lo, lo + per_process) if i < n]
        rows = examples.batch(idx or [0])
        rows = {f: rows[f] if idx else rows[f][:0] for f in fields}
        pad = per_process - len(idx)
        if pad:  # padding rows: segment id 0, outside every mask
            rows = {f: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for f, v in rows.items()}
        arrays = put(rows)
        teacher = reference.fields(arrays) if reference is not None else {}
        s, c, t = step(params, arrays["tokens"], arrays["positions"], arrays["segment_ids"], arrays["loss_mask"],
                       teacher)
        total += float(s)
        count += int(c)
        if t:
            t = jax.device_get(t)
            t = {name: np.asarray(v, np.float64 if name != "count" else np.int64) for name, v in t.items()}
            teacher_total = t if teacher_total is None else {name: teacher_total[name] + t[name] for name in t}
    if count == 0:
        raise InputError("the evaluation data has no supervised position (a next token of the same document, and "
                         "for conversations an assistant's token)")
    ce = total / count
    return {
        "cross_entropy": ce,
        "perplexity": math.exp(min(ce, 700.0)),
        "num_tokens": count,
        "num_examples": n,
        **({"teacher": {"against": reference.where, "k": int(k), **teacher_metrics.means(teacher_total)}}
           if teacher_total is not None else {}),
    }
