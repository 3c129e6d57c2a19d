"""On-device selection: float32 log-softmax, then top-k + tail, or tokens sampled from the teacher.

Only ``[B, L, k]`` (or ``[B, L, N]``) arrays and ``[B, L]`` tails leave the
device. Selection runs in float32 whatever the model's dtype (``top_k`` on
bfloat16 input was about 100x slower on CPU, and bfloat16 log-probs are too
coarse). Each selection is one function of a step's logits
(``select_topk``, ``select_sampled``); ``make_teacher_topk`` and
``make_teacher_sampled`` wrap one with the teacher's forward into a *teacher
function* of one signature, ``fn(params, tokens, positions, segment_ids,
example_index) -> dict``, which the dump, the online training and verify's
spot check all call (the example index keys a sampled selection's draws).

With a split forward (``features`` -> hidden states, ``head`` -> logits of a
vocabulary slice) the top-k selection runs over vocabulary chunks
(``select_topk_chunked``): a running logsumexp, a running top-k (each chunk's
top-k merged into it) and a running logsumexp of everything that left the
top-k, so no ``[B, L, V]`` array is built and peak memory grows with the
chunk, not with the vocabulary. One chunk is ``select_topk`` bit for bit;
several give the same ids and agree within 3e-6 (the head's matmul over a
slice rounds differently from the whole). Both selections iterate with
``fold_vocab_chunks``: a loop over the chunks, so XLA cannot merge the
chunks' head matmuls back into one.

The sampled selection is chunked the same way (``select_sampled_chunked``), in
two passes over the chunks: the first keeps running logsumexps (of the logits
and, per chunk, of the tempered logits), which give each chunk's tempered
mass; the second locates each draw's uniform first among the cumulative chunk
masses, then inside its chunk by a cumulative sum over that chunk only, and
gathers the drawn ids' log-probs. One chunk is ``select_sampled`` bit for bit;
several give the same draws unless a uniform falls within float32 rounding of
a step of the cumulative distribution, and log-probs within 1e-6.

``select_systematic`` draws N ids per position from ``softmax(logits / t)`` by
systematic sampling: one uniform u per position and the N points ``(u + i) / N``
of the cumulative distribution. Each id's count is ``floor(N p)`` or
``ceil(N p)``: its expectation is exactly ``N p`` (so the sampled losses stay
unbiased) while its variance is at most 1/4, against ``N p (1 - p)`` for N
independent draws. The ids with ``p >= 1/N`` are always drawn, and one of
``p < 1/N`` with probability ``N p``.

``select_hybrid`` keeps the teacher's top-k exactly (ids, log-probs, tail mass:
the top-k record) and adds N systematic draws from the tail renormalised (the
distribution outside the top-k). ``losses.hybrid_kl_per_token`` turns them into
an unbiased target whose only noise is in the tail. ``tail_plogp`` (the tail's
``sum p log p``, one value per position) lets the record drop the draws'
log-probs and still give an unbiased KL value. Both use ``sample_keys``.
``select_hybrid_chunked`` is the hybrid selection over vocabulary chunks: pass 1
the chunked top-k's (the head), pass 2 the tail's draws chunk by chunk, with
the tail's cumulative mass carried from chunk to chunk.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

# vocabulary entries per chunk of the chunked selection (default): vocabularies up to this size
# are one chunk (the unchunked computation, bit for bit); Gemma 3's 262k is 8 chunks.
AUTO_VOCAB_CHUNK = 32768


def _lse_outside(logits, ids):
    """logsumexp over the last axis with the entries at ``ids`` left out."""
    return jax.nn.logsumexp(jnp.put_along_axis(logits, ids, -jnp.inf, axis=-1, inplace=False), axis=-1)


# entries per block of ``top_k_by_blocks``: the candidates are k blocks of this many entries
TOPK_BLOCK = 16


def top_k_by_blocks(x: jax.Array, k: int, block: int = TOPK_BLOCK) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` exactly (values, ids, and lower ids first on ties), in two small top-k's.

    The last axis is cut into blocks of ``block`` entries. Every one of the k
    largest entries lies in one of the k blocks with the largest maxima (ties
    among maxima to the lower block, as ``top_k`` breaks them): a block holding
    a needed entry whose max ranks below k others would have k entries above or
    level with it, each a block's max, ahead of it. So ``top_k`` over the
    block maxima, then over those k blocks' entries (gathered in id order, so
    ties still go to the lower id), is the top-k. One cheap max pass over x
    replaces XLA's ``top_k`` over the whole axis (on CPU about 1.6x faster
    for 32k entries); axes shorter than ``4 * k * block`` go to ``top_k``.
    """
    n = x.shape[-1]
    if n < 4 * k * block:
        return jax.lax.top_k(x, k)
    nb = -(-n // block)
    if nb * block != n:
        x_pad = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - n)], constant_values=-jnp.inf)
    else:
        x_pad = x
    blocks = x_pad.reshape(*x.shape[:-1], nb, block)
    _, which = jax.lax.top_k(jnp.max(blocks, axis=-1), k)
    which = jnp.sort(which, axis=-1)  # id order, for the ties of the second top-k
    cand = jnp.take_along_axis(blocks, which[..., None], axis=-2).reshape(*x.shape[:-1], k * block)
    values, pos = jax.lax.top_k(cand, k)
    ids = jnp.take_along_axis(which, pos // block, axis=-1) * block + pos % block
    return values, ids.astype(jnp.int32)


def _top_and_sums(logits: jax.Array, k: int, scales: Sequence[float]):
    """The top-k of float32 ``logits`` (values, ids) and, per scale s, the logsumexp of ``s * logits``
    over the whole last axis and over the entries outside the top-k.

    One pass over the logits per scale, with no masked copy and no comparison
    (XLA's CPU reductions run compares and selects several times slower than
    arithmetic). With the (k+1)-th value ``m`` (the largest entry outside the
    top-k), ``sum(exp(min(s (x - m), 0)))`` counts 1 for every top-k entry
    (each is >= m) and ``exp(s (x - m))`` for every entry outside, so the
    outside sum is that minus k: exact in the k ones, and as accurate as a
    masked logsumexp (within 5e-6 of float64 in the tests' worst case, a tail
    of about one entry's mass). The whole sum adds the top-k's terms to it:
    positive terms only, nothing cancels.
    """
    V = logits.shape[-1]
    # read as stored: otherwise XLA fuses the logits' producer (the head, its softcap) into each pass,
    # recomputing it, and rounding it differently (contracted multiply-adds) from one caller to another
    logits = jax.lax.optimization_barrier(logits)
    if k >= V:  # nothing outside the top-k
        values, ids = jax.lax.top_k(logits, k)
        lse = [jax.nn.logsumexp(logits * s if s != 1.0 else logits, axis=-1) for s in scales]
        return values, ids, lse, [jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32) for _ in scales]
    # The k+1 largest are read whole only (reductions, and a top-k for the first k): XLA's CPU
    # compiler keeps a top-k as its fast TopK call only while every read of the sort it expands to is
    # the same prefix slice; a slice such as ``values1[..., :k]`` next to a reduction left a full sort
    # of every row (10x slower at 1k entries).
    values1, ids1 = top_k_by_blocks(logits, k + 1)
    values, pos = jax.lax.top_k(values1, k)  # the first k (sorted: ties keep their order)
    ids = jnp.take_along_axis(ids1, pos, axis=-1)
    top = jnp.max(values1, axis=-1, keepdims=True)
    nxt = jnp.min(values1, axis=-1, keepdims=True)  # the largest entry outside the top-k
    # -inf shifts (every entry, or every entry outside, is -inf) would give inf - inf: shift by 0 then
    some = jnp.isfinite(top)[..., 0]
    some_outside = jnp.isfinite(nxt)[..., 0]
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    nxt = jnp.where(jnp.isfinite(nxt), nxt, 0.0)
    lse, rest = [], []
    for s in scales:
        counted = jnp.sum(jnp.exp(jnp.minimum(s * (logits - nxt), 0.0)), axis=-1)  # k + outside
        outside = counted - k
        # all = the k+1 largest (m among them) + the outside entries other than m (counted - k - 1)
        beyond = jnp.where(some_outside, jnp.exp(s * (nxt - top))[..., 0] * (counted - (k + 1)), 0.0)
        whole = jnp.sum(jnp.exp(s * (values1 - top)), axis=-1) + beyond
        lse.append(jnp.where(some, s * top[..., 0] + jnp.log(whole), -jnp.inf))
        rest.append(jnp.where(some_outside, s * nxt[..., 0] + jnp.log(outside), -jnp.inf))
    return values, ids, lse, rest


