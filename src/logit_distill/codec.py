"""The byte layout of one store record (one example) and its two codecs.

``exact``:   log-probs float32, ids and counts int32: lossless, for tests and equivalence checks.
``default``: ids bit-packed to ceil(log2 vocab) bits, top-k log-probs as 16-bit fixed point
             (``q = round(-logprob * 1024)``, clamped to [0, 65535]), so a decoded
             log-prob is within 2**-11 (~4.9e-4) of the stored one over [-64, 0];
             below -64 (probability < 1.6e-28) values are clamped to -65535/1024.
             Sampled records (flags bit 1, layout "rice-v2"): counts in unary (N bits per
             position, whatever the number of distinct ids: count c is c - 1 one-bits and a
             zero); the ascending ids of a position as gaps and the log-probs as fixed point
             (``q = round(-logprob * 32)``, within 2**-6 ~ 0.0156, clamped to [0, 2**20 - 1]),
             both Rice-coded with a per-record parameter, each code split into a unary
             quotient stream and a fixed-width remainder stream (vectorized decoding).

Both codecs refuse NaN and +inf log-probs (``NonFiniteError``) instead of clamping them:
a store never holds a NaN, and the default codec never turns one into a plausible value
(-inf, an empty tail, is stored as the floor).

Layout (all little-endian; docs/FORMAT.md is the normative description):

    header, 48 bytes:  magic b"LDR1" | codec u8 | flags u8 | id_bits u8 | aux u8
                       | example_index u64 | seq_len u32 | width u32 | num_runs u32
                       | store_tag u32 (first 4 bytes of the store fingerprint)
                       | token_hash 16 bytes (BLAKE2b-128 of tokens as int32 LE)
    runs:              num_runs x (segment_id u32, length u32, first_position u32, step u32)
    tokens:            [L]     ids
    loss_mask:         masked records only (flags bit 2): [L] bits, 1 where position j (the
                       prediction of token j + 1) is supervised; the S set bits are the rows of
                       every section below, which then holds S rows instead of L

    top-k record (flags bit 0 clear; width = k, aux = m tempered tails):
    topk_ids:              [L, k]  ids
    topk_logprobs:         [L, k]  log-probs
    tail_logprob:          [L]     log-probs
    tail_logprob_tempered: [L, m]  log-probs (log tail mass at each manifest tail temperature)

    sampled record (flags bit 0 set; width = N, the draws per position; aux = 0): ragged,
    n_j distinct ids at position j, M = sum_j n_j
    counts:            exact: num_distinct [L] int32 then sample_counts [M] int32;
                       default: [L, N] bits, per position the unary codes of its counts
                       (count c: c - 1 one-bits, then a zero-bit; they fill exactly N bits)
    rice parameters:   default only: r_id u8, r_lp u8
    sample_ids:        [M]     ids, position-major, ascending within a position
                       (default: gaps Rice-coded with r_id: unary quotients, then r_id-bit remainders)
    sample_logprobs:   [M]     sampled log-probs (the teacher's untempered log-prob)
                       (default: fixed point q Rice-coded with r_lp, the same two streams)

    hybrid record (flags bit 3; width = N, the tail draws per position; aux = k, the head, <= 255;
    flags bit 4: one tempered tail per position, at the store's proposal temperature t):
    topk_ids:              [L, k]  ids            (the head: the teacher's exact top-k, as a top-k record;
    topk_logprobs:         [L, k]  log-probs       these three sections are absent when k = 0, where the
    tail_logprob:          [L]     log-probs       tail is the whole distribution)
    tail_logprob_tempered: [L, m]  log-probs (m = 1 with flags bit 4, else 0; absent when k = 0)
    counts:                as a sampled record's (exact: num_distinct [L] then [M]; default: [L, N] bits)
    rice parameter:        default only: r_id u8
    sample_ids:            [M] ids of the tail draws, as a sampled record's (default: Rice-coded gaps)
    tail_plogp:            [L] ``sum_{v in tail} p_t(v) log p_t(v)`` of the teacher tempered at t
                           (exact: float32; default: the top-k log-probs' 16-bit fixed point)
    The draws carry no log-probs: ``hybrid_kl``'s gradient never reads them and ``tail_plogp`` makes its
    value exact in expectation (``train.losses.hybrid_kl_per_token``).

``ids`` are int32 (exact) or one bit-packed stream of id_bits each, padded to a
whole byte (default); ``log-probs`` are float32 (exact) or uint16 fixed point
(default); ``sampled log-probs`` float32 (exact) or Rice-coded fixed point
(default). Segment ids and positions are stored as runs: positions inside a
run are ``first_position + step * j``, so a packed row of D documents costs D runs.
Decoded, a sampled record's ``sample_ids``/``sample_counts``/``sample_logprobs``
are ``[L, S]`` with the n_j used slots first and zeros after.

A masked record (flags bit 2) stores the teacher's values only at its supervised positions
(``loss_mask``), in position order; decoded, every field is dense ``[L, ...]`` again with zeros
outside the mask, and ``loss_mask`` says where values are. A record without the bit holds every
position; its ``loss_mask`` decodes as ``next_token_mask(segment_ids)`` (what such a store trains on).

No pickle: the layout is plain bytes and numpy views.
"""

from __future__ import annotations

import hashlib
import math
import struct

import numpy as np

from .errors import NonFiniteError, StoreError

MAGIC = b"LDR1"
HEADER = struct.Struct("<4sBBBBQIIII16s")
RUN_DTYPE = np.dtype([("segment_id", "<u4"), ("length", "<u4"), ("first", "<u4"), ("step", "<u4")])

# Fixed point of the default codec: log-prob = -q / LOGPROB_SCALE.
LOGPROB_SCALE = 1024.0
LOGPROB_FLOOR = -65535 / LOGPROB_SCALE
LOGPROB_MAX_ERROR = 0.5 / LOGPROB_SCALE

# Fixed point of sampled log-probs (default codec): log-prob = -q / SAMPLED_LOGPROB_SCALE, q Rice-coded.
SAMPLED_LOGPROB_SCALE = 32.0
SAMPLED_LOGPROB_QMAX = (1 << 20) - 1
SAMPLED_LOGPROB_FLOOR = -SAMPLED_LOGPROB_QMAX / SAMPLED_LOGPROB_SCALE
SAMPLED_LOGPROB_MAX_ERROR = 0.5 / SAMPLED_LOGPROB_SCALE
RICE_MAX_K = 24
# The default codec's sampled layout, recorded in the manifest (codec.sampled_layout).
SAMPLED_LAYOUT = "rice-v2"

