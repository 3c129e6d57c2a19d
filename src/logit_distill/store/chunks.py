"""Chunk names and the scan of a store directory.

A committed chunk is named

    chunk-<tag>-p<process:05d>-s<start:09d>-<end:09d>-<sha256[:16]>.array_record

``tag`` is the first 8 hex digits of the store fingerprint, ``[start, end)``
the steps it covers, and the last field the first 16 hex digits of the
SHA-256 of the file's bytes: the checksum travels with the commit itself, so
the set of names listed is the whole truth about what is committed.
"""

from __future__ import annotations

import dataclasses
import gc
import operator
import re

from .. import paths
from . import manifest as manifest_mod
from .layout import StoreLayout
from .lease import LEASE_NAME

CHUNK_RE = re.compile(
    r"^chunk-(?P<tag>[0-9a-f]{8})-p(?P<process>\d{5})-s(?P<start>\d{9})-(?P<end>\d{9})"
    r"-(?P<checksum>[0-9a-f]{16})\.array_record$"
)


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkInfo:
    name: str
    tag: str
    process: int
    start: int  # first step
    end: int  # one past the last step
    checksum: str
    size: int = 0

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.process, self.start, self.end)


def chunk_name(tag: str, process: int, start: int, end: int, checksum: str) -> str:
    return f"chunk-{tag}-p{process:05d}-s{start:09d}-{end:09d}-{checksum[:16]}.array_record"


def parse_chunk_name(name: str, size: int = 0) -> ChunkInfo | None:
    m = CHUNK_RE.match(name)
    if not m:
        return None
    tag, process, start, end, checksum = m.groups()
    return ChunkInfo(name, tag, int(process), int(start), int(end), checksum, size)


def expected_ranges(manifest: dict) -> list[tuple[int, int]]:
    """The step ranges [start, end) of a process's chunks, in order."""
    return StoreLayout.of(manifest).ranges()


def range_of_step(manifest: dict, step: int) -> tuple[int, int]:
    """The step range [start, end) of the chunk that holds ``step``."""
    return StoreLayout.of(manifest).range_of_step(step)


@dataclasses.dataclass
class ScanResult:
    """What a store directory holds, judged against its manifest."""

    chunks: dict[tuple[int, int, int], ChunkInfo]  # (process, start, end) -> committed chunk
    missing: dict[int, list[tuple[int, int]]]  # process -> expected ranges without a chunk
    duplicates: list[list[ChunkInfo]]  # several committed chunks for one range
    foreign: list[ChunkInfo]  # well-named chunks of another store or an unexpected range
    leftovers: list[str]  # temporary files and files that are no part of a store
    num_expected: int  # chunks a complete store has

    @property
    def complete(self) -> bool:
        return not any(self.missing.values()) and not self.duplicates

    @property
    def num_present(self) -> int:
        return len(self.chunks)

    def steps_missing(self) -> list[int]:
        """The steps some process still lacks, in order: every missing chunk range, gaps included."""
        steps = set()
        for ranges in self.missing.values():
            for start, end in ranges:
                steps.update(range(start, end))
        return sorted(steps)

    def first_missing_step(self, process: int) -> int | None:
        ranges = self.missing.get(process) or []
        return ranges[0][0] if ranges else None

    def missing_summary(self) -> str:
        parts = []
        for process, ranges in sorted(self.missing.items()):
            for start, end in ranges:
                parts.append(f"process {process} steps [{start}, {end})")
        return ", ".join(parts)


def scan(store_uri: str, manifest: dict, files: list[dict] | None = None) -> ScanResult:
    """Classify every file under ``store_uri``; never infers progress from the highest number."""
    # A scan allocates a few objects per chunk; in a process holding a large object graph
    # (JAX, a model) the cyclic GC's passes over it would double the scan of 10^4 chunks.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _scan(store_uri, manifest, files)
    finally:
        if gc_was_enabled:
            gc.enable()


def _scan(store_uri: str, manifest: dict, files: list[dict] | None) -> ScanResult:
    if files is None:
        files = paths.list_files(store_uri, with_sizes=False)
    tag = manifest["fingerprint"][:8]
    ranges = expected_ranges(manifest)
    valid_ranges = set(ranges)
    processes = range(manifest["layout"]["num_processes"])
    by_key: dict[tuple[int, int, int], list[ChunkInfo]] = {}
    foreign, leftovers = [], []
    for f in sorted(files, key=operator.itemgetter("name")):
        name = f["name"]
        if name in (manifest_mod.MANIFEST_NAME, manifest_mod.TOKENIZER_NAME, manifest_mod.TOKENIZER_CONFIG_NAME,
                    manifest_mod.CHAT_TEMPLATE_NAME, LEASE_NAME):
            continue
        info = parse_chunk_name(name, f["size"])
        if info is None:
            leftovers.append(name)
        elif info.tag != tag or (info.start, info.end) not in valid_ranges or info.process not in processes:
            foreign.append(info)
        else:
            by_key.setdefault(info.key, []).append(info)
    chunks = {key: found[0] for key, found in by_key.items()}
    duplicates = [found for found in by_key.values() if len(found) > 1]
    missing = {
        p: [(s, e) for s, e in ranges if (p, s, e) not in by_key] for p in processes
    }
    return ScanResult(
        chunks=chunks, missing=missing, duplicates=duplicates, foreign=foreign,
        leftovers=leftovers, num_expected=len(ranges) * len(processes),
    )