def select_topk(logits: jax.Array, k: int, tail_temperatures: Sequence[float] = ()) -> dict:
    """Top-k log-probabilities (sorted descending), their ids, and log of the mass outside them.

    The tail is a logsumexp over the entries outside the top-k (shifted by the
    largest of them), so it stays accurate when the top-k hold nearly all the
    mass (where ``log1p(-sum(p_topk))`` would cancel catastrophically).

    With ``tail_temperatures`` (T_1..T_m), also ``tail_logprob_tempered``
    ``[..., m]``: the log of the tail's mass in the tempered distribution
    ``p^(1/T) / sum p^(1/T)``.
    """
    return _select_topk(logits, int(k), tuple(float(T) for T in tail_temperatures))


# The selections are jitted with their sizes static: called on their own (verify, notebooks, tests) they
# compile once instead of op by op; inside the dump's program they are inlined like any other function.
@functools.partial(jax.jit, static_argnums=(1, 2))
def _select_topk(logits: jax.Array, k: int, tail_temperatures: tuple) -> dict:
    logits = logits.astype(jnp.float32)
    scales = (1.0, *(1.0 / T for T in tail_temperatures))
    top_values, top_ids, lse, rest = _top_and_sums(logits, k, scales)
    return _topk_record(top_values, top_ids, lse, rest)


