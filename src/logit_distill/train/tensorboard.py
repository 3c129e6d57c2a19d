"""Per-step training curves as TensorBoard event files (tensorboardX: no TensorFlow needed).

Where: ``$AIP_TENSORBOARD_LOG_DIR/<name of the training folder>/`` when the
variable is set (a Vertex AI custom job with a TensorBoard instance and a base
output directory sets it; the Vertex TensorBoard shows those files), so that
every student, whose folder is named by its train key, is a run of its own
there; otherwise ``<output>/tensorboard/``. Event files are written locally
and, for a gs:// destination, uploaded whole (object stores have no appends)
at most every ``UPLOAD_EVERY_S`` seconds while training, so Vertex's uploader
streams the curves during the run, and at each checkpoint and at the end.

On resume, the writer starts with a purge at the resumed step, so the steps
redone after a preemption replace the ones the killed run logged.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from .. import paths

TB_DIR = "tensorboard"
ENV = "AIP_TENSORBOARD_LOG_DIR"
SCALARS = ("loss", "kd_loss", "ce_loss", "learning_rate", "tokens_per_s", "alpha", "grad_norm")
UPLOAD_EVERY_S = 60.0  # a gs:// log dir: the longest a logged step waits before it is uploaded


def log_dir_for(output: str) -> str:
    shared = os.environ.get(ENV)
    return paths.join(shared, paths.basename(output)) if shared else paths.join(output, TB_DIR)


def _summary_writer_class():
    """tensorboardX's ``SummaryWriter``, imported without torch: tensorboardX imports torch whenever it is
    installed, only to accept torch tensors, which are never passed here (scalars only); that import costs a
    training process 2-3 CPU-seconds and a few hundred MB. A torch already loaded is left as it is."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoard:
    def __init__(self, output: str, purge_step: int | None = None):
        SummaryWriter = _summary_writer_class()
        self.uri = log_dir_for(output)
        self.remote = not paths.is_local(self.uri)
        self._tmp = tempfile.TemporaryDirectory(prefix="logit-distill-tb-") if self.remote else None
        local = self._tmp.name if self.remote else paths.local_path(self.uri)
        os.makedirs(local, exist_ok=True)
        self._local = local
        self._writer = SummaryWriter(logdir=local, purge_step=purge_step or None, flush_secs=30)
        self._uploaded_at = time.monotonic()

    def write(self, rec: dict) -> None:
        step = int(rec["step"])
        for key in SCALARS:
            if key in rec:
                self._writer.add_scalar(f"train/{key}", float(rec[key]), step)
        if self.remote and time.monotonic() - self._uploaded_at >= UPLOAD_EVERY_S:
            self.flush()

    def write_scalars(self, group: str, step: int, values: dict) -> None:
        """``group/name`` scalars at ``step`` (the held-out evaluation's)."""
        for name, value in values.items():
            self._writer.add_scalar(f"{group}/{name}", float(value), int(step))

    def flush(self) -> None:
        self._writer.flush()
        self._uploaded_at = time.monotonic()
        if self.remote:
            for name in sorted(os.listdir(self._local)):
                paths.commit_file(os.path.join(self._local, name), paths.join(self.uri, name))

    def close(self) -> None:
        self.flush()
        self._writer.close()
        if self._tmp is not None:
            self._tmp.cleanup()
