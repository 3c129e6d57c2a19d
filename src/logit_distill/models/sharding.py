"""Placing decoder parameters on a device mesh.

``replicate``: every array whole on every device. ``fsdp``: each array with at
least ``min_size`` elements is split along its largest dimension that the mesh
axis divides (axis ``fsdp`` if the mesh has one, else ``data``, else the first
axis); smaller arrays (norms, biases) are replicated.

``tensor`` (Megatron-style tensor parallelism over the mesh axis ``model``):
q/k/v projections and the MLP's gate/up are split by output rows (attention
heads, MLP columns), the attention output and MLP down projections by input
columns, the embedding and output head by vocabulary rows; norms are
replicated. A dimension the ``model`` axis does not divide stays whole.
``fsdp+tensor``: ``tensor``, and each large array's other dimension split over
the data axis as well (for teachers that do not fit ``model`` devices).

Mixtures of experts: ``expert`` splits the experts (dimension 0 of every
``mlp.experts.*`` tensor) over the ``model`` axis and replicates the rest;
``fsdp+expert`` adds ``fsdp`` for the rest (and the experts' other
dimensions). The tensor modes split the experts the same way (by expert, not by
their FFN columns: a device then runs whole experts). The forward runs the MoE
blocks inside ``shard_map`` (``expert_mesh``): each device routes its data
shard's tokens, runs the pairs of the experts it holds, and the partial sums
are added over ``model``.

The forward pass needs no annotations: under ``jit`` XLA's SPMD partitioner
inserts the collectives each op needs.

Meshes from ``jax.make_mesh`` have Explicit axes by default on jax 0.10, under
which a gather from a sharded embedding table is a type error (the failure
Tunix's loader hits); we place arrays on the same devices with Auto axes, so
the compiler chooses the shardings of intermediates.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MODES = ("replicate", "fsdp", "tensor", "fsdp+tensor", "expert", "fsdp+expert")
MODEL_AXIS = "model"
MODEL_AXIS_MODES = ("tensor", "fsdp+tensor", "expert", "fsdp+expert")  # modes with a ``model`` mesh axis
_EXPERT_TENSORS = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj",
                   "experts.down_proj_bias")
# HF tensor name suffix -> the dimension split over ``model`` (HF [out, in] layout)
_TENSOR_DIM = {
    "q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1,
    "q_proj.bias": 0, "k_proj.bias": 0, "v_proj.bias": 0,
    "gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1,
    "gate_proj.bias": 0, "up_proj.bias": 0,
    "embed_tokens.weight": 0, "lm_head.weight": 0,
    "q_b_proj.weight": 0, "kv_b_proj.weight": 0,  # MLA: by heads
}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        from ..errors import InputError

        raise InputError(f"unknown sharding mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with Auto axis types."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def make_mesh(devices, model_parallel: int = 1) -> Mesh:
    """A ``data`` mesh of ``devices`` or, with ``model_parallel`` > 1, a 2-D (``data``, ``model``) one."""
    devices = np.asarray(devices).reshape(-1)
    if model_parallel <= 1:
        return Mesh(devices, ("data",))
    if devices.size % model_parallel:
        from ..errors import InputError

        raise InputError(f"--model-parallel {model_parallel} does not divide the {devices.size} devices")
    return Mesh(devices.reshape(-1, model_parallel), ("data", MODEL_AXIS))


def fsdp_axis(mesh: Mesh) -> str:
    for name in ("fsdp", "data"):
        if name in mesh.axis_names:
            return name
    return mesh.axis_names[0]


def _fsdp_dim(shape, n: int, skip: int | None = None):
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if dim != skip and shape[dim] % n == 0:
            return dim
    return None


def is_expert_tensor(name: str) -> bool:
    return name.endswith(_EXPERT_TENSORS)


def spec_for(shape, mesh: Mesh, mode: str, min_size: int = 4096, name: str = "") -> P:
    check_mode(mode)
    spec: list = [None] * len(shape)
    tensor_dim = None
    if mode in MODEL_AXIS_MODES and MODEL_AXIS in mesh.axis_names and is_expert_tensor(name):
        if shape[0] % mesh.shape[MODEL_AXIS]:
            from ..errors import InputError

            raise InputError(f"{name}: the {shape[0]} experts do not split over the {mesh.shape[MODEL_AXIS]} "
                             f"devices of the model axis; choose --model-parallel dividing {shape[0]}")
        spec[0] = MODEL_AXIS
        tensor_dim = 0
    elif mode in ("tensor", "fsdp+tensor") and MODEL_AXIS in mesh.axis_names:
        dim = next((d for suffix, d in _TENSOR_DIM.items() if name.endswith(suffix)), None)
        if dim is not None and dim < len(shape) and shape[dim] % mesh.shape[MODEL_AXIS] == 0:
            spec[dim] = MODEL_AXIS
            tensor_dim = dim
    if mode in ("fsdp", "fsdp+tensor", "fsdp+expert") and len(shape) >= 2 and int(np.prod(shape)) >= min_size:
        axis = fsdp_axis(mesh)
        if axis != MODEL_AXIS:
            dim = _fsdp_dim(shape, mesh.shape[axis], skip=tensor_dim)
            if dim is not None:
                spec[dim] = axis
    return P(*spec) if any(spec) else P()


def sharding_for(shape, mesh: Mesh, mode: str, min_size: int = 4096, name: str = "") -> NamedSharding:
    return NamedSharding(auto_mesh(mesh), spec_for(shape, mesh, mode, min_size, name))


def _name(path) -> str:
    parts = []
    for p in path:
        key = getattr(p, "key", getattr(p, "idx", None))
        parts.append(str(key))
    return ".".join(parts)


def shard_params(params, mesh: Mesh, mode: str = "fsdp", min_size: int = 4096):
    """``params`` placed on ``mesh`` with NamedShardings (see module doc)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(a, sharding_for(a.shape, mesh, mode, min_size, _name(path))), params
    )