def _topk_record(top_values, top_ids, lse, rest) -> dict:
    """The selection's fields from the top-k and, per scale (1, then 1/T per tail temperature), the
    logsumexp of all entries and of those outside the top-k."""
    out = {
        "topk_ids": top_ids.astype(jnp.int32),
        "topk_logprobs": top_values - lse[0][..., None],
        "tail_logprob": rest[0] - lse[0],
    }
    if len(lse) > 1:
        out["tail_logprob_tempered"] = jnp.stack([r - a for r, a in zip(rest[1:], lse[1:])], axis=-1)
    return out


def _same_shapes(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def fold_vocab_chunks(head: Callable, x: jax.Array, vocab_size: int, chunk: int, step: Callable, state=None):
    """``state = step(state, start, float32 logits of entries [start, start + size))`` over the vocabulary
    chunks in order; ``head(x, start, size)`` gives a chunk's logits.

    The chunks run in a ``lax.fori_loop`` (``start`` traced) once the state's
    shapes are stable (after the first chunk or few, which run unrolled), and a
    last partial chunk after it. A loop, not an unrolled sequence: XLA would
    merge unrolled head matmuls that share ``x`` into one (its dot merger), and
    every chunk's logits would be live at once. Temporaries hold about one chunk.
    """
    full, last = divmod(vocab_size, chunk)
    i = 0
    while i < full:  # unrolled until the state keeps its shapes
        new = step(state, i * chunk, head(x, i * chunk, chunk).astype(jnp.float32))
        stable = state is not None and _same_shapes(new, state)
        state, i = new, i + 1
        if stable:
            break
    if i < full:
        state = jax.lax.fori_loop(
            i, full, lambda j, st: step(st, j * chunk, head(x, j * chunk, chunk).astype(jnp.float32)), state)
    if last:
        state = step(state, full * chunk, head(x, full * chunk, last).astype(jnp.float32))
    return state


def _fold_topk(head: Callable, x: jax.Array, vocab_size: int, k: int, chunk: int, scales: Sequence[float],
               masked: float | None = None):
    """Over vocabulary chunks: per scale s the logsumexp of ``s * logits`` (all entries, and those outside
    the top-k), and the running top-k (values, ids).

    With ``masked`` (a scale), also the logsumexp outside the top-k at that scale by a masked logsumexp of
    each chunk (a copy of it and one more pass): as accurate as ``jax.nn.logsumexp`` over the tail, where
    ``_top_and_sums``'s outside sum subtracts k and loses up to about 5e-6 (appended to ``rest``)."""
    if k > vocab_size:
        raise ValueError(f"top-k {k} exceeds the vocabulary of {vocab_size}")
    sums = tuple(scales) if masked is None else (*scales, float(masked))

    def step(state, start, logits):  # state: lse, rest (one per scale), running top-k values, ids
        c_v, c_i, c_lse, c_rest = _top_and_sums(logits, min(k, logits.shape[-1]), scales)
        if masked is not None:
            c_rest = [*c_rest, _lse_outside(logits * masked if masked != 1.0 else logits, c_i)]
        c_i = c_i + start
        if state is None:
            return c_lse, c_rest, c_v, c_i
        lse, rest, top_v, top_i = state
        # candidates in id order (the running top-k holds lower ids): top_k keeps the lower id on ties
        cand_v = jnp.concatenate([top_v, c_v], axis=-1)
        cand_i = jnp.concatenate([top_i, c_i], axis=-1)
        top_v, pos = jax.lax.top_k(cand_v, min(k, cand_v.shape[-1]))
        top_i = jnp.take_along_axis(cand_i, pos, axis=-1)
        lse = [jnp.logaddexp(a, b) for a, b in zip(lse, c_lse)]
        rest = [jnp.logaddexp(r, jnp.logaddexp(c, _lse_outside(cand_v * s if s != 1.0 else cand_v, pos)))
                for r, c, s in zip(rest, c_rest, sums)]
        return lse, rest, top_v, top_i

    return fold_vocab_chunks(head, x, vocab_size, chunk, step)


def select_topk_chunked(head: Callable, x: jax.Array, vocab_size: int, k: int, chunk: int,
                        tail_temperatures: Sequence[float] = ()) -> dict:
    """``select_topk`` of the logits that ``head(x, start, size)`` gives slice by slice."""
    if chunk >= vocab_size:
        return select_topk(head(x, 0, vocab_size), k, tail_temperatures)
    scales = (1.0, *(1.0 / float(T) for T in tail_temperatures))
    lse, rest, top_v, top_i = _fold_topk(head, x, vocab_size, k, chunk, scales)
    return _topk_record(top_v, top_i, lse, rest)


def sample_keys(seed: int, example_index: jax.Array, length: int) -> jax.Array:
    """``[B, L]`` PRNG keys of (seed, example index, position): counter-based, so a position's
    draws depend on nothing else (not the step, batch, device or process that computes it)."""
    base = jax.random.key(seed)

    def row(e):
        k = jax.random.fold_in(base, e)
        return jax.vmap(lambda j: jax.random.fold_in(k, j))(jnp.arange(length, dtype=jnp.uint32))

    return jax.vmap(row)(jnp.asarray(example_index).astype(jnp.uint32))


def _distinct(draws: jax.Array, draw_logprobs: jax.Array) -> dict:
    """``[..., N]`` draws (and each draw's log-prob) as distinct ascending ids in the first slots, their
    counts (0 in unused slots) and log-probs (0 in unused slots)."""
    N = draws.shape[-1]
    s, s_lp = jax.lax.sort((draws, draw_logprobs), dimension=draws.ndim - 1, num_keys=1)
    is_new = jnp.concatenate([jnp.ones_like(s[..., :1], bool), s[..., 1:] != s[..., :-1]], axis=-1)
    slot = jnp.cumsum(is_new, axis=-1) - 1
    flat_slot, flat_s, flat_lp = slot.reshape(-1, N), s.reshape(-1, N), s_lp.reshape(-1, N)
    # Scatter-adds per position: memory linear in N (no [N, N] one-hot).
    counts = jax.vmap(lambda sl: jnp.zeros(N, jnp.int32).at[sl].add(1))(flat_slot).reshape(s.shape)
    ids = jax.vmap(lambda sl, v: jnp.zeros(N, jnp.int32).at[sl].max(v))(flat_slot, flat_s).reshape(s.shape)
    lp = jax.vmap(lambda sl, v: jnp.full(N, -jnp.inf, jnp.float32).at[sl].max(v))(flat_slot, flat_lp)
    used = counts > 0
    return {"sample_ids": ids, "sample_counts": counts, "sample_logprobs": jnp.where(used, lp.reshape(s.shape), 0.0)}


def _uniforms(keys: jax.Array, num_samples: int) -> jax.Array:
    """``[B, L, N]`` float32 uniforms, N per position from its key."""
    return jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (num_samples,), jnp.float32)))(keys)