FLAG_SAMPLED = 1
# Default-codec sampled records in the Rice layout (ids as gaps, log-probs Rice-coded); a default-codec
# sampled record without it is the earlier layout, which this version does not read.
FLAG_SAMPLED_RICE = 2
# The teacher's values at supervised positions only, with the mask as [L] bits after the tokens.
FLAG_MASKED = 4
# A hybrid record: the exact top-k head plus draws from the rest (tail_plogp instead of the draws' log-probs).
FLAG_HYBRID = 8
# A hybrid record holding one tempered tail per position (at the store's proposal temperature).
FLAG_TEMPERED = 16
KNOWN_FLAGS = FLAG_SAMPLED | FLAG_SAMPLED_RICE | FLAG_MASKED | FLAG_HYBRID | FLAG_TEMPERED
# The default codec's hybrid layout, recorded in the manifest (codec.hybrid_layout).
HYBRID_LAYOUT = "hybrid-v1"
MAX_HYBRID_K = 255  # the head's k lives in the header's aux byte

# The fields of a decoded record (``decode_record``): those every record holds, then each selection's
# teacher fields (a top-k record holds ``tail_logprob_tempered`` only when its store has tail temperatures).
RECORD_FIELDS = ("example_index", "tokens", "segment_ids", "positions", "loss_mask")
SELECTION_FIELDS = {
    "topk": ("topk_ids", "topk_logprobs", "tail_logprob", "tail_logprob_tempered"),
    "sampled": ("sample_ids", "sample_counts", "sample_logprobs"),
    "hybrid": ("topk_ids", "topk_logprobs", "tail_logprob", "tail_logprob_tempered", "sample_ids", "sample_counts",
               "tail_plogp"),
}

CODEC_IDS = {"exact": 0, "default": 1}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}


def id_bits_for(vocab_size: int) -> int:
    """Bits per id in the default codec: ceil(log2 vocab_size), at least 1."""
    return max(1, math.ceil(math.log2(max(2, int(vocab_size)))))


def token_hash(tokens: np.ndarray) -> bytes:
    """A stable content hash of an example's tokens (BLAKE2b-128 of int32 little-endian)."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i4").tobytes(), digest_size=16).digest()


def bytes_per_entry(codec: str, vocab_size: int, seq_len: int, top_k: int) -> float:
    """Record size / (seq_len * top_k) for a packed row of one document."""
    size = record_size(codec, vocab_size, seq_len, top_k, num_runs=1)
    return size / (seq_len * top_k)


def record_size(codec: str, vocab_size: int, seq_len: int, top_k: int, num_runs: int,
                supervised: int | None = None) -> int:
    """Bytes of a top-k record; ``supervised``: a masked record with that many supervised positions."""
    bits = 32 if codec == "exact" else id_bits_for(vocab_size)
    return _record_size(codec, bits, seq_len, top_k, num_runs, supervised=supervised)


def _record_size(codec: str, bits: int, L: int, k: int, num_runs: int, tempered: int = 0,
                 supervised: int | None = None) -> int:
    size = HEADER.size + RUN_DTYPE.itemsize * num_runs
    S = L if supervised is None else supervised  # rows of the teacher's sections
    if supervised is not None:
        size += _packed_len(L, 1)
    if codec == "exact":
        return size + 4 * L + 8 * S * k + 4 * S + 4 * S * tempered
    return size + _packed_len(L, bits) + _packed_len(S * k, bits) + 2 * S * k + 2 * S + 2 * S * tempered


def _sampled_size(codec: str, bits: int, N: int, L: int, M: int, num_runs: int,
                  supervised: int | None = None) -> int:
    """Exact codec: the whole record; default codec: up to and including the Rice parameters."""
    size = HEADER.size + RUN_DTYPE.itemsize * num_runs
    S = L if supervised is None else supervised
    if supervised is not None:
        size += _packed_len(L, 1)
    if codec == "exact":
        return size + 4 * L + 4 * S + 12 * M
    return size + _packed_len(L, bits) + _packed_len(S * N, 1) + 2


def next_token_mask(segment_ids: np.ndarray) -> np.ndarray:
    """bool ``[..., L]``: position j predicts token j + 1 of its own document (numpy
    ``train.losses.next_token_mask``): the positions a record without a mask holds values for."""
    seg = np.asarray(segment_ids)
    out = np.zeros(seg.shape, bool)
    out[..., :-1] = (seg[..., :-1] != 0) & (seg[..., 1:] == seg[..., :-1])
    return out


def encode_mask(loss_mask: np.ndarray) -> bytes:
    """``[L]`` bools as ``ceil(L / 8)`` bytes, least significant bit first."""
    return np.packbits(np.asarray(loss_mask, bool).reshape(-1), bitorder="little").tobytes()


def decode_mask(data, offset: int, L: int) -> np.ndarray:
    """Inverse of ``encode_mask`` from ``data[offset:]``: bool ``[L]``; set padding bits are damage."""
    n = _packed_len(L, 1)
    if len(data) < offset + n:
        raise StoreError("masked record: the mask runs past the end of the record")
    bits = np.unpackbits(np.frombuffer(data, np.uint8, count=n, offset=offset), bitorder="little")
    if bits[L:].any():
        raise StoreError("masked record: bits are set in the mask's padding beyond seq_len")
    return bits[:L].astype(bool)


# ---------------------------------------------------------------- Rice codes


def rice_parameter(values: np.ndarray) -> int:
    """The k in [0, RICE_MAX_K] that codes ``values`` in the fewest bits (the smallest on a tie):
    value v costs (v >> k) + 1 + k bits."""
    v = np.asarray(values, np.int64).reshape(-1)
    if v.size == 0:
        return 0
    costs = [int(np.sum(v >> k)) + v.size * k for k in range(RICE_MAX_K + 1)]
    return int(np.argmin(costs))


def rice_encode(values: np.ndarray, k: int) -> tuple[bytes, bytes]:
    """Rice code of non-negative ``values`` with parameter ``k`` as two byte-aligned streams:
    the quotients ``v >> k`` in unary (q one-bits then a zero-bit) and the remainders, k bits each."""
    v = np.asarray(values, np.int64).reshape(-1)
    q = v >> k
    ends = np.cumsum(q + 1) - 1
    bits = np.ones(int(ends[-1]) + 1 if v.size else 0, np.uint8)
    bits[ends] = 0
    unary = np.packbits(bits, bitorder="little").tobytes()
    rem = pack_bits(v & ((1 << k) - 1), k) if k else b""
    return unary, rem


def rice_decode(data, offset: int, count: int, k: int, what: str) -> tuple[np.ndarray, int]:
    """Inverse of ``rice_encode`` from ``data[offset:]``: (values int64 [count], offset after both streams)."""
    if count == 0:
        return np.zeros(0, np.int64), offset
    if offset >= len(data):
        raise StoreError(f"sampled record: the {what} stream starts past the end of the record")
    raw = np.frombuffer(data, np.uint8, offset=offset)
    # With k chosen by ``rice_parameter`` the mean quotient is about 1: look at 4 bits a code first.
    window = raw[: (4 * count + 64) // 8]
    zeros = np.flatnonzero(np.unpackbits(window, bitorder="little") == 0)[:count]
    if zeros.size < count and window.size < raw.size:
        zeros = np.flatnonzero(np.unpackbits(raw, bitorder="little") == 0)[:count]
    if zeros.size < count:
        raise StoreError(f"sampled record: the {what} stream ends before its {count} codes")
    q = np.diff(zeros, prepend=-1) - 1
    offset += (int(zeros[-1]) + 8) // 8
    if k:
        size = _packed_len(count, k)
        if len(data) < offset + size:
            raise StoreError(f"sampled record: the {what} remainders run past the end of the record")
        rem = unpack_bits(memoryview(data)[offset: offset + size], count, k).astype(np.int64)
        offset += size
    else:
        rem = 0
    return (q << k) | rem, offset


def sampled_id_gaps(flat_ids: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Ascending distinct ids per position (position-major, n_j each) as gaps: the first id of a
    position itself, every later one minus its predecessor minus 1."""
    ids = np.asarray(flat_ids, np.int64)
    prev = np.concatenate([[-1], ids[:-1]])
    starts = np.cumsum(n) - n
    prev[starts[n > 0]] = -1
    return ids - prev - 1


