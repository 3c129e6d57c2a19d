"""KFP components of logit-distill: thin lightweight-component wrappers over the library.

One module per component. Each module holds the plain Python function (its body
is self-contained: imports inside, only ``logit_distill`` and the standard
library, so ``kfp.local``'s SubprocessRunner and the container run the same
source) and a ``build(image)`` factory that turns it into a
``@dsl.component`` on our image (``install_kfp_package=False``, no
``packages_to_install``). The module-level component objects use
``DEFAULT_IMAGE``; ``pipelines.compile --image`` rebuilds them on another image.
"""

from .image import DEFAULT_IMAGE, check_image
from . import dump_teacher_topk, plan_dump, train_offline_student, verify_logits

__all__ = ["DEFAULT_IMAGE", "check_image", "dump_teacher_topk", "plan_dump", "train_offline_student",
           "verify_logits", "build_all"]


def build_all(image: str = DEFAULT_IMAGE) -> dict:
    """name -> component, every component built on ``image``."""
    check_image(image)
    return {
        "plan_dump": plan_dump.build(image),
        "dump_teacher_topk": dump_teacher_topk.build(image),
        "verify_logits": verify_logits.build(image),
        "train_offline_student": train_offline_student.build(image),
    }