_searchsorted = jax.vmap(jax.vmap(lambda c, t: jnp.searchsorted(c, t, side="right")))


@functools.partial(jax.jit, static_argnums=(1, 3))
def select_sampled(logits: jax.Array, num_samples: int, keys: jax.Array,
                   proposal_temperature: float = 1.0) -> dict:
    """N draws with replacement per position from ``softmax(logits / t)``, as distinct ids + counts.

    ``logits`` ``[B, L, V]``, ``keys`` ``[B, L]`` (``sample_keys``). Draws are
    inverse-CDF lookups of N uniforms in the float32 cumulative sum of the
    tempered probabilities (N uniforms per position, not N x V Gumbels).
    Returns ``[B, L, N]`` arrays: ``sample_ids`` (distinct, ascending, in the
    first slots), ``sample_counts`` (summing to N; 0 in unused slots) and
    ``sample_logprobs`` (the teacher's untempered log-prob of each id; 0 in
    unused slots).
    """
    N = int(num_samples)
    logits = logits.astype(jnp.float32)
    logprobs = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    q = logprobs / proposal_temperature
    cdf = jnp.cumsum(jnp.exp(q - jax.nn.logsumexp(q, axis=-1, keepdims=True)), axis=-1)
    target = _uniforms(keys, N) * cdf[..., -1:]
    V = logits.shape[-1]
    draws = jnp.minimum(_searchsorted(cdf, target), V - 1).astype(jnp.int32)
    return _distinct(draws, jnp.take_along_axis(logprobs, draws, axis=-1))


