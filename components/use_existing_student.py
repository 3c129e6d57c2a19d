"""``use_existing_student``: the branch the pipeline takes when ``plan_training`` found the training done.

No accelerator job starts: this CPU task hands the existing training folder on
as the run's ``Model`` artifact (its metadata: the export folder and, when the
folder holds one, the held-out evaluation of ``eval.json``) and the export
folder as ``hf_dir``, for the Model Registry upload.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Model, Output

from .image import DEFAULT_IMAGE


def use_existing_student(output: str, model: Output[Model]) -> NamedTuple("ExistingStudent", [("hf_dir", str)]):
    """The complete training folder ``output`` as the model; its export folder as ``hf_dir``."""
    import collections
    import json

    from logit_distill import paths

    export = next(paths.join(output, d) for d, marker in (("hf", "config.json"), ("student", "student.json"))
                  if paths.exists(paths.join(output, d, marker)))
    model.uri = output
    model.metadata.update({"export_dir": export, "hf_dir": export if export.endswith("/hf") else "",
                           "reused": True})
    eval_uri = paths.join(output, "eval.json")
    if paths.exists(eval_uri):
        model.metadata["eval"] = json.loads(paths.read_bytes(eval_uri))
    print(f"use_existing_student: {output} is complete; the training is skipped", flush=True)
    return collections.namedtuple("ExistingStudent", ["hf_dir"])(export)


INPUTS = {
    "output": "The complete training folder (from plan_training).",
    "model": "The training folder, reused: the export and the held-out evaluation as metadata.",
}


def build(image: str = DEFAULT_IMAGE):
    from pipelines.params import describe

    return dsl.component(describe(use_existing_student, INPUTS), base_image=image, install_kfp_package=False)


component = build()
