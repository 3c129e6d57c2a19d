"""The end of a run: export the student, evaluate it on held-out data, write the report."""

from __future__ import annotations

import dataclasses

import jax

from .. import paths
from .metrics import say
from .plan import EVAL_NAME, TrainPlan, write_json


@dataclasses.dataclass(frozen=True)
class TrainResult:
    output: str
    final_step: int
    metrics: dict | None  # the last logged metrics
    eval: dict | None  # eval.json's content when eval_data was given
    hf_dir: str | None  # the HF export of a built-in student (None for a Flax student)
    resumed_from_step: int | None  # the checkpoint step this run started from (None: from scratch)
    export_dir: str | None = None  # the exported student: hf/ (built-in) or student/ (Flax NNX)
    report: str | None = None  # report.md in the output


def finish(plan: TrainPlan, student, state, last_metrics, put) -> TrainResult:
    """Export the student (process 0), evaluate it, write eval.json and the report."""
    config = plan.config
    export_dir = paths.join(config.output, plan.student.export_name)
    params = state["params"]
    if jax.process_index() == 0:
        student.save(_host_params(params), export_dir, plan.tokenizer_path)
    elif jax.process_count() > 1:
        _host_params(params)  # the all-gather is collective
    eval_result = None
    if plan.eval_examples is not None:
        from .evaluate import evaluate

        reference = plan.eval_reference
        if reference is not None and hasattr(reference, "load"):  # the online teacher is loaded once
            same = plan.source.teacher if plan.source.teacher_spec == reference.spec else None
            reference.load(reuse=same)
        eval_result = evaluate(student.apply, params, plan.eval_examples, batch_size=config.batch_size, put=put,
                               max_examples=config.max_eval_examples, process_index=jax.process_index(),
                               process_count=jax.process_count(), reference=reference)
        eval_result = {"data": config.eval_data or config.eval_store, "step": config.num_steps, **eval_result}
        if jax.process_index() == 0:
            write_json(paths.join(config.output, EVAL_NAME), eval_result)
            _log_eval(config.output, eval_result)
        say(f"eval: cross-entropy {eval_result['cross_entropy']:.4f} nats/token, perplexity "
            f"{eval_result['perplexity']:.3f} over {eval_result['num_tokens']} tokens of {eval_result['data']}")
        if "teacher" in eval_result:
            from .report import teacher_line

            say(f"eval: {teacher_line(eval_result['teacher'])}")
    result = TrainResult(output=config.output, final_step=config.num_steps, metrics=last_metrics, eval=eval_result,
                         hf_dir=export_dir if plan.student.kind == "hf" else None,
                         resumed_from_step=plan.resume_from, export_dir=export_dir)
    if config.report and jax.process_index() == 0:
        from .report import write_report

        result = dataclasses.replace(result, report=write_report(plan, result))
    return result


def _log_eval(output: str, eval_result: dict) -> None:
    """The held-out measures as TensorBoard scalars at the run's last step (``eval/...``)."""
    from .tensorboard import TensorBoard

    board = TensorBoard(output)
    try:
        board.write_scalars("eval", eval_result["step"], {
            "cross_entropy": eval_result["cross_entropy"],
            **{f"teacher_{k}": v for k, v in eval_result.get("teacher", {}).items()
               if k not in ("against", "k", "count")}})
    finally:
        board.close()


def _host_params(params):
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(params, tiled=True)
    return jax.device_get(params)