def select_sampled_chunked(head: Callable, x: jax.Array, vocab_size: int, num_samples: int, keys: jax.Array,
                           chunk: int, proposal_temperature: float = 1.0) -> dict:
    """``select_sampled`` of the logits that ``head(x, start, size)`` gives slice by slice.

    Pass 1 keeps the running logsumexp of the logits and each chunk's
    logsumexp of the tempered logits: together they give each chunk's share of
    the tempered mass. Pass 2 recomputes each chunk's logits, takes the
    cumulative sum of its tempered probabilities, and locates there the draws
    whose target ``u * total`` fell in that chunk's span of the cumulative
    chunk masses. The head runs twice; memory holds about one chunk's logits.
    """
    if chunk >= vocab_size:
        return select_sampled(head(x, 0, vocab_size), num_samples, keys, proposal_temperature)
    N, t = int(num_samples), float(proposal_temperature)
    chunks = -(-vocab_size // chunk)

    def pass1(state, start, logits):  # running logsumexp; per chunk, logsumexp of logits / t
        lse, lse_t = state
        return (jnp.logaddexp(lse, jax.nn.logsumexp(logits, axis=-1)),
                lse_t.at[..., start // chunk].set(jax.nn.logsumexp(logits / t, axis=-1)))

    lse, lse_t = fold_vocab_chunks(head, x, vocab_size, chunk, pass1, (
        jnp.full(x.shape[:-1], -jnp.inf, jnp.float32), jnp.zeros((*x.shape[:-1], chunks), jnp.float32)))
    # log of each chunk's tempered mass, q = (logits - lse) / t: logsumexp(logits / t) - lse / t
    log_mass = lse_t - (lse / t)[..., None]
    lse_q = jax.nn.logsumexp(log_mass, axis=-1)
    cum = jnp.cumsum(jnp.exp(log_mass - lse_q[..., None]), axis=-1)  # [B, L, chunks]
    target = _uniforms(keys, N) * cum[..., -1:]
    in_chunk = jnp.minimum(_searchsorted(cum, target), chunks - 1)  # each draw's chunk
    target = target - jnp.take_along_axis(jnp.pad(cum, [(0, 0), (0, 0), (1, 0)]), in_chunk, axis=-1)

    def pass2(state, start, logits):  # draws (and their log-probs) that fall in this chunk
        draws, draw_lp, target = state
        logprobs = logits - lse[..., None]
        cdf = jnp.cumsum(jnp.exp(logprobs / t - lse_q[..., None]), axis=-1)
        local = jnp.minimum(_searchsorted(cdf, target), logits.shape[-1] - 1).astype(jnp.int32)
        here = in_chunk == start // chunk
        return (jnp.where(here, local + start, draws),
                jnp.where(here, jnp.take_along_axis(logprobs, local, axis=-1), draw_lp), target)

    # the state carries the targets, which depend on pass 1: pass 2's chunks come after it
    state = (jnp.zeros(target.shape, jnp.int32), jnp.zeros(target.shape, jnp.float32), target)
    draws, draw_lp, _ = fold_vocab_chunks(head, x, vocab_size, chunk, pass2, state)
    return _distinct(draws, draw_lp)


def _on_mesh(run: Callable, mesh, device_batch: int) -> Callable:
    """``run`` jitted; with ``mesh`` (first axis splits the batch, parameters replicated), each device
    runs its rows ``device_batch`` examples at a time (``lax.map`` inside ``shard_map``)."""
    if mesh is None:
        return jax.jit(run)

    from jax.sharding import PartitionSpec as P

    db = int(device_batch)

    def local_rows(params, *rows):
        n = rows[0].shape[0]
        if n % db:
            raise ValueError(f"device batch {db} does not divide the {n} rows of each device")
        groups = tuple(a.reshape(n // db, db, *a.shape[1:]) for a in rows)
        out = jax.lax.map(lambda ex: run(params, *ex), groups)
        return jax.tree.map(lambda a: a.reshape(n, *a.shape[2:]), out)

    data = P(mesh.axis_names[0])
    # check_vma off: the Pallas attention kernels' outputs carry no varying-axis types, which the check
    # would refuse inside shard_map (every operand here is split over the batch axis alone)
    return jax.jit(jax.shard_map(local_rows, mesh=mesh, in_specs=(P(), data, data, data, data), out_specs=data,
                                 check_vma=False))


def make_teacher_select(apply: Callable, select: Callable, mesh=None, *, seed: int | None = None,
                        device_batch: int = 1) -> Callable:
    """``fn(params, tokens, positions, segment_ids, example_index) -> select's dict``.

    ``select(logits, keys)`` is one of the selections above with its settings
    bound; ``keys`` are ``sample_keys(seed, example_index, L)`` when ``seed``
    is given, else None. The returned function is jitted; the full
    ``[B, L, V]`` logits never leave the device.

    With ``mesh`` (a mesh whose first axis splits the batch, parameters
    replicated), each device runs its rows ``device_batch`` examples at a time
    (``lax.map`` inside ``shard_map``). Every micro-batch then goes through
    kernels of the same shape whatever the device count or batch size, so the
    dump writes the same bytes on 1 device and on 4 (a batched matmul's
    reduction order may depend on how many rows it holds).
    """

    def run(params, tokens, positions, segment_ids, example_index):
        keys = None if seed is None else sample_keys(seed, example_index, tokens.shape[1])
        return select(apply(params, tokens, positions, segment_ids), keys)

    return _on_mesh(run, mesh, device_batch)


def make_teacher_topk(apply: Callable | None, k: int, mesh=None, *, tail_temperatures: Sequence[float] = (),
                      device_batch: int = 1, features: Callable | None = None, head: Callable | None = None,
                      vocab_size: int | None = None, vocab_chunk: int | None = None) -> Callable:
    """``fn(params, tokens, positions, segment_ids, example_index) -> {topk_ids, topk_logprobs, tail_logprob[,
    tail_logprob_tempered]}`` (``example_index`` is unused: the top-k needs no draws).

    With ``features(params, tokens, positions, segment_ids) -> [B, L, D]``, ``head(params, x, start,
    end) -> float32 [B, L, end - start]`` and ``vocab_size``, the head and the selection run over
    vocabulary chunks of ``vocab_chunk`` (default ``AUTO_VOCAB_CHUNK``) entries; ``apply`` is unused.
    """
    temps = tuple(float(T) for T in tail_temperatures)
    if features is None:
        fn = make_teacher_select(apply, lambda logits, _: select_topk(logits, k, temps), mesh,
                                 device_batch=device_batch)
    else:
        chunk = int(vocab_chunk or AUTO_VOCAB_CHUNK)

        def run(params, tokens, positions, segment_ids, example_index):
            x = features(params, tokens, positions, segment_ids)
            return select_topk_chunked(functools.partial(head, params), x, vocab_size, k, chunk, temps)

        fn = _on_mesh(run, mesh, device_batch)
    return fn


def make_teacher_sampled(apply: Callable | None, num_samples: int, *, seed: int, proposal_temperature: float = 1.0,
                         mesh=None, device_batch: int = 1, features: Callable | None = None,
                         head: Callable | None = None, vocab_size: int | None = None,
                         vocab_chunk: int | None = None) -> Callable:
    """``fn(params, tokens, positions, segment_ids, example_index) -> {sample_ids, sample_counts,
    sample_logprobs}``: the same draws for an example wherever and whenever it is computed.

    ``features``, ``head``, ``vocab_size`` and ``vocab_chunk`` as in ``make_teacher_topk``: the head and
    the draws run over vocabulary chunks (``select_sampled_chunked``).
    """
    t = float(proposal_temperature)
    if features is None:
        return make_teacher_select(apply, lambda logits, keys: select_sampled(logits, num_samples, keys, t),
                                   mesh, seed=int(seed), device_batch=device_batch)
    chunk = int(vocab_chunk or AUTO_VOCAB_CHUNK)

    def run(params, tokens, positions, segment_ids, example_index):
        keys = sample_keys(int(seed), example_index, tokens.shape[1])
        x = features(params, tokens, positions, segment_ids)
        return select_sampled_chunked(functools.partial(head, params), x, vocab_size, num_samples, keys, chunk, t)

    return _on_mesh(run, mesh, device_batch)


def _systematic_draws(log_weights: jax.Array, num_samples: int, keys: jax.Array) -> jax.Array:
    """``[..., N]`` int32 ids of N systematic draws from ``softmax(log_weights)`` (ascending)."""
    N = int(num_samples)
    w = jnp.exp(log_weights - jax.nn.logsumexp(log_weights, axis=-1, keepdims=True))
    cdf = jnp.cumsum(w, axis=-1)
    u = _uniforms(keys, 1)  # [B, L, 1]
    target = (u + jnp.arange(N, dtype=jnp.float32)) / N * cdf[..., -1:]
    # (u + N - 1) / N rounds to 1 for u within 2**-21 of 1: such a draw goes to the last id of positive
    # weight (where the cumulative sum first reaches its total), never past it (an id of weight 0)
    last = jnp.argmax(cdf >= cdf[..., -1:], axis=-1)[..., None]
    return jnp.minimum(_searchsorted(cdf, target), last).astype(jnp.int32)


def _plogp(log_p: jax.Array) -> jax.Array:
    """``sum p log p`` over the last axis (0 log 0 = 0)."""
    p = jnp.exp(log_p)
    return jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, log_p, 0.0), 0.0), axis=-1)


@functools.partial(jax.jit, static_argnums=(1, 3))
def select_systematic(logits: jax.Array, num_samples: int, keys: jax.Array, proposal_temperature: float = 1.0) -> dict:
    """N systematic draws per position from ``softmax(logits / t)`` as a sampled record: ``sample_ids``
    (distinct, ascending, first slots), ``sample_counts`` (summing to N), ``sample_logprobs`` (the
    teacher's untempered log-probs), all ``[B, L, N]``; ``keys`` ``[B, L]``. Also ``tail_plogp``
    ``[B, L]``: ``sum p_t log p_t`` of the tempered teacher (minus its entropy)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp_t = jax.nn.log_softmax(logprobs / proposal_temperature, axis=-1)
    draws = _systematic_draws(lp_t, num_samples, keys)
    return {**_distinct(draws, jnp.take_along_axis(logprobs, draws, axis=-1)), "tail_plogp": _plogp(lp_t)}


def _tail_logprobs(logits: jax.Array, head_ids: jax.Array, proposal_temperature: float) -> tuple:
    """(the teacher's float32 log-probs, its log-probs tempered at t with the head's ids at -inf)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp_t = jax.nn.log_softmax(logprobs / float(proposal_temperature), axis=-1)
    return logprobs, jnp.put_along_axis(lp_t, head_ids, -jnp.inf, axis=-1, inplace=False)


def select_hybrid_tail_plogp(logits: jax.Array, head_ids: jax.Array, proposal_temperature: float = 1.0) -> jax.Array:
    """``[B, L]``: ``sum_{v not in head_ids} p_t(v) log p_t(v)`` of the teacher tempered at t, as
    ``select_hybrid`` stores it (``tail_plogp``)."""
    return _plogp(_tail_logprobs(logits, head_ids, proposal_temperature)[1])


@functools.partial(jax.jit, static_argnums=(1, 2, 4))
def select_hybrid(logits: jax.Array, k: int, num_samples: int, keys: jax.Array,
                  proposal_temperature: float = 1.0) -> dict:
    """The top-k record (``select_topk``; at t != 1 also ``tail_logprob_tempered`` ``[B, L, 1]`` at t)
    plus N systematic draws from the tail tempered at t (``sample_*``, as ``select_systematic``) and
    ``tail_plogp`` ``[B, L]``: ``sum_{v in tail} p_t(v) log p_t(v)`` of the tempered teacher."""
    t = float(proposal_temperature)
    logits = logits.astype(jnp.float32)
    out = select_topk(logits, k, () if t == 1.0 else (t,))
    logprobs, tail_lp_t = _tail_logprobs(logits, out["topk_ids"], t)
    draws = _systematic_draws(tail_lp_t, num_samples, keys)
    out.update(_distinct(draws, jnp.take_along_axis(logprobs, draws, axis=-1)))
    out["tail_plogp"] = _plogp(tail_lp_t)
    return out


def _mask_ids(values: jax.Array, ids: jax.Array, start: int | jax.Array, fill: float) -> jax.Array:
    """``values`` (a chunk of entries ``[start, start + size)``) with ``fill`` at those of ``ids`` in the chunk."""
    size = values.shape[-1]
    local = ids - start
    local = jnp.where((local >= 0) & (local < size), local, size)  # outside the chunk: a padding slot
    padded = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, 1)])
    return jnp.put_along_axis(padded, local, fill, axis=-1, inplace=False)[..., :size]


