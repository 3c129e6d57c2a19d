"""Whether a store's records are sound: one set of checks for the loader and for verify.

A checksum proves a chunk holds the bytes that were written, not that what was written makes sense.
``topk_problems``, ``sampled_problems`` and ``hybrid_problems`` check decoded records' values position by position,
vectorized over a batch of records ``[n, L, ...]``: each check is a named boolean mask ``[n, L]``
(True where a position fails) with a one-line text. ``verify`` reports every failing check of every
record; the training loader runs a cheaper subset on each record as it reads it (``RecordCheck``) and
stops at the first problem, before anything is trained on it.
"""

from __future__ import annotations

import numpy as np

from .. import codec as codec_mod
from ..errors import NonFiniteError, StoreError
from . import manifest as manifest_mod

# Normalization tolerance: |logaddexp(logsumexp(top-k), tail)| (float32 log-softmax on device).
NORM_ATOL = 5e-4
POSITIVE_ATOL = 1e-6  # a log-prob may exceed 0 by float32 rounding only
# Checks that find a NaN or an infinite value (NonFiniteError, exit 3; the others are damage, exit 4).
NONFINITE = ("logprob_finite", "tail_finite", "tail_tempered", "tail_plogp_finite")


def norm_atol(codec: str) -> float:
    return NORM_ATOL + (codec_mod.LOGPROB_MAX_ERROR if codec == "default" else 0.0)


def _only(found: dict, supervised) -> dict:
    """The value checks restricted to the supervised positions (``supervised`` None: every position)."""
    if supervised is None:
        return found
    return {kind: (mask & supervised if kind != "token_range" else mask, text) for kind, (mask, text) in found.items()}


def mask_problems(loss_mask, segment_ids) -> dict:
    """{check: (mask [n, L], text)} of a masked record's loss mask: a supervised position predicts a
    token of its own document."""
    outside = np.asarray(loss_mask, bool) & ~codec_mod.next_token_mask(segment_ids)
    return {"mask_inside": (outside, "supervised position outside its document (padding, or a document's last "
                                     "token)")}


def topk_problems(ids, lp, tail, *, vocab: int, codec: str, tokens=None, tempered=None, distinct: bool = True,
                  missing_tail_ok: bool = False, supervised=None) -> dict:
    """{check: (mask [n, L], text)} for top-k records (``ids``/``lp`` ``[n, L, k]``, ``tail`` ``[n, L]``,
    ``tempered`` ``[n, L, m]``). ``distinct`` adds the repeated-id check (a sort of the ids);
    ``missing_tail_ok``: a tail at -inf or the codec floor counts as "not recorded", and the top-k mass
    then need only not exceed 1. ``supervised`` (bool ``[n, L]``): the positions that hold values (a
    masked store's loss masks); the value checks judge those only."""
    return _only(_topk_problems(ids, lp, tail, vocab=vocab, codec=codec, tokens=tokens, tempered=tempered,
                                distinct=distinct, missing_tail_ok=missing_tail_ok), supervised)


