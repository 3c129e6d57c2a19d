"""The Grain input pipeline of the student: shuffle, epochs, per-process shards, batches.

Offline the source is the logit store (``Store`` is a Grain
``RandomAccessDataSource``); online it is ``OnlineSource``, a random-access
view of the teacher's ``ExampleSource`` whose records carry no teacher fields
(the teacher runs on each batch inside the loop). Both go through the same
``build_dataset``, so the same seed gives the same examples in the same order
whatever the mode.

The order is a pure function of (number of examples, seed, batch size,
process count): ``MapDataset.source(src).shuffle(seed).repeat(epochs)``
(Grain draws a new permutation per epoch), then process ``p`` takes elements
``p, p + P, ...`` and batches them. The iterator's state (``next_index``) is
saved with each checkpoint by Grain's Orbax handler, so a resumed run reads
exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import functools
import math

import grain
import numpy as np

from .. import codec as codec_mod
from ..errors import InputError, NonFiniteError, StoreError

# Fields a training batch carries (the store also has example_index, store_tag, token_hash).
MODEL_FIELDS = ("tokens", "segment_ids", "positions")
TEACHER_FIELDS = ("topk_ids", "topk_logprobs", "tail_logprob", "tail_logprob_tempered",
                  "sample_ids", "sample_counts", "sample_logprobs")
SAMPLE_FIELDS = ("sample_ids", "sample_counts", "sample_logprobs")


class OnlineSource:
    """Random access to examples ``0..n-1`` of an ``ExampleSource``, plus ``example_index``.

    The teacher fields are not computed here: the loop runs the teacher on
    each whole batch on device (``topk.make_teacher_topk``), as the dump does.
    """

    def __init__(self, examples, num_examples: int | None = None):
        self.examples = examples
        n = len(examples)
        if num_examples is not None:
            if not 0 < int(num_examples) <= n:
                raise InputError(f"num_examples={num_examples} is outside [1, {n}] (the data has {n} examples)")
            n = int(num_examples)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if not 0 <= index < self.n:
            raise IndexError(f"example {index} out of range [0, {self.n})")
        rec = dict(self.examples[index])
        rec["example_index"] = np.int64(index)
        return rec

    def __repr__(self) -> str:
        return f"OnlineSource({self.examples!r}, n={self.n})"


def _training_fields(record: dict, sample_width: int | None = None, tempered_index: int | None = None) -> dict:
    """The fields a batch needs. Sampled records (``[L, S]``, S varying per record) are padded
    with empty slots to ``sample_width`` (the store's N) so that they batch; of the stored
    tempered tails only column ``tempered_index`` (the training temperature) is kept, as ``[L]``."""
    keep = MODEL_FIELDS + TEACHER_FIELDS + ("example_index",)
    out = {k: np.asarray(record[k]) for k in keep if k in record}
    if sample_width is not None and "sample_ids" in out:
        pad = sample_width - out["sample_ids"].shape[-1]
        for k in SAMPLE_FIELDS:
            out[k] = np.pad(out[k], ((0, 0), (0, pad)))
    if "tail_logprob_tempered" in out:
        if tempered_index is None:
            del out["tail_logprob_tempered"]
        else:
            out["tail_logprob_tempered"] = out["tail_logprob_tempered"][:, tempered_index]
    return out


class RecordCheck:
    """Checks the values of each store record as the loader reads it (checksums only prove
    the bytes are the ones written, not that what was written makes sense).

    A top-k record passes when its ids lie in ``[0, vocab)``, its log-probs are finite
    (the tails may be -inf), sorted descending, at most 0, and the top-k mass plus the tail
    mass is 1 within the codec's bound (a tail at -inf or the codec floor is "not recorded":
    then the top-k mass must only not exceed 1). A sampled record passes when its used
    slots hold ids in range, finite log-probs at most 0, and counts summing to the store's
    N. Vectorized numpy, a few passes over ``[L, k]``. NaN/inf raise ``NonFiniteError``,
    anything else ``StoreError``.
    """

    def __init__(self, manifest: dict, uri: str):
        from ..verify.records import NORM_ATOL, POSITIVE_ATOL

        self.uri = uri
        self.vocab = int(manifest["shapes"]["vocab_size"])
        self.num_samples = int(manifest["shapes"].get("num_samples") or 0)
        default = manifest["codec"]["name"] == "default"
        self.counts_sum_to_n = default  # the default codec's unary counts always sum to N
        self.sampled_atol = POSITIVE_ATOL + codec_mod.SAMPLED_LOGPROB_MAX_ERROR
        self.atol = NORM_ATOL + (codec_mod.LOGPROB_MAX_ERROR if default else 0.0)
        self.positive_atol = POSITIVE_ATOL + (codec_mod.LOGPROB_MAX_ERROR if default else 0.0)
        self.floor = codec_mod.LOGPROB_FLOOR

    def problem(self, rec: dict) -> tuple[type, str, int] | None:
        """(error class, what, first bad position) of the record, or None when it is sound."""
        if "sample_ids" in rec:
            return self._sampled_problem(rec)
        lp, tail, ids = rec["topk_logprobs"], rec["tail_logprob"], rec["topk_ids"]
        bad = ~np.isfinite(lp).all(-1) | np.isnan(tail) | (tail == np.inf)
        if "tail_logprob_tempered" in rec:
            tempered = rec["tail_logprob_tempered"]
            bad |= (np.isnan(tempered) | (tempered == np.inf)).any(-1)
        if bad.any():
            return NonFiniteError, "a NaN or infinite log-prob", int(np.argmax(bad))
        checks = (
            ((ids < 0) | (ids >= self.vocab)).any(-1), f"a top-k id outside [0, {self.vocab})",
            (lp[..., 1:] > lp[..., :-1]).any(-1), "top-k log-probs not sorted descending",
            (lp[..., 0] > self.positive_atol) | (tail > self.positive_atol), "a log-prob > 0",
        )
        for i in range(0, len(checks), 2):
            if checks[i].any():
                return StoreError, checks[i + 1], int(np.argmax(checks[i]))
        with np.errstate(divide="ignore"):
            top = np.log(np.exp(lp.astype(np.float64)).sum(-1))
            total = np.logaddexp(top, tail.astype(np.float64))
        recorded = tail > self.floor
        bad = (top > self.atol) | (recorded & (np.abs(total) > self.atol))
        if bad.any():
            return StoreError, f"top-k and tail mass that do not sum to 1 (beyond {self.atol:.1e})", int(np.argmax(bad))
        return None

    def _sampled_problem(self, rec: dict) -> tuple[type, str, int] | None:
        ids, counts, lp = rec["sample_ids"], rec["sample_counts"], rec["sample_logprobs"]
        used = counts > 0
        bad = (used & ~np.isfinite(lp)).any(-1)
        if bad.any():
            return NonFiniteError, "a NaN or infinite log-prob", int(np.argmax(bad))
        checks = (
            (used & ((ids < 0) | (ids >= self.vocab))).any(-1), f"a sampled id outside [0, {self.vocab})",
            (counts < 0).any(-1) | ((counts.sum(-1) != self.num_samples) & self.counts_sum_to_n),
            f"negative counts or counts that do not sum to {self.num_samples}",
            (used & (lp > self.sampled_atol)).any(-1), "a log-prob > 0",
        )
        for i in range(0, len(checks), 2):
            if checks[i].any():
                return StoreError, checks[i + 1], int(np.argmax(checks[i]))
        return None

    def __call__(self, rec: dict) -> dict:
        found = self.problem(rec)
        if found is not None:
            cls, what, position = found
            raise cls(f"store {self.uri}: example {int(rec['example_index'])} holds {what} at position "
                      f"{position} (its chunk's checksum is intact: the values were written so); "
                      "nothing was trained on it; run `logit-distill verify` on the store and dump it again")
        return rec


def epochs_needed(num_examples: int, examples_consumed: int) -> int:
    return max(1, math.ceil(examples_consumed / num_examples))


def build_dataset(source, *, seed: int, batch_size: int, num_batches: int,
                  process_index: int = 0, process_count: int = 1, sample_width: int | None = None,
                  tempered_index: int | None = None, check=None) -> grain.MapDataset:
    """Batches of this process: a ``MapDataset`` of ``num_batches`` dicts of ``[b, ...]`` arrays.

    ``batch_size`` is the global batch (all processes); each process gets
    ``batch_size // process_count`` examples per batch. ``check`` (e.g. ``RecordCheck``)
    sees each record before it is batched.
    """
    n = len(source)
    if n < 1:
        raise InputError("the training data holds no examples")
    if batch_size % process_count:
        raise InputError(f"batch_size={batch_size} is not divisible by the {process_count} processes")
    per_process = batch_size // process_count
    epochs = epochs_needed(n, num_batches * batch_size)
    ds = grain.MapDataset.source(source).shuffle(seed=int(seed)).repeat(epochs)
    ds = ds[process_index::process_count]
    fields = functools.partial(_training_fields, sample_width=sample_width, tempered_index=tempered_index)
    if check is not None:
        ds = ds.map(check)
    ds = ds.map(fields).batch(per_process, drop_remainder=True)
    if len(ds) < num_batches:  # cannot happen with the epoch count above; a guard against misuse
        raise InputError(f"the pipeline yields {len(ds)} batches, {num_batches} are needed")
    return ds[:num_batches]


def make_iterator(dataset: grain.MapDataset, *, num_threads: int = 4, prefetch: int = 8):
    """A checkpointable Grain ``DatasetIterator`` (``get_state``/``set_state``) over ``dataset``."""
    options = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
    return iter(dataset.to_iter_dataset(options))


# ----------------------------------------------------------------------------- store checks


def verify_store_for_training(store, *, loss: str, temperature: float = 1.0) -> None:
    """Before step 0: the store is complete, every chunk passes its checksum, its selection
    suits the loss, and a ``topk_tail_kl`` loss has a tail to learn from (at T != 1: the tail
    mass tempered at T). Raises ``StoreError``/``InputError``."""
    from ..store import manifest as manifest_mod

    store.require_complete()
    selection = manifest_mod.selection_of(store.manifest)
    if (selection == "sampled") != (loss == "sampled_kl"):
        fits = "sampled_kl" if selection == "sampled" else "topk_tail_kl or topk_kl"
        raise InputError(f"--loss {loss} does not fit store {store.uri}: it holds a {selection} selection; "
                         f"use --loss {fits}")
    if loss == "topk_tail_kl" and float(temperature) != 1.0:
        have = manifest_mod.tail_temperatures_of(store.manifest)
        if float(temperature) not in have:
            raise InputError(
                f"--loss topk_tail_kl at --temperature {temperature:g} needs the teacher's tail mass tempered "
                f"at {temperature:g}, but store {store.uri} holds it at "
                f"{', '.join(f'{T:g}' for T in have) if have else 'no temperature'}; use one of those (or 1), "
                f"or dump with --tail-temperatures {temperature:g}")
    # open_store reads lazily; a chunk's checksum is checked when it is first opened.
    # Check them all now, so a corrupt chunk fails the run before any step, not hours in.
    for chunk in sorted(store.scan.chunks.values(), key=lambda c: c.key):
        store.chunk_path(chunk)
    if loss == "topk_tail_kl":
        require_tail_mass(store)


def require_tail_mass(store, sample: int = 16) -> None:
    """``topk_tail_kl`` needs the teacher's mass outside the top-k.

    A store has none when ``top_k >= vocab_size`` (the tail is -inf everywhere)
    or when its records carry no tail (every ``tail_logprob`` at the codec floor
    or -inf, e.g. a dump that did not compute it). The manifest decides the
    first case; the second is judged on the first ``sample`` examples.
    """
    shapes = store.manifest["shapes"]
    if shapes["top_k"] >= shapes["vocab_size"]:
        raise InputError(
            f"--loss topk_tail_kl needs tail mass, but store {store.uri} keeps top_k={shapes['top_k']} "
            f"of vocab_size={shapes['vocab_size']} entries: there is no tail. Use --loss topk_kl."
        )
    floor = codec_mod.LOGPROB_FLOOR
    for i in range(min(sample, len(store))):
        rec = store[i]
        valid = rec["segment_ids"] != 0
        tail = rec["tail_logprob"][valid]
        if tail.size and np.any(np.isfinite(tail) & (tail > floor)):
            return
    raise InputError(
        f"--loss topk_tail_kl needs tail mass, but store {store.uri} has tail_logprob at the floor "
        f"(<= {floor:.1f} or -inf) in all of its first {min(sample, len(store))} examples: "
        "it holds no tail. Use --loss topk_kl."
    )