def select_hybrid_chunked(head: Callable, x: jax.Array, vocab_size: int, k: int, num_samples: int,
                          keys: jax.Array, chunk: int, proposal_temperature: float = 1.0) -> dict:
    """``select_hybrid`` of the logits that ``head(x, start, size)`` gives slice by slice.

    Pass 1 is the chunked top-k's (``select_topk_chunked``): the running top-k
    (the head) and the logsumexps of the logits and of the tempered logits,
    over all entries and outside the head. Pass 2 recomputes each chunk's
    logits, sets the head's entries among them to weight 0, and walks the
    tail's cumulative distribution chunk by chunk: the cumulative sum of the
    chunk's renormalised tempered tail probabilities, offset by the mass of
    the chunks before it (carried), locates the systematic targets
    ``(u + i) / N`` that fall in the chunk; the chunk's ``sum p_t log p_t``
    over its tail entries is added up. The head runs twice; memory holds
    about one chunk's logits.

    One chunk is ``select_hybrid`` bit for bit. Several give the same head and
    the same draws unless a target falls within float32 rounding of a step of
    the tail's cumulative distribution (the chunks' cumulative sums and the
    tail's normaliser round differently from one sum over the whole
    vocabulary), and log-probs within float32 rounding.
    """
    if chunk >= vocab_size:
        return select_hybrid(head(x, 0, vocab_size), k, num_samples, keys, proposal_temperature)
    N, t = int(num_samples), float(proposal_temperature)
    scales = (1.0,) if t == 1.0 else (1.0, 1.0 / t)
    # the record's fields as the chunked top-k's; the tail's normaliser by a masked logsumexp (the outside
    # sums of _top_and_sums, off by up to 5e-6, would move the draws' targets against the unchunked ones)
    lse, rest, top_v, top_i = _fold_topk(head, x, vocab_size, k, chunk, scales, masked=scales[-1])
    out = _topk_record(top_v, top_i, lse, rest[:-1])
    s, lse_s = scales[-1], lse[-1]
    # the tail's tempered log-mass (unnormalised); no tail (every entry in the head or -inf): weights 0
    log_tail = jnp.where(jnp.isfinite(rest[-1]), rest[-1], jnp.inf)
    target = (_uniforms(keys, 1) + jnp.arange(N, dtype=jnp.float32)) / N  # [B, L, N], as _systematic_draws

    def pass2(state, start, logits):
        draws, draw_lp, done, cum, last, last_lp, plogp = state
        size = logits.shape[-1]
        scaled = _mask_ids(logits * s if s != 1.0 else logits, top_i, start, -jnp.inf)  # head: -inf
        cdf = cum[..., None] + jnp.cumsum(jnp.exp(scaled - log_tail[..., None]), axis=-1)
        local = _searchsorted(cdf, target)
        here = ~done & (local < size)
        local = jnp.minimum(local, size - 1).astype(jnp.int32)
        logprobs = logits - lse[0][..., None]
        draws = jnp.where(here, local + start, draws)
        draw_lp = jnp.where(here, jnp.take_along_axis(logprobs, local, axis=-1), draw_lp)
        # a target past the tail's total (rounding) goes to where the cumulative sum first reaches it
        end = cdf[..., -1]
        grew = end > cum
        at = jnp.argmax(cdf >= end[..., None], axis=-1).astype(jnp.int32)
        if isinstance(start, int) and start == 0:  # the first chunk (unrolled): without a tail, id 0 as unchunked
            last_lp = logprobs[..., 0]
        last = jnp.where(grew, at + start, last)
        last_lp = jnp.where(grew, jnp.take_along_axis(logprobs, at[..., None], axis=-1)[..., 0], last_lp)
        plogp = plogp + _plogp(scaled - lse_s[..., None])
        return draws, draw_lp, done | here, end, last, last_lp, plogp

    # per draw: its id, log-prob and whether it is placed; per position: the tail's cumulative mass so far, the
    # id where it was last reached (and its log-prob), and the tail's sum p_t log p_t so far
    zeros = jnp.zeros(target.shape[:-1], jnp.float32)
    state = (jnp.zeros(target.shape, jnp.int32), jnp.zeros(target.shape, jnp.float32), jnp.zeros(target.shape, bool),
             zeros, jnp.zeros(target.shape[:-1], jnp.int32), zeros, zeros)
    draws, draw_lp, done, _, last, last_lp, plogp = fold_vocab_chunks(head, x, vocab_size, chunk, pass2, state)
    draws = jnp.where(done, draws, last[..., None])
    draw_lp = jnp.where(done, draw_lp, last_lp[..., None])
    out.update(_distinct(draws, draw_lp))
    out["tail_plogp"] = plogp
    return out