def sampled_ids_from_gaps(gaps: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Inverse of ``sampled_id_gaps``."""
    c = np.cumsum(np.asarray(gaps, np.int64) + 1)
    starts = np.cumsum(n) - n
    base = np.concatenate([[0], c])[starts]
    return c - np.repeat(base, n) - 1


def encode_unary_counts(counts: np.ndarray, N: int) -> bytes:
    """``[L, S]`` counts (used slots first, each row summing to N) as ``[L, N]`` bits: per position,
    each count c as c - 1 one-bits then a zero-bit, little-endian bit order."""
    counts = np.asarray(counts, np.int64)
    L = counts.shape[0]
    bits = np.ones((L, N), np.uint8)
    used = counts > 0
    ends = np.cumsum(counts, axis=-1) - 1
    rows = np.broadcast_to(np.arange(L)[:, None], counts.shape)
    bits[rows[used], ends[used]] = 0
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def decode_unary_counts(data, L: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``encode_unary_counts``: (n_j [L], flat counts [M] position-major)."""
    raw = np.frombuffer(data, np.uint8, count=_packed_len(L * N, 1))
    bits = np.unpackbits(raw, bitorder="little")[: L * N].reshape(L, N)
    if L and np.any(bits[:, -1] != 0):
        j = int(np.argmax(bits[:, -1] != 0))
        raise StoreError(f"sampled record: the counts of position {j} do not end at N = {N} draws")
    rows, cols = np.nonzero(bits == 0)
    prev = np.empty_like(cols)
    prev[:1] = -1
    prev[1:] = np.where(rows[1:] == rows[:-1], cols[:-1], -1)
    return np.bincount(rows, minlength=L).astype(np.int64), (cols - prev).astype(np.int32)


def _packed_len(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


# ---------------------------------------------------------------- bit packing


def pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Pack non-negative integers < 2**bits into a little-endian bit stream."""
    v = np.ascontiguousarray(values, dtype=np.uint32).reshape(-1)
    if bits == 32:
        return v.astype("<u4").tobytes()
    shifts = np.arange(bits, dtype=np.uint32)
    bitmat = ((v[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bitmat.reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: bytes | memoryview, count: int, bits: int) -> np.ndarray:
    """Inverse of ``pack_bits``: ``count`` values as int32.

    Each value lies within the 8 bytes starting at its first byte: read those
    as an (unaligned) little-endian uint64, shift and mask. About 4x faster
    than unpacking single bits.
    """
    if bits == 32:
        return np.frombuffer(data, dtype="<u4", count=count).astype(np.int32)
    n = _packed_len(count, bits)
    buf = np.zeros(n + 8, dtype=np.uint8)
    buf[:n] = np.frombuffer(data, dtype=np.uint8, count=n)
    words = np.ndarray((n + 1,), dtype="<u8", buffer=buf, strides=(1,))
    starts = np.arange(count, dtype=np.int64) * bits
    values = words[starts >> 3] >> (starts & 7).astype(np.uint64)
    return (values & np.uint64((1 << bits) - 1)).astype(np.int32)


# ---------------------------------------------------------------- runs


def decode_runs(runs: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = runs["length"].astype(np.int64)
    if int(lengths.sum()) != seq_len:
        raise StoreError(f"record runs cover {int(lengths.sum())} positions, expected seq_len={seq_len}")
    segment_ids = np.repeat(runs["segment_id"].astype(np.int32), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    offset = np.arange(seq_len, dtype=np.int64) - starts
    positions = np.repeat(runs["first"].astype(np.int64), lengths) + np.repeat(
        runs["step"].astype(np.int64), lengths
    ) * offset
    return segment_ids, positions.astype(np.int32)


def encode_runs(segment_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Runs of (segment_id, length, first_position, step) that reproduce the row exactly.

    A document (positions +1 per token) or a padding stretch (constant position)
    is one run; anything else falls back to shorter runs, never to a wrong one.
    """
    seg = np.asarray(segment_ids, dtype=np.int64)
    pos = np.asarray(positions, dtype=np.int64)
    n = seg.shape[0]
    if n < 2:
        runs = np.zeros(n, RUN_DTYPE)
        if n:
            runs[0] = (seg[0], 1, pos[0], 0)
        return runs
    same_seg = seg[1:] == seg[:-1]
    inc = same_seg & (pos[1:] == pos[:-1] + 1)
    const = same_seg & (pos[1:] == pos[:-1])
    # A run breaks where neither continuation holds, or where the kind of continuation changes.
    kind = np.where(inc, 1, np.where(const, 0, -1))
    brk = np.ones(n, dtype=bool)
    brk[1:] = kind == -1
    brk[2:] |= (kind[1:] != kind[:-1]) & (kind[1:] != -1) & (kind[:-1] != -1)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n))
    steps = np.where(lengths > 1, np.where(kind[np.minimum(starts, n - 2)] == 1, 1, 0), 0)
    runs = np.empty(len(starts), RUN_DTYPE)
    runs["segment_id"] = seg[starts]
    runs["length"] = lengths
    runs["first"] = pos[starts]
    runs["step"] = steps
    return runs


