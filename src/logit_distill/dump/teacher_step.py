"""The teacher's step of the dump: forward + selection (+ the NaN/inf check), jitted over a mesh of every
device, data parallel over the batch; and the settings that depend on the machine it runs on."""

from __future__ import annotations

import math

import numpy as np

from ..errors import InputError, NonFiniteError
from .config import DumpConfig

# default examples per kernel per device; other backends: 8
DEVICE_BATCH = {"cpu": 1}
_DEFAULT_DEVICE_BATCH = 8


def dump_mesh(config: DumpConfig):
    """The dump's mesh over every device: ``data``, or (``data``, ``model``) for the tensor and expert modes."""
    import jax

    from ..models.sharding import MODEL_AXIS_MODES, make_mesh

    mp = 1
    if config.sharding in MODEL_AXIS_MODES:
        mp = config.model_parallel or jax.local_device_count()
    return make_mesh(jax.devices(), mp)


def device_batch_for(config: DumpConfig, rows_per_device: int, backend: str) -> int:
    """``--device-batch``, checked, or the backend's default that divides ``rows_per_device``."""
    if config.device_batch is not None:
        if rows_per_device % config.device_batch:
            raise InputError(
                f"--device-batch {config.device_batch} does not divide the {rows_per_device} examples each "
                f"device gets (--batch-size / devices); choose a divisor")
        return config.device_batch
    return math.gcd(DEVICE_BATCH.get(backend, _DEFAULT_DEVICE_BATCH), rows_per_device)


