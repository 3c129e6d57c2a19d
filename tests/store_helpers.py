"""Small builders shared by the store tests."""

from logit_distill import store
from logit_distill.store.synthetic import synthetic_step


def small_manifest(codec="default", num_steps=5, steps_per_file=2, examples_per_step=4,
                   num_processes=1, seq_len=16, top_k=4, vocab_size=300, **content):
    return store.build_manifest(
        seq_len=seq_len, top_k=top_k, vocab_size=vocab_size, codec=codec, num_steps=num_steps,
        examples_per_step=examples_per_step, steps_per_file=steps_per_file,
        num_processes=num_processes, content={"teacher": "synthetic", **content},
    )


def write_store(uri, manifest, steps=None, seed=0):
    """Write the given steps (default: all) for every process; return the records by step."""
    store.init_store(uri, manifest)
    steps = range(manifest["layout"]["num_steps"]) if steps is None else steps
    written = {}
    for p in range(manifest["layout"]["num_processes"]):
        by_step = {s: synthetic_step(manifest, s, p, seed) for s in steps}
        store.write_examples(uri, manifest, p, by_step)
        for s, recs in by_step.items():
            written[(s, p)] = recs
    return written
