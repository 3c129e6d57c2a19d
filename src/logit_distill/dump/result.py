"""What a dump did (``DumpResult``), with the store as a final scan finds it."""

from __future__ import annotations

import dataclasses
import time

from .. import paths
from .. import store as store_mod
from ..store import manifest as manifest_mod


@dataclasses.dataclass(frozen=True)
class DumpResult:
    store: str
    fingerprint: str
    dump_key: str
    num_steps: int
    resumed_from_step: int  # the first step this run computed (num_steps: nothing to do)
    steps_run: int  # steps computed by this run
    chunks_present_at_start: int
    chunks_written: int  # by this run
    chunks_expected: int
    examples: int  # examples in the committed chunks
    positions: int  # examples x seq_len (padding included)
    store_bytes: int
    bytes_per_entry: float  # store bytes / (positions x entries per position: top_k, a hybrid store's k + N)
    bytes_per_position: float  # store bytes / positions
    tokens_per_s: float  # positions computed by this run per second of its compute
    elapsed_s: float
    complete: bool
    time_to_first_step_s: float | None = None  # from the call to the first new step handed to the writer
    # documents (conversations) of the data left out for having no supervised token (None: the data was not read)
    skipped_unsupervised: int | None = None

    def summary(self) -> str:
        return (f"{self.store}: {self.examples} examples of {self.positions // max(1, self.examples)} positions, "
                f"{self.chunks_expected} chunks ({self.chunks_written} written now, resumed at step "
                f"{self.resumed_from_step}), {self.store_bytes / 1e6:.1f} MB, {self.bytes_per_position:.1f} "
                f"bytes/position, {self.tokens_per_s:.0f} positions/s"
                + (f"; {self.skipped_unsupervised} documents of the data skipped (no supervised token)"
                   if self.skipped_unsupervised else ""))


def dump_result(uri: str, manifest: dict, *, present: int, chunks_written: int, steps_run: int, resumed_from: int,
                elapsed_compute: float, t_start: float, first_step_at: float | None,
                skipped_unsupervised: int | None = None) -> DumpResult:
    layout, L = manifest["layout"], manifest["shapes"]["seq_len"]
    B = layout["examples_per_step"]
    b = B // layout["num_processes"]
    final = store_mod.scan(uri, manifest)
    files = {f["name"]: f["size"] for f in paths.list_files(uri)}
    store_bytes = sum(files.get(c.name, 0) for c in final.chunks.values())
    examples = sum((c.end - c.start) * b for c in final.chunks.values())
    positions = examples * L
    return DumpResult(
        store=uri, fingerprint=manifest["fingerprint"], dump_key=manifest_mod.dump_key(manifest),
        num_steps=layout["num_steps"], resumed_from_step=resumed_from, steps_run=steps_run,
        chunks_present_at_start=present, chunks_written=chunks_written, chunks_expected=final.num_expected,
        examples=examples, positions=positions, store_bytes=store_bytes,
        bytes_per_entry=store_bytes / max(1, positions * manifest_mod.entries_per_position(manifest)),
        bytes_per_position=store_bytes / max(1, positions),
        tokens_per_s=steps_run * B * L / elapsed_compute if steps_run else 0.0,
        elapsed_s=time.perf_counter() - t_start, complete=final.complete,
        time_to_first_step_s=None if first_step_at is None else first_step_at - t_start,
        skipped_unsupervised=skipped_unsupervised,
    )
