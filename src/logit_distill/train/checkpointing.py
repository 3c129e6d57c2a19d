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


class TrainCheckpointer:
    """Save and restore ``(state, data iterator)`` pairs by optimizer step."""

    def __init__(self, output: str, *, max_to_keep: int = 3, async_save: bool = True):
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
        self.manager.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(data_iterator),
            ),
            force=True,
        )

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
