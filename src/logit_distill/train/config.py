"""Training's settings: one frozen ``TrainConfig`` whose ``check()`` validates every value before any work.

Offline (``store``) or online (``teacher``, ``data``, ``top_k`` or ``samples``, ``seq_len``: the
teacher runs in the loop). ``batch_size`` examples per micro-step (global, over all devices and
processes); an optimizer step takes ``grad_accum`` micro-steps, so ``num_steps`` optimizer steps
read ``num_steps * grad_accum * batch_size`` examples. docs/TRAIN.md describes every field.
"""

from __future__ import annotations

import dataclasses
import math

from ..data import ChatOptions
from ..errors import InputError
from ..store.lease import DEFAULT_TIMEOUT_S as DEFAULT_LEASE_TIMEOUT_S
from .losses import KINDS, representation
from .schedules import ALPHA_KINDS

SHARDING_MODES = ("replicate", "fsdp")
LOG_LINES = 20  # the default --log-every gives about this many log lines (and metric rows) per run


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    student: str  # HF checkpoint, preset:NAME[@SEED] or flax:MODULE:FACTORY[?k=v&...]
    output: str
    num_steps: int  # optimizer steps
    batch_size: int  # examples per micro-step, over all devices and processes
    # the data: a store (offline), or a teacher run in the loop (online)
    store: str | None = None
    teacher: str | None = None
    data: str | None = None
    top_k: int | None = None
    seq_len: int | None = None
    samples: int | None = None  # online sampled_kl: draws per position
    proposal_temperature: float = 1.0  # online sampled_kl
    packing: bool = True  # online
    data_seed: int = 0  # online: the ExampleSource order seed, as given to the dump (also keys the draws)
    num_examples: int | None = None  # online: use the first n examples of the data
    text_field: str | None = None  # JSONL field of --data / --eval-data (default: the store's, else "text")
    # how conversations in --data / --eval-data are read, rendered and masked (None: the store's, else defaults)
    chat: ChatOptions | None = None
    # optimization
    learning_rate: float = 3e-4
    warmup_steps: int | None = None  # default min(100, num_steps // 10)
    end_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # None: no clipping
    grad_accum: int = 1
    seed: int = 0  # the training shuffle
    param_sharding: str = "replicate"
    # the loss
    loss: str | None = None  # default: the store's (topk_tail_kl, topk_kl for a store without tail, sampled_kl)
    alpha: float = 1.0
    alpha_end: float | None = None
    alpha_schedule: str = "constant"
    temperature: float = 1.0
    allow_biased_temperature: bool = False  # a sampled loss at T != the draws' t (self-normalised weights)
    jsd_beta: float = 0.5  # the *_jsd losses' mixture weight
    skew: float = 0.1  # the *_skew_* losses' mixture weight
    allow_tokenizer_mismatch: bool = False
    # outputs
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    eval_data: str | None = None
    eval_teacher: str | None = None  # teacher-relative evaluation on --eval-data, over the full vocabulary
    eval_store: str | None = None  # teacher-relative evaluation on a held-out store's records
    max_eval_examples: int | None = None
    log_every: int | None = None  # default: about LOG_LINES rows per run
    progress: bool = True
    report: bool = True  # report.md + loss.png in the output (docs/TRAIN.md)
    force_takeover: bool = False  # take over a stale lease of the output
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S

    @classmethod
    def from_flat(cls, *, warmup_steps: int = -1, loss: str = "", alpha_end: float = -1.0, eval_data: str = "",
                  max_eval_examples: int = 0, eval_teacher: str = "", eval_store: str = "",
                  **fields) -> "TrainConfig":
        """The config of settings given flat, every one set (the pipeline's parameters): -1, 0 or "" for
        "unset" (the default)."""
        return cls(warmup_steps=None if warmup_steps < 0 else warmup_steps, loss=loss or None,
                   alpha_end=None if alpha_end < 0 else alpha_end, eval_data=eval_data or None,
                   max_eval_examples=max_eval_examples or None, eval_teacher=eval_teacher or None,
                   eval_store=eval_store or None, **fields)

    @property
    def online(self) -> bool:
        return self.store is None

    @property
    def warmup(self) -> int:
        return min(100, self.num_steps // 10) if self.warmup_steps is None else self.warmup_steps

    @property
    def log_interval(self) -> int:
        return self.log_every if self.log_every is not None else max(1, math.ceil(self.num_steps / LOG_LINES))

    @property
    def inputs(self) -> dict:
        """The input paths by flag (the output must not overlap them)."""
        return {"--store": self.store, "--teacher": self.teacher, "--data": self.data, "--student": self.student,
                "--eval-data": self.eval_data, "--eval-teacher": self.eval_teacher, "--eval-store": self.eval_store,
                "--chat-template": self.chat.chat_template if self.chat else None}

    def check(self) -> "TrainConfig":
        """Every setting on its own and against the others (nothing is read); InputError naming the flag."""
        if self.output is None or not str(self.output).strip():
            raise InputError("--output is empty; give a path (a local folder or gs://bucket/prefix)")
        if not self.student or not str(self.student).strip():
            raise InputError("--student is empty; give a checkpoint folder, preset:NAME or flax:MODULE:FACTORY")
        for name, low in (("num_steps", 1), ("batch_size", 1), ("grad_accum", 1), ("checkpoint_every", 1),
                          ("keep_checkpoints", 1), ("seed", 0), ("data_seed", 0)):
            _require_int(name, getattr(self, name), low)
        for name in ("log_every", "max_eval_examples", "num_examples", "top_k", "seq_len", "samples"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), 2 if name == "seq_len" else 1)
        if self.warmup_steps is not None:
            _require_int("warmup_steps", self.warmup_steps, 0)
            if self.warmup_steps >= self.num_steps:
                raise InputError(f"--warmup-steps {self.warmup_steps} must be below --num-steps {self.num_steps}")
        _check_floats(self)
        if self.loss is not None and self.loss not in KINDS:
            raise InputError(f"--loss {self.loss!r} is not one of {', '.join(KINDS)}")
        if self.allow_biased_temperature and self.loss is not None and representation(self.loss) != "sampled":
            raise InputError(f"--allow-biased-temperature applies to the sampled_* losses, not --loss {self.loss}")
        if self.alpha_schedule not in ALPHA_KINDS:
            raise InputError(f"--alpha-schedule {self.alpha_schedule!r} is not one of {', '.join(ALPHA_KINDS)}")
        if self.alpha_schedule == "constant" and self.alpha_end is not None and self.alpha_end != self.alpha:
            raise InputError(f"--alpha-end {self.alpha_end} differs from --alpha {self.alpha}: give --alpha-schedule "
                             "linear or cosine to change alpha over training")
        if self.param_sharding not in SHARDING_MODES:
            raise InputError(f"--param-sharding {self.param_sharding!r} is not one of {', '.join(SHARDING_MODES)}")
        self._check_eval()
        if self.text_field is not None and (not isinstance(self.text_field, str) or not self.text_field):
            raise InputError(f"--text-field must be a non-empty name, got {self.text_field!r}")
        if self.chat is not None:
            if not isinstance(self.chat, ChatOptions):
                raise InputError(f"chat must be a ChatOptions, got {type(self.chat).__name__}")
            if not self.online and self.eval_data is None:
                raise InputError("the chat options apply to --data (online) and --eval-data; a store records the "
                                 "options its data was read with: give --eval-data or drop them")
            self.chat.check()
        self._check_mode()
        return self

    def _check_eval(self) -> None:
        if self.eval_store is not None and (self.eval_data is not None or self.eval_teacher is not None):
            raise InputError("--eval-store holds its own held-out examples and the teacher's values on them; give "
                             "--eval-store alone, or --eval-data (with --eval-teacher for the teacher's measures)")
        if self.eval_teacher is not None and self.eval_data is None:
            raise InputError("--eval-teacher runs the teacher on --eval-data; give --eval-data too")
        if self.eval_data is None and self.eval_store is None and self.max_eval_examples is not None:
            raise InputError("--max-eval-examples applies to --eval-data or --eval-store; give one or drop it")

    def _check_mode(self) -> None:
        online_only = {"teacher": self.teacher, "data": self.data, "top_k": self.top_k, "seq_len": self.seq_len}
        rep = None if self.loss is None else representation(self.loss)
        if rep == "hybrid" and self.online:
            raise InputError(f"--loss {self.loss} reads a hybrid store's record (dump --selection hybrid); online, use "
                             "full_kl (the teacher's whole distribution) or sampled_kl with --samples")
        if rep == "full" and not self.online:
            raise InputError(f"--loss {self.loss} needs the teacher's whole distribution, which no store holds: "
                             "train online (--teacher, --data, --seq-len), or use a topk_tail_* loss on a top-k store")
        if not self.online:
            given = [f"--{k.replace('_', '-')}" for k, v in online_only.items() if v is not None]
            if given:
                raise InputError(f"--store excludes {', '.join(given)} (offline from a store, or online with a "
                                 "teacher in the loop, not both)")
            if self.samples is not None:
                raise InputError("--samples is for online training; a sampled store records its own N")
            if self.num_examples is not None:
                raise InputError("--num-examples is for online training; a store holds what it holds")
            return
        sampled = self.samples is not None or rep == "sampled"
        if rep == "full":
            given = [f for f, v in (("--top-k", self.top_k), ("--samples", self.samples)) if v is not None]
            if given:
                raise InputError(f"--loss {self.loss} reads the teacher's whole vocabulary; drop {', '.join(given)}")
            online_only.pop("top_k")
        elif sampled:
            if rep not in (None, "sampled"):
                raise InputError(f"--samples applies to the sampled_* losses, not --loss {self.loss}")
            if self.samples is None:
                raise InputError(f"online --loss {self.loss} needs --samples N >= 1 (draws per position)")
            online_only.pop("top_k")
        missing = [f"--{k.replace('_', '-')}" for k, v in online_only.items() if v is None]
        if missing:
            raise InputError("give either --store, or --teacher, --data, --top-k (or --samples) and --seq-len "
                             f"(missing: {', '.join(missing)})")

    def resolved_loss(self, selection: str, top_k: int, vocab_size: int) -> str:
        """The loss of a run on a store of ``selection`` (online: "sampled" with --samples, else "topk"):
        ``losses.DEFAULT_LOSS``, except topk_kl for a top-k store holding the whole vocabulary."""
        if self.loss is not None:
            return self.loss
        if selection in ("sampled", "hybrid"):
            return f"{selection}_kl"
        # A top-k covering the whole vocabulary has no tail: plain top-k KL is then the exact loss.
        return "topk_kl" if top_k >= vocab_size else "topk_tail_kl"


