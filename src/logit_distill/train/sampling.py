"""``sample_from_teacher``: documents sampled from a teacher, for KD tests and demos.

A thin layer over ``logit_distill.sampling.sample_documents`` (the one sampler
of the project) that appends an end-of-document token, as the data pipeline's
documents carry one.
"""

from __future__ import annotations

import numpy as np


def sample_from_teacher(loaded, num_docs: int, doc_len: int, seed: int, *, temperature: float = 1.0,
                        eos_id: int | None = None) -> list[np.ndarray]:
    """``num_docs`` int32 token sequences of ``doc_len`` tokens sampled autoregressively from
    ``loaded`` at ``temperature`` (first token uniform), each followed by ``eos_id`` if given.
    Deterministic in ``seed``. Write them with ``logit_distill.data.write_pretokenized``."""
    from ..sampling import sample_documents

    docs = sample_documents(loaded, num_docs=num_docs, doc_len=doc_len, seed=seed, temperature=temperature)
    docs = [np.asarray(d, np.int32) for d in docs]
    if eos_id is not None:
        docs = [np.concatenate([d, np.array([eos_id], np.int32)]) for d in docs]
    return docs
