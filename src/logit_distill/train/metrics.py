"""What a run records per logged step: ``metrics.jsonl`` and TensorBoard (``MetricsLog``), fetched from
the device one step behind it and printed as one log line (``StepMetrics``)."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import jax

from .. import paths

METRICS_NAME = "metrics.jsonl"


class MetricsLog:
    """``metrics.jsonl``: one JSON object per logged step.

    Locally each line is appended and flushed as it comes; on an object store
    (no appends) the whole file is rewritten at each checkpoint and at the end.
    On resume, lines of steps after the checkpoint (logged by the killed run,
    about to be redone) are dropped, so each step appears once.
    """

    def __init__(self, output: str, keep_up_to_step: int):
        self.uri = paths.join(output, METRICS_NAME)
        self.local = paths.is_local(self.uri)
        self.lines: list[str] = []
        if paths.exists(self.uri):
            for line in paths.read_bytes(self.uri).decode(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if isinstance(rec, dict) and rec.get("step", math.inf) <= keep_up_to_step:
                    self.lines.append(json.dumps(rec, sort_keys=True))
        self.flush()
        self._file = open(paths.local_path(self.uri), "a") if self.local else None
        from .tensorboard import TensorBoard

        self.tensorboard = TensorBoard(output, purge_step=keep_up_to_step)

    @property
    def last(self) -> dict | None:
        return json.loads(self.lines[-1]) if self.lines else None

    def write(self, rec: dict) -> None:
        line = json.dumps(rec, sort_keys=True)
        self.lines.append(line)
        self.tensorboard.write(rec)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def flush(self) -> None:
        if getattr(self, "tensorboard", None) is not None:
            self.tensorboard.flush()
        if self.local and getattr(self, "_file", None) is not None:
            self._file.flush()
            return
        paths.write_bytes_atomic(self.uri, "".join(line + "\n" for line in self.lines).encode())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        else:
            self.flush()
        self.tensorboard.close()


class StepMetrics:
    """The logged steps' metrics of a run: a logged step's device metrics are kept as they are and
    fetched (a host sync) only after the next step is dispatched, so the device never waits for the
    host; ``flush`` fetches and writes what is kept (before a checkpoint, at the end)."""

    def __init__(self, metrics_log: MetricsLog | None, *, num_steps: int, every: int, progress: bool):
        self.log = metrics_log
        self.num_steps, self.every, self.progress = num_steps, every, progress
        self.last = metrics_log.last if metrics_log else None
        self.pending = None  # (step, device metrics per micro-step, alpha, lr, tokens)
        self.tokens = 0
        self.t_last = time.perf_counter()

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def step_done(self, step: int, micro_metrics: list, alpha: float, lr: float) -> None:
        """After optimizer step ``step`` (1-based) was dispatched: write the previous logged step's metrics,
        and keep this one's when it is a logged step."""
        self.flush()
        if step % self.every == 0 or step == self.num_steps:
            self.pending = (step, micro_metrics, alpha, lr, self.tokens)
            self.tokens = 0

    def flush(self) -> None:
        if self.pending is None:
            return
        step, micro, alpha, lr, tokens = self.pending
        self.pending = None
        host: list[dict[str, Any]] = jax.device_get(micro)
        now = time.perf_counter()
        n = len(host)
        rec = {
            "step": step,
            "loss": sum(float(m["loss"]) for m in host) / n,
            "kd_loss": sum(float(m["kd_loss"]) for m in host) / n,
            "ce_loss": sum(float(m["ce_loss"]) for m in host) / n,
            "grad_norm": sum(float(m["grad_norm"]) for m in host) / n,
            "num_tokens": sum(int(m["num_tokens"]) for m in host),
            "learning_rate": lr,
            "alpha": alpha,
            "tokens_per_s": tokens / max(now - self.t_last, 1e-9),
        }
        self.last, self.t_last = rec, now
        if self.log is not None:
            self.log.write(rec)
        say(f"step {step}/{self.num_steps}: loss {rec['loss']:.4f} (KD {rec['kd_loss']:.4f}, CE {rec['ce_loss']:.4f}), "
            f"lr {lr:.3g}, alpha {alpha:.3f}, {rec['tokens_per_s']:.0f} tokens/s", self.progress)

    def checkpointed(self) -> None:
        """At a checkpoint: the metrics up to it are on disk with it."""
        self.flush()
        if self.log is not None and not self.log.local:
            self.log.flush()


def say(line: str, progress: bool = False) -> None:
    """A line of the run on stderr (process 0 only); above the progress bar when there is one."""
    if jax.process_index() != 0:
        return
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(f"logit-distill train: {line}", file=sys.stderr)
    else:
        print(f"logit-distill train: {line}", file=sys.stderr, flush=True)