# ---------------------------------------------------------------- log-probs


def first_not_storable(x: np.ndarray) -> int | None:
    """Flat index of the first NaN or +inf in ``x`` (log-probs), or None when there is none."""
    x = np.asarray(x)
    bad = np.isnan(x) | (x == np.inf)
    return int(np.argmax(bad.reshape(-1))) if bad.any() else None


def _refuse_not_storable(example_index: int, rows: np.ndarray | None = None, **fields) -> None:
    """NonFiniteError naming the example, field and position of the first NaN/+inf log-prob
    (``rows``: the positions of a masked record's rows)."""
    for name, values in fields.items():
        values = np.asarray(values)
        bad = first_not_storable(values)
        if bad is not None:
            position = bad // max(1, values.shape[-1]) if values.ndim > 1 else bad
            position = int(rows[position]) if rows is not None else position
            raise NonFiniteError(
                f"example {int(example_index)}: {name} is {values.reshape(-1)[bad]} at position {position}; "
                "a store holds finite log-probs only (is the teacher's checkpoint damaged?)"
            )


def quantize_logprobs(x: np.ndarray) -> np.ndarray:
    q = np.rint(-np.asarray(x, dtype=np.float32) * np.float32(LOGPROB_SCALE))
    q = np.nan_to_num(q, nan=65535.0, posinf=65535.0)
    return np.clip(q, 0, 65535).astype("<u2")