def make_teacher_hybrid(apply: Callable | None, k: int, num_samples: int, *, seed: int,
                        proposal_temperature: float = 1.0, mesh=None, device_batch: int = 1,
                        features: Callable | None = None, head: Callable | None = None,
                        vocab_size: int | None = None, vocab_chunk: int | None = None) -> Callable:
    """``fn(params, tokens, positions, segment_ids, example_index) -> the hybrid record's fields``
    (``select_hybrid`` without the draws' log-probs, which the record does not keep).

    ``features``, ``head``, ``vocab_size`` and ``vocab_chunk`` as in ``make_teacher_topk``: the head, the
    top-k and the tail's draws run over vocabulary chunks (``select_hybrid_chunked``)."""
    t = float(proposal_temperature)

    def select(logits, keys):
        out = select_hybrid(logits, k, num_samples, keys, t)
        del out["sample_logprobs"]
        return out

    if features is None:
        return make_teacher_select(apply, select, mesh, seed=int(seed), device_batch=device_batch)

    chunk = int(vocab_chunk or AUTO_VOCAB_CHUNK)

    def run(params, tokens, positions, segment_ids, example_index):
        keys = sample_keys(int(seed), example_index, tokens.shape[1])
        x = features(params, tokens, positions, segment_ids)
        out = select_hybrid_chunked(functools.partial(head, params), x, vocab_size, k, num_samples, keys, chunk, t)
        del out["sample_logprobs"]
        return out

    return _on_mesh(run, mesh, device_batch)


