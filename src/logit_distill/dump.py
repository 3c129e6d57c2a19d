"""The teacher dump: run the teacher once over the data and keep its top-k (or tokens sampled from
it) in a logit store.

Resume is a scan: on start the committed chunks are listed, and every chunk
range that is missing (gaps included, not just the tail) is computed again;
the data order is a pure function of its inputs, so reaching step N is a
seek, not a replay. A SIGTERM/SIGINT stops taking steps, lets the chunks that
are complete commit, drops the chunk in flight and exits non-zero.

Multi-host (JAX multi-controller): the batch of a step is split over
processes in order (process p owns examples [p*b, (p+1)*b) of each step) and
each process writes its own chunks. Every process lists the same committed
chunks after a barrier, so all agree on which steps run; a process whose
chunk for a range already exists computes along (the forward is SPMD) but
writes nothing.

Every process checks every step's teacher output for NaN/inf (scalars
reduced over the whole batch inside the step): a bad example of any process
stops all of them at that step with the same error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time

import numpy as np

from . import outputs, paths
from . import store as store_mod
from .errors import InputError, NonFiniteError, StoreError
from .flags import positive_float
from .signals import Interrupted, StopOnSignal
from .store import manifest as manifest_mod
from .store.lease import DEFAULT_TIMEOUT_S as DEFAULT_LEASE_TIMEOUT_S, Lease

log = logging.getLogger("logit_distill.dump")


class DumpInterrupted(Interrupted):
    """The dump stopped on a signal; committed chunks are kept and a re-run resumes."""


@dataclasses.dataclass
class DumpConfig:
    teacher: str  # HF checkpoint dir/URI or preset:NAME[@SEED]
    data: str  # JSONL / pre-tokenized ArrayRecord file, glob or directory
    output: str  # store location (local path, file:// or gs://)
    top_k: int = 64
    seq_len: int = 512
    batch_size: int = 8  # examples per step, across all processes
    num_steps: int | None = None  # default: every full batch of the data
    steps_per_file: int = 50
    codec: str = "default"
    seed: int = 0
    packing: bool = True
    dtype: str = "float32"
    text_field: str = "text"
    tokenizer: str | None = None  # default: the teacher's tokenizer.json
    sharding: str = "replicate"  # teacher params: replicate | fsdp | tensor | fsdp+tensor | expert | fsdp+expert
    model_parallel: int | None = None  # devices of the mesh's model axis (tensor and expert modes; default: all)
    attention: str = "auto"  # auto | dense | blocked | pallas_gpu | pallas_tpu (models/attention.py)
    device_batch: int | None = None  # examples per kernel on each device (default: per backend)
    vocab_chunk: int | None = None  # vocabulary entries per chunk of the selection (default 32768)
    array_record_options: str = manifest_mod.DEFAULT_ARRAY_RECORD_OPTIONS
    max_pending_steps: int = 4
    progress: bool = True
    selection: str = "topk"  # topk | sampled
    samples: int | None = None  # sampled: draws per position (N)
    proposal_temperature: float = 1.0  # sampled: draws from softmax(logits / t)
    tail_temperatures: tuple = ()  # topk: also store the tail mass of the teacher tempered by each T
    force_takeover: bool = False  # take over a stale lease (docs/FORMAT.md, "Lease")
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    wait_for_stale_lease: bool = False  # with force_takeover: wait for a lease not yet stale to go stale, once


@dataclasses.dataclass
class DumpResult:
    store: str
    fingerprint: str
    dump_key: str
    num_steps: int
    resumed_from_step: int
    steps_run: int
    chunks_present_at_start: int
    chunks_written: int
    chunks_expected: int
    examples: int
    tokens: int
    store_bytes: int
    bytes_per_entry: float
    tokens_per_s: float
    elapsed_s: float
    complete: bool
    bytes_per_position: float = 0.0  # store bytes / (examples x seq_len)
    time_to_first_step_s: float | None = None  # from the call to the first new step handed to the writer

    def summary(self) -> str:
        return (
            f"store {self.store}: {self.examples} examples, {self.tokens} tokens, "
            f"{self.chunks_expected} chunks ({self.chunks_written} written now, resumed at step "
            f"{self.resumed_from_step}), {self.store_bytes / 1e6:.1f} MB, "
            f"{self.bytes_per_entry:.3f} bytes/entry, {self.tokens_per_s:.0f} tokens/s"
        )


# ----------------------------------------------------------------- set-up


def _process_info() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _check_settings(config: DumpConfig) -> None:
    for name in ("top_k", "seq_len", "batch_size", "steps_per_file"):
        if getattr(config, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
    if config.num_steps is not None and config.num_steps < 1:
        raise InputError(f"--num-steps must be >= 1, got {config.num_steps}")
    if config.codec not in ("exact", "default"):
        raise InputError(f"--codec must be exact or default, got {config.codec!r}")
    if config.dtype not in ("float32", "bfloat16"):
        raise InputError(f"--dtype must be float32 or bfloat16, got {config.dtype!r}")
    if config.selection not in ("topk", "sampled"):
        raise InputError(f"--selection must be topk or sampled, got {config.selection!r}")
    if config.selection == "sampled":
        if config.samples is None or config.samples < 1 or config.samples > 65535:
            raise InputError(f"--selection sampled needs --samples N with 1 <= N <= 65535, got {config.samples}")
        if config.tail_temperatures:
            raise InputError("--tail-temperatures applies to --selection topk; a sampled store has no tail")
    elif config.samples is not None:
        raise InputError("--samples applies to --selection sampled; give --selection sampled or drop --samples")
    if not all(math.isfinite(float(T)) and float(T) > 0
               for T in (config.proposal_temperature, *config.tail_temperatures)):
        raise InputError(f"temperatures must be finite and > 0: --proposal-temperature {config.proposal_temperature}, "
                         f"--tail-temperatures {list(config.tail_temperatures)}")
    if config.selection == "topk" and config.proposal_temperature != 1.0:
        raise InputError("--proposal-temperature applies to --selection sampled")
    if not (math.isfinite(float(config.lease_timeout_s)) and float(config.lease_timeout_s) > 0):
        raise InputError(f"--lease-timeout must be finite and > 0 seconds, got {config.lease_timeout_s}")
    for name in ("model_parallel", "device_batch", "vocab_chunk"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    from .models.attention import check_attention
    from .models.sharding import MODEL_AXIS_MODES, check_mode

    check_attention(config.attention)
    check_mode(config.sharding)
    if config.model_parallel not in (None, 1) and config.sharding not in MODEL_AXIS_MODES:
        raise InputError(f"--model-parallel {config.model_parallel} needs --sharding tensor, fsdp+tensor, expert "
                         f"or fsdp+expert, not {config.sharding}")
    _check_array_record_options(config.array_record_options)


def _check_array_record_options(options: str) -> None:
    """Open a writer with ``options`` on a scratch file: a typo fails here, before anything is created."""
    import os
    import tempfile

    from array_record.python.array_record_module import ArrayRecordWriter

    with tempfile.TemporaryDirectory(prefix="logit-distill-options-") as scratch:
        try:
            ArrayRecordWriter(os.path.join(scratch, "probe.array_record"), options).close()
        except (ValueError, RuntimeError) as e:
            raise InputError(f"--array-record-options {options!r}: {e}; "
                             "e.g. 'group_size:1,uncompressed' or 'group_size:1,zstd:3'") from None


def plan_manifest(config: DumpConfig, num_processes: int = 1) -> dict:
    """The manifest (hence fingerprint and dump key) of ``config``, without loading the teacher's
    weights or tokenizing the data. Needs ``config.num_steps``.

    The pipeline names the store ``<output_root>/teacher_topk/<dump_key>/`` from this
    before the dump starts; ``run_dump`` writes exactly this manifest.
    """
    from .data import plan_identity
    from .models import describe_model

    _check_settings(config)
    if config.num_steps is None:
        raise InputError("planning a store needs --num-steps")
    if config.batch_size % num_processes:
        raise InputError(f"--batch-size {config.batch_size} is not divisible by the {num_processes} processes")
    hf_config, teacher_identity, teacher_tokenizer = describe_model(config.teacher)
    vocab_size = int(hf_config["vocab_size"])
    max_len = int(hf_config.get("max_position_embeddings") or 0)
    if max_len and config.seq_len > max_len:
        raise InputError(
            f"--seq-len {config.seq_len} exceeds the teacher's maximum of {max_len} "
            f"positions (max_position_embeddings in {config.teacher})"
        )
    if config.selection == "topk" and config.top_k > vocab_size:
        raise InputError(f"--top-k {config.top_k} exceeds the teacher's vocabulary of {vocab_size}")
    data_identity = plan_identity(
        config.data, config.tokenizer or teacher_tokenizer, seq_len=config.seq_len,
        packing=config.packing, seed=config.seed, text_field=config.text_field,
    )
    manifest = store_mod.build_manifest(
        seq_len=config.seq_len, top_k=config.top_k, vocab_size=vocab_size, codec=config.codec,
        num_steps=config.num_steps, examples_per_step=config.batch_size,
        steps_per_file=config.steps_per_file, num_processes=num_processes,
        array_record_options=config.array_record_options,
        content={
            "teacher": teacher_identity,
            "teacher_dtype": config.dtype,
            "data": data_identity,
            "selection": _SELECTION_TEXT[config.selection],
        },
        **_selection_settings(config),
    )
    manifest["info"]["teacher_spec"] = config.teacher
    manifest["info"]["data_spec"] = config.data
    return manifest


_SELECTION_TEXT = {
    "topk": "float32 log-softmax; jax.lax.top_k; tail = logsumexp outside the top-k",
    "sampled": "float32 log-softmax; N inverse-CDF draws per position from softmax(logits / t), keys "
               "fold_in(fold_in(key(sample_seed), example_index), position); distinct ids ascending + counts",
}


def _selection_settings(config: DumpConfig) -> dict:
    if config.selection == "sampled":
        return {"selection": "sampled", "num_samples": config.samples,
                "proposal_temperature": config.proposal_temperature, "sample_seed": config.seed}
    return {"tail_temperatures": tuple(config.tail_temperatures)}


def prepare(config: DumpConfig):
    """Load the teacher and the data, check them against each other, build the manifest.

    Returns (teacher, source, manifest). Raises InputError on bad input before
    anything is written.
    """
    from .data import ExampleSource, settings_identity
    from .models import load_model

    _check_settings(config)
    process, num_processes = _process_info()
    if config.batch_size % num_processes:
        raise InputError(f"--batch-size {config.batch_size} is not divisible by the {num_processes} processes")
    mesh = dump_mesh(config)
    _check_layout(config, mesh)
    teacher = load_model(config.teacher, dtype=config.dtype, mesh=mesh, shard_mode=config.sharding)
    if config.seq_len > teacher.max_seq_len:
        raise InputError(
            f"--seq-len {config.seq_len} exceeds the teacher's maximum of {teacher.max_seq_len} "
            f"positions (max_position_embeddings in {config.teacher})"
        )
    source = ExampleSource.open(
        config.data, config.tokenizer or teacher.tokenizer_path, seq_len=config.seq_len,
        packing=config.packing, seed=config.seed, text_field=config.text_field,
    )
    source.check_vocab(teacher.vocab_size)
    available = len(source) // config.batch_size
    if available < 1:
        raise InputError(
            f"{config.data} gives {len(source)} examples of {config.seq_len} tokens: fewer than one "
            f"batch of {config.batch_size}; lower --batch-size or --seq-len, or add data"
        )
    num_steps = config.num_steps if config.num_steps is not None else available
    if num_steps > available:
        raise InputError(
            f"--num-steps {num_steps}: the data gives {len(source)} examples, enough for 1..{available} "
            f"steps of {config.batch_size}"
        )
    manifest = plan_manifest(dataclasses.replace(config, num_steps=num_steps), num_processes)
    # The plan and what was loaded must describe the same teacher and data.
    assert manifest["content"]["teacher"] == teacher.identity, "teacher identity changed while loading"
    assert manifest["content"]["data"] == settings_identity(source.identity), "data identity mismatch"
    return teacher, source, manifest


def _remove_leftovers(uri: str, scan) -> None:
    for name in scan.leftovers:
        if name.startswith(paths.TMP_PREFIX):
            paths.remove(paths.join(uri, name))
            log.info("removed leftover %s", name)
        else:
            log.warning("%s: %s is no part of the store; left in place", uri, name)
    for chunk in scan.foreign:
        log.warning("%s: chunk %s belongs to another store or range; left in place", uri, chunk.name)
    if scan.duplicates:
        names = ", ".join(c.name for c in scan.duplicates[0])
        raise StoreError(f"{uri}: several committed chunks for one step range ({names}); "
                         "run `logit-distill verify` and delete the wrong one")


# ----------------------------------------------------------------- compute


DEVICE_BATCH = {"cpu": 1}  # default examples per kernel per device; other backends: 8
_DEFAULT_DEVICE_BATCH = 8


def dump_mesh(config: DumpConfig):
    """The dump's mesh over every device: ``data``, or (``data``, ``model``) for the tensor modes."""
    import jax

    from .models.sharding import MODEL_AXIS_MODES, make_mesh

    mp = 1
    if config.sharding in MODEL_AXIS_MODES:
        mp = config.model_parallel or jax.local_device_count()
    return make_mesh(jax.devices(), mp)


