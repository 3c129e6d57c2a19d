"""The teacher dump: run the teacher once over the data and keep its top-k (or tokens sampled from it)
in a logit store.

  config        ``DumpConfig`` (frozen) and its ``check()``: every setting, before any work
  plan          ``plan_dump(config)`` -> ``DumpPlan``: the manifest (fingerprint, dump key) the dump
                writes, without loading the teacher's weights or tokenizing the data
  teacher_step  ``TeacherStep``: the jitted forward + selection + NaN/inf check over the device mesh
  run           ``run_dump(config)`` -> ``DumpResult``: lease, load, resume scan, the steps, the writer
  result        ``DumpResult``
"""

from .config import DumpConfig
from .plan import DumpPlan, plan_dump
from .result import DumpResult
from .run import DumpInterrupted, run_dump
from .teacher_step import TeacherStep

__all__ = ["DumpConfig", "DumpInterrupted", "DumpPlan", "DumpResult", "TeacherStep", "plan_dump", "run_dump"]
