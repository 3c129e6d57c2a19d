"""Codecs: round trip, error bound, byte count, runs, bad records."""

import numpy as np
import pytest

from logit_distill import codec
from logit_distill.errors import StoreError


def _record(rng, L=37, k=8, V=151936, logprob_low=-60.0):
    lp = np.sort(rng.uniform(logprob_low, 0, size=(L, k)).astype(np.float32), axis=1)[:, ::-1]
    seg = np.repeat([1, 2, 0], [20, 12, L - 32]).astype(np.int32)
    pos = np.concatenate([np.arange(20), np.arange(12), np.zeros(L - 32)]).astype(np.int32)
    return dict(
        example_index=123456789012,
        tokens=rng.integers(0, V, L).astype(np.int32),
        segment_ids=seg,
        positions=pos,
        topk_ids=rng.integers(0, V, (L, k)).astype(np.int32),
        topk_logprobs=np.ascontiguousarray(lp),
        tail_logprob=rng.uniform(-30, -0.01, L).astype(np.float32),
        vocab_size=V,
    )


def test_exact_round_trip_is_lossless():
    rec = _record(np.random.default_rng(0))
    out = codec.decode_record(codec.encode_record("exact", **rec))
    for key in ("tokens", "segment_ids", "positions", "topk_ids"):
        np.testing.assert_array_equal(out[key], rec[key])
        assert out[key].dtype == np.int32
    np.testing.assert_array_equal(out["topk_logprobs"], rec["topk_logprobs"])
    np.testing.assert_array_equal(out["tail_logprob"], rec["tail_logprob"])
    assert out["topk_logprobs"].dtype == np.float32
    assert int(out["example_index"]) == rec["example_index"]
    assert out["token_hash"] == codec.token_hash(rec["tokens"]).hex()


@pytest.mark.parametrize("V", [2, 300, 32000, 128256, 151936, 262144])
def test_default_round_trip_within_bound(V):
    rng = np.random.default_rng(V)
    rec = _record(rng, V=V, k=min(8, V))
    out = codec.decode_record(codec.encode_record("default", **rec))
    np.testing.assert_array_equal(out["tokens"], rec["tokens"])
    np.testing.assert_array_equal(out["topk_ids"], rec["topk_ids"])
    np.testing.assert_array_equal(out["segment_ids"], rec["segment_ids"])
    np.testing.assert_array_equal(out["positions"], rec["positions"])
    err = np.abs(out["topk_logprobs"] - rec["topk_logprobs"]).max()
    assert err <= codec.LOGPROB_MAX_ERROR <= 1e-3
    assert np.abs(out["tail_logprob"] - rec["tail_logprob"]).max() <= codec.LOGPROB_MAX_ERROR


def test_default_clamps_below_floor_and_handles_minus_inf():
    rng = np.random.default_rng(1)
    rec = _record(rng, k=4)
    rec["topk_logprobs"][:, -1] = -200.0
    rec["tail_logprob"][:] = -np.inf
    out = codec.decode_record(codec.encode_record("default", **rec))
    assert np.all(out["topk_logprobs"][:, -1] == np.float32(codec.LOGPROB_FLOOR))
    assert np.all(out["tail_logprob"] == np.float32(codec.LOGPROB_FLOOR))
    assert np.isfinite(out["topk_logprobs"]).all()


def test_default_bytes_per_entry_formula_and_bound():
    # ids in ceil(log2 V) bits + 16-bit log-probs; Qwen's 151936 needs 18 bits: 4.25 bytes.
    L, k, V = 2048, 64, 151936
    assert codec.id_bits_for(V) == 18
    rng = np.random.default_rng(2)
    rec = _record(rng, L=L, k=k, V=V)
    rec["segment_ids"] = np.ones(L, np.int32)
    rec["positions"] = np.arange(L, dtype=np.int32)
    data = codec.encode_record("default", **rec)
    topk_bytes = (18 * L * k + 7) // 8 + 2 * L * k
    assert topk_bytes / (L * k) == 4.25
    per_position = (18 * L + 7) // 8 + 2 * L
    assert len(data) == codec.HEADER.size + codec.RUN_DTYPE.itemsize + topk_bytes + per_position
    assert len(data) / (L * k) == pytest.approx(codec.bytes_per_entry("default", V, L, k))
    assert codec.bytes_per_entry("default", 32000, L, k) <= 4.0
    assert codec.bytes_per_entry("exact", V, L, k) > 8.0