def dequantize_logprobs(q: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * np.float32(-1.0 / LOGPROB_SCALE)


def quantize_sampled_logprobs(x: np.ndarray) -> np.ndarray:
    top = SAMPLED_LOGPROB_QMAX
    q = np.rint(-np.asarray(x, dtype=np.float64) * SAMPLED_LOGPROB_SCALE)
    q = np.nan_to_num(q, nan=top, posinf=top)
    return np.clip(q, 0, top).astype(np.int64)


def dequantize_sampled_logprobs(q: np.ndarray) -> np.ndarray:
    return (np.asarray(q, np.float64) * (-1.0 / SAMPLED_LOGPROB_SCALE)).astype(np.float32)


# ---------------------------------------------------------------- records


def _supervised_rows(loss_mask, L: int):
    """(the mask section's bytes, the supervised rows) of a masked record; (b"", None) without a mask."""
    if loss_mask is None:
        return b"", None
    mask = np.asarray(loss_mask)
    if mask.shape != (L,) or mask.dtype != bool:
        raise ValueError(f"loss_mask must be bool [{L}], got {mask.dtype} {mask.shape}")
    return encode_mask(mask), np.flatnonzero(mask)


def encode_record(
    codec: str,
    *,
    example_index: int,
    tokens: np.ndarray,
    segment_ids: np.ndarray,
    positions: np.ndarray,
    topk_ids: np.ndarray | None = None,
    topk_logprobs: np.ndarray | None = None,
    tail_logprob: np.ndarray | None = None,
    vocab_size: int,
    store_tag: int = 0,
    tail_logprob_tempered: np.ndarray | None = None,
    sample_ids: np.ndarray | None = None,
    sample_counts: np.ndarray | None = None,
    sample_logprobs: np.ndarray | None = None,
    num_samples: int | None = None,
    loss_mask: np.ndarray | None = None,
    tail_plogp: np.ndarray | None = None,
) -> bytes:
    """Encode one example. Shapes: tokens/segment_ids/positions/tail [L], topk [L, k],
    tail_logprob_tempered [L, m]; or, for a sampled record, sample_* [L, S'] (any S' >= the
    distinct ids of every position, used slots first) and ``num_samples`` N; or, for a hybrid
    record (``tail_plogp`` [L] given), the top-k fields (m <= 1), ``sample_ids``/``sample_counts``
    of the tail draws and ``num_samples``.

    With ``loss_mask`` (bool [L]) the record is masked: the teacher's fields are kept at the
    positions the mask sets only (what they hold elsewhere is never read)."""
    if codec not in CODEC_IDS:
        raise ValueError(f"unknown codec {codec!r}; known: {sorted(CODEC_IDS)}")
    tokens = np.asarray(tokens)
    mask_bytes, rows = _supervised_rows(loss_mask, tokens.shape[0])
    if tail_plogp is not None:
        return _encode_hybrid(codec, example_index, tokens, segment_ids, positions, topk_ids, topk_logprobs,
                              tail_logprob, tail_logprob_tempered, sample_ids, sample_counts, tail_plogp, vocab_size,
                              store_tag, num_samples, mask_bytes, rows)
    if sample_ids is not None:
        return _encode_sampled(codec, example_index, tokens, segment_ids, positions, sample_ids, sample_counts,
                               sample_logprobs, vocab_size, store_tag, num_samples, mask_bytes, rows)
    L, k = np.shape(topk_ids)
    if tokens.shape != (L,) or np.shape(topk_logprobs) != (L, k) or np.shape(tail_logprob) != (L,):
        raise ValueError(
            f"inconsistent record shapes: tokens {tokens.shape}, topk_ids {(L, k)}, "
            f"topk_logprobs {np.shape(topk_logprobs)}, tail_logprob {np.shape(tail_logprob)}"
        )
    tempered = np.zeros((L, 0), np.float32) if tail_logprob_tempered is None else np.asarray(tail_logprob_tempered)
    if tempered.ndim != 2 or tempered.shape[0] != L or tempered.shape[1] > 255:
        raise ValueError(f"tail_logprob_tempered has shape {tempered.shape}, expected ({L}, m <= 255)")
    topk_ids, topk_logprobs, tail_logprob = np.asarray(topk_ids), np.asarray(topk_logprobs), np.asarray(tail_logprob)
    if rows is not None:  # the supervised positions only, in order
        topk_ids, topk_logprobs, tail_logprob, tempered = (a[rows] for a in (topk_ids, topk_logprobs, tail_logprob,
                                                                              tempered))
    _refuse_not_storable(example_index, topk_logprobs=topk_logprobs, tail_logprob=tail_logprob,
                         tail_logprob_tempered=tempered, rows=rows)
    runs = encode_runs(segment_ids, positions)
    bits = 32 if codec == "exact" else id_bits_for(vocab_size)
    header = HEADER.pack(
        MAGIC, CODEC_IDS[codec], 0 if rows is None else FLAG_MASKED, bits, tempered.shape[1], int(example_index),
        L, k, len(runs), store_tag, token_hash(tokens)
    )
    parts = [header, runs.tobytes(), _encode_tokens(codec, tokens, bits), mask_bytes,
             *_encode_head(codec, bits, topk_ids, topk_logprobs, tail_logprob, tempered)]
    return b"".join(parts)


def _encode_tokens(codec: str, tokens, bits: int) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes() if codec == "exact" else pack_bits(tokens, bits)


def _encode_head(codec: str, bits: int, topk_ids, topk_logprobs, tail_logprob, tempered) -> list[bytes]:
    """The top-k sections: ids, log-probs, tail, tempered tails."""
    if codec == "exact":
        return [np.ascontiguousarray(a, dtype=d).tobytes() for a, d in (
            (topk_ids, "<i4"), (topk_logprobs, "<f4"), (tail_logprob, "<f4"), (tempered, "<f4"))]
    return [pack_bits(topk_ids, bits), *(quantize_logprobs(a).tobytes() for a in (topk_logprobs, tail_logprob,
                                                                                   tempered))]


def _encode_sampled(codec, example_index, tokens, segment_ids, positions, ids, counts, logprobs, vocab_size,
                    store_tag, num_samples, mask_bytes=b"", rows=None) -> bytes:
    ids, counts, logprobs = np.asarray(ids), np.asarray(counts), np.asarray(logprobs)
    L = tokens.shape[0]
    if ids.ndim != 2 or ids.shape[0] != L or counts.shape != ids.shape or logprobs.shape != ids.shape:
        raise ValueError(f"inconsistent sampled record shapes: tokens {tokens.shape}, sample_ids {ids.shape}, "
                         f"sample_counts {counts.shape}, sample_logprobs {logprobs.shape}")
    if num_samples is None or int(num_samples) < 1:
        raise ValueError("a sampled record needs num_samples >= 1")
    N = int(num_samples)
    if rows is not None:  # the supervised positions only, in order
        ids, counts, logprobs = ids[rows], counts[rows], logprobs[rows]
    bits = 32 if codec == "exact" else id_bits_for(vocab_size)
    used, n = _check_draws(ids, counts, N, codec, bits, "sampled")
    _refuse_not_storable(example_index, sample_logprobs=np.where(used, logprobs, 0.0), rows=rows)
    runs = encode_runs(segment_ids, positions)
    flags = FLAG_SAMPLED if codec == "exact" else FLAG_SAMPLED | FLAG_SAMPLED_RICE
    if rows is not None:
        flags |= FLAG_MASKED
    header = HEADER.pack(MAGIC, CODEC_IDS[codec], flags, bits, 0,
                         int(example_index), L, N, len(runs), store_tag, token_hash(tokens))
    flat_ids, flat_counts, flat_lp = ids[used], counts[used], logprobs[used]
    parts = [header, runs.tobytes()]
    if codec == "exact":
        parts += [np.ascontiguousarray(tokens, dtype="<i4").tobytes(), mask_bytes, n.astype("<i4").tobytes(),
                  flat_ids.astype("<i4").tobytes(), flat_counts.astype("<i4").tobytes(),
                  flat_lp.astype("<f4").tobytes()]
    else:
        gaps = sampled_id_gaps(flat_ids, n)
        qlp = quantize_sampled_logprobs(flat_lp)
        k_ids, k_lp = rice_parameter(gaps), rice_parameter(qlp)
        parts += [pack_bits(tokens, bits), mask_bytes, encode_unary_counts(counts, N), bytes([k_ids, k_lp]),
                  *rice_encode(gaps, k_ids), *rice_encode(qlp, k_lp)]
    return b"".join(parts)


def _check_draws(ids, counts, N: int, codec: str, bits: int, what: str):
    """(used [S, S'] bool, n [S] distinct ids per position) of draws in slots (used first, ascending ids);
    ValueError naming ``what`` (a record kind) when they cannot be stored."""
    used = counts > 0
    n = used.sum(-1)
    if not np.array_equal(used, np.arange(ids.shape[1])[None, :] < n[:, None]):
        raise ValueError(f"{what} record: the slots with a count > 0 must come first at every position")
    if np.any(n < 1):
        raise ValueError(f"{what} record: every position needs at least one sampled id")
    if codec != "exact" and n.size and np.any(counts.sum(-1) != N):  # the unary layout needs it; exact keeps any
        j = int(np.argmax(counts.sum(-1) != N))
        raise ValueError(f"{what} record: the counts of position {j} sum to {int(counts[j].sum())}, not N = {N}")
    if codec != "exact":
        flat = ids[used]
        if np.any(sampled_id_gaps(flat, n) < 0):
            raise ValueError(f"{what} record: the ids of a position must be distinct and ascending")
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= 1 << bits):
            raise ValueError(f"{what} record: an id lies outside [0, 2**{bits})")
    return used, n


