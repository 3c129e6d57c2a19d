"""The Vertex AI machine shapes a custom job can ask for: machine type, accelerator type and count, TPU topology.

``submit`` refuses, before anything is sent, a worker pool that Vertex would reject at job creation (hours
into a run, after the dump): an accelerator a machine type does not carry, the wrong count, a TPU topology
on a GPU machine or one the slice cannot have. The table holds the accelerator-optimized families of
Vertex AI custom training (docs: https://cloud.google.com/vertex-ai/docs/training/configure-compute,
"Machine types", "GPUs", "TPUs"): A2, A3, A4 / A4X and G2 GPU machines, and TPU v2/v3, v4, v5e, v5p, v6e
and v7 hosts. A machine type of another family with no accelerator (``ACCELERATOR_TYPE_UNSPECIFIED``, count
0) is a CPU machine and is accepted as given; N1 machines take the GPUs Vertex attaches to them.

The accelerator enum is Vertex's own (``google.cloud.aiplatform_v1.AcceleratorType`` of the installed
client). TPU v5e and later hosts are identified by their machine type alone: the TPU enum names that exist
(``TPU_V5_LITEPOD``, ``TPU_V4_POD``, ...) are accepted with the host's chip count, and no accelerator
(count 0) is accepted for every TPU VM host, since the machine type already says which chips it has.
"""

from __future__ import annotations

import dataclasses
import math
import re

NO_ACCELERATOR = "ACCELERATOR_TYPE_UNSPECIFIED"


@dataclasses.dataclass(frozen=True)
class Shape:
    accelerator: str  # the Vertex enum name
    counts: tuple[int, ...]  # accelerator counts the machine type takes
    tpu_dims: int = 0  # TPU VM hosts: the topology's dimensions (2: AxB, 3: AxBxC); 0: not a TPU VM host
    chips_per_host: int = 0


def _gpu(accelerator: str, count: int) -> Shape:
    return Shape(accelerator, (count,))


# machine type -> shape. GPU machines carry a fixed number of GPUs.
GPU_MACHINES = {
    **{f"a2-highgpu-{n}g": _gpu("NVIDIA_TESLA_A100", n) for n in (1, 2, 4, 8)},
    "a2-megagpu-16g": _gpu("NVIDIA_TESLA_A100", 16),
    **{f"a2-ultragpu-{n}g": _gpu("NVIDIA_A100_80GB", n) for n in (1, 2, 4, 8)},
    **{f"a3-highgpu-{n}g": _gpu("NVIDIA_H100_80GB", n) for n in (1, 2, 4, 8)},
    "a3-megagpu-8g": _gpu("NVIDIA_H100_MEGA_80GB", 8),
    "a3-ultragpu-8g": _gpu("NVIDIA_H200_141GB", 8),
    "a4-highgpu-8g": _gpu("NVIDIA_B200", 8),
    "a4x-highgpu-4g": _gpu("NVIDIA_GB200", 4),
    **{f"g2-standard-{n}": _gpu("NVIDIA_L4", 1) for n in (4, 8, 12, 16, 32)},
    "g2-standard-24": _gpu("NVIDIA_L4", 2),
    "g2-standard-48": _gpu("NVIDIA_L4", 4),
    "g2-standard-96": _gpu("NVIDIA_L4", 8),
}


def _tpu(accelerator: str, chips: int, dims: int) -> Shape:
    return Shape(accelerator, (chips,), tpu_dims=dims, chips_per_host=chips)


# TPU VM hosts: v4 and v5p slices are 3-D (AxBxC), v5e and v6e 2-D (AxB), v7 3-D. Enum names the installed
# client lacks (v5p, v6e, v7) leave only "no accelerator" for those hosts.
TPU_MACHINES = {
    "ct4p-hightpu-4t": _tpu("TPU_V4_POD", 4, 3),
    **{f"ct5lp-hightpu-{n}t": _tpu("TPU_V5_LITEPOD", n, 2) for n in (1, 4, 8)},
    "ct5p-hightpu-4t": _tpu("TPU_V5P", 4, 3),
    **{f"ct6e-standard-{n}t": _tpu("TPU_V6E", n, 2) for n in (1, 4, 8)},
    "tpu7x-standard-4t": _tpu("TPU_V7X", 4, 3),
}
# The legacy TPU node of TPU v2 / v3: 8 cores, no topology.
LEGACY_TPU = {"cloud-tpu": (Shape("TPU_V2", (8,)), Shape("TPU_V3", (8,)))}
# Families whose every machine type is in the tables above: another shape of theirs does not exist.
KNOWN_FAMILIES = ("a2-", "a3-", "a4-", "a4x-", "g2-", "ct4p-", "ct5lp-", "ct5p-", "ct6e-", "tpu7x-")
# N1 machines take these GPUs, attached (1, 2, 4 or 8 of them).
N1_GPUS = {"NVIDIA_TESLA_T4": (1, 2, 4), "NVIDIA_TESLA_V100": (1, 2, 4, 8), "NVIDIA_TESLA_P100": (1, 2, 4),
           "NVIDIA_TESLA_P4": (1, 2, 4)}


