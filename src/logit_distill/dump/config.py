"""The dump's settings: one frozen ``DumpConfig`` whose ``check()`` validates every value before any work."""

from __future__ import annotations

import dataclasses
import math

from ..data import ChatOptions
from ..data.conversations import FLAT_FIELDS as CHAT_FLAT
from ..codec import MAX_HYBRID_K
from ..errors import InputError
from ..store import manifest as manifest_mod
from ..store.lease import DEFAULT_TIMEOUT_S as DEFAULT_LEASE_TIMEOUT_S

SELECTIONS = manifest_mod.SELECTIONS  # topk | sampled | hybrid
CODECS = ("default", "exact")
DTYPES = ("float32", "bfloat16")
# The selection of a new store, and each selection's --top-k and --samples when they are not given. The hybrid
# record top-4 + 16 tail draws (36.5 bytes per position) matched top-64 + tail (213) in held-out KL and closed
# 0.97 of the CE-only -> full-KD gap (docs/BENCHMARKS.md, "fidelity"). A sampled store has no head (its top_k is
# its N) and no default N: --samples is required (no measured sampled setting reached the benchmark's goal).
DEFAULT_SELECTION = "hybrid"
DEFAULT_TOP_K = {"topk": 64, "hybrid": 4}
DEFAULT_SAMPLES = {"hybrid": 16}
# The store's settings as the pipeline's components take them (their input names: ``DumpConfig.from_flat``'s
# keywords), the same in plan_dump, preflight and dump_teacher_topk.
COMPONENT_FIELDS = ("teacher", "data", "num_steps", "top_k", "seq_len", "batch_size", "steps_per_file", "codec",
                    "data_seed", "packing", "selection", "samples", "proposal_temperature", "tail_temperatures",
                    "dtype", "text_field", "tokenizer", *CHAT_FLAT)


