"""The training report: ``report.md`` and ``loss.png`` (loss, KD and CE curves; learning rate and alpha)
in the output folder. ``logit-distill train`` writes them at the end of a run, and the KFP component
shows the same figure and figures in its HTML artifact."""

from __future__ import annotations

import io
import json

from .. import paths
from ..outputs import report_comment

REPORT_NAME = "report.md"
PLOT_NAME = "loss.png"


def read_metrics(output: str) -> list[dict]:
    """The rows of ``<output>/metrics.jsonl`` (lines cut by a kill are skipped)."""
    uri = paths.join(output, "metrics.jsonl")
    if not paths.exists(uri):
        return []
    rows = []
    for line in paths.read_bytes(uri).decode(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if isinstance(r, dict) and "step" in r]


def loss_plot(rows: list[dict], eval_result: dict | None = None) -> bytes:
    """The PNG of the training curves (matplotlib's Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    steps = [r["step"] for r in rows]
    for key, label in (("loss", "total"), ("kd_loss", "KD (teacher)"), ("ce_loss", "CE (next token)")):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], label=label)
    if eval_result:
        ax.axhline(eval_result["cross_entropy"], color="k", ls="--", lw=1,
                   label=f"held-out CE {eval_result['cross_entropy']:.3f}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("nats / token")
    ax.set_title("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax2.plot(steps, [r.get("learning_rate", float("nan")) for r in rows], label="learning rate")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("learning rate")
    ax3 = ax2.twinx()
    ax3.plot(steps, [r.get("alpha", float("nan")) for r in rows], color="tab:red", label="alpha (KD weight)")
    ax3.set_ylabel("alpha")
    ax3.set_ylim(-0.05, 1.05)
    ax2.set_title("schedules")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def outcome_lines(result, final: dict | None) -> list[str]:
    """The run's outcome as short sentences (the report, the component's page, the CLI's summary)."""
    lines = []
    if final:
        lines.append(f"final training loss {final.get('loss', float('nan')):.4f} (KD {final.get('kd_loss', float('nan')):.4f}, "
                     f"CE {final.get('ce_loss', float('nan')):.4f}) at step {final.get('step', result.final_step)}")
    if result.eval:
        lines.append(f"held-out cross-entropy {result.eval['cross_entropy']:.4f} nats/token, perplexity "
                     f"{result.eval['perplexity']:.2f} over {result.eval['num_tokens']} tokens")
    if result.eval and "teacher" in result.eval:
        lines.append(teacher_line(result.eval["teacher"]))
    if result.resumed_from_step is not None:
        lines.append(f"resumed from checkpoint step {result.resumed_from_step}")
    return lines


_TEACHER_MEASURES = (  # (key of teacher_metrics, how the report says it)
    ("kl", "KL(teacher || student) {:.4f} nats/token"),
    ("kl_bins", "KL over the k + 1 bins {:.4f} nats/token (a lower bound of the full KL)"),
    ("kl_draws", "KL estimated from the draws {:.4f} nats/token"),
    ("top1_agreement", "top-1 agreement {:.1%}"),
    ("topk_mass", "the student's mass on the teacher's top-{k} {:.3f}"),
    ("tail_shape_kl", "tail-shape KL (outside the top-{k}) {:.4f}"),
)


def teacher_line(measures: dict) -> str:
    """The teacher-relative measures of eval.json's ``teacher`` as one sentence."""
    parts = [text.format(measures[key], k=measures["k"]) for key, text in _TEACHER_MEASURES if key in measures]
    return f"against {measures['against']}: {', '.join(parts)} over {measures['count']} positions"


def write_report(plan, result) -> str:
    """Write ``report.md`` and ``loss.png`` into the run's output; returns the report's URI."""
    from .losses import kd_metric_note

    config = plan.config
    rows = read_metrics(config.output)
    paths.write_bytes_atomic(paths.join(config.output, PLOT_NAME), loss_plot(rows, result.eval))
    settings = {"student": config.student, "data": plan.source.where, "steps": config.num_steps,
                "batch size": f"{config.batch_size} x {config.grad_accum} (grad accum)",
                "sequence length": plan.source.seq_len, "loss": plan.loss,
                "KD metric": kd_metric_note(plan.loss, config.temperature, plan.proposal_temperature),
                "alpha": config.alpha,
                "alpha end": config.alpha_end, "alpha schedule": config.alpha_schedule,
                "temperature": config.temperature, "learning rate": config.learning_rate, "seed": config.seed,
                "export": result.export_dir}
    text = "\n".join([
        report_comment("train"),
        f"# Student training: {config.output}",
        "",
        *[f"- {line}" for line in outcome_lines(result, result.metrics or (rows[-1] if rows else None))],
        "",
        f"![training curves]({PLOT_NAME})",
        "",
        "| setting | value |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in settings.items()],
        "",
    ])
    uri = paths.join(config.output, REPORT_NAME)
    paths.write_bytes_atomic(uri, text.encode())
    return uri
