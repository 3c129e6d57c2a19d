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
from ..errors import InputError

# Fields a training batch carries (the store also has example_index, store_tag, token_hash): the
# model's inputs and the loss mask (the supervised positions: every KD and CE term is over them).
MODEL_FIELDS = ("tokens", "segment_ids", "positions", "loss_mask")
TEACHER_FIELDS = tuple(f for fields in codec_mod.SELECTION_FIELDS.values() for f in fields)
SAMPLE_FIELDS = codec_mod.SELECTION_FIELDS["sampled"]


class OnlineSource:
    """Random access to examples ``0..n-1`` of an ``ExampleSource``, plus ``example_index``.

    The teacher fields are not computed here: the loop runs the teacher on
    each whole batch on device (``selection.make_teacher_topk``), as the dump does.
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
    """The fields a batch needs. Sampled and hybrid records (``[L, S]``, S varying per record) are padded
    with empty slots to ``sample_width`` (the store's N) so that they batch; of the stored
    tempered tails only column ``tempered_index`` (the training temperature) is kept, as ``[L]``."""
    keep = MODEL_FIELDS + TEACHER_FIELDS + ("example_index",)
    out = {k: np.asarray(record[k]) for k in keep if k in record}
    if sample_width is not None and "sample_ids" in out:
        pad = sample_width - out["sample_ids"].shape[-1]
        for k in SAMPLE_FIELDS:
            if k in out:  # a hybrid record's draws carry no log-probs
                out[k] = np.pad(out[k], ((0, 0), (0, pad)))
    if "tail_logprob_tempered" in out:
        if tempered_index is None:
            del out["tail_logprob_tempered"]
        else:
            out["tail_logprob_tempered"] = out["tail_logprob_tempered"][:, tempered_index]
    return out


def epochs_needed(num_examples: int, examples_consumed: int) -> int:
    return max(1, math.ceil(examples_consumed / num_examples))


def build_dataset(source, *, seed: int, batch_size: int, num_batches: int,
                  process_index: int = 0, process_count: int = 1, sample_width: int | None = None,
                  tempered_index: int | None = None, check=None) -> grain.MapDataset:
    """Batches of this process: a ``MapDataset`` of ``num_batches`` dicts of ``[b, ...]`` arrays.

    ``batch_size`` is the global batch (all processes); each process gets
    ``batch_size // process_count`` examples per batch. ``check`` (e.g. ``store.checks.RecordCheck``)
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


def verify_store_for_training(store, *, loss: str) -> None:
    """Before step 0: the store is complete, every chunk passes its checksum, and a ``topk_tail_kl``
    loss has a tail to learn from. Raises ``StoreError``/``InputError``. (The loss against the store's
    selection and tempered tails is the plan's check, ``train.plan``.)"""
    store.require_complete()
    # open_store reads lazily; a chunk's checksum is checked when it is first opened.
    # Check them all now, so a corrupt chunk fails the run before any step, not hours in.
    for chunk in sorted(store.scan.chunks.values(), key=lambda c: c.key):
        store.chunk_path(chunk)
    if loss.startswith("topk_tail_"):
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
        tail = rec["tail_logprob"][rec["loss_mask"]]  # a masked record holds values there only
        if tail.size and np.any(np.isfinite(tail) & (tail > floor)):
            return
    raise InputError(
        f"--loss topk_tail_kl needs tail mass, but store {store.uri} has tail_logprob at the floor "
        f"(<= {floor:.1f} or -inf) in all of its first {min(sample, len(store))} examples: "
        "it holds no tail. Use --loss topk_kl."
    )

