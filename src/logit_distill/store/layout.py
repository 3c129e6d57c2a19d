"""The store's index arithmetic, in one place: which step, process, chunk and record hold an example.

A step holds ``B`` examples (``examples_per_step``), split over ``P`` processes in order: process
``p`` owns examples ``[step * B + p * b, step * B + (p + 1) * b)`` with ``b = B / P``. Each process
writes its own chunks, each covering the steps ``[start, end)`` of a fixed range of
``steps_per_file`` steps (the last range may be shorter); inside a chunk, the examples of a step
follow those of the step before, so the example of (step, offset) is record
``(step - start) * b + offset``.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class StoreLayout:
    num_steps: int
    examples_per_step: int  # B, over all processes
    num_processes: int  # P
    steps_per_file: int

    @classmethod
    def of(cls, manifest: dict) -> "StoreLayout":
        layout = manifest["layout"]
        return cls(int(layout["num_steps"]), int(layout["examples_per_step"]), int(layout["num_processes"]),
                   int(layout["steps_per_file"]))

    @property
    def examples_per_process(self) -> int:
        """b: the examples of one step that one process owns."""
        return self.examples_per_step // self.num_processes

    @property
    def num_examples(self) -> int:
        return self.num_steps * self.examples_per_step

    # -- examples

    def example_index(self, step, process, offset=0):
        """The global index of the example at ``offset`` of ``process``'s part of ``step`` (arrays too)."""
        return step * self.examples_per_step + process * self.examples_per_process + offset

    def step_examples(self, step: int, process: int) -> np.ndarray:
        """The global indices of ``process``'s examples of ``step``, in order (int64)."""
        first = self.example_index(step, process)
        return np.arange(first, first + self.examples_per_process, dtype=np.int64)

    def locate(self, index: int) -> tuple[int, int, int]:
        """(step, process, offset) of global example ``index``."""
        step, r = divmod(int(index), self.examples_per_step)
        process, offset = divmod(r, self.examples_per_process)
        return step, process, offset

    # -- chunks

    def ranges(self) -> list[tuple[int, int]]:
        """The step ranges [start, end) of one process's chunks, in order."""
        n, s = self.num_steps, self.steps_per_file
        starts = range(0, n, s)
        return list(zip(starts, [*range(s, n, s), n]))

    def range_of_step(self, step: int) -> tuple[int, int]:
        """The step range [start, end) of the chunk that holds ``step``."""
        start = (step // self.steps_per_file) * self.steps_per_file
        return start, min(start + self.steps_per_file, self.num_steps)

    @property
    def num_chunks(self) -> int:
        """Chunks of a complete store (every process's)."""
        return len(self.ranges()) * self.num_processes

    def records_in(self, start: int, end: int) -> int:
        """Records of a chunk covering steps [start, end)."""
        return (end - start) * self.examples_per_process

    def record_of(self, start: int, step, offset=0):
        """The record index, in the chunk starting at step ``start``, of (``step``, ``offset``)."""
        return (step - start) * self.examples_per_process + offset

    def example_of_record(self, process: int, start: int, record):
        """The global index of record(s) ``record`` of ``process``'s chunk starting at step ``start``."""
        step, offset = divmod(record, self.examples_per_process)
        return self.example_index(start + step, process, offset)