def accelerator_types() -> tuple[str, ...]:
    """Vertex's accelerator enum, as the installed client has it."""
    from google.cloud.aiplatform_v1.types import AcceleratorType

    return tuple(t.name for t in AcceleratorType)


def problems(job: str, machine: str, accelerator: str, count: int, topology: str) -> list[str]:
    """Why the ``job``'s worker pool (``<job>_machine_type`` etc.) is not a shape Vertex creates; [] if it is."""
    name = f"{job}_machine_type={machine!r}"
    enum = accelerator_types()
    if accelerator not in enum:
        close = [e for e in enum if accelerator and accelerator.upper().split("_")[-1] in e]
        return [f"{job}_accelerator_type={accelerator!r} is not a Vertex accelerator type (one of "
                f"{', '.join(close or enum)})"]
    if topology and not re.fullmatch(r"\d+x\d+(x\d+)?", topology):
        return [f"{job}_tpu_topology={topology!r} is not of the form AxB or AxBxC (e.g. 4x4, 2x2x2)"]
    gpu, tpu = GPU_MACHINES.get(machine), TPU_MACHINES.get(machine)
    if gpu is not None:
        if topology:
            return [f"{job}_tpu_topology={topology!r} on {name}, a GPU machine: leave it empty"]
        return _accelerators(job, name, accelerator, count, (gpu,), allow_none=False)
    if tpu is not None:
        found = _accelerators(job, name, accelerator, count, (tpu,) if tpu.accelerator in enum else (),
                              allow_none=True)
        if found or not topology:
            return found
        dims = [int(d) for d in topology.split("x")]
        chips = math.prod(dims)
        if len(dims) != tpu.tpu_dims:
            return [f"{job}_tpu_topology={topology!r} on {name}: its slices are "
                    f"{'AxB' if tpu.tpu_dims == 2 else 'AxBxC'}"]
        if chips < tpu.chips_per_host or chips % tpu.chips_per_host:
            return [f"{job}_tpu_topology={topology!r} ({chips} chips) on {name}: a slice is whole hosts of "
                    f"{tpu.chips_per_host} chips"]
        return []
    if machine in LEGACY_TPU:
        return _accelerators(job, name, accelerator, count, LEGACY_TPU[machine], allow_none=False)
    if machine.startswith(KNOWN_FAMILIES):
        return [f"{name} is not a Vertex machine type of its family (e.g. "
                f"{', '.join(m for m in [*GPU_MACHINES, *TPU_MACHINES] if m[:3] == machine[:3])})"]
    if topology:
        return [f"{job}_tpu_topology={topology!r} on {name}, not a TPU machine: leave it empty"]
    if machine.startswith("n1-") and accelerator in N1_GPUS:
        if count not in N1_GPUS[accelerator]:
            return [f"{job}_accelerator_count={count} of {accelerator} on {name}: N1 machines take "
                    f"{' or '.join(map(str, N1_GPUS[accelerator]))}"]
        return []
    if accelerator != NO_ACCELERATOR or count:
        return [f"{job}_accelerator_type={accelerator!r} x {count} on {name}, a machine type without "
                f"accelerators: give {job}_accelerator_type={NO_ACCELERATOR} {job}_accelerator_count=0, or an "
                "accelerator-optimized machine type (a3-highgpu-8g, g2-standard-24, ct5lp-hightpu-4t, ...)"]
    return []


def _accelerators(job: str, name: str, accelerator: str, count: int, shapes: tuple[Shape, ...],
                  allow_none: bool) -> list[str]:
    if allow_none and accelerator == NO_ACCELERATOR and count == 0:
        return []
    for shape in shapes:
        if shape.accelerator == accelerator:
            if count in shape.counts:
                return []
            return [f"{job}_accelerator_count={count} on {name}: it carries "
                    f"{' or '.join(map(str, shape.counts))} {accelerator}"]
    takes = [f"{s.accelerator} x {'/'.join(map(str, s.counts))}" for s in shapes]
    if allow_none:
        takes.append(f"{NO_ACCELERATOR} x 0")
    return [f"{job}_accelerator_type={accelerator!r} on {name}: it takes {' or '.join(takes)}"]