@dataclasses.dataclass(frozen=True)
class DumpConfig:
    """What to dump and how. The fields up to ``tail_temperatures`` (and the number of processes)
    decide the store's content, hence its fingerprint; the others only how the dump runs.

    ``top_k`` and ``samples`` left None take the selection's defaults when the config is made (``DEFAULT_TOP_K``,
    ``DEFAULT_SAMPLES``; a sampled config's ``top_k`` is its ``samples``), so every reader of a config sees
    concrete numbers and a config given the same values explicitly is the same config. (``dataclasses.replace``
    of ``selection`` alone keeps the resolved numbers of the old one: give ``top_k`` and ``samples`` too.)"""

    teacher: str  # HF checkpoint dir/URI or preset:NAME[@SEED]
    data: str  # JSONL / pre-tokenized ArrayRecord file, glob or directory
    output: str  # store location (local path, file:// or gs://)
    top_k: int | None = None  # None: the selection's default (topk 64, hybrid 4; sampled: its samples)
    seq_len: int = 512
    batch_size: int = 8  # examples per step, across all processes
    num_steps: int | None = None  # default: every full batch of the data
    steps_per_file: int = 50
    codec: str = "default"
    seed: int = 0  # the document order (and a sampled store's draws)
    packing: bool = True
    dtype: str = "float32"
    text_field: str = "text"
    chat: ChatOptions = dataclasses.field(default_factory=ChatOptions)  # conversations: format, template, masks
    tokenizer: str | None = None  # default: the teacher's tokenizer.json
    selection: str = DEFAULT_SELECTION  # topk | sampled | hybrid (top_k's exact head + samples draws from the rest)
    samples: int | None = None  # sampled, hybrid: draws per position (N); None: hybrid 16, sampled: required
    proposal_temperature: float = 1.0  # sampled, hybrid: draws from softmax(logits / t)
    tail_temperatures: tuple = ()  # topk: also store the tail mass of the teacher tempered by each T
    array_record_options: str = manifest_mod.DEFAULT_ARRAY_RECORD_OPTIONS
    # how the dump runs (not part of the store's identity)
    sharding: str = "replicate"  # teacher params: replicate | fsdp | tensor | fsdp+tensor | expert | fsdp+expert
    model_parallel: int | None = None  # devices of the mesh's model axis (tensor and expert modes; default: all)
    attention: str = "auto"  # auto | dense | blocked | pallas_gpu | pallas_tpu (models/attention.py)
    device_batch: int | None = None  # examples per kernel on each device (default: per backend)
    vocab_chunk: int | None = None  # vocabulary entries per chunk of the selection (default 32768)
    max_pending_steps: int = 4
    progress: bool = True
    force_takeover: bool = False  # take over a stale lease (docs/FORMAT.md, "Lease")
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    wait_for_stale_lease: bool = False  # with force_takeover: wait for a lease not yet stale to go stale, once

    def __post_init__(self):
        object.__setattr__(self, "tail_temperatures", tuple(float(T) for T in self.tail_temperatures))
        # the selection's defaults, resolved here only (an unknown selection keeps None: check() names it)
        if self.samples is None:
            object.__setattr__(self, "samples", DEFAULT_SAMPLES.get(self.selection))
        if self.top_k is None:
            object.__setattr__(self, "top_k", self.samples if self.selection == "sampled"
                               else DEFAULT_TOP_K.get(self.selection))

    def check(self) -> "DumpConfig":
        """Every setting on its own and against the others (no file is read); InputError naming the flag."""
        if self.top_k is not None:  # None: no default (a sampled config without samples: named below)
            _require_int("top_k", self.top_k, 1)
        for name in ("seq_len", "batch_size", "steps_per_file", "max_pending_steps"):
            _require_int(name, getattr(self, name), 1)
        for name in ("num_steps", "model_parallel", "device_batch", "vocab_chunk"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), 1)
        _require_int("seed", self.seed, 0)
        _require_choice("codec", self.codec, CODECS)
        _require_choice("dtype", self.dtype, DTYPES)
        _require_choice("selection", self.selection, SELECTIONS)
        if self.selection in ("sampled", "hybrid"):
            if self.samples is None:
                raise InputError(f"--selection {self.selection} needs --samples N (draws per position, "
                                 "1 <= N <= 65535; e.g. 32)")
            if not 1 <= self.samples <= 65535:
                raise InputError(f"--selection {self.selection} needs --samples N with 1 <= N <= 65535, "
                                 f"got {self.samples}")
            if self.tail_temperatures:
                raise InputError(f"--tail-temperatures applies to --selection topk; a {self.selection} store "
                                 + ("has no tail" if self.selection == "sampled" else
                                    "holds its tail mass at --proposal-temperature"))
        elif self.samples is not None:
            raise InputError("--samples applies to --selection sampled or hybrid; give one or drop --samples")
        if self.selection == "hybrid" and self.top_k > MAX_HYBRID_K:
            raise InputError(f"--selection hybrid (the default) keeps a small exact head: --top-k must be <= "
                             f"{MAX_HYBRID_K}, got {self.top_k}; for a larger head alone, --selection topk")
        if not all(math.isfinite(float(T)) and float(T) > 0 for T in (self.proposal_temperature,
                                                                       *self.tail_temperatures)):
            raise InputError(f"temperatures must be finite and > 0: --proposal-temperature {self.proposal_temperature}, "
                             f"--tail-temperatures {list(self.tail_temperatures)}")
        if self.selection == "topk" and self.proposal_temperature != 1.0:
            raise InputError("--proposal-temperature applies to --selection sampled or hybrid")
        if not (math.isfinite(float(self.lease_timeout_s)) and float(self.lease_timeout_s) > 0):
            raise InputError(f"--lease-timeout must be finite and > 0 seconds, got {self.lease_timeout_s}")
        if not self.text_field or not isinstance(self.text_field, str):
            raise InputError(f"--text-field must be a non-empty name, got {self.text_field!r}")
        if not isinstance(self.chat, ChatOptions):
            raise InputError(f"chat must be a ChatOptions, got {type(self.chat).__name__}")
        self.chat.check()
        from ..models.attention import check_attention
        from ..models.sharding import MODEL_AXIS_MODES, check_mode

        check_attention(self.attention)
        check_mode(self.sharding)
        if self.model_parallel not in (None, 1) and self.sharding not in MODEL_AXIS_MODES:
            raise InputError(f"--model-parallel {self.model_parallel} needs --sharding tensor, fsdp+tensor, expert "
                             f"or fsdp+expert, not {self.sharding}")
        _check_array_record_options(self.array_record_options)
        return self

    @classmethod
    def from_flat(cls, *, data_seed: int = 0, top_k: int = 0, samples: int = 0, proposal_temperature: float = 1.0,
                  tail_temperatures: str = "", tokenizer: str = "", model_parallel: int = 0, device_batch: int = 0,
                  vocab_chunk: int = 0, **fields) -> "DumpConfig":
        """The config of settings given flat, every one set (the pipeline's parameters): 0 or "" for "unset"
        (``top_k`` and ``samples`` 0: the selection's default, as the command line's omitted flags),
        ``tail_temperatures`` as comma-separated text, ``samples`` and ``proposal_temperature`` applying to a
        sampled or hybrid selection only, ``data_seed`` for ``seed``, the conversation options as
        ``ChatOptions.from_flat`` takes them."""
        sampled = fields.get("selection", DEFAULT_SELECTION) in ("sampled", "hybrid")
        chat = ChatOptions.from_flat(**{k: fields.pop(k) for k in CHAT_FLAT if k in fields})
        return cls(seed=data_seed, chat=chat, top_k=top_k or None, samples=(samples or None) if sampled else None,
                   proposal_temperature=proposal_temperature if sampled else 1.0,
                   tail_temperatures=tuple(float(x) for x in tail_temperatures.split(",") if x.strip()),
                   tokenizer=tokenizer or None, model_parallel=model_parallel or None,
                   device_batch=device_batch or None, vocab_chunk=vocab_chunk or None, **fields)

    @classmethod
    def from_component(cls, inputs: dict, **settings) -> "DumpConfig":
        """The config of a pipeline component's ``inputs`` (its arguments by name, ``locals()`` on entry): the
        store's settings among them (``COMPONENT_FIELDS``, given flat), with ``settings`` (the output, how the dump
        runs) as ``from_flat`` takes them. plan_dump and preflight plan ``output="", progress=False``."""
        return cls.from_flat(**{name: inputs[name] for name in COMPONENT_FIELDS}, **settings)

    def describe_selection(self) -> str:
        """The selection with its resolved numbers, in words (the dump's first line)."""
        at = f" at proposal temperature {self.proposal_temperature:g}" if self.proposal_temperature != 1.0 else ""
        if self.selection == "hybrid":
            return f"hybrid selection: top-{self.top_k} + tail mass and {self.samples} tail draws per position{at}"
        if self.selection == "sampled":
            return f"sampled selection: {self.samples} draws per position{at}"
        tails = f", tail mass at T = 1 and {', '.join(f'{T:g}' for T in self.tail_temperatures)}" \
            if self.tail_temperatures else " + tail mass"
        return f"topk selection: top-{self.top_k}{tails}"

    @property
    def inputs(self) -> dict:
        """The input paths by flag (outputs must not overlap them)."""
        return {"--teacher": self.teacher, "--data": self.data, "--tokenizer": self.tokenizer,
                "--chat-template": self.chat.chat_template}

    def selection_settings(self) -> dict:
        """The manifest's selection fields."""
        if self.selection in ("sampled", "hybrid"):
            t = float(self.proposal_temperature)
            # a hybrid record holds its tail mass at t too: the training temperature must be t (docs/LOSSES.md)
            tempered = {"tail_temperatures": () if t == 1.0 else (t,)} if self.selection == "hybrid" else {}
            return {"selection": self.selection, "num_samples": self.samples, "proposal_temperature": t,
                    "sample_seed": self.seed, **tempered}
        return {"tail_temperatures": self.tail_temperatures}


def flag(name: str) -> str:
    """The command-line flag of a config field."""
    return {"lease_timeout_s": "--lease-timeout"}.get(name, "--" + name.replace("_", "-"))


def _require_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{flag(name)} must be an integer >= {low}, got {value!r}")


def _require_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise InputError(f"{flag(name)} must be one of {', '.join(choices)}, got {value!r}")


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