def _topk_problems(ids, lp, tail, *, vocab: int, codec: str, tokens, tempered, distinct: bool,
                   missing_tail_ok: bool) -> dict:
    atol = norm_atol(codec)
    positive = POSITIVE_ATOL + (codec_mod.LOGPROB_MAX_ERROR if codec == "default" else 0.0)
    out = {}
    if tokens is not None:
        out["token_range"] = (np.asarray(tokens).view(np.uint32) >= vocab, f"token id outside [0, {vocab})")
    # Ids as uint32: a negative id becomes >= 2**31, so one comparison checks [0, V).
    if distinct:  # after a sort (needed for distinctness) the range check reads only the last column
        s = np.sort(ids.view(np.uint32), axis=-1)
        out["id_range"] = (s[..., -1] >= vocab, f"top-k id outside [0, {vocab})")
        out["id_distinct"] = ((s[..., 1:] == s[..., :-1]).any(-1), "repeated top-k id")
        del s
    else:
        out["id_range"] = ((ids.view(np.uint32) >= vocab).any(-1), f"top-k id outside [0, {vocab})")
    out["logprob_finite"] = (~np.isfinite(lp).all(-1), "non-finite top-k log-prob")
    out["tail_finite"] = (np.isnan(tail) | (tail == np.inf), "NaN or +inf tail log-prob")
    if tempered is not None and tempered.shape[-1]:
        out["tail_tempered"] = ((np.isnan(tempered) | (tempered > POSITIVE_ATOL)).any(-1),
                                "tempered tail log-prob NaN or > 0")
    out["logprob_positive"] = ((lp[..., 0] > positive) | (tail > positive), "a log-prob > 0")
    out["logprob_sorted"] = ((lp[..., 1:] > lp[..., :-1]).any(-1), "top-k log-probs not sorted descending")
    with np.errstate(all="ignore"):
        lse = np.log(np.exp(lp.astype(np.float64)).sum(-1))
        total = np.logaddexp(lse, tail.astype(np.float64))
        # NaN fails these comparisons, so a NaN anywhere in a position is caught here too.
        out["topk_mass"] = (~(lse <= atol), f"logsumexp(top-k) > 0 (beyond {atol:.1e})")
        unbalanced = ~(np.abs(total) <= atol)
        if missing_tail_ok:
            unbalanced &= tail > codec_mod.LOGPROB_FLOOR
        out["normalization"] = (unbalanced, "top-k and tail mass do not sum to 1 "
                                            f"(|logaddexp(logsumexp(top-k), tail)| > {atol:.1e})")
    return out


def sampled_problems(ids, counts, lp, *, vocab: int, num_samples: int, counts_sum_to_n: bool = True,
                     tokens=None, supervised=None) -> dict:
    """{check: (mask [n, L], text)} for sampled records (``[n, L, S]``, used slots first, zeros after);
    ``supervised`` as in ``topk_problems``."""
    return _only(_sampled_problems(ids, counts, lp, vocab=vocab, num_samples=num_samples,
                                   counts_sum_to_n=counts_sum_to_n, tokens=tokens), supervised)


def _sampled_problems(ids, counts, lp, *, vocab: int, num_samples: int, counts_sum_to_n: bool, tokens) -> dict:
    used = counts > 0
    out = {}
    if tokens is not None:
        out["token_range"] = (np.asarray(tokens).view(np.uint32) >= vocab, f"token id outside [0, {vocab})")
    with np.errstate(invalid="ignore"):
        out["logprob_finite"] = ((used & ~np.isfinite(lp)).any(-1), "non-finite sampled log-prob")
        out["count_sum"] = ((counts < 0).any(-1) | ((counts.sum(-1) != num_samples) & counts_sum_to_n),
                            f"negative sample counts, or counts that do not sum to N = {num_samples}")
        out["id_range"] = ((used & (ids.view(np.uint32) >= vocab)).any(-1), f"sampled id outside [0, {vocab})")
        s = np.sort(np.where(used, ids.astype(np.int64), -1 - np.arange(ids.shape[-1])), axis=-1)
        out["id_distinct"] = ((s[..., 1:] == s[..., :-1]).any(-1), "repeated sampled id")
        out["logprob_positive"] = ((used & (lp > POSITIVE_ATOL + codec_mod.SAMPLED_LOGPROB_MAX_ERROR)).any(-1),
                                   "sampled log-prob > 0")
    return out


