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
