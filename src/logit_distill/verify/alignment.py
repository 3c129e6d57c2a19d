"""The data alignment and teacher spot checks, on examples sampled from the store."""

from __future__ import annotations

import json

import numpy as np

from .. import codec as codec_mod
from ..errors import InputError
from ..store import chunks as chunks_mod
from .context import _Ctx
from .report import _Check


def _sample(ctx: _Ctx, present: list[chunks_mod.ChunkInfo], count: int, seed: int) -> list[tuple]:
    """Up to ``count`` (global index, chunk, record), the first and last present example first, then random."""
    if count <= 0 or not present:
        return []
    sizes = np.array([ctx.expected_records(c) for c in present], np.int64)
    total = int(sizes.sum())
    count = min(count, total)
    rng = np.random.default_rng(seed)
    picks = [0, total - 1] if total > 1 else [0]
    if count > len(picks):
        rest = rng.choice(total, size=min(total, count + 2), replace=False)
        picks += [int(x) for x in rest if x not in (0, total - 1)]
    picks = list(dict.fromkeys(picks))[:count]
    ends = np.cumsum(sizes)
    out = []
    for flat in picks:
        ci = int(np.searchsorted(ends, flat, side="right"))
        record = flat - (int(ends[ci - 1]) if ci else 0)
        out.append((int(ctx.global_index(present[ci], record)), present[ci], int(record)))
    return out


def _prepare_source(manifest: dict, data: str, tokenizer: str | None):
    """The data pipeline of the store's manifest over ``data``: its order, length, packing, text field and
    chat options (conversations are rendered with the template of ``tokenizer``'s folder: the store's copy
    by default)."""
    from ..data import ChatOptions, ExampleSource

    content = manifest.get("content") or {}
    want = content.get("data") if isinstance(content, dict) else None
    if not isinstance(want, dict):
        raise InputError("the manifest records no data settings (content.data): the store was not written by "
                         "`logit-distill dump`, so the data order cannot be rebuilt")
    source = ExampleSource.open(
        data, tokenizer, seq_len=manifest["shapes"]["seq_len"], packing=bool(want.get("packing", True)),
        seed=int(want.get("seed", 0)), text_field=want.get("text_field") or "text",
        chat=ChatOptions.from_identity(want.get("chat")),
        fresh=True,  # re-derive what is checked: no hash or token cache is trusted
    )
    return source, want


def _check_data(ctx: _Ctx, source, want: dict, samples: list, kept: dict, chk: _Check) -> None:
    have = source.identity
    # Only the fields the store recorded are compared (the dump may leave derived counts out).
    differ = sorted(k for k in want if want[k] != have.get(k, "<absent>"))
    for key in differ:
        chk.add("identity", f"data identity differs from the store's manifest: {key}: store has "
                            f"{want.get(key, '<absent>')!r}, --data gives {have.get(key, '<absent>')!r}", field=key)
    needed = ctx.layout.num_examples
    if len(source) < needed:
        chk.add("length", f"--data gives {len(source)} examples, the store holds {needed}")
    from ..store import manifest as manifest_mod

    # A masked store's records carry the supervised positions the dump was given: they must be the data's.
    fields = ("tokens", "segment_ids", "positions") + (("loss_mask",) if manifest_mod.masked_of(ctx.manifest) else ())
    checked = mismatched = 0
    for g, chunk, record in samples:
        if g not in kept:
            continue  # undecodable: reported by `records`
        rec = kept[g][0]
        if g >= len(source):
            continue
        want_ex = source[g]
        checked += 1
        for key in fields:
            diff = np.flatnonzero(want_ex[key] != rec[key])
            if diff.size:
                mismatched += 1
                chk.add("tokens", f"{ctx.chunk_uri(chunk)} record {record} (example {g}): {key} differ from the "
                                  f"data pipeline's at {diff.size} of {ctx.seq_len} positions (first at {int(diff[0])})",
                        chunk=chunk.name, record=record, example=g, field=key)
                break
    chk.details.update(examples_compared=checked, examples_mismatched=mismatched, identity_differs=differ)
    what = "tokens and supervision masks" if "loss_mask" in fields else "tokens"
    chk.ok_message = (f"{checked} sampled examples' {what} equal the data pipeline's; data identity matches the "
                      "manifest")


def _prepare_teacher(manifest: dict, teacher: str):
    from ..models import load_model

    content = manifest.get("content") or {}
    dtype = content.get("teacher_dtype") or "float32"
    return load_model(teacher, dtype=dtype)


