"""Joining a multi-host JAX job from the environment the platform sets."""

from __future__ import annotations

import json
import os

# Port of the JAX coordinator on the first host of a Vertex custom job (LOGIT_DISTILL_COORDINATOR_PORT
# overrides it, e.g. for several jobs on one machine).
COORDINATOR_PORT = 8476
PORT_ENV = "LOGIT_DISTILL_COORDINATOR_PORT"


def vertex_cluster(cluster_spec: str | None) -> tuple[str, int, int] | None:
    """(coordinator address, number of processes, this process's index) from a Vertex
    ``CLUSTER_SPEC`` (worker pool 0 is the chief, pool 1 the other replicas), or None
    for a single host."""
    spec = json.loads(cluster_spec or "{}")
    cluster = spec.get("cluster") or {}
    hosts = list(cluster.get("workerpool0", [])) + list(cluster.get("workerpool1", []))
    if len(hosts) < 2:
        return None
    task = spec.get("task") or {}
    index = int(task.get("index", 0)) + (1 if task.get("type") == "workerpool1" else 0)
    from . import environment

    port = environment.get(PORT_ENV, COORDINATOR_PORT)
    return f"{hosts[0].rsplit(':', 1)[0]}:{port}", len(hosts), index


def init_from_environment() -> None:
    """Call ``jax.distributed.initialize`` when this process is one of several hosts:
    a Vertex GPU custom job (``CLUSTER_SPEC``) or a TPU slice (found by JAX itself).
    A single host does nothing."""
    import jax

    cluster = vertex_cluster(os.environ.get("CLUSTER_SPEC"))
    if cluster is not None:
        coordinator, num_processes, process_id = cluster
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    elif os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") >= 1:
        jax.distributed.initialize()


def tpu_hosts(topology: str, machine_type: str = "") -> int:
    """Hosts of a TPU slice: its chips (the product of the topology's dimensions, e.g. ``4x4`` = 16)
    over the chips per host (the machine type's ``-<N>t`` suffix, e.g. ``ct5lp-hightpu-4t``; 4 otherwise,
    as on v4 and v5p hosts). Empty topology: one host."""
    import math
    import re

    from .errors import InputError

    if not topology:
        return 1
    if not re.fullmatch(r"\d+(x\d+){1,2}", topology):
        raise InputError(f"tpu_topology {topology!r} is not of the form AxB or AxBxC (e.g. 4x4, 2x2x2)")
    chips = math.prod(int(d) for d in topology.split("x"))
    m = re.search(r"-(\d+)t$", machine_type or "")
    per_host = int(m.group(1)) if m else 4
    return max(1, chips // per_host)


def planned_processes(replicas: int, tpu_topology: str = "", machine_type: str = "") -> int:
    """JAX processes a custom job will run: its replicas times the hosts of each replica's TPU slice.
    The dump checks its key against ``jax.process_count()``, so the two agree when this is right."""
    return int(replicas) * tpu_hosts(tpu_topology, machine_type)


def process_info() -> tuple[int, int]:
    """(this process's index, the number of processes) of the JAX job."""
    import jax

    return jax.process_index(), jax.process_count()


def barrier(name: str) -> None:
    """Wait until every process of a multi-host job reaches the barrier ``name`` (no-op alone)."""
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
