"""Which epoch each row of a training batch comes from, and the draw index of online sampled draws.

The loader's order (``loader.build_dataset``) is the shuffled examples repeated
epoch after epoch, process ``p`` of ``P`` taking elements ``p, p + P, ...``
and batching ``b = batch_size / P`` of them: row ``r`` of this process's
micro-batch ``i`` is element ``(i * b + r) * P + p`` of the repeated sequence,
in epoch ``element // n``.

An offline store holds one set of draws per example, read every epoch. Online,
the teacher draws again on every batch, so its draws can change per epoch
(more of the teacher's distribution seen over a run) while epoch 0 keeps the
dump's (an online run's first epoch sees what a store would hold): the draws of
example ``e`` in epoch ``k`` are keyed as the dump keys example ``k * n + e``
(``selection.sample_keys(seed, draw_index, L)``), an index no example of the data
has when ``k >= 1`` (until ``k * n + e`` reaches 2**32, where the uint32
fold-in wraps).
"""

from __future__ import annotations

import numpy as np


def row_epochs(micro_batch: int, rows: int, num_examples: int, *, process_index: int = 0,
               process_count: int = 1) -> np.ndarray:
    """int64 ``[rows]``: the epoch of each row of this process's micro-batch ``micro_batch`` (counted
    from 0 over the run, gradient-accumulation micro-batches included) of ``rows`` examples."""
    element = (micro_batch * rows + np.arange(rows, dtype=np.int64)) * process_count + process_index
    return element // int(num_examples)


def draw_index(example_index, epoch, num_examples: int) -> np.ndarray:
    """uint32: the index whose dump keys give example ``example_index``'s draws in ``epoch``
    (the example itself in epoch 0)."""
    e = np.asarray(example_index, np.int64) + np.asarray(epoch, np.int64) * int(num_examples)
    return (e % (1 << 32)).astype(np.uint32)
