"""Where a pipeline's student trains: ``<output_root>/students/<train_key>/``.

The train key is a fingerprint of the store (its manifest fingerprint) and every
training setting, as the dump key is of the store's settings: a retried,
preempted or resubmitted training task with the same settings lands in the same
folder and resumes from its last checkpoint; other settings get another folder.
"""

from __future__ import annotations

import hashlib

from .. import paths
from ..store import manifest as manifest_mod

STUDENTS_DIR = "students"


def store_fingerprint(store_uri: str) -> str:
    uri = paths.join(store_uri, manifest_mod.MANIFEST_NAME)
    return manifest_mod.parse_manifest(paths.read_bytes(uri), uri)["fingerprint"]


def train_key(store_uri: str, settings: dict, *, fingerprint: str | None = None) -> str:
    """16 hex digits of SHA-256 over the store's fingerprint (read from ``store_uri``, or given: a planned
    store's) and ``settings`` (canonical JSON)."""
    text = manifest_mod.canonical_json({"store": fingerprint or store_fingerprint(store_uri), "settings": settings})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def train_output(output_root: str, store_uri: str, settings: dict) -> str:
    return paths.join(output_root, STUDENTS_DIR, train_key(store_uri, settings))


def training_settings(*, student: str, num_steps: int, batch_size: int, grad_accum: int, learning_rate: float,
                      warmup_steps: int, seed: int, loss: str, alpha: float, alpha_end: float,
                      alpha_schedule: str, temperature: float, allow_tokenizer_mismatch: bool = False,
                      jsd_beta: float = 0.5, skew: float = 0.1, allow_biased_temperature: bool = False) -> dict:
    """The settings a pipeline's train key covers, as its components give them (``-1`` / ``""``: defaults).

    As in the training's own identity (``plan.run_settings``): ``jsd_beta`` only with a ``*_jsd`` loss, ``skew``
    only with a ``*_skew_*`` one, ``allow_biased_temperature`` only when set (an empty ``loss``, the store's
    default, is neither). The evaluation settings (``eval_data``, ``eval_teacher``, ``eval_store``) are not
    in it: ``training_state`` says whether a folder holds the evaluation asked for."""
    settings = {"student": student, "num_steps": num_steps, "batch_size": batch_size, "grad_accum": grad_accum,
                "learning_rate": learning_rate, "warmup_steps": warmup_steps, "seed": seed, "loss": loss,
                "alpha": alpha, "alpha_end": alpha_end, "alpha_schedule": alpha_schedule,
                "temperature": temperature}
    if allow_tokenizer_mismatch:  # in the key only when set (as in the training's config): earlier folders resume
        settings["allow_tokenizer_mismatch"] = True
    # Recorded only where they apply, as in train_config.json: the keys of earlier folders are unchanged.
    if loss.endswith("_jsd"):
        settings["jsd_beta"] = float(jsd_beta)
    if "_skew_" in loss:
        settings["skew"] = float(skew)
    if allow_biased_temperature:
        settings["allow_biased_temperature"] = True
    return settings


def training_state(output: str, eval_data: str = "", eval_teacher: str = "", eval_store: str = "") -> str:
    """What a training folder holds: ``complete`` (the export written, and the evaluation asked for: on
    ``eval_data`` or ``eval_store``, against ``eval_teacher`` when given), ``exported, not evaluated on ...``,
    ``checkpoint at step N`` or ``empty``. Reads names only (and eval.json)."""
    import json

    held_out = eval_data or eval_store
    against = f"teacher {eval_teacher}" if eval_teacher else f"store {eval_store}" if eval_store else None
    for export, marker in (("hf", "config.json"), ("student", "student.json")):  # written last by the export
        if paths.exists(paths.join(output, export, marker)):
            if not held_out:
                return "complete"
            eval_uri = paths.join(output, "eval.json")
            done = json.loads(paths.read_bytes(eval_uri)) if paths.exists(eval_uri) else {}
            if done.get("data") == held_out and (against is None or done.get("teacher", {}).get("against") == against):
                return "complete"
            return f"exported, not evaluated on {held_out}" + (f" against {against}" if eval_teacher else "")
    fs, folder = paths.url_to_fs(paths.join(output, "checkpoints"))  # Orbax commits a step as a folder N
    names = [paths.basename(n) for n in fs.ls(folder, detail=False)] if fs.exists(folder) else []
    steps = [int(n) for n in names if n.isdigit()]
    return f"checkpoint at step {max(steps)}" if steps else "empty"