def hybrid_problems(ids, lp, tail, draw_ids, draw_counts, plogp, *, vocab: int, codec: str, num_samples: int,
                    tokens=None, tempered=None, distinct: bool = True, supervised=None) -> dict:
    """{check: (mask [n, L], text)} for hybrid records: the head as ``topk_problems`` (ids in range and
    distinct, log-probs finite, <= 0 and sorted, head mass + tail mass = 1), the tail draws (``[n, L, S]``,
    used slots first) as ``sampled_problems`` (counts summing to N, ids in range and distinct) and outside
    the head, and ``plogp`` ``[n, L]`` (the tail's ``sum p_t log p_t``) finite and within what the tail's
    mass m_t at the proposal temperature allows over its V - k ids: ``[m_t log(m_t / (V - k)), m_t log m_t]``
    (``tempered[..., 0]`` is log m_t when the store holds it, else ``tail``). ``supervised`` as in
    ``topk_problems``."""
    k = ids.shape[-1]
    found = _topk_problems(ids, lp, tail, vocab=vocab, codec=codec, tokens=tokens, tempered=tempered,
                           distinct=distinct, missing_tail_ok=False)
    draws = _sampled_problems(draw_ids, draw_counts, np.zeros(draw_ids.shape, np.float32), vocab=vocab,
                              num_samples=num_samples, counts_sum_to_n=True, tokens=None)
    for kind in ("count_sum", "id_range", "id_distinct"):
        mask, text = draws[kind]
        found["draw_" + kind] = (mask, text.replace("sampled id", "tail draw id"))
    used = draw_counts > 0
    in_head = (used[..., :, None] & (draw_ids[..., :, None] == ids[..., None, :])).any((-1, -2))
    found["draw_in_head"] = (in_head, "a tail draw is one of the head's top-k ids")
    log_m = (tempered[..., 0] if tempered is not None and tempered.shape[-1] else tail).astype(np.float64)
    tol = norm_atol(codec) * (2.0 + np.log(vocab))
    with np.errstate(all="ignore"):
        m = np.exp(log_m)
        low, high = m * (log_m - np.log(max(vocab - k, 1))), m * log_m
        p = plogp.astype(np.float64)
        found["tail_plogp_finite"] = (~np.isfinite(p), "non-finite tail sum p log p")
        found["tail_plogp_range"] = (~((p >= low - tol) & (p <= high + tol)),
                                     f"tail sum p log p outside [m log(m / (V - k)), m log m] for its tail mass m "
                                     f"(beyond {tol:.1e})")
    return _only(found, supervised)


class RecordCheck:
    """The loader's check of each record as it reads it: the problems of ``topk_problems`` /
    ``sampled_problems`` / ``hybrid_problems`` that cost a few passes over ``[L, k]`` (no sort for distinct ids); the first
    one raises (NonFiniteError for a NaN/inf, StoreError for the rest)."""

    def __init__(self, manifest: dict, uri: str):
        self.uri = uri
        self.vocab = int(manifest["shapes"]["vocab_size"])
        self.num_samples = int(manifest["shapes"].get("num_samples") or 0)
        self.codec = manifest["codec"]["name"]
        self.masked = manifest_mod.masked_of(manifest)

    def problem(self, rec: dict) -> tuple[type, str, int] | None:
        """(error class, what, first bad position) of the record, or None when it is sound."""
        supervised = rec["loss_mask"] if self.masked else None
        if "tail_plogp" in rec:
            found = hybrid_problems(rec["topk_ids"], rec["topk_logprobs"], rec["tail_logprob"], rec["sample_ids"],
                                    rec["sample_counts"], rec["tail_plogp"], vocab=self.vocab, codec=self.codec,
                                    num_samples=self.num_samples, tempered=rec.get("tail_logprob_tempered"),
                                    distinct=False, supervised=supervised)
        elif "sample_ids" in rec:
            found = sampled_problems(rec["sample_ids"], rec["sample_counts"], rec["sample_logprobs"],
                                     vocab=self.vocab, num_samples=self.num_samples,
                                     counts_sum_to_n=self.codec == "default", supervised=supervised)
        else:
            found = topk_problems(rec["topk_ids"], rec["topk_logprobs"], rec["tail_logprob"], vocab=self.vocab,
                                  codec=self.codec, tempered=rec.get("tail_logprob_tempered"), distinct=False,
                                  missing_tail_ok=True, supervised=supervised)
        if self.masked:
            found.update(mask_problems(rec["loss_mask"], rec["segment_ids"]))
        ordered = sorted(found.items(), key=lambda kv: kv[0] not in NONFINITE)  # NaN first: exit 3
        for kind, (mask, text) in ordered:
            if mask.any():
                cls = NonFiniteError if kind in NONFINITE else StoreError
                return cls, ("a NaN or infinite log-prob" if cls is NonFiniteError else text), int(np.argmax(mask))
        return None

    def __call__(self, rec: dict) -> dict:
        found = self.problem(rec)
        if found is not None:
            cls, what, position = found
            raise cls(f"store {self.uri}: example {int(rec['example_index'])} holds {what} at position "
                      f"{position} (its chunk's checksum is intact: the values were written so); "
                      "nothing was trained on it; run `logit-distill verify` on the store and dump it again")
        return rec
