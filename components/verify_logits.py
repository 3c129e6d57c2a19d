"""``verify_logits``: prove the store complete, intact and aligned before any student trains on it.

A thin wrapper over ``logit_distill.verify.verify_store``. Outputs: ``Metrics``
(the store's figures: examples, bytes per entry, teacher entropy, ... and
``passed`` as 0/1), a ``Markdown`` report (every check with its result, the
figures, the problems found) that the Vertex UI renders, and the boolean
``Output`` (passed) that the pipeline gates training on (a single return value:
``kfp.local`` resolves conditions only on a task's ``Output``). A bad store does not fail this
task, so its report is kept and shown; the pipeline then fails the run in ``verification_failed``
with the report's first failing check. ``store_state`` (a digest of the store's committed chunk
names) is an input only so that the cache key covers the store's content: a store that changed is
verified again.
"""

from kfp import dsl
from kfp.dsl import Dataset, Input, Markdown, Metrics, Output

from .image import DEFAULT_IMAGE


def verify_logits(
    store: Input[Dataset],
    metrics: Output[Metrics],
    report: Output[Markdown],
    expected_steps: int = 0,
    data: str = "",
    tokenizer: str = "",
    teacher: str = "",
    spot_check: int = 0,
    sample: int = 256,
    seed: int = 0,
    workers: int = 4,
    store_state: str = "",
) -> bool:
    """Verify the store behind ``store.uri``; write the Markdown report; return whether every check passed."""
    import math
    import os

    from logit_distill.logs import configure_from_environment
    from logit_distill.verify import VerifyConfig, verify_store

    configure_from_environment()

    result = verify_store(VerifyConfig(
        store=store.uri, expected_steps=expected_steps or None, data=data or None, tokenizer=tokenizer or None,
        teacher=teacher or None, spot_check=spot_check if teacher else 0, sample=sample, seed=seed,
        workers=max(1, workers), progress=False,
    ))
    os.makedirs(os.path.dirname(report.path) or ".", exist_ok=True)
    with open(report.path, "w", encoding="utf-8") as f:
        f.write(result.markdown())
    print(result.failure_line(), flush=True)

    metrics.log_metric("passed", 1 if result.passed else 0)
    for c in result.checks:
        if c["status"] != "skipped":  # a skipped check is in the report and its metadata, not a number
            metrics.log_metric(f"check_{c['name']}", 1 if c["status"] == "passed" else 0)
    for key, value in result.figures.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        metrics.log_metric(key, round(value, 6) if isinstance(value, float) else value)
    report.metadata.update({"passed": result.passed, "store": store.uri, "store_state": store_state,
                            "failed_checks": [c["name"] for c in result.failed_checks],
                            "skipped_checks": [c["name"] for c in result.checks if c["status"] == "skipped"],
                            "first_failure": "" if result.passed else result.failure_line()})
    return bool(result.passed)


# Descriptions of the inputs no pipeline parameter feeds (the others come from pipelines/params.py).
INPUTS = {
    "store": "The store to verify.",
    "metrics": "Every figure of the verification, passed (0/1) and one check_<name> per check.",
    "report": "The verification report (Markdown).",
    "seed": "Seed of the sampled records.",
    "workers": "Threads reading chunks.",
    "store_state": "Digest of the store's committed chunk names (from plan_dump or the dump): the cache key.",
}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(verify_logits, INPUTS), base_image=image, install_kfp_package=False)


component = build()