def _spot_fn(apply, k: int, proposal_temperature: float | None = None):
    """The teacher's top-k, tail and log-probs at the stored ids; with ``proposal_temperature`` (a hybrid
    store) also ``tail_plogp``, the tail's ``sum p_t log p_t`` as the dump computes it."""
    import jax
    import jax.numpy as jnp

    from ..selection import select_hybrid_tail_plogp, select_topk

    @jax.jit
    def fn(params, tokens, positions, segment_ids, stored_ids):
        logits = apply(params, tokens, positions, segment_ids).astype(jnp.float32)
        out = select_topk(logits, k)
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        out["stored_ids_logprob"] = jnp.take_along_axis(logits, stored_ids, axis=-1) - lse
        if proposal_temperature is not None:
            out["tail_plogp"] = select_hybrid_tail_plogp(logits, out["topk_ids"], proposal_temperature)
        return out

    return fn


def _sampled_spot_fn(apply):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def fn(params, tokens, positions, segment_ids, stored_ids):
        logits = apply(params, tokens, positions, segment_ids).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        return jnp.take_along_axis(logits, stored_ids, axis=-1) - lse

    return fn


def _report_mismatch(ctx: _Ctx, chk: _Check, chunk, record: int, example: int, err, bound: float) -> int:
    """Name the first position of one record whose error ``err`` [L] exceeds ``bound`` (positions without
    values, outside a masked record's mask, are 0); the count of them."""
    bad = np.flatnonzero(err > bound)
    if bad.size:
        pos = int(bad[0])
        chk.add("mismatch", f"{ctx.chunk_uri(chunk)} record {record} (example {example}): {bad.size} of "
                            f"{ctx.seq_len} positions differ from the recomputed teacher (first at position "
                            f"{pos}: |Δ log-prob| {float(err[pos]):.3g} > bound {bound:.2g}); logits "
                            "misaligned with the tokens, or another teacher",
                chunk=chunk.name, record=record, example=example, position=pos)
    return int(bad.size)


def _held(ctx: _Ctx, rec: dict) -> np.ndarray:
    """bool [L]: the positions whose teacher values the record holds (a masked store's supervised ones)."""
    from ..store import manifest as manifest_mod

    return rec["loss_mask"] if manifest_mod.masked_of(ctx.manifest) else np.ones(ctx.seq_len, bool)


def _check_teacher_sampled(ctx: _Ctx, loaded, todo: list, kept: dict, atol: float | None, chk: _Check) -> None:
    """The sampled ids' stored log-probs equal the recomputed teacher's log-probs of those ids."""
    bound = atol if atol is not None else (
        codec_mod.SAMPLED_LOGPROB_MAX_ERROR + 1e-4 if ctx.codec == "default" else 1e-4)
    floor = codec_mod.SAMPLED_LOGPROB_FLOOR if ctx.codec == "default" else -np.inf
    fn = _sampled_spot_fn(loaded.apply)
    N = int(ctx.manifest["shapes"]["num_samples"])
    max_err, positions_bad = 0.0, 0
    bs = min(8, len(todo))
    for first in range(0, len(todo), bs):
        group = todo[first:first + bs]
        recs = [kept[g][0] for g, _, _ in group]
        recs += [recs[-1]] * (bs - len(recs))
        stack = {key: np.stack([r[key] for r in recs]) for key in ("tokens", "positions", "segment_ids")}
        # One shape, one compilation: pad every record's slots to N.
        ids = np.stack([np.pad(r["sample_ids"], ((0, 0), (0, N - r["sample_ids"].shape[1]))) for r in recs])
        lps = np.stack([np.pad(r["sample_logprobs"], ((0, 0), (0, N - r["sample_ids"].shape[1]))) for r in recs])
        used = np.stack([np.pad(r["sample_counts"], ((0, 0), (0, N - r["sample_ids"].shape[1]))) for r in recs]) > 0
        out = np.asarray(fn(loaded.params, stack["tokens"], stack["positions"], stack["segment_ids"],
                            np.clip(ids, 0, ctx.vocab - 1).astype(np.int32)))
        for j, (g, chunk, record) in enumerate(group):
            with np.errstate(invalid="ignore"):
                d = np.where(used[j], np.abs(lps[j] - np.maximum(out[j], floor)), 0.0)
            err = np.where(np.isnan(d), np.inf, d).max(-1)
            err = np.where(_held(ctx, recs[j]), err, 0.0)
            max_err = max(max_err, float(err.max()))
            positions_bad += _report_mismatch(ctx, chk, chunk, record, g, err, bound)
    chk.details.update(examples_compared=len(todo), bound=bound, max_abs_error=max_err,
                       positions_mismatched=positions_bad)
    chk.ok_message = (f"{len(todo)} sampled examples: the sampled ids' log-probs agree with the recomputed teacher "
                      f"(max |Δ log-prob| {max_err:.2g} <= {bound:.2g})")


