"""Verify a logit store: prove it complete, intact and aligned. docs/VERIFY.md describes the checks.

``verify_store(VerifyConfig(store=uri, ...))`` runs the checks below, each
reported by name with the chunk / record it concerns, and returns a
``VerifyReport`` (JSON and Markdown). ``logit-distill verify`` is its command
line (``logit_distill.cli.verify``).

  manifest            present, known format version, self-consistent
  coverage            committed chunks cover steps 0..N-1 of every process:
                      no gap, duplicate or foreign chunk; ``expected_steps``
  integrity           every chunk: SHA-256 against its name, readable, record count
  records             every record: header, shapes, dtypes, id ranges, distinct ids,
                      finite sorted log-probs <= 0, normalization with the tail,
                      example index, store tag and token hash
  data_alignment      (``data``) sampled examples' tokens equal the data pipeline's
  teacher_spot_check  (``teacher`` + ``spot_check``) the teacher recomputed on
                      sampled examples agrees within the codec's bound

Speed: the store is read once. Chunks are checked on a thread pool (numpy
releases the GIL), at most ``workers`` at a time; inside a chunk, records are
read and checked in batches of bounded size with vectorized numpy, so memory
stays bounded whatever the chunk size. A local chunk is hashed in a streaming
pass and then parsed by the ArrayRecord reader (which needs a path; the second
read hits the page cache); a remote chunk is downloaded once, hashed on the
way, parsed from the temporary copy and deleted. Records sampled for the data
and teacher checks are kept during that same pass.

Modules:

  config     ``VerifyConfig`` and its ``check()``
  report     ``VerifyReport`` (JSON / Markdown), ``_Check`` (one check's problems)
  context    ``_Ctx`` (the store's geometry) and ``_ChunkResult``
  integrity  per-chunk read: streaming SHA-256, ArrayRecord open, record count
  records    vectorized per-record checks of a batch of records
  coverage   the manifest and coverage checks
  alignment  sampling, data alignment and teacher spot check
  run        ``verify_store``: the parallel streaming read, orchestration
"""

from __future__ import annotations

from .config import DEFAULT_SAMPLE, VerifyConfig
from .integrity import BATCH_BYTES
from .report import CHECK_NAMES, MAX_LISTED, VerifyReport
from .run import verify_store

__all__ = ["BATCH_BYTES", "CHECK_NAMES", "DEFAULT_SAMPLE", "MAX_LISTED", "VerifyConfig", "VerifyReport",
           "verify_store"]
