"""What Vertex AI would reject in a set of pipeline parameters, found before anything is submitted.

Each problem is one line, said as ``submit`` says it. A mistake found here costs nothing; the same mistake
found by Vertex costs a run: a custom job that cannot be created fails its task only after the plan, the
dump or the verification before it, and a path on the submitting machine's disk does not exist in a job.
"""

from __future__ import annotations

import re

from pipelines import machines

# Parameters that name something the jobs read or write: they must be in Cloud Storage (gs://) on Vertex.
# name -> other accepted forms (prefixes), and whether empty is allowed.
CLOUD_PATHS = {
    "teacher": (("preset:",), False),
    "data": ((), False),
    "student": (("preset:", "flax:"), False),
    "output_root": ((), False),
    "store": ((), False),
    "eval_data": ((), True),
    "eval_teacher": (("preset:",), True),
    "eval_store": ((), True),
    "tokenizer": ((), True),
    "base_output_directory": ((), True),
}
DURATIONS = ("dump_timeout", "dump_max_wait_duration", "train_timeout", "train_max_wait_duration")
# https://cloud.google.com/vertex-ai/docs/reference/rest/v1/projects.locations.models/upload (versionAliases)
VERSION_ALIAS = re.compile(r"[a-z][a-zA-Z0-9-]{0,126}[a-z0-9]")
MODEL_NAME = re.compile(r"projects/[^/]+/locations/[^/]+/models/[^/@]+")
TENSORBOARD_NAME = re.compile(r"projects/[^/]+/locations/[^/]+/tensorboards/[^/]+")
# Google Cloud labels (keys start with a lowercase letter; both at most 63 characters).
LABEL_KEY = re.compile(r"[a-z][a-z0-9_-]{0,62}")
LABEL_VALUE = re.compile(r"[a-z0-9_-]{0,63}")
# An experiment is a Vertex ML Metadata context: aiplatform_v1 CreateContextRequest.context_id.
EXPERIMENT = re.compile(r"[a-z0-9-]{4,128}")


def problems(values: dict, variant: str) -> list[str]:
    """Every problem of ``values`` (all of the variant's parameters, defaults included), one line each."""
    found = []
    for name, (other_forms, empty_ok) in CLOUD_PATHS.items():
        if name in values:
            found += _cloud_path(name, str(values[name]), other_forms, empty_ok)
    for name in DURATIONS:
        if name in values and not re.fullmatch(r"\d+s", str(values[name])):
            found.append(f"{name}={values[name]!r} is not a duration in seconds (e.g. 86400s)")
    for job in ("dump", "train"):
        if f"{job}_machine_type" in values:
            found += machines.problems(job, values[f"{job}_machine_type"], values[f"{job}_accelerator_type"],
                                       values[f"{job}_accelerator_count"], values[f"{job}_tpu_topology"])
            found += reservation_problems(f"{job}_reservation_affinity", values[f"{job}_reservation_affinity"])
    found += label_problems("job_labels", values.get("job_labels") or {})
    if values.get("register_model") and not values.get("serving_image"):
        found.append("register_model=true needs serving_image (the model's serving container)")
    for alias in values.get("model_version_aliases") or []:
        if not isinstance(alias, str) or not VERSION_ALIAS.fullmatch(alias):
            found.append(f"model_version_aliases: {alias!r} is not a version alias ([a-z][a-zA-Z0-9-]{{0,126}}"
                         "[a-z0-9]: a lowercase letter first, a lowercase letter or digit last)")
    parent = values.get("parent_model") or ""
    if parent and not MODEL_NAME.fullmatch(parent):
        found.append(f"parent_model={parent!r} is not a model's resource name (projects/P/locations/R/models/ID)")
    tensorboard = values.get("tensorboard") or ""
    if tensorboard:
        if not TENSORBOARD_NAME.fullmatch(tensorboard):
            found.append(f"tensorboard={tensorboard!r} is not a TensorBoard instance's resource name "
                         "(projects/P/locations/R/tensorboards/ID)")
        if not str(values.get("base_output_directory", "")).startswith("gs://"):
            found.append("tensorboard needs base_output_directory=gs://... (where Vertex writes its logs)")
    return found


def _cloud_path(name: str, value: str, other_forms: tuple[str, ...], empty_ok: bool) -> list[str]:
    if (empty_ok and not value) or value.startswith("gs://") or value.startswith(other_forms):
        return []
    if not value:
        return [f"{name} is empty: give a gs:// path"]
    forms = " or ".join(["gs://..."] + [f"{f}..." for f in other_forms])
    return [f"{name}={value!r} is not in Cloud Storage: a Vertex job cannot read this machine's disk; give "
            f"{forms}"]


def reservation_problems(name: str, value) -> list[str]:
    """Why ``value`` is not a ReservationAffinity Vertex accepts (empty: none; parsed with aiplatform_v1's type)."""
    if not value:
        return []
    from google.cloud.aiplatform_v1.types import ReservationAffinity

    shape = ('{"reservation_affinity_type": "SPECIFIC_RESERVATION", "key": '
             '"compute.googleapis.com/reservation-name", "values": ["projects/P/zones/Z/reservations/R"]}')
    try:
        affinity = ReservationAffinity(value)
    except (TypeError, ValueError, KeyError) as e:
        why = " ".join(str(e).split())[:120]
        return [f"{name}={_json(value)} is not a ReservationAffinity ({why}); give e.g. {shape}"]
    kind = ReservationAffinity.Type(affinity.reservation_affinity_type).name
    if kind == "TYPE_UNSPECIFIED":
        return [f"{name}={_json(value)} has no reservation_affinity_type (NO_RESERVATION, ANY_RESERVATION or "
                f"SPECIFIC_RESERVATION); give e.g. {shape}"]
    if kind == "SPECIFIC_RESERVATION" and (not affinity.key or not list(affinity.values)):
        return [f"{name}={_json(value)}: SPECIFIC_RESERVATION needs key and values; give e.g. {shape}"]
    if kind != "SPECIFIC_RESERVATION" and (affinity.key or list(affinity.values)):
        return [f"{name}={_json(value)}: key and values go with SPECIFIC_RESERVATION only"]
    return []


def label_problems(name: str, labels: dict) -> list[str]:
    for key, value in labels.items():
        if not LABEL_KEY.fullmatch(str(key)) or not isinstance(value, str) or not LABEL_VALUE.fullmatch(value):
            return [f"{name}: {key!r}: {value!r} is not a label (lowercase letters, digits, _ or -; keys start "
                    "with a letter; both at most 63 characters)"]
    return []


def experiment_problem(name: str) -> str | None:
    if EXPERIMENT.fullmatch(name):
        return None
    return (f"--experiment {name!r} is not a Vertex AI Experiment name (4 to 128 lowercase letters, digits or "
            "-, e.g. qwen3-kd)")


def _json(value) -> str:
    import json

    return json.dumps(value, sort_keys=True)