def check_layout(config: DumpConfig, mesh) -> None:
    """The batch splits over the mesh's data axis, and --device-batch divides each device's rows."""
    import jax

    data_devices = mesh.shape["data"]
    if config.batch_size % data_devices:
        raise InputError(f"--batch-size {config.batch_size} is not divisible by the {data_devices} data-parallel "
                         "devices; choose a multiple")
    if config.sharding == "replicate":
        device_batch_for(config, config.batch_size // data_devices, jax.default_backend())


def dump_attention(config: DumpConfig, backend: str) -> str:
    """The attention implementation the dump runs on ``backend``.

    The Pallas kernels run in the replicated mode only, where each device's examples go through
    ``shard_map`` as local arrays; the sharded modes hand the model global arrays split over devices,
    which XLA partitions op by op and a Pallas call does not support, so ``auto`` runs ``blocked``
    (pure JAX) there and an explicit kernel is refused."""
    from ..models.attention import BLOCK, check_attention, resolve_attention

    name = check_attention(config.attention, backend)
    if config.sharding == "replicate":
        return resolve_attention(name, L=config.seq_len, backend=backend)
    if name in ("pallas_gpu", "pallas_tpu"):
        raise InputError(f"--attention {name} runs with --sharding replicate only (each device's examples as "
                         f"local arrays); with --sharding {config.sharding} use --attention auto (blocked there)")
    if name == "auto":
        return "blocked" if config.seq_len > BLOCK else "dense"
    return name


class TeacherStep:
    """One dump step on device: the teacher's forward over a batch and its selection (top-k + tail,
    sampled ids + counts, or both: the hybrid record), with the step's NaN/inf check fused in. ``dispatch`` starts it
    asynchronously; ``nonfinite`` and ``fetch`` wait for it."""

    def __init__(self, teacher, config: DumpConfig, mesh):
        import functools

        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        from ..models import decoder, shard_params
        from ..models.moe import expert_mesh_for
        from ..selection import (NONFINITE_KEY, make_teacher_hybrid, make_teacher_sampled, make_teacher_topk,
                                 with_finite_check)

        self.mesh = mesh
        check_layout(config, mesh)
        self.batch_sharding = NamedSharding(mesh, P("data"))
        self.params = shard_params(teacher.params, mesh, config.sharding)
        replicated = config.sharding == "replicate"
        rows = config.batch_size // mesh.shape["data"]
        self.device_batch = device_batch_for(config, rows, jax.default_backend()) if replicated else rows
        self.attention = dump_attention(config, jax.default_backend())
        # MoE teachers in the sharded modes: their experts' matmuls split over the mesh (models.sharding)
        moe = {} if replicated or getattr(teacher.config, "moe", None) is None else {
            "expert_mesh": expert_mesh_for(mesh, config.sharding)}
        apply = functools.partial(teacher.apply, attention=self.attention, **moe)
        # Replicated teachers run device_batch examples at a time on each device: the same kernel
        # shapes, hence the same bytes, on any number of devices. The sharded modes split the
        # matmuls themselves, so the last bits may differ.
        on_mesh = dict(mesh=mesh if replicated else None, device_batch=self.device_batch)
        if teacher.config is not None:  # the head and selection over vocabulary chunks
            cfg = teacher.config
            on_mesh.update(features=functools.partial(decoder.hidden, cfg, attention=self.attention, **moe),
                           head=functools.partial(decoder.head_logits, cfg), vocab_size=cfg.vocab_size,
                           vocab_chunk=config.vocab_chunk)
        if config.selection == "sampled":
            fn = make_teacher_sampled(apply, config.samples, seed=config.seed,
                                      proposal_temperature=config.proposal_temperature, **on_mesh)
        elif config.selection == "hybrid":
            fn = make_teacher_hybrid(apply, config.top_k, config.samples, seed=config.seed,
                                     proposal_temperature=config.proposal_temperature, **on_mesh)
        else:
            fn = make_teacher_topk(apply, config.top_k, tail_temperatures=config.tail_temperatures, **on_mesh)
        # NaN/inf check of every log-prob, fused into the same jitted step: scalars over the whole batch
        self.fn = with_finite_check(fn)
        self.nonfinite_key = NONFINITE_KEY
        self.examples_per_step = config.batch_size

    def dispatch(self, local_batch: dict, example_index: np.ndarray):
        """Start the step on this process's rows; returns device arrays (asynchronously).
        ``example_index`` (this process's global example indices) keys the draws of a sampled store."""
        import jax

        args = [jax.make_array_from_process_local_data(self.batch_sharding, local_batch[key])
                for key in ("tokens", "positions", "segment_ids")]
        index = jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(example_index, np.int32))
        return self.fn(self.params, *args, index)

    def fetch(self, out: dict) -> dict:
        """This process's rows of the selection, as numpy (waits for the compute)."""
        result = {}
        for key, arr in out.items():
            if key == self.nonfinite_key:
                continue
            shards = sorted(arr.addressable_shards, key=lambda s: s.index[0].start or 0)
            seen, parts = set(), []
            for s in shards:
                start = s.index[0].start or 0
                if start not in seen:
                    seen.add(start)
                    parts.append(np.asarray(s.data))
            result[key] = np.concatenate(parts, axis=0)
        return result

    def refuse_nonfinite(self, step: int, out: dict) -> None:
        """Raise NonFiniteError if any example of the step has a NaN/+inf log-prob or tail (waits for the
        compute).

        The check's scalars are over the whole batch of the step, the same on every process: each raises
        the same error at the same step. Called before the step is handed to the writer: nothing of it is
        written, and the chunk it belongs to is dropped (chunks committed before it are kept).
        """
        bad_examples, row, position = self.nonfinite(out)
        if bad_examples:
            B = self.examples_per_step
            raise NonFiniteError(
                f"the teacher's log-probs are not finite (NaN or inf) at step {step}, example {step * B + row}, "
                f"position {position} ({bad_examples} of {B} examples of the step); nothing of this step was "
                "written; check the teacher's weights for NaN/inf (or use --dtype float32 if bfloat16 overflows)")

    def nonfinite(self, out: dict) -> tuple[int, int, int]:
        """The step's finite check, the same on every process: (examples of the whole batch with a
        NaN/inf log-prob, the first one's row in the batch, its first bad position); -1 for none.
        Waits for the compute."""
        return tuple(int(np.asarray(x.addressable_shards[0].data)) for x in out[self.nonfinite_key])