def flag(name: str) -> str:
    return {"lease_timeout_s": "--lease-timeout"}.get(name, "--" + name.replace("_", "-"))


def _require_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{flag(name)} must be an integer >= {low}, got {value!r}")


_FLOAT_RULES = {
    "learning_rate": (lambda v: v > 0, "> 0"),
    "temperature": (lambda v: v > 0, "> 0"),
    "proposal_temperature": (lambda v: v > 0, "> 0"),
    "weight_decay": (lambda v: v >= 0, ">= 0"),
    "max_grad_norm": (lambda v: v > 0, "> 0 (or none for no clipping)"),
    "end_lr_fraction": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "alpha": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "alpha_end": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "jsd_beta": (lambda v: 0 < v < 1, "in (0, 1)"),
    "skew": (lambda v: 0 < v < 1, "in (0, 1)"),
    "lease_timeout_s": (lambda v: v > 0, "> 0 seconds"),
}
_OPTIONAL = ("max_grad_norm", "alpha_end")


def _check_floats(config: TrainConfig) -> None:
    """The float settings: finite numbers, each in its range (None where it means 'off')."""
    for name, (ok, rule) in _FLOAT_RULES.items():
        value = getattr(config, name)
        if value is None and name in _OPTIONAL:
            continue
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise InputError(f"{flag(name)} must be a number {rule}, got {value!r}") from None
        if isinstance(value, bool) or not math.isfinite(v) or not ok(v):
            raise InputError(f"{flag(name)} must be a finite number {rule}, got {value!r}")