def device_batch_for(config: DumpConfig, rows_per_device: int, backend: str) -> int:
    """``--device-batch``, checked, or the backend's default that divides ``rows_per_device``."""
    import math

    if config.device_batch is not None:
        if rows_per_device % config.device_batch:
            raise InputError(
                f"--device-batch {config.device_batch} does not divide the {rows_per_device} examples each "
                f"device gets (--batch-size / devices); choose a divisor")
        return config.device_batch
    return math.gcd(DEVICE_BATCH.get(backend, _DEFAULT_DEVICE_BATCH), rows_per_device)


def _check_layout(config: DumpConfig, mesh) -> None:
    """The batch splits over the mesh's data axis, and --device-batch divides each device's rows."""
    import jax

    data_devices = mesh.shape["data"]
    if config.batch_size % data_devices:
        raise InputError(
            f"--batch-size {config.batch_size} is not divisible by the {data_devices} data-parallel "
            "devices; choose a multiple"
        )
    if config.sharding == "replicate":
        device_batch_for(config, config.batch_size // data_devices, jax.default_backend())


class _Compute:
    """The jitted teacher selection over a mesh of every device, data parallel over the batch."""

    def __init__(self, teacher, config: DumpConfig):
        import functools

        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        from .models import decoder, shard_params
        from .models.sharding import expert_mesh_for
        from .topk import NONFINITE_KEY, make_teacher_sampled, make_teacher_topk, with_finite_check

        self.mesh = dump_mesh(config)
        _check_layout(config, self.mesh)
        data_devices = self.mesh.shape["data"]
        self.batch_sharding = NamedSharding(self.mesh, P("data"))
        self.params = shard_params(teacher.params, self.mesh, config.sharding)
        replicated = config.sharding == "replicate"
        rows = config.batch_size // data_devices
        self.device_batch = device_batch_for(config, rows, jax.default_backend()) if replicated else rows
        self.attention = dump_attention(config, jax.default_backend())
        # MoE teachers in the sharded modes: their experts' matmuls split over the mesh (models.sharding)
        moe = {} if replicated or getattr(teacher.config, "moe", None) is None else {
            "expert_mesh": expert_mesh_for(self.mesh, config.sharding)}
        apply = functools.partial(teacher.apply, attention=self.attention, **moe)
        # Replicated teachers run device_batch examples at a time on each device: the same kernel
        # shapes, hence the same bytes, on any number of devices. The sharded modes split the
        # matmuls themselves, so the last bits may differ.
        mesh = self.mesh if replicated else None
        self.sampled = config.selection == "sampled"
        split = {}
        if teacher.config is not None:  # the head and selection over vocabulary chunks
            cfg = teacher.config
            split = dict(features=functools.partial(decoder.hidden, cfg, attention=self.attention, **moe),
                         head=functools.partial(decoder.head_logits, cfg), vocab_size=cfg.vocab_size,
                         vocab_chunk=config.vocab_chunk)
        if self.sampled:
            self.fn = make_teacher_sampled(apply, config.samples, seed=config.seed,
                                           proposal_temperature=config.proposal_temperature, mesh=mesh,
                                           device_batch=self.device_batch, **split)
        else:
            self.fn = make_teacher_topk(apply, config.top_k, mesh=mesh, tail_temperatures=config.tail_temperatures,
                                        device_batch=self.device_batch, **split)
        # NaN/inf check of every log-prob, fused into the same jitted step: scalars over the whole batch
        self.fn = with_finite_check(self.fn)
        self.nonfinite_key = NONFINITE_KEY
        self.num_processes = jax.process_count()

    def dispatch(self, local_batch: dict, example_index: np.ndarray):
        """Start the forward on this process's rows; returns device arrays (asynchronously).

        ``example_index`` (this process's global example indices) keys the draws of a sampled store.
        """
        import jax

        args = [
            jax.make_array_from_process_local_data(self.batch_sharding, local_batch[key])
            for key in ("tokens", "positions", "segment_ids")
        ]
        if self.sampled:
            args.append(jax.make_array_from_process_local_data(
                self.batch_sharding, np.asarray(example_index, np.int32)))
        return self.fn(self.params, *args)

    def fetch(self, out: dict) -> dict:
        """This process's rows of the outputs (all but the finite check), as numpy (waits for the compute)."""
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

    def nonfinite(self, out: dict) -> tuple[int, int, int]:
        """The step's finite check, the same on every process: (examples of the whole batch with a
        NaN/inf log-prob, the first one's row in the batch, its first bad position); -1 for none.
        Waits for the compute."""
        return tuple(int(_replicated(x)) for x in out[self.nonfinite_key])


def _replicated(arr) -> np.ndarray:
    """A replicated output (every device holds all of it) as numpy, from this process's first device."""
    return np.asarray(arr.addressable_shards[0].data)


# ----------------------------------------------------------------- the dump


def steps_to_run(manifest: dict, scan) -> list[int]:
    """The steps some process still lacks, in order: every missing chunk range, gaps included."""
    steps = set()
    for ranges in scan.missing.values():
        for start, end in ranges:
            steps.update(range(start, end))
    return sorted(steps)


def dump_attention(config: DumpConfig, backend: str) -> str:
    """The attention implementation the dump runs on ``backend``.

    The Pallas kernels run in the replicated mode only, where each device's examples go through
    ``shard_map`` as local arrays; the sharded modes hand the model global arrays split over devices,
    which XLA partitions op by op and a Pallas call does not support, so ``auto`` runs ``blocked``
    (pure JAX) there and an explicit kernel is refused."""
    from .models.attention import BLOCK, check_attention, resolve_attention

    name = check_attention(config.attention, backend)
    if config.sharding == "replicate":
        return resolve_attention(name, L=config.seq_len, backend=backend)
    if name in ("pallas_gpu", "pallas_tpu"):
        raise InputError(f"--attention {name} runs with --sharding replicate only (each device's examples as "
                         f"local arrays); with --sharding {config.sharding} use --attention auto (blocked there)")
    if name == "auto":
        return "blocked" if config.seq_len > BLOCK else "dense"
    return name


def _check_backend(config: DumpConfig) -> None:
    """Settings that depend on the machine the dump runs on (the plan, on a CPU, does not check these)."""
    import jax

    dump_attention(config, jax.default_backend())


def run_dump(config: DumpConfig) -> DumpResult:
    """Dump the teacher's top-k for ``config`` into ``config.output``; resume if it exists."""
    t_start = time.perf_counter()
    outputs.require_nonblank(config.output, "--output")
    _check_settings(config)
    _check_backend(config)
    inputs = {"--teacher": config.teacher, "--data": config.data, "--tokenizer": config.tokenizer}
    paths.check_inputs_reachable(inputs)  # gs://: one line within seconds, not a minute of retries
    outputs.check_output(config.output, "--output", kind="dir", own_store=True, inputs=inputs)
    done = _already_complete(config, t_start)
    if done is not None:  # a scan of names found every chunk: no teacher is loaded, nothing is written
        return done
    lease = None
    process, _ = _process_info()
    if process == 0:  # process 0 holds the store's lease for every process of the job (the others never look)
        lease = Lease(config.output, timeout_s=config.lease_timeout_s, force_takeover=config.force_takeover,
                      wait_for_stale=config.wait_for_stale_lease)
        lease.acquire()  # before the teacher loads: a second dump refuses at once, not after minutes of loading
    had_manifest = lease is None or paths.exists(paths.join(config.output, manifest_mod.MANIFEST_NAME))
    try:
        teacher, source, manifest = prepare(config)
        return _run_dump_leased(config, teacher, source, manifest, lease, t_start)
    except BaseException:
        if not had_manifest:
            _forget_unused_manifest(config.output)
        raise
    finally:
        if lease is not None:
            lease.release()


def _forget_unused_manifest(uri: str) -> None:
    """A run that created the manifest and failed before its first chunk removes the manifest (and the
    tokenizer copy) again,
    so that a corrected command is not refused as "another configuration". (It holds the lease.)"""
    try:
        names = [f["name"] for f in paths.list_files(uri, with_sizes=False)]
        if manifest_mod.MANIFEST_NAME in names and not any(n.startswith("chunk-") for n in names):
            if manifest_mod.TOKENIZER_NAME in names:  # first: a manifest alone is still a store
                paths.remove(paths.join(uri, manifest_mod.TOKENIZER_NAME))
            paths.remove(paths.join(uri, manifest_mod.MANIFEST_NAME))
    except Exception as e:  # noqa: BLE001 - the original failure is the one to report
        log.warning("%s: could not remove the unused manifest: %s", uri, e)


def _run_dump_leased(config: DumpConfig, teacher, source, manifest, lease, t_start) -> DumpResult:
    process, num_processes = _process_info()
    uri = config.output
    if process == 0:
        store_mod.init_store(uri, manifest)
    _barrier("logit-distill-dump-init")
    if process != 0:
        store_mod.init_store(uri, manifest)  # checks the manifest process 0 wrote or found
    scan = store_mod.scan(uri, manifest)
    if process == 0:
        _remove_leftovers(uri, scan)
        if source.tokenizer is not None:  # the store keeps its tokenizer: students are checked against it
            store_mod.put_tokenizer(uri, manifest, source.tokenizer.path)
    _barrier("logit-distill-dump-scan")

    layout = manifest["layout"]
    B, num_steps = layout["examples_per_step"], layout["num_steps"]
    b = B // num_processes
    todo = steps_to_run(manifest, scan)
    mine = {s for start, end in scan.missing[process] for s in range(start, end)}
    resumed_from = todo[0] if todo else num_steps
    present = scan.num_present
    if todo:
        msg = (f"resuming at step {resumed_from} ({present} of {scan.num_expected} chunks present)"
               if present else f"starting at step 0 ({scan.num_expected} chunks to write)")
    else:
        msg = f"nothing to do: all {scan.num_expected} chunks present"
    log.info("%s: %s", uri, msg)
    if process == 0:
        print(f"logit-distill dump: {uri}: {msg}", file=sys.stderr, flush=True)

    committed = []
    steps_run = 0
    first_step_at = None
    t_compute = time.perf_counter()
    if todo:
        compute = _Compute(teacher, config)
        writer = store_mod.BackgroundWriter(
            uri, manifest, process, max_pending_steps=config.max_pending_steps,
            on_commit=lambda info: log.info("committed %s", info.name),
        )
        bar = _progress(config, len(todo), num_steps, process)
        pending = None

        def finish(item):
            nonlocal first_step_at
            step, local, out = item
            # Every process checks every step (its own and the others'): all stop at the same step.
            _refuse_nonfinite(step, *compute.nonfinite(out), B)
            if step in mine:
                records = compute.fetch(out)
                records.update(local)
                records["example_index"] = np.arange(step * B + process * b, step * B + (process + 1) * b)
                writer.submit(step, records)
                if first_step_at is None:
                    first_step_at = time.perf_counter()

        try:
            with StopOnSignal() as stop:
                for step in todo:
                    if stop.event.is_set():
                        break
                    if lease is not None:
                        lease.check()  # taken over after going stale: write nothing more
                    first = step * B + process * b
                    local = source.batch(range(first, first + b))
                    out = compute.dispatch(local, np.arange(first, first + b))  # asynchronous: overlaps with the previous step's host work
                    if pending is not None:
                        finish(pending)
                        steps_run += 1
                        bar.update(config.batch_size * config.seq_len)
                    pending = (step, local, out)
                if pending is not None and not stop.event.is_set():
                    finish(pending)
                    steps_run += 1
                    bar.update(config.batch_size * config.seq_len)
                if stop.event.is_set():
                    writer.abort()
                    committed = writer.committed
                    raise DumpInterrupted(
                        f"stopped by signal {stop.signum} after {steps_run} steps; "
                        f"{len(committed)} chunks committed in this run; re-run the same command to resume"
                    )
            committed = writer.close()
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
    elapsed_compute = time.perf_counter() - t_compute

    _barrier("logit-distill-dump-done")
    result = _result(uri, manifest, present, len(committed), steps_run, resumed_from, elapsed_compute, t_start,
                     first_step_at)
    if process == 0:
        print(f"logit-distill dump: {result.summary()}", file=sys.stderr, flush=True)
    return result


def _already_complete(config: DumpConfig, t_start: float) -> DumpResult | None:
    """The result of a dump with nothing to do, when the store already holds every chunk of the
    planned manifest; None otherwise (and when the number of steps is left to the data)."""
    from .store.status import may_be_complete, store_status

    if config.num_steps is None:
        return None
    process, num_processes = _process_info()
    manifest = plan_manifest(config, num_processes)
    if not may_be_complete(config.output, manifest):
        return None
    status = store_status(config.output, manifest)
    if not status.complete:
        return None
    if process == 0:
        print(f"logit-distill dump: {config.output}: nothing to do: all {status.expected} chunks present "
              "(the teacher was not loaded)", file=sys.stderr, flush=True)
    return _result(config.output, manifest, status.present, 0, 0, manifest["layout"]["num_steps"], 0.0, t_start,
                   None)


def _result(uri: str, manifest: dict, present: int, chunks_written: int, steps_run: int, resumed_from: int,
            elapsed_compute: float, t_start: float, first_step_at: float | None) -> DumpResult:
    """What a dump did, with the store as a final scan finds it."""
    _, num_processes = _process_info()
    layout = manifest["layout"]
    B, num_steps = layout["examples_per_step"], layout["num_steps"]
    b = B // num_processes
    final = store_mod.scan(uri, manifest)
    files = {f["name"]: f["size"] for f in paths.list_files(uri)}
    store_bytes = sum(files.get(c.name, 0) for c in final.chunks.values())
    examples = sum((c.end - c.start) * b for c in final.chunks.values())
    positions = examples * manifest["shapes"]["seq_len"]
    tokens_run = steps_run * B * manifest["shapes"]["seq_len"]
    result = DumpResult(
        store=uri,
        fingerprint=manifest["fingerprint"],
        dump_key=manifest_mod.dump_key(manifest),
        num_steps=num_steps,
        resumed_from_step=resumed_from,
        steps_run=steps_run,
        chunks_present_at_start=present,
        chunks_written=chunks_written,
        chunks_expected=final.num_expected,
        examples=examples,
        tokens=positions,
        store_bytes=store_bytes,
        bytes_per_entry=store_bytes / max(1, positions * manifest["shapes"]["top_k"]),
        bytes_per_position=store_bytes / max(1, positions),
        tokens_per_s=tokens_run / elapsed_compute if steps_run else 0.0,
        elapsed_s=time.perf_counter() - t_start,
        complete=final.complete,
        time_to_first_step_s=None if first_step_at is None else first_step_at - t_start,
    )
    return result


def _refuse_nonfinite(step: int, bad_examples: int, row: int, position: int, examples_per_step: int) -> None:
    """Raise NonFiniteError if any example of the step has a NaN/+inf log-prob or tail.

    The arguments after ``step`` are the on-device check's scalars over the whole batch of the
    step (``_Compute.nonfinite``), the same on every process: each raises the same error at the
    same step. Called before the step is handed to the writer: nothing of it is written, and the
    chunk it belongs to is dropped (chunks committed before it are kept).
    """
    if bad_examples:
        raise NonFiniteError(
            f"the teacher's log-probs are not finite (NaN or inf) at step {step}, example "
            f"{step * examples_per_step + row}, position {position} ({bad_examples} of {examples_per_step} "
            "examples of the step); nothing of this step was written; check the teacher's weights for NaN/inf "
            "(or use --dtype float32 if bfloat16 overflows)"
        )


def _progress(config: DumpConfig, total: int, num_steps: int, process: int):
    from tqdm import tqdm

    # Counted in tokens, so the rate reads as tokens/s; one update per step.
    tokens_per_step = config.batch_size * config.seq_len
    return tqdm(
        total=total * tokens_per_step, unit="tok", unit_scale=True, desc="dump",
        disable=not config.progress or process != 0, file=sys.stderr, dynamic_ncols=True,
        postfix=f"{total} of {num_steps} steps to run, {tokens_per_step} tokens/step",
    )


# ----------------------------------------------------------------- CLI


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "dump", help="run a teacher over the data and store its top-k log-probs (resumable)",
        description="Run the teacher once over the data; store each position's top-k log-probs, ids "
                    "and tail mass in a chunked logit store. Re-running the same command resumes.",
    )
    p.add_argument("--teacher", required=True,
                   help="HF checkpoint directory or gs:// URI (config.json, *.safetensors, tokenizer.json), "
                        "or preset:NAME[@SEED] for a tiny random teacher")
    p.add_argument("--data", required=True,
                   help="JSONL file, glob or directory (text per line) or pre-tokenized *.array_record files")
    p.add_argument("--output", required=True, help="store location: local path, file:// or gs:// URI")
    p.add_argument("--top-k", type=int, default=64, help="log-probs kept per position (default 64)")
    p.add_argument("--selection", choices=["topk", "sampled"], default="topk",
                   help="topk: the k most likely ids + tail mass (default); sampled: --samples N draws per "
                        "position from the teacher, stored as distinct ids + counts + log-probs (unbiased)")
    p.add_argument("--samples", type=int, default=None,
                   help="--selection sampled: draws per position, with replacement (e.g. 32)")
    p.add_argument("--proposal-temperature", type=positive_float, default=1.0,
                   help="--selection sampled: draw from softmax(logits / t) (default 1: the teacher itself)")
    p.add_argument("--tail-temperatures", type=_temperatures, default=(),
                   help="--selection topk: comma-separated temperatures T1,T2 at which the tail mass of the "
                        "tempered teacher is also stored, for topk_tail_kl at T != 1 (e.g. 2,4)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per example (default 512)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="examples per step across all processes (default 8)")
    p.add_argument("--num-steps", type=int, default=None,
                   help="steps to dump (default: every full batch of the data)")
    p.add_argument("--steps-per-file", type=int, default=50,
                   help="steps per chunk file: the most work a kill can lose (default 50)")
    p.add_argument("--codec", choices=["default", "exact"], default="default",
                   help="default: bit-packed ids + 16-bit log-probs (error <= 4.9e-4); exact: float32 + int32")
    p.add_argument("--seed", type=int, default=0, help="seed of the document order (default 0)")
    p.add_argument("--no-packing", dest="packing", action="store_false",
                   help="one document per example, padded, instead of packing documents to --seq-len")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="teacher weights and compute dtype (selection is always float32)")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text (default text)")
    p.add_argument("--tokenizer", default=None,
                   help="directory or file of tokenizer.json (default: the teacher's)")
    p.add_argument("--sharding", choices=["replicate", "fsdp", "tensor", "fsdp+tensor", "expert", "fsdp+expert"],
                   default="replicate",
                   help="teacher parameters: replicated on every device; fsdp (split over the data axis); "
                        "tensor (heads and MLP columns split over a model axis, a mixture's experts too); "
                        "fsdp+tensor (both); expert (a mixture's experts split over the model axis, the rest "
                        "replicated); fsdp+expert (experts over the model axis, the rest fsdp)")
    p.add_argument("--model-parallel", type=int, default=None,
                   help="devices of the model axis with --sharding tensor/fsdp+tensor/expert/fsdp+expert "
                        "(default: all the devices of one host); the rest of the devices split the batch")
    p.add_argument("--attention", choices=["auto", "dense", "blocked", "pallas_gpu", "pallas_tpu"], default="auto",
                   help="attention implementation (default auto: the Pallas flash kernel on GPU, splash "
                        "attention on TPU (both with --sharding replicate), blocked for sequences over 256 "
                        "tokens, dense otherwise); all agree to float rounding")
    p.add_argument("--device-batch", type=int, default=None,
                   help="examples per kernel on each device with --sharding replicate (default: 1 on CPU, "
                        "8 on accelerators, lowered to divide the device's rows); fix it for identical "
                        "bytes across device counts")
    p.add_argument("--vocab-chunk", type=int, default=None,
                   help="vocabulary entries per chunk of the output head and selection (default 32768): "
                        "memory of one chunk instead of the whole vocabulary")
    p.add_argument("--array-record-options", default=manifest_mod.DEFAULT_ARRAY_RECORD_OPTIONS,
                   help="ArrayRecord writer options, e.g. 'group_size:1,zstd:3' (default uncompressed)")
    p.add_argument("--force-takeover", action="store_true",
                   help="take over the store's lease when it is stale (its dump stopped refreshing it for "
                        "longer than its timeout, e.g. on a machine that is gone)")
    p.add_argument("--lease-timeout", dest="lease_timeout_s", type=positive_float, default=DEFAULT_LEASE_TIMEOUT_S,
                   help="seconds without a refresh after which this dump's lease counts as stale; it is "
                        f"refreshed every quarter of it (default {DEFAULT_LEASE_TIMEOUT_S:.0f})")
    p.add_argument("--quiet", dest="progress", action="store_false",
                   help="no progress bar (the resume line and the summary are still printed)")
    p.set_defaults(func=_cli_main)


def _temperatures(text: str) -> tuple:
    import argparse

    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be finite and > 0, got {text!r}")
    return values


def _cli_main(args) -> int:
    config = DumpConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DumpConfig)
                           if hasattr(args, f.name)})
    result = run_dump(config)
    return 0 if result.complete else 1