def _encode_hybrid(codec, example_index, tokens, segment_ids, positions, topk_ids, topk_logprobs, tail_logprob,
                   tempered, ids, counts, tail_plogp, vocab_size, store_tag, num_samples, mask_bytes=b"",
                   rows=None) -> bytes:
    L = tokens.shape[0]
    topk_ids, topk_logprobs = np.asarray(topk_ids), np.asarray(topk_logprobs)
    ids, counts, tail_plogp = np.asarray(ids), np.asarray(counts), np.asarray(tail_plogp)
    k = topk_ids.shape[-1] if topk_ids.ndim == 2 else -1
    tail_logprob = np.zeros(L, np.float32) if tail_logprob is None else np.asarray(tail_logprob)
    tempered = np.zeros((L, 0), np.float32) if tempered is None else np.asarray(tempered)
    if (topk_ids.shape != (L, k) or topk_logprobs.shape != (L, k) or tail_logprob.shape != (L,)
            or ids.ndim != 2 or ids.shape[0] != L or counts.shape != ids.shape or tail_plogp.shape != (L,)
            or tempered.ndim != 2 or tempered.shape[0] != L or tempered.shape[1] > 1 or k > MAX_HYBRID_K):
        raise ValueError(f"inconsistent hybrid record shapes: tokens {tokens.shape}, topk_ids {topk_ids.shape}, "
                         f"topk_logprobs {topk_logprobs.shape}, tail_logprob {tail_logprob.shape}, tail_logprob_tempered "
                         f"{tempered.shape} (at most 1 column), sample_ids {ids.shape}, sample_counts {counts.shape}, "
                         f"tail_plogp {tail_plogp.shape} (k <= {MAX_HYBRID_K})")
    if num_samples is None or not 1 <= int(num_samples) <= 0xFFFFFFFF:
        raise ValueError("a hybrid record needs num_samples >= 1")
    N = int(num_samples)
    if rows is not None:  # the supervised positions only, in order
        topk_ids, topk_logprobs, tail_logprob, tempered, ids, counts, tail_plogp = (
            a[rows] for a in (topk_ids, topk_logprobs, tail_logprob, tempered, ids, counts, tail_plogp))
    bits = 32 if codec == "exact" else id_bits_for(vocab_size)
    used, n = _check_draws(ids, counts, N, codec, bits, "hybrid")
    _refuse_not_storable(example_index, topk_logprobs=topk_logprobs, tail_logprob=tail_logprob,
                         tail_logprob_tempered=tempered, tail_plogp=tail_plogp, rows=rows)
    m = tempered.shape[1] if k else 0
    flags = FLAG_HYBRID | (FLAG_TEMPERED if m else 0) | (0 if rows is None else FLAG_MASKED)
    runs = encode_runs(segment_ids, positions)
    header = HEADER.pack(MAGIC, CODEC_IDS[codec], flags, bits, k, int(example_index), L, N, len(runs), store_tag,
                         token_hash(tokens))
    parts = [header, runs.tobytes(), _encode_tokens(codec, tokens, bits), mask_bytes]
    if k:
        parts += _encode_head(codec, bits, topk_ids, topk_logprobs, tail_logprob, tempered[:, :m])
    flat_ids, flat_counts = ids[used], counts[used]
    if codec == "exact":
        parts += [n.astype("<i4").tobytes(), flat_ids.astype("<i4").tobytes(), flat_counts.astype("<i4").tobytes(),
                  tail_plogp.astype("<f4").tobytes()]
    else:
        gaps = sampled_id_gaps(flat_ids, n)
        r = rice_parameter(gaps)
        parts += [encode_unary_counts(counts, N), bytes([r]), *rice_encode(gaps, r),
                  quantize_logprobs(tail_plogp).tobytes()]
    return b"".join(parts)


def hybrid_fixed_bytes(codec: str, vocab_size: int, k: int, N: int, tempered: int = 0) -> float:
    """Bytes per supervised position of a hybrid record that do not depend on the draws (the head, the
    counts, ``tail_plogp``); the draws' ids add a Rice-coded gap each (default) or 8 bytes each (exact)."""
    if codec == "exact":
        return 8 * k + 4 * (k > 0) * (1 + tempered) + 4 + 4
    bits = id_bits_for(vocab_size)
    return k * bits / 8 + 2 * k + 2 * (k > 0) * (1 + tempered) + N / 8 + 2


def decode_header(data: bytes | memoryview) -> dict:
    if len(data) < HEADER.size:
        raise StoreError(f"record of {len(data)} bytes is shorter than its {HEADER.size}-byte header")
    magic, codec_id, flags, bits, aux, index, L, k, num_runs, tag, thash = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise StoreError(f"record does not start with {MAGIC!r} (got {magic!r})")
    if codec_id not in CODEC_NAMES:
        raise StoreError(f"record has unknown codec id {codec_id}")
    if flags & ~KNOWN_FLAGS or (flags & FLAG_HYBRID and flags & (FLAG_SAMPLED | FLAG_SAMPLED_RICE)):
        raise StoreError(f"record has unknown flags {flags:#04x}")
    hybrid = {}
    if flags & FLAG_HYBRID:  # width holds N, aux the head's k; aux is then the tempered tails, as a top-k record's
        hybrid = {"num_samples": k, "top_k": aux, "aux": int(bool(flags & FLAG_TEMPERED))}
    return {
        "codec": CODEC_NAMES[codec_id],
        "flags": flags,
        "selection": "hybrid" if flags & FLAG_HYBRID else "sampled" if flags & FLAG_SAMPLED else "topk",
        "masked": bool(flags & FLAG_MASKED),
        "id_bits": bits,
        "aux": aux,
        "example_index": index,
        "seq_len": L,
        "top_k": k,
        "num_runs": num_runs,
        "store_tag": tag,
        "token_hash": thash.hex(),
        **hybrid,
    }


def _record_fields(h: dict, tokens, segment_ids, positions, loss_mask) -> dict:
    """The fields every decoded record holds (``RECORD_FIELDS``), with the header's store tag and token hash."""
    return {"example_index": np.int64(h["example_index"]), "store_tag": np.uint32(h["store_tag"]),
            "token_hash": h["token_hash"], "tokens": tokens, "segment_ids": segment_ids, "positions": positions,
            "loss_mask": loss_mask}


