"""Per-step training curves as TensorBoard event files (tensorboardX: no TensorFlow needed).

Where: ``$AIP_TENSORBOARD_LOG_DIR`` when set (a Vertex AI custom job with a
TensorBoard instance and a base output directory sets it; the Vertex
TensorBoard shows those files), otherwise ``<output>/tensorboard/``. Event
files are written locally and, for a gs:// destination, uploaded whole at each
checkpoint and at the end (object stores have no appends).

On resume, the writer starts with a purge at the resumed step, so the steps
redone after a preemption replace the ones the killed run logged.
"""

from __future__ import annotations

import os
import tempfile

from .. import paths

TB_DIR = "tensorboard"
ENV = "AIP_TENSORBOARD_LOG_DIR"
SCALARS = ("loss", "kd_loss", "ce_loss", "learning_rate", "tokens_per_s", "alpha", "grad_norm")


def log_dir_for(output: str) -> str:
    return os.environ.get(ENV) or paths.join(output, TB_DIR)


class TensorBoard:
    def __init__(self, output: str, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        self.uri = log_dir_for(output)
        self.remote = not paths.is_local(self.uri)
        self._tmp = tempfile.TemporaryDirectory(prefix="logit-distill-tb-") if self.remote else None
        local = self._tmp.name if self.remote else paths.local_path(self.uri)
        os.makedirs(local, exist_ok=True)
        self._local = local
        self._writer = SummaryWriter(logdir=local, purge_step=purge_step or None, flush_secs=30)

    def write(self, rec: dict) -> None:
        step = int(rec["step"])
        for key in SCALARS:
            if key in rec:
                self._writer.add_scalar(f"train/{key}", float(rec[key]), step)

    def flush(self) -> None:
        self._writer.flush()
        if self.remote:
            for name in sorted(os.listdir(self._local)):
                paths.commit_file(os.path.join(self._local, name), paths.join(self.uri, name))

    def close(self) -> None:
        self.flush()
        self._writer.close()
        if self._tmp is not None:
            self._tmp.cleanup()
