"""Writes a store for ever-longer; the crash test SIGKILLs it at random moments."""

import sys
import time

from logit_distill import store
from logit_distill.store.synthetic import synthetic_step

uri = sys.argv[1]
manifest = store.build_manifest(
    seq_len=64, top_k=16, vocab_size=1024, codec="default", num_steps=60, examples_per_step=8,
    steps_per_file=2, num_processes=1, content={"teacher": "crash-test"},
)
store.init_store(uri, manifest)
have = store.scan(uri, manifest)
writer = store.BackgroundWriter(uri, manifest, 0)
for start, end in have.missing[0]:
    for step in range(start, end):
        time.sleep(0.1)  # stands in for the teacher's compute, so kills land mid-run
        writer.submit(step, synthetic_step(manifest, step, 0))
writer.close()
print("done", flush=True)