def _spread(rows: np.ndarray, mask, L: int) -> np.ndarray:
    """Rows of the supervised positions back to ``[L, ...]``, zeros elsewhere (``mask`` None: all rows)."""
    if mask is None:
        return rows
    out = np.zeros((L, *rows.shape[1:]), rows.dtype)
    out[mask] = rows
    return out


def _decode_prefix(mv, h: dict) -> tuple:
    """(segment_ids, positions, tokens, the stored mask or None, the loss mask, offset after them) of a
    record: its runs, tokens and mask."""
    L, bits = h["seq_len"], h["id_bits"]
    runs_end = HEADER.size + RUN_DTYPE.itemsize * h["num_runs"]
    head = runs_end + (4 * L if h["codec"] == "exact" else _packed_len(L, bits)) + (
        _packed_len(L, 1) if h["masked"] else 0)
    if len(mv) < head:
        raise StoreError(f"record is {len(mv)} bytes, shorter than its header implies ({head}+)")
    runs = np.frombuffer(mv, dtype=RUN_DTYPE, count=h["num_runs"], offset=HEADER.size)
    segment_ids, positions = decode_runs(runs, L)
    return segment_ids, positions, *_tokens_and_mask(mv, h, runs_end, segment_ids)


def _tokens_and_mask(mv, h: dict, off: int, segment_ids) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, int]:
    """(tokens, the stored mask or None, the record's loss mask, offset after both)."""
    L, bits = h["seq_len"], h["id_bits"]
    if h["codec"] == "exact":
        tokens = np.frombuffer(mv, "<i4", L, off).astype(np.int32)
        off += 4 * L
    else:
        n = _packed_len(L, bits)
        tokens = unpack_bits(mv[off: off + n], L, bits)
        off += n
    if not h["masked"]:
        return tokens, None, next_token_mask(segment_ids), off
    mask = decode_mask(mv, off, L)
    return tokens, mask, mask, off + _packed_len(L, 1)


def decode_record(data: bytes) -> dict:
    """Decode one record into numpy arrays (log-probs float32, ids and counts int32); the teacher's
    fields are ``[L, ...]`` with zeros where ``loss_mask`` is not set (a masked record holds nothing there)."""
    h = decode_header(data)
    if h["selection"] == "sampled":
        return _decode_sampled(data, h)
    if h["selection"] == "hybrid":
        return _decode_hybrid(data, h)
    L, k, bits, codec, m = h["seq_len"], h["top_k"], h["id_bits"], h["codec"], h["aux"]
    mv = memoryview(data)
    segment_ids, positions, tokens, mask, loss_mask, off = _decode_prefix(mv, h)
    S = L if mask is None else int(mask.sum())
    expected = _record_size(codec, bits, L, k, h["num_runs"], m, supervised=None if mask is None else S)
    if len(data) != expected:
        raise StoreError(f"record is {len(data)} bytes, "
                         f"{'its header and mask imply' if h['masked'] else 'its header implies'} {expected}")
    topk_ids, topk_logprobs, tail, tempered, off = _decode_head(mv, off, codec, bits, S, k, m)
    return {**_record_fields(h, tokens, segment_ids, positions, loss_mask),
            **_head_fields(topk_ids, topk_logprobs, tail, tempered, mask, L)}


def _decode_head(mv, off: int, codec: str, bits: int, S: int, k: int, m: int) -> tuple:
    """The top-k sections of ``S`` rows at ``off`` (ids, log-probs, tail, ``m`` tempered tails), and the
    offset after them; the caller has checked that the record holds them."""
    if codec == "exact":
        topk_ids = np.frombuffer(mv, "<i4", S * k, off).astype(np.int32).reshape(S, k)
        topk_logprobs = np.frombuffer(mv, "<f4", S * k, off + 4 * S * k).astype(np.float32).reshape(S, k)
        off += 8 * S * k
        tail = np.frombuffer(mv, "<f4", S, off).astype(np.float32)
        tempered = np.frombuffer(mv, "<f4", S * m, off + 4 * S).astype(np.float32).reshape(S, m)
        return topk_ids, topk_logprobs, tail, tempered, off + 4 * S * (1 + m)
    n = _packed_len(S * k, bits)
    topk_ids = unpack_bits(mv[off: off + n], S * k, bits).reshape(S, k)
    off += n
    topk_logprobs = dequantize_logprobs(np.frombuffer(mv, "<u2", S * k, off)).reshape(S, k)
    off += 2 * S * k
    tail = dequantize_logprobs(np.frombuffer(mv, "<u2", S, off))
    tempered = dequantize_logprobs(np.frombuffer(mv, "<u2", S * m, off + 2 * S)).reshape(S, m)
    return topk_ids, topk_logprobs, tail, tempered, off + 2 * S * (1 + m)


def _head_fields(topk_ids, topk_logprobs, tail, tempered, mask, L: int) -> dict:
    """The decoded top-k fields, dense ``[L, ...]`` (``tail_logprob_tempered`` when the record holds it)."""
    out = {"topk_ids": _spread(topk_ids, mask, L), "topk_logprobs": _spread(topk_logprobs, mask, L),
           "tail_logprob": _spread(tail, mask, L)}
    if tempered.shape[-1]:
        out["tail_logprob_tempered"] = _spread(tempered, mask, L)
    return out


