"""The example order: a pure function of (documents, seed, seq_len, packing), specified here exactly.

Document order. Document d (0-based, in file order, then record/line order) gets the key
`splitmix64(d XOR splitmix64(seed))` (64-bit unsigned arithmetic); documents are taken in increasing
key order. splitmix64 is a bijection of uint64, so keys never tie and the permutation does not
depend on the sort algorithm. We specify our own permutation instead of calling
`numpy.random.Generator.permutation` because NumPy does not promise that a Generator method returns
the same stream across releases (NEP 19): a NumPy upgrade must never change the order of a half-
written logit store.

Packed (`packing=True`): the permuted documents are concatenated into one stream of T tokens
(documents keep the EOS they end with). Example i is `stream[i*L : (i+1)*L]`; there are ceil(T / L)
examples, the last one padded. Inside an example, segment ids number the (pieces of) documents
1, 2, 3, ... and positions restart at 0 at each segment start; a document cut by an example boundary
continues in the next example as segment 1 with positions starting again at 0 (the teacher sees
exactly the context inside the example). Example i is found with a binary search over the
cumulative document lengths: O(L log n), independent of i.

Not packed (`packing=False`): each permuted document is split into consecutive windows of L tokens
(ceil(len / L) examples per document, nothing dropped); window w holds tokens [w*L, (w+1)*L) of the
document with segment id 1 and positions 0.., padded at the end.

Padding: token `pad_id`, segment id 0, position 0.
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64


def splitmix64(x) -> np.ndarray:
    """The splitmix64 finalizer (Steele, Lea, Flood 2014) over a uint64 array, wrapping arithmetic."""
    z = np.asarray(x, dtype=_U64).copy()
    with np.errstate(over="ignore"):
        z += _U64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        z = z ^ (z >> _U64(31))
    return z


def document_order(num_documents: int, seed: int) -> np.ndarray:
    """int64 [num_documents]: the document index at each place of the order."""
    mask = splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=_U64))[0]
    keys = splitmix64(np.arange(num_documents, dtype=_U64) ^ mask)
    return np.argsort(keys, kind="stable").astype(np.int64)


class PackedLayout:
    """Example i of the packed stream, by binary search."""

    def __init__(self, lengths: np.ndarray, order: np.ndarray, offsets: np.ndarray, seq_len: int):
        self.seq_len = seq_len
        self.order = order
        self.doc_start = offsets[order]  # where each ordered document starts in the token cache
        self.cum = np.concatenate([[0], np.cumsum(lengths[order])]).astype(np.int64)
        self.total = int(self.cum[-1])
        self.num_examples = -(-self.total // seq_len)

    def gather(self, i: int):
        """(token indices into the cache, segment ids, positions) of the non-padding part of example i."""
        start = i * self.seq_len
        end = min(start + self.seq_len, self.total)
        p = np.arange(start, end, dtype=np.int64)
        k = np.searchsorted(self.cum, p, side="right") - 1  # place in the order of each stream position
        seg_start = np.maximum(self.cum[k], start)
        src = self.doc_start[k] + (p - self.cum[k])
        return src, (k - k[0] + 1), (p - seg_start)


class UnpackedLayout:
    """Example i = window w of ordered document k."""

    def __init__(self, lengths: np.ndarray, order: np.ndarray, offsets: np.ndarray, seq_len: int):
        self.seq_len = seq_len
        ordered_len = lengths[order]
        self.doc_start = offsets[order]
        self.doc_len = ordered_len
        windows = -(-ordered_len // seq_len)
        self.cum = np.concatenate([[0], np.cumsum(windows)]).astype(np.int64)
        self.num_examples = int(self.cum[-1])

    def gather(self, i: int):
        k = int(np.searchsorted(self.cum, i, side="right")) - 1
        w = i - int(self.cum[k])
        lo = w * self.seq_len
        n = min(self.seq_len, int(self.doc_len[k]) - lo)
        pos = np.arange(n, dtype=np.int64)
        return self.doc_start[k] + lo + pos, np.ones(n, np.int64), pos
