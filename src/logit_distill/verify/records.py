"""The records check: decode a batch of records and check them with vectorized numpy."""

from __future__ import annotations

import numpy as np

from .. import codec as codec_mod
from ..errors import StoreError
from ..store import checks
from .context import _ChunkResult, _Ctx


def _locators(chunk, uri: str, first: int, expected_index: np.ndarray):
    """``where(i, position=None)`` (the fields of a finding) and ``label(i)`` (its text) of record
    ``first + i`` of ``chunk``."""

    def where(i: int, position: int | None = None) -> dict:
        w = {"chunk": chunk.name, "record": int(first + i), "example": int(expected_index[i])}
        if position is not None:
            w["position"] = int(position)
        return w

    def label(i: int) -> str:
        return f"{uri} record {first + i} (example {int(expected_index[i])})"

    return where, label


def _check_batch(ctx: _Ctx, chunk, first: int, raws: list[bytes], res: _ChunkResult) -> None:
    """Decode a batch of records and check them with vectorized numpy."""
    if ctx.manifest["shapes"].get("selection") == "sampled":
        return _check_sampled_batch(ctx, chunk, first, raws, res)
    n, L, k, V = len(raws), ctx.seq_len, ctx.top_k, ctx.vocab
    m = len(ctx.manifest["shapes"].get("tail_temperatures", []))
    # a hybrid record: this top-k head, plus N draws from the rest and the tail's sum p log p
    hybrid = ctx.manifest["shapes"].get("selection") == "hybrid"
    N = int(ctx.manifest["shapes"].get("num_samples") or 0)
    draw_ids = np.zeros((n, L, N), np.int32)
    draw_counts = np.zeros((n, L, N), np.int32)
    plogp = np.zeros((n, L), np.float32)
    uri = ctx.chunk_uri(chunk)
    chk = res.records
    ids = np.zeros((n, L, k), np.int32)
    lp = np.zeros((n, L, k), np.float32)
    tail = np.zeros((n, L), np.float32)
    tokens = np.zeros((n, L), np.int32)
    seg = np.zeros((n, L), np.int32)
    loss_mask = np.zeros((n, L), bool)
    index = np.zeros(n, np.int64)
    tags = np.zeros(n, np.int64)
    ok = np.ones(n, bool)
    kept_tempered: dict = {}
    dtype_ok = True
    wanted = ctx.wanted.get(chunk.name, {})
    expected_index = ctx.global_index(chunk, np.arange(first, first + n, dtype=np.int64))
    where, label = _locators(chunk, uri, first, expected_index)

    for i, raw in enumerate(raws):
        try:
            h = codec_mod.decode_header(raw)
            bad = [f"{key} {h[key]} (manifest: {want})" for key, want in (
                ("codec", ctx.codec), ("selection", "hybrid" if hybrid else "topk"), ("seq_len", L), ("top_k", k),
                ("id_bits", ctx.id_bits), ("aux", m), ("masked", ctx.masked),
                *((("num_samples", N),) if hybrid else ())) if h.get(key) != want]
            if bad:
                chk.add("header", f"{label(i)}: header says {', '.join(bad)}: a record of another configuration",
                        **where(i))
                ok[i] = False
                continue
            rec = codec_mod.decode_record(raw)
        except StoreError as e:
            chk.add("decode", f"{label(i)}: cannot be decoded: {e}", **where(i))
            ok[i] = False
            continue
        if codec_mod.token_hash(rec["tokens"]).hex() != rec["token_hash"]:
            chk.add("token_hash", f"{label(i)}: token hash does not match its tokens (corrupt tokens)", **where(i))
        if rec["topk_ids"].shape != (L, k) or rec["topk_logprobs"].shape != (L, k) or rec["tokens"].shape != (L,):
            chk.add("shape", f"{label(i)}: shapes topk_ids {rec['topk_ids'].shape}, topk_logprobs "
                             f"{rec['topk_logprobs'].shape}, tokens {rec['tokens'].shape}; manifest says "
                             f"{(L, k)}", **where(i))
            ok[i] = False
            continue
        dtype_ok &= (rec["topk_ids"].dtype == np.int32 and rec["tokens"].dtype == np.int32
                     and rec["topk_logprobs"].dtype == np.float32 and rec["tail_logprob"].dtype == np.float32)
        ids[i], lp[i], tail[i] = rec["topk_ids"], rec["topk_logprobs"], rec["tail_logprob"]
        if hybrid:
            S = rec["sample_ids"].shape[1]
            draw_ids[i, :, :S], draw_counts[i, :, :S], plogp[i] = rec["sample_ids"], rec["sample_counts"], rec["tail_plogp"]
        if m:
            kept_tempered[i] = rec["tail_logprob_tempered"]
        tokens[i], seg[i], loss_mask[i] = rec["tokens"], rec["segment_ids"], rec["loss_mask"]
        index[i], tags[i] = int(rec["example_index"]), int(rec["store_tag"])
        g = wanted.get(first + i)
        if g is not None:
            res.kept[g] = (rec, first + i)
    if not dtype_ok:
        chk.add("dtype", f"{uri}: records {first}..{first + n - 1} decode to unexpected dtypes", chunk=chunk.name)

    # Record-level fields.
    for i in np.flatnonzero(ok & (index != expected_index)):
        chk.add("example_index", f"{label(i)}: holds example {int(index[i])}; its position in the store is "
                                 f"example {int(expected_index[i])} (misplaced or shifted records)", **where(i))
    for i in np.flatnonzero(ok & (tags != ctx.tag)):
        chk.add("store_tag", f"{label(i)}: belongs to another store (tag {int(tags[i]):08x}, this store's is "
                             f"{ctx.tag:08x}): a chunk of another configuration was copied in", **where(i))

    # Position-level checks (store/checks.py): [n, L] masks, few passes over the [n, L, k] arrays.
    tempered_all = np.stack([kept_tempered.get(i, np.zeros((L, m), np.float32)) for i in range(n)]) if m else None
    # A masked store holds values at supervised positions only: those are judged, and the mask itself.
    supervised = loss_mask if ctx.masked else None
    if hybrid:
        per_position = checks.hybrid_problems(ids, lp, tail, draw_ids, draw_counts, plogp, vocab=V, codec=ctx.codec,
                                              num_samples=N, tokens=tokens, tempered=tempered_all,
                                              supervised=supervised)
    else:
        per_position = checks.topk_problems(ids, lp, tail, vocab=V, codec=ctx.codec, tokens=tokens,
                                            tempered=tempered_all, supervised=supervised)
    if ctx.masked:
        per_position.update(checks.mask_problems(loss_mask, seg))
    any_bad = np.zeros((n, L), bool)
    for mask, _ in per_position.values():
        any_bad |= mask
    any_bad &= ok[:, None]
    if any_bad.any():
        for kind, (mask, text) in per_position.items():
            for i in np.flatnonzero(ok & mask.any(-1)):
                pos = int(np.argmax(mask[i]))
                chk.add(kind, f"{label(i)}: {text} at position {pos}", **where(i, pos))
    with np.errstate(all="ignore"):
        p = np.exp(lp)
        mass = p.sum(-1)
        # Figures over real tokens (segment_ids != 0; a masked store's supervised ones) of decodable records
        # whose position passed. Entropy estimate from the top-k: -sum p log p over the top-k, plus
        # -P_tail log P_tail (the tail as one outcome): a lower bound of the teacher's entropy.
        use = (loss_mask if ctx.masked else seg != 0) & ~any_bad & ok[:, None]
        ent = -np.vecdot(p, lp) - np.exp(tail) * np.where(np.isfinite(tail), tail, 0.0)
        res.sums["positions"] += int(ok.sum()) * L
        res.sums["tokens"] += int(use.sum())
        res.sums["supervised"] += int(loss_mask[ok].sum())
        res.sums["entropy"] += float(ent[use].sum(dtype=np.float64))
        res.sums["topk_mass"] += float(mass[use].sum(dtype=np.float64))
    res.records_checked += int(ok.sum())


