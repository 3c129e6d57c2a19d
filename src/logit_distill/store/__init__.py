"""The logit store: manifest, chunks, scan, writer and reader. docs/FORMAT.md is its spec."""

from .chunks import ChunkInfo, ScanResult, chunk_name, expected_ranges, parse_chunk_name, scan
from .manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    build_manifest,
    diff_manifests,
    dump_key,
    fingerprint_of,
    parse_manifest,
    require_same_config,
)
from .reader import Store, open_store, stack_records
from .writer import (BackgroundWriter, ChunkWriter, forget_unused_manifest, init_store, put_tokenizer,
                     remove_leftovers, write_examples)

__all__ = [
    "BackgroundWriter", "ChunkInfo", "ChunkWriter", "FORMAT_VERSION", "MANIFEST_NAME", "ScanResult",
    "Store", "build_manifest", "chunk_name", "diff_manifests", "dump_key", "expected_ranges",
    "fingerprint_of", "init_store", "open_store", "parse_chunk_name", "parse_manifest", "put_tokenizer", "forget_unused_manifest", "remove_leftovers",
    "require_same_config", "scan", "stack_records", "write_examples",
]
