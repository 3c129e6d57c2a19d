"""``verification_failed``: fail the run when the store did not verify, naming the first failing check.

``verify_logits`` itself succeeds either way, so that its report and metrics are
kept and shown in the UI; the pipeline runs this task only when verification
failed, and its error (the report's first failing check and its message)
becomes the run's error.
"""

from kfp import dsl
from kfp.dsl import Input, Markdown

from .image import DEFAULT_IMAGE


def verification_failed(report: Input[Markdown]):
    """Raise with the verification report's first failing check."""
    meta = report.metadata or {}
    line = meta.get("first_failure") or f"failed checks: {', '.join(meta.get('failed_checks') or []) or '?'}"
    raise RuntimeError(f"store {meta.get('store', '?')} failed verification: {line} "
                       f"(report: {report.uri}); training was not started")


INPUTS = {"report": "The verification report (its metadata names the failed checks)."}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(verification_failed, INPUTS), base_image=image, install_kfp_package=False)


component = build()