def _check_sampled_batch(ctx: _Ctx, chunk, first: int, raws: list[bytes], res: _ChunkResult) -> None:
    """The checks of a sampled store's records: counts sum to N, ids distinct and in the vocabulary,
    log-probs finite and <= 0, plus the record-level fields."""
    n, L, V = len(raws), ctx.seq_len, ctx.vocab
    N = int(ctx.manifest["shapes"]["num_samples"])
    uri = ctx.chunk_uri(chunk)
    chk = res.records
    wanted = ctx.wanted.get(chunk.name, {})
    expected_index = ctx.global_index(chunk, np.arange(first, first + n, dtype=np.int64))
    where, label = _locators(chunk, uri, first, expected_index)

    checked = 0
    for i, raw in enumerate(raws):
        try:
            h = codec_mod.decode_header(raw)
            bad = [f"{key} {h[key]} (manifest: {want})" for key, want in (
                ("codec", ctx.codec), ("selection", "sampled"), ("seq_len", L), ("id_bits", ctx.id_bits),
                ("top_k", N), ("aux", 0), ("masked", ctx.masked)) if h[key] != want]
            if bad:
                chk.add("header", f"{label(i)}: header says {', '.join(bad)}: a record of another configuration",
                        **where(i))
                continue
            rec = codec_mod.decode_record(raw)
        except StoreError as e:
            chk.add("decode", f"{label(i)}: cannot be decoded: {e}", **where(i))
            continue
        checked += 1
        if codec_mod.token_hash(rec["tokens"]).hex() != rec["token_hash"]:
            chk.add("token_hash", f"{label(i)}: token hash does not match its tokens (corrupt tokens)", **where(i))
        if int(rec["example_index"]) != int(expected_index[i]):
            chk.add("example_index", f"{label(i)}: holds example {int(rec['example_index'])}; its position in the "
                                     f"store is example {int(expected_index[i])} (misplaced or shifted records)",
                    **where(i))
        if int(rec["store_tag"]) != ctx.tag:
            chk.add("store_tag", f"{label(i)}: belongs to another store (tag {int(rec['store_tag']):08x}, this "
                                 f"store's is {ctx.tag:08x}): a chunk of another configuration was copied in",
                    **where(i))
        ids, counts, lp = rec["sample_ids"], rec["sample_counts"], rec["sample_logprobs"]
        used = counts > 0
        per_position = checks.sampled_problems(ids, counts, lp, vocab=V, num_samples=N, tokens=rec["tokens"],
                                               supervised=rec["loss_mask"] if ctx.masked else None)
        if ctx.masked:
            per_position.update(checks.mask_problems(rec["loss_mask"], rec["segment_ids"]))
        for kind, (mask, text) in per_position.items():
            if mask.any():
                pos = int(np.argmax(mask))
                chk.add(kind, f"{label(i)}: {text} at position {pos}", **where(i, pos))
        g = wanted.get(first + i)
        if g is not None:
            res.kept[g] = (rec, first + i)
        real = rec["loss_mask"] if ctx.masked else rec["segment_ids"] != 0
        res.sums["supervised"] += int(rec["loss_mask"].sum())
        # Entropy estimate: the mean of -log p over the draws (unbiased at proposal temperature 1).
        w = counts / max(N, 1)
        res.sums["tokens"] += int(real.sum())
        res.sums["entropy"] += float(-(w * lp).sum(-1)[real].sum(dtype=np.float64))
        res.sums["topk_mass"] += float(np.where(used, np.exp(lp), 0.0).sum(-1)[real].sum(dtype=np.float64))
    res.sums["positions"] += checked * L
    res.records_checked += checked