def test_encoding_is_deterministic():
    rec = _record(np.random.default_rng(3))
    assert codec.encode_record("default", **rec) == codec.encode_record("default", **rec)


@pytest.mark.parametrize("seed", range(20))
def test_runs_reproduce_any_row(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    seg = np.sort(rng.integers(0, 4, n))
    pos = rng.integers(0, 3, n) if seed % 2 else np.arange(n) % 7
    runs = codec.encode_runs(seg, pos)
    s, p = codec.decode_runs(runs, n)
    np.testing.assert_array_equal(s, seg)
    np.testing.assert_array_equal(p, pos)


def test_packed_row_is_one_run_per_document():
    seg = np.repeat([1, 2, 3, 0], [5, 7, 3, 4])
    pos = np.concatenate([np.arange(5), np.arange(7), np.arange(3), np.zeros(4)])
    assert len(codec.encode_runs(seg, pos)) == 4


def test_bit_packing_round_trip():
    rng = np.random.default_rng(4)
    for bits in (1, 5, 15, 17, 18, 31, 32):
        v = rng.integers(0, 2 ** min(bits, 31), 1001, dtype=np.int64)
        np.testing.assert_array_equal(codec.unpack_bits(codec.pack_bits(v, bits), 1001, bits), v)


def test_bad_records_raise_store_error():
    rec = _record(np.random.default_rng(5))
    data = codec.encode_record("default", **rec)
    with pytest.raises(StoreError, match="header"):
        codec.decode_record(data[:10])
    with pytest.raises(StoreError, match="does not start"):
        codec.decode_record(b"XXXX" + data[4:])
    with pytest.raises(StoreError, match="bytes, its header implies"):
        codec.decode_record(data[:-3])


# ------------------------------------------------------------------ sampled records (default codec: Rice)


def _random_sampled(rng, L, V, N, spread=None):
    """Per position, N draws from a random distribution over V ids: (ids, counts, log-probs) [L, N]."""
    ids = np.zeros((L, N), np.int32)
    counts = np.zeros((L, N), np.int32)
    lp = np.zeros((L, N), np.float32)
    for j in range(L):
        logits = rng.normal(size=V) * (spread if spread is not None else rng.uniform(0, 8))
        logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        u, c = np.unique(rng.choice(V, N, p=np.exp(logp) / np.exp(logp).sum()), return_counts=True)
        ids[j, :len(u)], counts[j, :len(u)], lp[j, :len(u)] = u, c, logp[u]
    return ids, counts, lp


def _encode_sampled(ids, counts, lp, V, N, tokens=None, codec_name="default"):
    L = ids.shape[0]
    return codec.encode_record(codec_name, example_index=7, tokens=np.zeros(L) if tokens is None else tokens,
                               segment_ids=np.ones(L), positions=np.arange(L), vocab_size=V, sample_ids=ids,
                               sample_counts=counts, sample_logprobs=lp, num_samples=N)


def _check_sampled(raw, ids, counts, lp):
    rec = codec.decode_record(raw)
    S = int((counts > 0).sum(-1).max())
    np.testing.assert_array_equal(rec["sample_ids"], ids[:, :S])
    np.testing.assert_array_equal(rec["sample_counts"], counts[:, :S])
    want = np.maximum(lp[:, :S], codec.SAMPLED_LOGPROB_FLOOR)
    assert np.abs(rec["sample_logprobs"] - want).max() <= codec.SAMPLED_LOGPROB_MAX_ERROR + 1e-6
    return rec


@pytest.mark.parametrize("seed", range(6))
def test_sampled_default_fuzz_round_trip_and_determinism(seed):
    rng = np.random.default_rng(100 + seed)
    L, V, N = int(rng.integers(1, 40)), int(rng.choice([2, 3, 50, 8192, 151936])), int(rng.choice([1, 2, 16, 64]))
    ids, counts, lp = _random_sampled(rng, L, V, N)
    raw = _encode_sampled(ids, counts, lp, V, N, tokens=rng.integers(0, V, L))
    _check_sampled(raw, ids, counts, lp)
    assert raw == _encode_sampled(ids, counts, lp, V, N, tokens=codec.decode_record(raw)["tokens"])


def test_sampled_default_edges_and_bound():
    V, N, L = 8192, 8, 5
    ids = np.zeros((L, N), np.int32)
    counts = np.zeros((L, N), np.int32)
    lp = np.zeros((L, N), np.float32)
    ids[0, 0], counts[0, 0] = 0, 8                                      # one id, the smallest
    ids[1, :2], counts[1, :2], lp[1, :2] = [0, V - 1], [4, 4], [-0.0, -np.inf]  # both ends; -inf clamps
    ids[2, :8], counts[2, :8] = np.arange(V - 8, V), 1                  # all distinct, adjacent, at the top
    lp[2, :8] = np.linspace(-5000.0, -1e-3, 8)                           # far below any fixed-width range
    ids[3, 0], counts[3, 0], lp[3, 0] = V - 1, 8, -1e6                   # below the floor: clamps
    ids[4, :3], counts[4, :3], lp[4, :3] = [5, 6, 4000], [1, 6, 1], [-1.23456, -0.01, -20.0]
    raw = _encode_sampled(ids, counts, lp, V, N)
    rec = _check_sampled(raw, ids, counts, lp)
    assert rec["sample_logprobs"][1, 1] == np.float32(codec.SAMPLED_LOGPROB_FLOOR)
    # Every representable value in [-64, 0] is within the bound.
    x = -np.linspace(0, 64, 100001).astype(np.float32)
    back = codec.dequantize_sampled_logprobs(codec.quantize_sampled_logprobs(x))
    assert np.abs(back - x).max() <= codec.SAMPLED_LOGPROB_MAX_ERROR + 1e-6


def test_sampled_default_ids_must_ascend_and_fit():
    V, N = 100, 4
    ids = np.array([[9, 3, 0, 0]], np.int32)
    counts = np.array([[2, 2, 0, 0]], np.int32)
    with pytest.raises(ValueError, match="ascending"):
        _encode_sampled(ids, counts, np.zeros((1, 4), np.float32), V, N)
    with pytest.raises(ValueError, match="outside"):
        _encode_sampled(np.array([[3, 200, 0, 0]], np.int32), counts, np.zeros((1, 4), np.float32), V, N)


def test_rice_streams_round_trip_and_parameter_is_optimal():
    rng = np.random.default_rng(3)
    for scale in (0, 1, 30, 5000, 2 ** 20):
        v = rng.geometric(1 / (scale + 1), size=int(rng.integers(1, 300))) - 1
        k = codec.rice_parameter(v)
        cost = lambda kk: int(np.sum(v >> kk)) + v.size * (kk + 1)  # noqa: E731
        assert all(cost(k) <= cost(kk) for kk in range(codec.RICE_MAX_K + 1))
        for kk in {0, k, codec.RICE_MAX_K}:
            unary, rem = codec.rice_encode(v, kk)
            data = b"\x07" + unary + rem
            back, end = codec.rice_decode(data, 1, v.size, kk, "test")
            np.testing.assert_array_equal(back, v)
            assert end == len(data)


def test_sampled_default_corrupt_records_raise_store_error():
    rng = np.random.default_rng(5)
    V, N, L = 8192, 32, 12
    ids, counts, lp = _random_sampled(rng, L, V, N, spread=3.5)
    raw = _encode_sampled(ids, counts, lp, V, N)
    head = codec.HEADER.size + codec.RUN_DTYPE.itemsize + (13 * L + 7) // 8 + (N * L + 7) // 8
    with pytest.raises(StoreError):
        codec.decode_record(raw[:-1])
    with pytest.raises(StoreError):
        codec.decode_record(raw + b"\x00")
    with pytest.raises(StoreError, match="earlier layout"):  # flags without the Rice bit
        codec.decode_record(raw[:5] + bytes([codec.FLAG_SAMPLED]) + raw[6:])
    with pytest.raises(StoreError, match="Rice parameters"):
        codec.decode_record(raw[:head] + bytes([codec.RICE_MAX_K + 1]) + raw[head + 1:])
    with pytest.raises(StoreError, match="ends before"):  # the unary stream never terminates
        codec.decode_record(raw[:head + 2] + b"\xff" * (len(raw) - head - 2))
    # Random byte flips never crash with anything but StoreError (or decode to something).
    for _ in range(200):
        bad = bytearray(raw)
        i = int(rng.integers(head, len(raw)))
        bad[i] ^= 1 << int(rng.integers(0, 8))
        try:
            codec.decode_record(bytes(bad))
        except StoreError:
            pass


def test_sampled_default_size_beats_fixed_width():
    """At ~16 distinct ids of V = 8192, a Rice-coded id gap plus log-prob costs far less than the
    fixed-width 13-bit id plus 12-bit log-prob of the earlier layout."""
    rng = np.random.default_rng(8)
    V, N, L = 8192, 32, 64
    ids, counts, lp = _random_sampled(rng, L, V, N, spread=3.6)
    raw = _encode_sampled(ids, counts, lp, V, N)
    M = int((counts > 0).sum())
    fixed_width = codec._sampled_size("default", 13, N, L, M, 1) - 2 + (13 * M + 7) // 8 + (12 * M + 7) // 8
    per_id = (len(raw) - codec._sampled_size("default", 13, N, L, M, 1)) * 8 / M
    assert per_id < 19.5 and len(raw) < 0.85 * fixed_width, (per_id, len(raw), fixed_width)


@pytest.mark.parametrize("codec_name", ["exact", "default"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_codecs_refuse_nan_and_plus_inf(codec_name, bad):
    from logit_distill.errors import NonFiniteError

    L, k = 6, 3
    lp = np.log(np.tile(np.float32([0.5, 0.2, 0.1]), (L, 1)))
    for field in ("topk_logprobs", "tail_logprob"):
        rec = dict(example_index=11, tokens=np.arange(L), segment_ids=np.ones(L), positions=np.arange(L),
                   topk_ids=np.tile(np.arange(k), (L, 1)), topk_logprobs=lp.copy(),
                   tail_logprob=np.full(L, -3.0, np.float32), vocab_size=50)
        if field == "topk_logprobs":
            rec[field][4, 1] = bad
        else:
            rec[field][4] = bad
        with pytest.raises(NonFiniteError, match=f"example 11: {field} is .* at position 4"):
            codec.encode_record(codec_name, **rec)


# ------------------------------------------------------------------ masked records (supervised positions only)


def _mask(rng, seg, fraction=0.4):
    """A loss mask inside the next-token positions of ``seg``: runs of supervised positions."""
    inside = codec.next_token_mask(seg)
    runs = np.repeat(rng.random(len(seg) // 3 + 1) < fraction, 3)[: len(seg)]
    return inside & runs


@pytest.mark.parametrize("codec_name", ["exact", "default"])
@pytest.mark.parametrize("tempered", [0, 2])
def test_masked_topk_record_holds_the_supervised_positions_only(codec_name, tempered):
    rng = np.random.default_rng(40 + tempered)
    rec = _record(rng, L=64, k=8, V=32000)
    rec["segment_ids"] = np.repeat([1, 2, 0], [30, 26, 8]).astype(np.int32)
    rec["positions"] = np.concatenate([np.arange(30), np.arange(26), np.zeros(8)]).astype(np.int32)
    if tempered:
        rec["tail_logprob_tempered"] = rng.uniform(-20, -0.1, (64, tempered)).astype(np.float32)
    mask = _mask(rng, rec["segment_ids"])
    S = int(mask.sum())
    assert 0 < S < 56
    raw = codec.encode_record(codec_name, **rec, loss_mask=mask)
    assert codec.decode_header(raw)["masked"]
    full = codec.encode_record(codec_name, **rec)
    assert len(raw) == codec._record_size(codec_name, 32 if codec_name == "exact" else 15, 64, 8, 3, tempered,
                                          supervised=S)
    assert len(raw) < len(full)
    out = codec.decode_record(raw)
    ref = codec.decode_record(full)
    np.testing.assert_array_equal(out["loss_mask"], mask)
    np.testing.assert_array_equal(ref["loss_mask"], codec.next_token_mask(rec["segment_ids"]))
    fields = ["topk_ids", "topk_logprobs", "tail_logprob"] + (["tail_logprob_tempered"] if tempered else [])
    for key in ("tokens", "segment_ids", "positions"):
        np.testing.assert_array_equal(out[key], rec[key])
    for key in fields:  # the full record's values at the mask, zeros elsewhere
        np.testing.assert_array_equal(out[key][mask], ref[key][mask])
        assert not out[key][~mask].any()
        assert out[key].shape == ref[key].shape and out[key].dtype == ref[key].dtype
    # Nothing outside the mask reaches the bytes: other values there (NaN included) give the same record.
    garbage = dict(rec)
    for key in fields:
        other = np.nan if rec[key].dtype.kind == "f" else 7
        garbage[key] = np.where(mask.reshape(-1, *[1] * (rec[key].ndim - 1)), rec[key], other).astype(rec[key].dtype)
    assert codec.encode_record(codec_name, **garbage, loss_mask=mask) == raw
    # A NaN at a supervised position is refused, naming that position.
    from logit_distill.errors import NonFiniteError

    bad = dict(rec, tail_logprob=rec["tail_logprob"].copy())
    j = int(np.flatnonzero(mask)[3])
    bad["tail_logprob"][j] = np.nan
    with pytest.raises(NonFiniteError, match=f"tail_logprob is nan at position {j}"):
        codec.encode_record(codec_name, **bad, loss_mask=mask)


@pytest.mark.parametrize("codec_name", ["exact", "default"])
def test_masked_sampled_record_round_trip(codec_name):
    rng = np.random.default_rng(9)
    L, V, N = 48, 300, 16
    ids, counts, lp = _random_sampled(rng, L, V, N)
    seg = np.repeat([1, 0], [40, 8]).astype(np.int32)
    mask = _mask(rng, seg)
    # Positions outside the mask need no draws at all.
    ids[~mask], counts[~mask], lp[~mask] = 0, 0, 0
    raw = codec.encode_record(codec_name, example_index=3, tokens=rng.integers(0, V, L), segment_ids=seg,
                              positions=np.where(seg > 0, np.arange(L), 0), vocab_size=V, sample_ids=ids,
                              sample_counts=counts, sample_logprobs=lp, num_samples=N, loss_mask=mask)
    out = codec.decode_record(raw)
    np.testing.assert_array_equal(out["loss_mask"], mask)
    S = int((counts > 0).sum(-1).max())
    np.testing.assert_array_equal(out["sample_ids"], ids[:, :S])
    np.testing.assert_array_equal(out["sample_counts"], counts[:, :S])
    tol = 0 if codec_name == "exact" else codec.SAMPLED_LOGPROB_MAX_ERROR + 1e-6
    assert np.abs(out["sample_logprobs"] - np.maximum(lp[:, :S], codec.SAMPLED_LOGPROB_FLOOR)).max() <= tol
    # An example without a supervised position stores tokens and mask only.
    none = np.zeros(L, bool)
    raw = codec.encode_record(codec_name, example_index=3, tokens=np.zeros(L), segment_ids=seg, positions=np.zeros(L),
                              vocab_size=V, sample_ids=ids, sample_counts=counts, sample_logprobs=lp, num_samples=N,
                              loss_mask=none)
    out = codec.decode_record(raw)
    assert out["sample_ids"].shape == (L, 0) and not out["loss_mask"].any()


def test_masked_record_damage_is_a_store_error():
    rng = np.random.default_rng(11)
    rec = _record(rng, L=37)
    mask = _mask(rng, rec["segment_ids"])
    raw = codec.encode_record("default", **rec, loss_mask=mask)
    mask_at = codec.HEADER.size + codec.RUN_DTYPE.itemsize * 3 + (18 * 37 + 7) // 8
    padded = bytearray(raw)
    padded[mask_at + 4] |= 0x80  # bit 39 of a 37-bit mask
    with pytest.raises(StoreError, match="padding beyond seq_len"):
        codec.decode_record(bytes(padded))
    flipped = bytearray(raw)
    flipped[mask_at] ^= 0x01  # one more or one fewer supervised position: the size no longer fits
    with pytest.raises(StoreError, match="its header and mask imply"):
        codec.decode_record(bytes(flipped))
    with pytest.raises(StoreError):
        codec.decode_record(raw[: mask_at + 2])
    unknown = bytearray(raw)
    unknown[5] |= 0x40
    with pytest.raises(StoreError, match="unknown flags"):
        codec.decode_record(bytes(unknown))


# ------------------------------------------------------------------ hybrid records (exact head + tail draws)


def _hybrid(rng, L=48, k=4, V=32000, N=16):
    """A hybrid record: a top-k head and N draws from outside it, with the tail's sum p log p."""
    rec = _record(rng, L=L, k=k, V=V)
    ids, counts, _ = _random_sampled(rng, L, V - k, N)
    # draws of ids outside the head: shift each position's draw ids past its head ids
    for j in range(L):
        rec["topk_ids"][j] = rng.choice(V, k, replace=False)
        rest = np.setdiff1d(np.arange(V), rec["topk_ids"][j])
        used = counts[j] > 0
        ids[j, used] = rest[ids[j, used]]
    rec.update(sample_ids=ids, sample_counts=counts, tail_plogp=-rng.uniform(0, 12, L).astype(np.float32),
               num_samples=N)
    return rec


@pytest.mark.parametrize("codec_name", ["exact", "default"])
@pytest.mark.parametrize("masked,tempered", [(False, False), (True, True)])
def test_hybrid_record_round_trip(codec_name, masked, tempered):
    rng = np.random.default_rng(60 + masked)
    rec = _hybrid(rng)
    L, N = 48, 16
    if tempered:
        rec["tail_logprob_tempered"] = (rec["tail_logprob"] - 0.5)[:, None]
    mask = _mask(rng, rec["segment_ids"]) if masked else None
    raw = codec.encode_record(codec_name, **rec, loss_mask=mask)
    assert raw == codec.encode_record(codec_name, **rec, loss_mask=mask)  # deterministic
    h = codec.decode_header(raw)
    assert (h["selection"], h["top_k"], h["num_samples"], h["aux"], h["masked"]) == ("hybrid", 4, N, int(tempered),
                                                                                     masked)
    out = codec.decode_record(raw)
    rows = np.ones(L, bool) if mask is None else mask
    S = out["sample_ids"].shape[1]
    np.testing.assert_array_equal(out["topk_ids"][rows], rec["topk_ids"][rows])
    np.testing.assert_array_equal(out["sample_ids"][rows], rec["sample_ids"][rows][:, :S])
    np.testing.assert_array_equal(out["sample_counts"][rows], rec["sample_counts"][rows][:, :S])
    tol = 0 if codec_name == "exact" else codec.LOGPROB_MAX_ERROR + 1e-6
    for key in ("topk_logprobs", "tail_logprob", "tail_plogp") + (("tail_logprob_tempered",) if tempered else ()):
        assert np.abs(out[key][rows] - rec[key][rows]).max() <= tol, key
        assert not out[key][~rows].any()
    assert ("tail_logprob_tempered" in out) == tempered and "sample_logprobs" not in out
    if codec_name == "default" and not masked:  # the fixed part per position, plus the Rice-coded id gaps
        fixed = codec.hybrid_fixed_bytes("default", 32000, 4, N)
        header = codec.HEADER.size + codec.RUN_DTYPE.itemsize * 3 + (15 * L + 7) // 8
        assert fixed == 4 * 15 / 8 + 8 + 2 + 2 + 2
        assert L * fixed < len(raw) - header < L * (fixed + N * 3)
    # Damage is a StoreError: a truncated record, a flipped count bit, a head flag on a sampled record.
    with pytest.raises(StoreError):
        codec.decode_record(raw[:-1])
    both = bytearray(raw)
    both[5] |= codec.FLAG_SAMPLED
    with pytest.raises(StoreError, match="unknown flags"):
        codec.decode_record(bytes(both))


def test_hybrid_record_without_a_head_and_bad_input():
    rng = np.random.default_rng(70)
    rec = _hybrid(rng, k=4)
    L = 48
    none = dict(rec, topk_ids=np.zeros((L, 0), np.int32), topk_logprobs=np.zeros((L, 0), np.float32),
                tail_logprob=None)
    out = codec.decode_record(codec.encode_record("default", **none))
    assert out["topk_ids"].shape == (L, 0) and not out["tail_logprob"].any()
    from logit_distill.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match="tail_plogp is nan at position 5"):
        codec.encode_record("default", **dict(rec, tail_plogp=np.where(np.arange(L) == 5, np.nan, rec["tail_plogp"])))
    with pytest.raises(ValueError, match="sum to"):
        codec.encode_record("default", **dict(rec, num_samples=17))