def _decode_sampled(data: bytes, h: dict) -> dict:
    L, N, bits, codec = h["seq_len"], h["top_k"], h["id_bits"], h["codec"]
    if N < 1:
        raise StoreError("sampled record says 0 draws per position")
    mv = memoryview(data)
    segment_ids, positions, tokens, mask, loss_mask, off = _decode_prefix(mv, h)
    S = L if mask is None else int(mask.sum())  # positions with draws
    supervised = None if mask is None else S
    if len(data) < _sampled_size(codec, bits, N, L, 0, h["num_runs"], supervised):
        raise StoreError(f"record is {len(data)} bytes, shorter than its header implies "
                         f"({_sampled_size(codec, bits, N, L, 0, h['num_runs'], supervised)}+)")
    if codec == "exact":
        n = np.frombuffer(mv, "<i4", S, off).astype(np.int64)
        off += 4 * S
        if np.any(n < 1) or np.any(n > N):
            raise StoreError(f"sampled record: a position claims {int(n.max())} distinct ids of N = {N} draws")
        M = int(n.sum())
        size = _sampled_size(codec, bits, N, L, M, h["num_runs"], supervised)
        if len(data) != size:
            raise StoreError(f"record is {len(data)} bytes, its header and counts imply {size}")
        flat_ids = np.frombuffer(mv, "<i4", M, off).astype(np.int32)
        off += 4 * M
        flat_counts = np.frombuffer(mv, "<i4", M, off).astype(np.int32)
        off += 4 * M
        flat_lp = np.frombuffer(mv, "<f4", M, off).astype(np.float32)
    else:
        if not h["flags"] & FLAG_SAMPLED_RICE:
            raise StoreError("sampled record in an earlier layout (ids bit-packed, not Rice-coded gaps), "
                             "which this version does not read; dump the store again")
        size = _packed_len(S * N, 1)
        n, flat_counts = decode_unary_counts(mv[off : off + size], S, N)
        off += size
        M = int(n.sum())
        k_ids, k_lp = data[off], data[off + 1]
        off += 2
        if k_ids > RICE_MAX_K or k_lp > RICE_MAX_K:
            raise StoreError(f"sampled record: Rice parameters {k_ids}, {k_lp} exceed {RICE_MAX_K}")
        gaps, off = rice_decode(data, off, M, k_ids, "id gap")
        flat_ids = sampled_ids_from_gaps(gaps, n)
        if M and int(flat_ids.max()) >= 1 << bits:
            raise StoreError(f"sampled record: a decoded id is {int(flat_ids.max())}, beyond {bits}-bit ids")
        flat_ids = flat_ids.astype(np.int32)
        qlp, off = rice_decode(data, off, M, k_lp, "log-prob")
        if M and int(qlp.max()) > SAMPLED_LOGPROB_QMAX:
            raise StoreError(f"sampled record: a log-prob code {int(qlp.max())} exceeds {SAMPLED_LOGPROB_QMAX}")
        flat_lp = dequantize_sampled_logprobs(qlp)
        if off != len(data):
            raise StoreError(f"record is {len(data)} bytes, its header and codes imply {off}")
    ids, counts, lp = _slots(n, flat_ids, flat_counts, flat_lp)
    return {
        **_record_fields(h, tokens, segment_ids, positions, loss_mask),
        "sample_ids": _spread(ids, mask, L),
        "sample_counts": _spread(counts, mask, L),
        "sample_logprobs": _spread(lp, mask, L),
    }


def _slots(n: np.ndarray, *flat: np.ndarray) -> list[np.ndarray]:
    """Ragged per-position values (n_j each, position-major) as ``[S, max n_j]`` slots, used first, zeros after."""
    width = int(n.max()) if n.size else 0
    used = np.arange(width)[None, :] < n[:, None]
    out = []
    for values in flat:
        a = np.zeros((len(n), width), values.dtype)
        a[used] = values
        out.append(a)
    return out


def _decode_hybrid(data: bytes, h: dict) -> dict:
    L, N, k, m, bits, codec = h["seq_len"], h["num_samples"], h["top_k"], h["aux"], h["id_bits"], h["codec"]
    if N < 1:
        raise StoreError("hybrid record says 0 draws per position")
    if m and not k:
        raise StoreError("hybrid record without a head says it holds a tempered tail")
    mv = memoryview(data)
    segment_ids, positions, tokens, mask, loss_mask, off = _decode_prefix(mv, h)
    S = L if mask is None else int(mask.sum())
    exact = codec == "exact"
    fixed = (_packed_len(S * k, bits) + 2 * S * k + 2 * S * (1 + m) * (k > 0) if not exact
             else 8 * S * k + 4 * S * (1 + m) * (k > 0)) + (4 * S if exact else _packed_len(S * N, 1) + 1) + \
        (4 if exact else 2) * S
    if len(data) < off + fixed:
        raise StoreError(f"record is {len(data)} bytes, shorter than its header implies ({off + fixed}+)")
    if k:
        topk_ids, topk_lp, tail, tempered, off = _decode_head(mv, off, codec, bits, S, k, m)
    else:  # no head: the tail is the whole distribution
        topk_ids, topk_lp, tail, tempered = (np.zeros((S, 0), np.int32), np.zeros((S, 0), np.float32),
                                             np.zeros(S, np.float32), np.zeros((S, 0), np.float32))
    if exact:
        n = np.frombuffer(mv, "<i4", S, off).astype(np.int64)
        off += 4 * S
        if np.any(n < 1) or np.any(n > N):
            raise StoreError(f"hybrid record: a position claims {int(n.max())} distinct ids of N = {N} draws")
        M = int(n.sum())
        if len(data) != off + 8 * M + 4 * S:
            raise StoreError(f"record is {len(data)} bytes, its header and counts imply {off + 8 * M + 4 * S}")
        flat_ids = np.frombuffer(mv, "<i4", M, off).astype(np.int32)
        flat_counts = np.frombuffer(mv, "<i4", M, off + 4 * M).astype(np.int32)
        off += 8 * M
        plogp = np.frombuffer(mv, "<f4", S, off).astype(np.float32)
    else:
        size = _packed_len(S * N, 1)
        n, flat_counts = decode_unary_counts(mv[off: off + size], S, N)
        off += size
        r = data[off]
        if r > RICE_MAX_K:
            raise StoreError(f"hybrid record: Rice parameter {r} exceeds {RICE_MAX_K}")
        gaps, off = rice_decode(data, off + 1, int(n.sum()), r, "id gap")
        flat_ids = sampled_ids_from_gaps(gaps, n)
        if flat_ids.size and int(flat_ids.max()) >= 1 << bits:
            raise StoreError(f"hybrid record: a decoded id is {int(flat_ids.max())}, beyond {bits}-bit ids")
        flat_ids = flat_ids.astype(np.int32)
        if len(data) != off + 2 * S:
            raise StoreError(f"record is {len(data)} bytes, its header and codes imply {off + 2 * S}")
        plogp = dequantize_logprobs(np.frombuffer(mv, "<u2", S, off))
    ids, counts = _slots(n, flat_ids, flat_counts)
    return {**_record_fields(h, tokens, segment_ids, positions, loss_mask),
            **_head_fields(topk_ids, topk_lp, tail, tempered, mask, L),
            "sample_ids": _spread(ids, mask, L), "sample_counts": _spread(counts, mask, L),
            "tail_plogp": _spread(plogp, mask, L)}
