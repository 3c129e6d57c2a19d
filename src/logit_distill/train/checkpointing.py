"""Orbax checkpoints of a training run: model/optimizer state and the Grain iterator state.

One ``orbax.checkpoint.CheckpointManager`` under ``<output>/checkpoints``
(Orbax writes local paths and gs:// itself). Each checkpoint step ``N`` (the
number of optimizer steps done) holds two items:

- ``state``: ``{"params", "opt_state", "step"}`` (``StandardSave``; restored
  onto the shardings of a freshly built state, so the same code resumes on
  one device or many);
- ``data``: this process's Grain iterator state (``grain.checkpoint``), a
  small JSON file per process.

Orbax commits a checkpoint atomically (locally a temporary directory renamed
when finished, on GCS a ``commit_success.txt`` written last); ``latest_step``
only sees finished ones, so a run killed during a save resumes from the
previous checkpoint. On ``gs://`` the arrays go through tensorstore's own GCS
client, which reads its endpoint from ``TENSORSTORE_GCS_HTTP_URL`` (set from
``STORAGE_EMULATOR_HOST`` by ``paths``).
"""

from __future__ import annotations

import grain
import jax
import orbax.checkpoint as ocp

from .. import paths


def checkpoint_dir(output: str) -> str:
    return paths.join(output, "checkpoints")


def _orbax_path(uri: str):
    # Orbax (etils.epath) takes local paths and gs:// URIs; strip file:// for it.
    return paths.local_path(uri) if paths.is_local(uri) else uri


def storage_error(e: BaseException, where: str) -> BaseException:
    """An OSError (errno, strerror, ``where``) for a storage failure Orbax or tensorstore reports in words
    (``... [os_error_code='28']``, ``RESOURCE_EXHAUSTED``, ``No space left on device``), else ``e``."""
    import errno
    import os
    import re

    if isinstance(e, OSError):
        return e
    text = str(e)
    code = re.search(r"os_error_code='?(\d+)", text)
    if code:
        n = int(code.group(1))
    elif "No space left" in text or "RESOURCE_EXHAUSTED" in text:
        n = errno.ENOSPC
    elif "Read-only file system" in text:
        n = errno.EROFS
    elif "Permission denied" in text or "PERMISSION_DENIED" in text:
        n = errno.EACCES
    else:
        return e
    return OSError(n, os.strerror(n), where)


def latest_step(output: str) -> int | None:
    """The step of the latest finished checkpoint in ``output`` (None: none), without creating anything."""
    directory = checkpoint_dir(output)
    if not paths.exists(directory):
        return None
    manager = ocp.CheckpointManager(_orbax_path(directory),
                                    options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    try:
        return manager.latest_step()
    finally:
        manager.close()


class TrainCheckpointer:
    """Save and restore ``(state, data iterator)`` pairs by optimizer step."""

    def __init__(self, output: str, *, max_to_keep: int = 3, async_save: bool = False):
        # Synchronous by default: a failed save must stop the run at once (see ``save``); a save of a
        # small student takes well under a second, and one every ``checkpoint_every`` steps.
        self.directory = checkpoint_dir(output)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(
            _orbax_path(self.directory),
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": grain.checkpoint.CheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_iterator) -> None:
        """Save synchronously: a storage failure (a full disk, a lost bucket) raises here, as one
        OSError naming the folder, instead of in a background thread while training goes on; the
        checkpoint being written is never committed, the previous one stays the latest. On a local
        disk the space is checked first: a save that cannot fit is refused before Orbax writes a byte
        (its failing writes leave tracebacks on stderr from tensorstore's threads)."""
        self._check_space(state)
        try:
            self.manager.save(
                int(step),
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=grain.checkpoint.CheckpointSave(data_iterator),
                ),
                force=True,
            )
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - Orbax and tensorstore report storage failures as ValueError
            raise storage_error(e, self.directory) from e

    def _check_space(self, state) -> None:
        import errno
        import os

        if not paths.is_local(self.directory):
            return
        need = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards
                   if s.replica_id == 0)
        need = int(need * 1.1) + (1 << 20)  # OCDBT's index and the item metadata
        folder = paths.local_path(self.directory)
        st = os.statvfs(folder if os.path.isdir(folder) else os.path.dirname(folder))
        free = st.f_bavail * st.f_frsize
        if free < need:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} for a checkpoint of {need / 1e6:.1f} MB "
                                        f"({free / 1e6:.1f} MB free)", self.directory)

    def restore(self, step: int, state_like, data_iterator):
        """The state saved at ``step`` placed like ``state_like``; ``data_iterator`` is set in place."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state_like
        )
        restored = self.manager.restore(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract),
                data=grain.checkpoint.CheckpointRestore(data_iterator),
            ),
        )
        return restored["state"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
