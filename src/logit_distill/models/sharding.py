"""Placing decoder parameters on a device mesh.

``replicate``: every array whole on every device. ``fsdp``: each array with at
least ``min_size`` elements is split along its largest dimension that the mesh
axis divides (axis ``fsdp`` if the mesh has one, else ``data``, else the first
axis); smaller arrays (norms, biases) are replicated. The forward pass needs no
annotations: under ``jit`` XLA gathers what each op needs.

Meshes from ``jax.make_mesh`` have Explicit axes by default on jax 0.10, under
which a gather from a sharded embedding table is a type error (the failure
Tunix's loader hits); we place arrays on the same devices with Auto axes, so
the compiler chooses the shardings of intermediates.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MODES = ("replicate", "fsdp")


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with Auto axis types."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def fsdp_axis(mesh: Mesh) -> str:
    for name in ("fsdp", "data"):
        if name in mesh.axis_names:
            return name
    return mesh.axis_names[0]


def spec_for(shape, mesh: Mesh, mode: str, min_size: int = 4096) -> P:
    if mode not in MODES:
        from ..errors import InputError

        raise InputError(f"unknown sharding mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "replicate" or len(shape) < 2 or int(np.prod(shape)) < min_size:
        return P()
    axis = fsdp_axis(mesh)
    n = mesh.shape[axis]
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % n == 0:
            spec = [None] * len(shape)
            spec[dim] = axis
            return P(*spec)
    return P()


def sharding_for(shape, mesh: Mesh, mode: str, min_size: int = 4096) -> NamedSharding:
    return NamedSharding(auto_mesh(mesh), spec_for(shape, mesh, mode, min_size))


def shard_params(params, mesh: Mesh, mode: str = "fsdp", min_size: int = 4096):
    """``params`` placed on ``mesh`` with NamedShardings (see module doc)."""
    return jax.tree.map(
        lambda a: jax.device_put(a, sharding_for(a.shape, mesh, mode, min_size)), params
    )
