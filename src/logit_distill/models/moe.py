"""The mixture-of-experts block: exact, dropless routing and grouped expert matmuls.

Every token goes to its top-k experts (no capacity factor, nothing dropped:
the stored logits must be the teacher's). Routing follows transformers' code
for each family (``MoeConfig``: softmax, top-k-then-softmax, or DeepSeek's
sigmoid with group-limited top-k); ties go to the lower expert index
(``lax.top_k``). transformers' ``torch.topk`` leaves the order of equal values
unspecified (on CPU it comes out of a partial sort), so where a tie straddles
the k-th place no implementation can promise its choice; ties inside the top-k
change nothing (the set is the same).

The experts run as grouped matmuls whose cost follows the active parameters,
never through a ``[tokens, experts, ffn]`` tensor:

- ``tiles`` (CPU): the (token, choice) pairs are sorted by expert into a
  buffer where each expert's rows start on a tile of ``tile`` rows; a loop over
  the tiles in use multiplies each tile by its expert's weights (plain 2-D
  matmuls, which XLA's CPU backend runs at full speed). The padding is at
  most one partial tile per expert. Rows move by gathers only (XLA's CPU
  scatters of rows are slow; only int32 indices are scattered): a buffer row
  knows its token, a pair knows its buffer row.
- ``ragged`` (GPU, TPU): the sorted rows through ``jax.lax.ragged_dot_general``
  with the experts' group sizes, which XLA lowers to its grouped-matmul
  instruction there. On CPU it is decomposed densely (~100x slower than a dense
  matmul of the same FLOPs, measured), hence ``tiles``.
- ``auto``: ``tiles`` on CPU, ``ragged`` elsewhere.

Both compute every row's expert output with the same per-expert arithmetic;
tests compare them with each other and with transformers.

Expert parallelism (``ExpertMesh``): inside ``jax.shard_map`` each device
routes the tokens of its data shard (the router is replicated), runs only the
pairs whose expert it holds, and the partial sums are added over the expert
axis (``psum``). The sum of a token's k contributions is then formed in
another order than on one device, so the last bits may differ (see
docs/MODELS.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .config import MoeConfig

IMPLEMENTATIONS = ("auto", "tiles", "ragged")


def check_experts(name: str) -> str:
    if name not in IMPLEMENTATIONS:
        from ..errors import InputError

        raise InputError(f"unknown experts implementation {name!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    return name


def resolve_experts(name: str, backend: str | None = None) -> str:
    check_experts(name)
    if name != "auto":
        return name
    return "tiles" if (backend or jax.default_backend()) == "cpu" else "ragged"


@dataclasses.dataclass(frozen=True)
class ExpertMesh:
    """Where the MoE block runs split: ``data_axis`` splits the batch (dimension 0 of the hidden states),
    ``expert_axis`` (or None) splits the experts (dimension 0 of every expert tensor)."""

    mesh: object
    data_axis: str | None = "data"
    expert_axis: str | None = None


# ----------------------------------------------------------------------------- routing


def route(moe: MoeConfig, p: dict, x):
    """(weights [N, k], expert ids [N, k] int32) for hidden states x [N, D], as transformers routes.

    Weights are float32 for the sigmoid router (as its scores are), else in x's dtype."""
    if moe.router == "sigmoid":  # DeepSeek-V3 / GLM-4.5: float32 router, group-limited top-k
        gate = p["gate"]
        logits = jnp.einsum("nd,ed->ne", x.astype(jnp.float32), gate["weight"].astype(jnp.float32))
        scores = jax.nn.sigmoid(logits)
        choice = scores + gate["e_score_correction_bias"].astype(jnp.float32)
        n, e = choice.shape
        g = moe.n_group
        if g > 1:
            group_scores = jax.lax.top_k(choice.reshape(n, g, e // g), 2)[0].sum(-1)
            _, groups = jax.lax.top_k(group_scores, moe.topk_group)
            keep = jnp.zeros((n, g), jnp.bool_).at[jnp.arange(n)[:, None], groups].set(True)
            choice = jnp.where(jnp.repeat(keep, e // g, axis=1), choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, moe.top_k)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if moe.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * moe.routed_scaling_factor, ids.astype(jnp.int32)
    if moe.router == "topk_softmax":  # gpt-oss: top-k of the logits (router bias included), softmax over them
        r = p["router"]
        logits = jnp.einsum("nd,ed->ne", x, r["weight"]) + r["bias"]
        top, ids = jax.lax.top_k(logits, moe.top_k)
        weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(x.dtype)
        return weights, ids.astype(jnp.int32)
    # Qwen3-MoE: float32 softmax over every expert, its top-k, optionally renormalized
    logits = jnp.einsum("nd,ed->ne", x, p["gate"]["weight"])
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, moe.top_k)
    if moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids.astype(jnp.int32)


# ----------------------------------------------------------------------------- one expert's FFN


def _swiglu(moe: MoeConfig, gate, up):
    if moe.swiglu_limit is None:
        return jax.nn.silu(gate) * up
    limit = moe.swiglu_limit  # gpt-oss: clamped, (up + 1) * gate * sigmoid(alpha * gate)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * moe.swiglu_alpha))


def _split_gate_up(moe: MoeConfig, gu):
    if moe.layout == "interleaved":
        return gu[..., 0::2], gu[..., 1::2]
    i = gu.shape[-1] // 2
    return gu[..., :i], gu[..., i:]


def expert_ffn(moe: MoeConfig, ex: dict, e, rows):
    """Rows [T, D] through expert ``e`` (traced index) of the expert tensors ``ex``."""
    if moe.layout == "interleaved":
        gu = rows @ ex["gate_up_proj"][e] + ex["gate_up_proj_bias"][e]
        h = _swiglu(moe, *_split_gate_up(moe, gu))
        return h @ ex["down_proj"][e] + ex["down_proj_bias"][e]
    gu = rows @ ex["gate_up_proj"][e].T
    h = _swiglu(moe, *_split_gate_up(moe, gu))
    return h @ ex["down_proj"][e].T


def num_experts_of(ex: dict) -> int:
    return ex["gate_up_proj"].shape[0]


# ----------------------------------------------------------------------------- grouped matmuls


def default_tile(rows: int, experts: int) -> int:
    """Rows per tile: about half an expert's average share (padding is at most a partial tile per expert),
    a multiple of 8 between 8 and 256."""
    avg = rows / max(1, experts)
    return int(min(256, max(8, 8 * round(avg / 16))))


def _sorted_layout(expert_of, num_experts: int, tile: int):
    """For pairs with expert ``expert_of`` [M] (``num_experts`` = not on this device): each expert's pairs
    in order, starting on a tile boundary. Returns (pair of each buffer row (M = none), buffer row of each
    pair (the last row = none), expert of each tile, tiles in use, buffer rows)."""
    expert_of = jnp.asarray(expert_of, jnp.int32)
    m = expert_of.shape[0]
    counts = jnp.bincount(expert_of, length=num_experts + 1)[:num_experts]
    tiles_per = (counts + tile - 1) // tile
    tile_end = jnp.cumsum(tiles_per)
    tile_start = tile_end - tiles_per
    max_tiles = (m + num_experts * (tile - 1)) // tile
    capacity = max_tiles * tile
    order = jnp.argsort(expert_of, stable=True).astype(jnp.int32)
    sorted_e = expert_of[order]
    valid = sorted_e < num_experts
    e_c = jnp.minimum(sorted_e, num_experts - 1)
    group_start = jnp.cumsum(counts) - counts
    rank = jnp.arange(m, dtype=jnp.int32) - group_start[e_c]
    dest = jnp.where(valid, tile_start[e_c] * tile + rank, capacity).astype(jnp.int32)
    pair_of_row = jnp.full((capacity,), m, jnp.int32).at[dest].set(order, mode="drop")
    row_of_pair = jnp.zeros((m,), jnp.int32).at[order].set(dest)
    tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(max_tiles), side="right"), num_experts - 1)
    return pair_of_row, row_of_pair, tile_expert.astype(jnp.int32), tile_end[-1], capacity


def experts_tiles(moe: MoeConfig, ex: dict, x, expert_of, tile: int | None = None):
    """Every pair's expert output [M, D] (M = N * k pairs, pair n*k + j is token n's j-th choice;
    pairs with ``expert_of`` = number of local experts give zeros)."""
    n, d = x.shape
    m = expert_of.shape[0]
    k = m // n
    e = num_experts_of(ex)
    tile = tile or default_tile(m, e)
    pair_of_row, row_of_pair, tile_expert, used, capacity = _sorted_layout(expert_of, e, tile)
    token = jnp.where(pair_of_row < m, pair_of_row // k, n)
    buf = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[token]  # [capacity, D], padding rows zero

    def body(t, out):
        rows = jax.lax.dynamic_slice_in_dim(buf, t * tile, tile)
        y = expert_ffn(moe, ex, tile_expert[t], rows).astype(out.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, y, t * tile, 0)

    out = jax.lax.fori_loop(0, used, body, jnp.zeros((capacity + 1, d), x.dtype))  # last row: "none"
    return out[row_of_pair]


def experts_ragged(moe: MoeConfig, ex: dict, x, expert_of):
    """As ``experts_tiles``, through ``jax.lax.ragged_dot_general`` over the pairs sorted by expert."""
    n, d = x.shape
    expert_of = jnp.asarray(expert_of, jnp.int32)
    m = expert_of.shape[0]
    k = m // n
    e = num_experts_of(ex)
    order = jnp.argsort(expert_of, stable=True).astype(jnp.int32)
    sorted_e = expert_of[order]
    sizes = jnp.bincount(expert_of, length=e + 1)[:e].astype(jnp.int32)
    valid = (sorted_e < e)[:, None]
    rows = jnp.where(valid, x[order // k], 0)  # pairs on no local expert last, as zero rows
    group_of_row = jnp.minimum(sorted_e, e - 1)

    def grouped(lhs, w, contract_rhs: int):
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(([1], [contract_rhs]), ([], [])), lhs_ragged_dimensions=[0],
            rhs_group_dimensions=[0])
        return jax.lax.ragged_dot_general(lhs, w, sizes, dims)

    if moe.layout == "interleaved":
        gu = grouped(rows, ex["gate_up_proj"], 1) + ex["gate_up_proj_bias"][group_of_row]
        h = _swiglu(moe, *_split_gate_up(moe, gu))
        y = grouped(h.astype(x.dtype), ex["down_proj"], 1) + ex["down_proj_bias"][group_of_row]
    else:
        gu = grouped(rows, ex["gate_up_proj"], 2)
        h = _swiglu(moe, *_split_gate_up(moe, gu))
        y = grouped(h.astype(x.dtype), ex["down_proj"], 2)
    y = jnp.where(valid, y, 0).astype(x.dtype)
    inverse = jnp.zeros((m,), jnp.int32).at[order].set(jnp.arange(m, dtype=jnp.int32))
    return y[inverse]


_GROUPED = {"tiles": experts_tiles, "ragged": experts_ragged}


def routed_experts(moe: MoeConfig, p: dict, x, impl: str, expert_offset=0):
    """The routed experts' weighted sum [N, D] for x [N, D]: all of them, or (``expert_offset`` and the
    local slice of the expert tensors) the share of the experts this device holds."""
    weights, ids = route(moe, p, x)
    e_local = num_experts_of(p["experts"])
    local = ids - expert_offset
    here = (local >= 0) & (local < e_local)
    expert_of = jnp.where(here, local, e_local).reshape(-1)
    y = _GROUPED[impl](moe, p["experts"], x, expert_of)  # [N * k, D]
    y = y.reshape(x.shape[0], moe.top_k, x.shape[1])
    w = jnp.where(here, weights, 0).astype(jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, w, preferred_element_type=jnp.float32).astype(x.dtype)


def expert_mesh_for(mesh: jax.sharding.Mesh, mode: str) -> ExpertMesh | None:
    """How the MoE blocks run on ``mesh`` in a sharded ``mode`` (``ExpertMesh``): split over the
    batch (axis ``data``), and the experts over ``model`` in the modes that split them; None for
    ``replicate`` (each device then runs whole examples with every expert)."""
    from .sharding import MODEL_AXIS, MODEL_AXIS_MODES, check_mode

    check_mode(mode)
    if mode == "replicate":
        return None
    data = "data" if "data" in mesh.axis_names else None
    experts = MODEL_AXIS if mode in MODEL_AXIS_MODES and MODEL_AXIS in mesh.axis_names else None
    return ExpertMesh(mesh, data_axis=data, expert_axis=experts)


def block(moe: MoeConfig, p: dict, x, impl: str = "auto", expert_mesh: ExpertMesh | None = None,
          shared=None):
    """The MoE block on hidden states x [B, L, D]: routed experts (+ ``shared(x)``, the shared experts)."""
    impl = resolve_experts(impl)
    B, L, D = x.shape
    routed = {k: v for k, v in p.items() if k != "shared_experts"}
    if expert_mesh is None:
        out = routed_experts(moe, routed, x.reshape(B * L, D), impl).reshape(B, L, D)
    else:
        out = _sharded(moe, routed, x, impl, expert_mesh)
    if shared is not None:
        out = out + shared(x)
    return out


def _sharded(moe: MoeConfig, p: dict, x, impl: str, em: ExpertMesh):
    from jax.sharding import PartitionSpec as P

    from .sharding import auto_mesh

    mesh = auto_mesh(em.mesh)
    ax = em.expert_axis
    n_shards = mesh.shape[ax] if ax else 1
    if moe.num_experts % n_shards:
        from ..errors import InputError

        raise InputError(f"the {moe.num_experts} experts do not split over the {n_shards} devices of the "
                         f"{ax!r} mesh axis; choose --model-parallel dividing {moe.num_experts}")
    data = em.data_axis if em.data_axis in mesh.axis_names else None
    if data is not None and x.shape[0] % mesh.shape[data]:  # a batch that does not split: every device all of it
        data = None

    def local(p, x):
        b, l, d = x.shape
        offset = 0 if ax is None else jax.lax.axis_index(ax) * (moe.num_experts // n_shards)
        y = routed_experts(moe, p, x.reshape(b * l, d), impl, expert_offset=offset).reshape(b, l, d)
        return y if ax is None else jax.lax.psum(y, ax)

    specs = jax.tree.map(lambda _: P(), p)
    specs["experts"] = jax.tree.map(lambda _: P(ax), p["experts"])
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(data)), out_specs=P(data), check_vma=False)(p, x)


def active_params_per_token(moe: MoeConfig, hidden: int) -> int:
    """Matmul parameters one token goes through in an MoE block (router, k experts, shared experts)."""
    per_expert = 3 * hidden * moe.intermediate_size
    return hidden * moe.num_experts + moe.top_k * per_expert + 3 * hidden * moe.shared_intermediate_size


__all__ = ["ExpertMesh", "IMPLEMENTATIONS", "block", "check_experts", "default_tile", "expert_ffn",
           "expert_mesh_for", "experts_ragged", "experts_tiles", "resolve_experts", "route", "routed_experts"]