NONFINITE_KEY = "nonfinite"


def _first_nonfinite(out: dict) -> jax.Array:
    """``[B]`` int32: per example, the first position where any log-prob of the selection (top-k,
    tail, tempered tails, sampled ids') is NaN or +inf, else -1."""
    bad = None
    for key, value in out.items():
        if "logprob" not in key and key != "tail_plogp":
            continue
        b = jnp.isnan(value) | (value == jnp.inf)
        b = b.reshape(b.shape[:2] + (-1,)).any(-1) if b.ndim > 2 else b
        bad = b if bad is None else bad | b
    first = jnp.argmax(bad, axis=-1).astype(jnp.int32)
    return jnp.where(jnp.any(bad, axis=-1), first, jnp.int32(-1))


def _nonfinite_summary(first: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Three int32 scalars from the ``[B]`` first bad positions: the number of bad examples, the row
    of the first (-1: none) and its first bad position (-1: none). Reductions over the batch axis:
    on a mesh that splits the batch (over processes too) they are an all-reduce, and every device
    holds the same scalars."""
    B = first.shape[0]
    bad = first >= 0
    rows = jnp.arange(B, dtype=jnp.int32)
    row = jnp.min(jnp.where(bad, rows, jnp.int32(B)))
    position = jnp.max(jnp.where(rows == row, first, jnp.int32(-1)))
    return jnp.sum(bad, dtype=jnp.int32), jnp.where(row < B, row, jnp.int32(-1)), position


def with_finite_check(fn: Callable) -> Callable:
    """``fn`` (a teacher selection: arrays ``[B, L, ...]``) whose output also holds, under
    ``NONFINITE_KEY``, the replicated scalars of ``_nonfinite_summary``: the examples of the whole
    batch with a NaN/+inf log-prob, the first one's row and its first bad position.

    Reductions over the selection's output, traced into the same jitted program (the inner jit
    is inlined; on a mesh each device reduces its own rows, then one all-reduce of scalars): three
    int32 scalars more leave the device, every process of a multi-host job reads the same ones, and
    the dump refuses a step on every process before anything of it is written (a NaN weight in a
    teacher gives NaN logits).
    """

    @jax.jit
    def checked(*args):
        out = fn(*args)
        return {**out, NONFINITE_KEY: _nonfinite_summary(_first_nonfinite(out))}

    return checked
