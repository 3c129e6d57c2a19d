"""Byte layouts of the candidate records, built from the default codec's own pieces (``logit_distill.codec``),
with their decoders: the fidelity benchmark trains on what these round trips give back and counts their bytes.

``sampled``   the default codec's sampled record (``codec.encode_record``), as the dump writes it.
``compact``   a sampled record without the per-id log-probs: header, runs, tokens, unary counts, one Rice
              parameter, the Rice-coded id gaps, then ``tail_plogp`` (the teacher's ``sum p log p``, here
              over the whole vocabulary) as one uint16 fixed-point value per position, as the top-k
              log-probs are stored. At T = t it trains exactly as the sampled record (the gradient never
              reads the draws' log-probs) and its KL value stays unbiased (``losses.hybrid_kl_per_token``
              with k = 0).
``hybrid``    the top-k record's fields (ids bit-packed, log-probs and tail as uint16 fixed point) followed by
              the compact record's draws of the tail and ``tail_plogp`` of the tail.

Header (48 bytes), runs and tokens are the codec's; ``width`` in the header holds N, ``aux`` the head's k.
"""

from __future__ import annotations

import numpy as np

from logit_distill import codec

LAYOUTS = ("sampled", "compact", "hybrid")


def _draws(rec: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids, counts = np.asarray(rec["sample_ids"]), np.asarray(rec["sample_counts"])
    used = counts > 0
    return ids[used], counts, used.sum(-1)


def _plogp_bytes(x) -> bytes:
    return codec.quantize_logprobs(np.asarray(x, np.float32)).tobytes()  # -plogp in [0, 64): 2**-11 steps


def encode(layout: str, rec: dict, *, vocab_size: int, num_samples: int, example_index: int = 0) -> bytes:
    """One example's record in ``layout``; ``rec`` holds tokens, segment_ids, positions and the
    selection's fields ``[L, ...]`` (numpy)."""
    common = dict(example_index=example_index, tokens=rec["tokens"], segment_ids=rec["segment_ids"],
                  positions=rec["positions"], vocab_size=vocab_size)
    if layout == "sampled":
        return codec.encode_record("default", **common, sample_ids=rec["sample_ids"],
                                   sample_counts=rec["sample_counts"], sample_logprobs=rec["sample_logprobs"],
                                   num_samples=num_samples)
    L = len(rec["tokens"])
    bits = codec.id_bits_for(vocab_size)
    k = 0 if layout == "compact" else np.shape(rec["topk_ids"])[-1]
    runs = codec.encode_runs(rec["segment_ids"], rec["positions"])
    header = codec.HEADER.pack(codec.MAGIC, codec.CODEC_IDS["default"], codec.FLAG_SAMPLED, bits, k,
                               int(example_index), L, num_samples, len(runs), 0, codec.token_hash(rec["tokens"]))
    parts = [header, runs.tobytes(), codec.pack_bits(rec["tokens"], bits)]
    if layout == "hybrid":
        parts += [codec.pack_bits(rec["topk_ids"], bits), codec.quantize_logprobs(rec["topk_logprobs"]).tobytes(),
                  codec.quantize_logprobs(rec["tail_logprob"]).tobytes()]
    flat_ids, counts, n = _draws(rec)
    gaps = codec.sampled_id_gaps(flat_ids, n)
    r = codec.rice_parameter(gaps)
    parts += [codec.encode_unary_counts(counts, num_samples), bytes([r]), *codec.rice_encode(gaps, r),
              _plogp_bytes(rec["tail_plogp"])]
    return b"".join(parts)


def decode(layout: str, data: bytes, *, vocab_size: int) -> dict:
    """Inverse of ``encode``: the selection's fields ``[L, ...]`` (draws in ``[L, S]`` slots, used first)."""
    if layout == "sampled":
        return codec.decode_record(data)
    h = codec.decode_header(data)
    L, N, k, bits = h["seq_len"], h["top_k"], h["aux"], h["id_bits"]
    mv = memoryview(data)
    off = codec.HEADER.size + codec.RUN_DTYPE.itemsize * h["num_runs"] + codec._packed_len(L, bits)
    out: dict = {}
    if layout == "hybrid":
        size = codec._packed_len(L * k, bits)
        out["topk_ids"] = codec.unpack_bits(mv[off: off + size], L * k, bits).reshape(L, k)
        off += size
        out["topk_logprobs"] = codec.dequantize_logprobs(np.frombuffer(mv, "<u2", L * k, off)).reshape(L, k)
        off += 2 * L * k
        out["tail_logprob"] = codec.dequantize_logprobs(np.frombuffer(mv, "<u2", L, off))
        off += 2 * L
    size = codec._packed_len(L * N, 1)
    n, flat_counts = codec.decode_unary_counts(mv[off: off + size], L, N)
    off += size
    r = data[off]
    gaps, off = codec.rice_decode(data, off + 1, int(n.sum()), r, "id gap")
    flat_ids = codec.sampled_ids_from_gaps(gaps, n)
    out["tail_plogp"] = codec.dequantize_logprobs(np.frombuffer(mv, "<u2", L, off))
    off += 2 * L
    if off != len(data):
        raise ValueError(f"{layout} record: {len(data)} bytes, its fields end at {off}")
    S = int(n.max())
    used = np.arange(S)[None, :] < n[:, None]
    ids, counts = np.zeros((L, S), np.int32), np.zeros((L, S), np.int32)
    ids[used], counts[used] = flat_ids, flat_counts
    out.update(sample_ids=ids, sample_counts=counts)
    return out
