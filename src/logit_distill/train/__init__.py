"""Student training: from a logit store (offline) or with the teacher in the loop (online).

  config         ``TrainConfig`` (frozen) and its ``check()``
  plan           ``plan_training(config)`` -> ``TrainPlan``: every check that needs no weights; the run's
                 settings and the checkpoint it resumes from
  sources        ``open_source(config)`` -> ``TrainSource``: the examples, offline or online
  student        the student (built-in decoder or Flax NNX): described, opened, its tokenizer checked
  run            ``train_student(config)`` -> ``TrainResult``: the lease, the state, the loop
  export         the end of a run: export, evaluation, report
  step           the pure train step, the optimizer, the finite guard
  losses         KD losses and CE (pure, tested against float64)
  loader         the Grain pipeline over a store or the data
  metrics        metrics.jsonl, TensorBoard, the log lines
  checkpointing  Orbax checkpoints of the state and the iterator
  evaluate, report, schedules, key (the pipeline's keyed folder), tensorboard, sampling
"""

__all__ = ["TrainConfig", "TrainPlan", "TrainResult", "plan_training", "sample_from_teacher", "train_student"]


def __getattr__(name):
    # Lazy: the loop pulls in Orbax and Grain, which parsing a command line does not need.
    if name == "TrainConfig":
        from .config import TrainConfig

        return TrainConfig
    if name in ("TrainPlan", "plan_training"):
        from . import plan

        return getattr(plan, name)
    if name == "train_student":
        from .run import train_student

        return train_student
    if name == "TrainResult":
        from .export import TrainResult

        return TrainResult
    if name == "sample_from_teacher":
        from .sampling import sample_from_teacher

        return sample_from_teacher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