def _check_teacher(ctx: _Ctx, loaded, samples: list, kept: dict, atol: float | None, chk: _Check) -> None:
    content = ctx.manifest.get("content") or {}
    want_id = content.get("teacher") if isinstance(content, dict) else None
    if isinstance(want_id, dict) and want_id != loaded.identity:
        keys = sorted(k for k in set(want_id) | set(loaded.identity) if want_id.get(k) != loaded.identity.get(k))
        chk.add("identity", f"the teacher's identity differs from the store's manifest in {', '.join(keys)} "
                            f"(store: {json.dumps(want_id, sort_keys=True)[:200]}); is it the dump's teacher?")
    if loaded.vocab_size != ctx.vocab:
        chk.add("vocab", f"the teacher's vocabulary has {loaded.vocab_size} entries, the store's {ctx.vocab}")
        return
    bound = atol if atol is not None else (
        codec_mod.LOGPROB_MAX_ERROR + 1e-4 if ctx.codec == "default" else 1e-4)
    todo = [(g, chunk, record) for g, chunk, record in samples if g in kept]
    if not todo:
        chk.add("nothing", "no sampled example could be decoded (see records)")
        return
    if ctx.manifest["shapes"].get("selection") == "sampled":
        return _check_teacher_sampled(ctx, loaded, todo, kept, atol, chk)
    hybrid = ctx.manifest["shapes"].get("selection") == "hybrid"
    fn = _spot_fn(loaded.apply, ctx.top_k, float(ctx.manifest["shapes"]["proposal_temperature"]) if hybrid else None)
    bs = min(8, len(todo))
    floor = codec_mod.LOGPROB_FLOOR if ctx.codec == "default" else -np.inf
    max_err, id_agree, id_total, positions_bad = 0.0, 0, 0, 0
    for first in range(0, len(todo), bs):
        group = todo[first:first + bs]
        recs = [kept[g][0] for g, _, _ in group]
        recs += [recs[-1]] * (bs - len(recs))  # one shape, one compilation
        stack = {key: np.stack([r[key] for r in recs]) for key in
                 ("tokens", "positions", "segment_ids", "topk_ids", "topk_logprobs", "tail_logprob")
                 + (("tail_plogp",) if hybrid else ())}
        stored_ids = np.clip(stack["topk_ids"], 0, ctx.vocab - 1).astype(np.int32)
        out = fn(loaded.params, stack["tokens"], stack["positions"], stack["segment_ids"], stored_ids)
        out = {key: np.asarray(v) for key, v in out.items()}
        for j, (g, chunk, record) in enumerate(group):
            t_top = np.maximum(out["topk_logprobs"][j], floor)
            t_at_stored = np.maximum(out["stored_ids_logprob"][j], floor)
            t_tail = np.maximum(out["tail_logprob"][j], floor)
            with np.errstate(invalid="ignore"):
                # The stored log-prob of each stored id, and ids equal except at ties: where the ids
                # differ, the teacher's log-probs of both ids are within the bound.
                d_value = np.abs(stack["topk_logprobs"][j] - t_at_stored)
                d_ids = np.abs(t_at_stored - t_top)
                d_tail = np.where(stack["tail_logprob"][j] == t_tail, 0.0, np.abs(stack["tail_logprob"][j] - t_tail))
            err = np.maximum(np.maximum(d_value, d_ids).max(-1), d_tail)
            if hybrid:  # the tail's sum p log p, a 16-bit fixed-point value as the log-probs
                err = np.maximum(err, np.abs(stack["tail_plogp"][j] - out["tail_plogp"][j]))
            err = np.where(np.isnan(err), np.inf, err)
            held = _held(ctx, recs[j])
            err = np.where(held, err, 0.0)
            id_agree += int((stack["topk_ids"][j] == out["topk_ids"][j])[held].sum())
            id_total += stack["topk_ids"][j][held].size
            max_err = max(max_err, float(err.max()))
            positions_bad += _report_mismatch(ctx, chk, chunk, record, g, err, bound)
    chk.details.update(examples_compared=len(todo), bound=bound, max_abs_error=max_err,
                       id_agreement=id_agree / max(1, id_total), positions_mismatched=positions_bad)
    chk.ok_message = (f"{len(todo)} sampled examples agree with the recomputed teacher (max |Δ log-prob| "
                      f"{max_err:.2g} <= {bound:.2g}; ids equal at {100 * id_agree / max(1, id_total):.2f}%, "
                      "the rest ties)")
