"""KFP components of logit-distill: thin lightweight-component wrappers over the library.

One module per component. Each module holds the plain Python function (its body
is self-contained: imports inside, only ``logit_distill`` and the standard
library, so ``kfp.local``'s SubprocessRunner and the container run the same
source) and a ``build(image)`` factory that turns it into a
``@dsl.component`` on our image (``install_kfp_package=False``, no
``packages_to_install``). The module-level component objects use
``DEFAULT_IMAGE``; ``pipelines.compile --image`` rebuilds them on another image.
"""

from .image import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE, check_image
from . import (dump_teacher_topk, fail_on_error, plan_dump, plan_training, preflight, train_offline_student,
               use_existing_store, use_existing_student, verification_failed, verify_logits)

__all__ = ["DEFAULT_CPU_IMAGE", "DEFAULT_IMAGE", "check_image", "dump_teacher_topk", "fail_on_error", "plan_dump",
           "plan_training", "preflight", "train_offline_student", "use_existing_store", "use_existing_student",
           "verification_failed", "verify_logits", "build_all"]


# The components that need an accelerator (dump, train); the others run on the CPU image.
ACCELERATED = ("dump_teacher_topk", "train_offline_student")
CPU = ("plan_dump", "preflight", "use_existing_store", "fail_on_error", "verify_logits", "verification_failed", "plan_training",
       "use_existing_student")


def build_all(image: str = DEFAULT_IMAGE, cpu_image: str | None = None) -> dict:
    """name -> component: dump and train on ``image``, the others on ``cpu_image`` (default: ``image``)."""
    check_image(image)
    cpu = check_image(cpu_image) if cpu_image else image
    modules = {"plan_dump": plan_dump, "dump_teacher_topk": dump_teacher_topk, "fail_on_error": fail_on_error,
               "use_existing_store": use_existing_store, "verify_logits": verify_logits,
               "verification_failed": verification_failed, "plan_training": plan_training, "preflight": preflight,
               "train_offline_student": train_offline_student, "use_existing_student": use_existing_student}
    return {name: module.build(image if name in ACCELERATED else cpu) for name, module in modules.items()}
