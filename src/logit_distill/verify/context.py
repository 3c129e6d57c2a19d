"""The store's geometry shared by the checks (``_Ctx``) and one chunk's outcome (``_ChunkResult``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import paths
from ..store import chunks as chunks_mod
from ..store.layout import StoreLayout
from .report import _Check


@dataclasses.dataclass
class _Ctx:
    uri: str
    manifest: dict
    local: bool
    tmp_dir: str | None
    seq_len: int
    top_k: int
    vocab: int
    codec: str
    id_bits: int
    layout: StoreLayout
    tag: int
    on_records: Any  # progress callback(n)
    wanted: dict  # chunk name -> {record: global index} kept for the data / teacher checks
    masked: bool = False  # records hold the teacher's values at supervised positions only

    def global_index(self, chunk: chunks_mod.ChunkInfo, record) -> Any:
        """Global example index of record(s) ``record`` of ``chunk`` (works on arrays)."""
        return self.layout.example_of_record(chunk.process, chunk.start, record)

    def expected_records(self, chunk: chunks_mod.ChunkInfo) -> int:
        return self.layout.records_in(chunk.start, chunk.end)

    def chunk_uri(self, chunk) -> str:
        return paths.join(self.uri, chunk.name)


@dataclasses.dataclass
class _ChunkResult:
    chunk: chunks_mod.ChunkInfo
    size: int = 0
    records_checked: int = 0
    integrity: list = dataclasses.field(default_factory=list)  # (kind, message, where)
    records: _Check = dataclasses.field(default_factory=lambda: _Check("records"))
    kept: dict = dataclasses.field(default_factory=dict)  # global index -> (record dict, record no)
    sums: dict = dataclasses.field(default_factory=lambda: {
        "positions": 0, "tokens": 0, "supervised": 0, "entropy": 0.0, "topk_mass": 0.0})
