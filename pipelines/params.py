"""The pipeline's parameters, in one place.

Every parameter of both pipeline variants is one ``Param`` row below: its type,
its default, the components and inputs it feeds, its allowed values and its
description. Everything else derives from this table:

- both pipeline signatures and their docstrings (``pipeline_function``): kfp
  reads the Google-style ``Args:`` into the compiled YAML's parameter
  descriptions, which the Vertex UI shows;
- the DAG's wiring (``args_for(component, p)``: the component inputs a
  parameter feeds, renamed where the component calls it otherwise);
- the components' input descriptions (``describe``) and a test that the
  components' own defaults agree with the table;
- ``pipelines.submit`` and ``pipelines.run_local``: typing ``name=value``
  strings, refusing values out of range or not among the choices (``check``);
- the parameter table in docs/PIPELINE.md (``markdown_table``, rewritten by
  ``make compile``).

To add a parameter: add a row (and the input to the component functions it
feeds), then ``make compile``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from typing import Any, Callable

# Component names (the keys of ``components.build_all``).
PLAN, DUMP, VERIFY, TRAIN = "plan_dump", "dump_teacher_topk", "verify_logits", "train_offline_student"
TRAIN_PLAN = "plan_training"  # the CPU task before each training: its folder, and whether it is done
PREFLIGHT = "preflight"  # the CPU task after the dump's plan: the dump and the KD training checked (its inputs:
                         # plan_dump's, and plan_training's prefixed train_)

REQUIRED = inspect.Parameter.empty
# The variants: the pipelines that dump (local: plain components for kfp.local and Kubeflow; vertex: custom
# jobs) and the two that start from an existing store.
VARIANTS = ("local", "vertex", "from_store", "from_store_vertex")
NAMES = {"local": "logit-distill", "vertex": "logit-distill-vertex", "from_store": "logit-distill-from-store",
         "from_store_vertex": "logit-distill-from-store-vertex"}  # variant -> pipeline name
BOTH = ("local", "vertex")  # the pipelines that dump
ALL = VARIANTS
LOCAL = ("local",)
VERTEX = ("vertex", "from_store_vertex")  # dump and / or training as Vertex AI custom jobs
VERTEX_DUMP = ("vertex",)
FROM_STORE = ("from_store", "from_store_vertex")
PLAIN = ("local", "from_store")  # plain components, resources as task requests

# Parameters renamed so that each says its stage: the old name -> the new one (refused with a hint).
RENAMED = {
    "num_steps": "dump_num_steps", "batch_size": "dump_batch_size", "dtype": "dump_dtype",
    "sharding": "dump_sharding", "model_parallel": "dump_model_parallel", "attention": "dump_attention",
    "device_batch": "dump_device_batch", "vocab_chunk": "dump_vocab_chunk",
    "lease_timeout_s": "dump_lease_timeout_s", "train_steps": "train_num_steps",
}


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    type: type
    default: Any  # REQUIRED: no default
    help: str
    to: dict[str, str] = dataclasses.field(default_factory=dict)  # component -> its input name
    variants: tuple[str, ...] = BOTH
    vertex_default: Any = None  # another default in the Vertex variant (None: the same)
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    exclusive: bool = False  # min and max themselves are refused (an open interval)
    group: str = ""

    def default_in(self, variant: str) -> Any:
        if variant in VERTEX and self.vertex_default is not None:
            return self.vertex_default
        return self.default

    def problem(self, value: Any, variant: str = "vertex") -> str | None:
        """Why ``value`` is not acceptable for this parameter, or None."""
        if self.type is float and isinstance(value, (int, float)) and not math.isfinite(value):
            return f"{self.name}={value!r} is not a finite number"
        if self.choices is not None and value not in self.choices:
            return f"{self.name}={value!r} is not one of {', '.join(repr(c) for c in self.choices)}"
        if self.exclusive and ((self.min is not None and value <= self.min) or
                               (self.max is not None and value >= self.max)):
            return f"{self.name}={value!r} is not in the open interval ({self.min:g}, {self.max:g})"
        if self.min is not None and value < self.min:
            return f"{self.name}={value!r} is below its minimum {self.min:g}"
        if self.max is not None and value > self.max:
            return f"{self.name}={value!r} is above its maximum {self.max:g}"
        return None


# The --loss choices of training from a store (the full_* losses need an online teacher).
OFFLINE_LOSSES = ("topk_kl", *(f"topk_tail_{d}" for d in ("kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl",
                                                         "tv")),
                  *(f"sampled_{d}" for d in ("kl", "jsd", "skew_kl", "skew_reverse_kl", "tv")), "hybrid_kl")


def _to(*components: str, **renamed: str) -> dict[str, str]:
    """Components fed under the parameter's own name, plus ``component=input_name`` renames."""
    out = {c: "" for c in components}
    out.update(renamed)
    return out


ACCELERATORS_HELP = ("Vertex accelerator enum name (NVIDIA_H100_80GB, NVIDIA_L4, TPU_V5_LITEPOD, ...; "
                     "ACCELERATOR_TYPE_UNSPECIFIED with count 0 for a CPU machine)")

def _job_params(job: str, what: str, strategy: str) -> tuple[Param, ...]:
    """The Vertex custom-job settings of the dump or the training job."""
    v = dict(variants=VERTEX_DUMP if job == "dump" else VERTEX, group="vertex")
    return (
        Param(f"{job}_machine_type", str, "a3-highgpu-8g", f"Machine type of each {what} host (GPU: "
              "a3-highgpu-8g, g2-standard-24, ...; TPU: ct5lp-hightpu-4t, ct6e-standard-4t, ...).", **v),
        Param(f"{job}_tpu_topology", str, "", f"TPU slice topology of the {what} job (e.g. 4x4, 2x2x2); empty for "
              "GPUs. A multi-host slice runs one process per host.", **v),
        Param(f"{job}_strategy", str, strategy, f"Scheduling of the {what} job: SPOT (preemptible), STANDARD or "
              "FLEX_START (waits up to max_wait_duration for capacity).",
              choices=("SPOT", "STANDARD", "FLEX_START"), **v),
        Param(f"{job}_timeout", str, "604800s", f"Longest the {what} job may run (seconds, e.g. 604800s = 7 days).",
              **v),
        Param(f"{job}_max_wait_duration", str, "86400s", "FLEX_START: longest wait for the machines (seconds).",
              **v),
        Param(f"{job}_boot_disk_type", str, "pd-ssd", f"Boot disk type of each {what} host.", **v),
        Param(f"{job}_boot_disk_size_gb", int, 100, f"Boot disk size of each {what} host, in GB.", min=10, **v),
        Param(f"{job}_reservation_affinity", dict, {}, f"Reservation affinity of the {what} hosts, as Vertex's "
              "ReservationAffinity: {\"reservation_affinity_type\": \"SPECIFIC_RESERVATION\", \"key\": "
              "\"compute.googleapis.com/reservation-name\", \"values\": [\"projects/P/zones/Z/reservations/R\"]} "
              "(empty: none).", **v),
    )


# fmt: off
PARAMS: tuple[Param, ...] = (
    # ---- inputs
    Param("teacher", str, REQUIRED, "Teacher model: an HF checkpoint folder or gs:// prefix (config.json, "
          "*.safetensors, tokenizer.json) or preset:NAME.", _to(PLAN, DUMP, VERIFY), group="inputs"),
    Param("data", str, REQUIRED, "Training data: JSONL text or pre-tokenized ArrayRecord (file, glob or folder; "
          "local or gs://).", _to(PLAN, DUMP, VERIFY), group="inputs"),
    Param("student", str, REQUIRED, "Student: an HF checkpoint folder or gs:// prefix, preset:NAME, or "
          "flax:MODULE:FACTORY[?key=value&...] (a Flax NNX module importable in the image; docs/STUDENTS.md).",
          _to(TRAIN, TRAIN_PLAN), variants=ALL, group="inputs"),
    Param("output_root", str, REQUIRED, "Where the stores and students live (gs:// on Vertex): the store is "
          "<output_root>/teacher_topk/<dump_key>/, a student <output_root>/students/<train_key>/.",
          _to(PLAN, TRAIN, TRAIN_PLAN), variants=ALL, group="inputs"),
    Param("store", str, REQUIRED, "An existing logit store (local or gs://, written by the dump): the pipeline "
          "verifies it and trains from it.", variants=FROM_STORE, group="inputs"),
    Param("dump_num_steps", int, REQUIRED, "Dump steps (batches of dump_batch_size examples) the store covers "
          "(the training's steps are train_num_steps).",
          {PLAN: "num_steps", DUMP: "num_steps", VERIFY: "expected_steps"}, min=1, group="inputs"),
    # ---- the dump (every setting here but dump_sharding, dump_model_parallel, dump_attention,
    # dump_device_batch, dump_vocab_chunk and dump_lease_timeout_s changes the store's content, hence its key)
    Param("top_k", int, 0, "Teacher entries kept per token position: the exact head of a hybrid store (at most "
          "255; 0: 4) or the ids of a topk store (0: 64); a sampled store keeps samples ids instead.",
          _to(PLAN, DUMP), min=0, group="dump"),
    Param("seq_len", int, 512, "Tokens per example.", _to(PLAN, DUMP), vertex_default=2048, min=2, group="dump"),
    Param("dump_batch_size", int, 8, "Examples per dump step, across all hosts (the training's batch is "
          "train_batch_size).", {PLAN: "batch_size", DUMP: "batch_size"}, min=1, group="dump"),
    Param("steps_per_file", int, 50, "Dump steps per store chunk (the unit of resume).", _to(PLAN, DUMP), min=1,
          group="dump"),
    Param("codec", str, "default", "Store codec: default (ids bit-packed, log-probs as 16-bit fixed point; "
          "docs/FORMAT.md) or exact (float32 log-probs).",
          _to(PLAN, DUMP), choices=("default", "exact"), group="dump"),
    Param("selection", str, "hybrid", "What the store keeps per position: hybrid (the exact top_k head + tail "
          "mass and samples draws from the rest: unbiased, noise in the tail only; its defaults matched top-64 + "
          "tail in held-out KL at 36.5 bytes per position against 213, docs/BENCHMARKS.md), topk (the top_k most "
          "likely ids + the tail mass) or sampled (samples ids drawn from the teacher, with counts: unbiased).",
          _to(PLAN, DUMP), choices=("topk", "sampled", "hybrid"), group="dump"),
    Param("samples", int, 0, "Draws per position from the tail of a hybrid store (0: 16), or of a sampled store "
          "(required there: no sampled setting has a measured default).", _to(PLAN, DUMP), min=0, max=65535,
          group="dump"),
    Param("proposal_temperature", float, 1.0, "Sampled and hybrid stores draw from the teacher at this temperature.",
          _to(PLAN, DUMP), min=1e-6, group="dump"),
    Param("tail_temperatures", str, "", "Top-k stores: comma-separated temperatures whose tempered tail mass is "
          "also stored, for topk_tail_kl at temperature != 1 (empty: none).", _to(PLAN, DUMP), group="dump"),
    Param("data_seed", int, 0, "Seed of the example order (and of a sampled store's draws).", _to(PLAN, DUMP),
          min=0, group="dump"),
    Param("packing", bool, True, "Pack documents into examples (with segment ids).", _to(PLAN, DUMP),
          group="dump"),
    Param("dump_dtype", str, "float32", "The teacher's compute dtype in the dump.",
          {PLAN: "dtype", DUMP: "dtype"}, vertex_default="bfloat16", choices=("float32", "bfloat16"), group="dump"),
    Param("text_field", str, "text", "JSONL field holding the text.", _to(PLAN, DUMP), group="dump"),
    Param("data_format", str, "auto", "What the data's records hold: auto (messages if they have the messages "
          "field, prompt_completion if they have prompt and completion, else text), text, messages or "
          "prompt_completion (docs/DATA.md, Conversations).", _to(PLAN, DUMP),
          choices=("auto", "text", "messages", "prompt_completion"), group="dump"),
    Param("messages_field", str, "messages", "Field of a conversation's messages.", _to(PLAN, DUMP), group="dump"),
    Param("chat_template", str, "", "A Jinja chat template file (local or gs://) for conversations (empty: the "
          "tokenizer's chat_template.jinja, else tokenizer_config.json's chat_template).", _to(PLAN, DUMP),
          group="dump"),
    Param("chat_template_kwargs", str, "", "The template's keyword arguments as a JSON object, e.g. "
          "{\"enable_thinking\": false} (empty: none).", _to(PLAN, DUMP), group="dump"),
    Param("supervise_roles", str, "assistant", "Comma-separated roles whose turns are stored and trained (others "
          "than assistant use the prefix mask method).", _to(PLAN, DUMP), group="dump"),
    Param("supervise_end_of_turn", bool, True, "Train the end-of-turn token of a supervised turn (the student "
          "learns to stop).", _to(PLAN, DUMP), group="dump"),
    Param("mask_empty_reasoning", bool, True, "Leave out the tokens of the empty reasoning blocks that templates "
          "insert themselves.", _to(PLAN, DUMP), group="dump"),
    Param("mask_method", str, "auto", "How the supervised tokens are found: generation (the template's "
          "{% generation %} markers), prefix (rendering prefixes) or auto (markers when the template has them).",
          _to(PLAN, DUMP), choices=("auto", "generation", "prefix"), group="dump"),
    Param("tokenizer", str, "", "tokenizer.json to use instead of the teacher's (empty: the teacher's).",
          _to(PLAN, DUMP, VERIFY), group="dump"),
    Param("dump_sharding", str, "replicate", "The teacher's parameters over the dump's devices: replicate, fsdp "
          "(sharded over the data axis), tensor (heads and MLP columns over all the devices of a host, a mixture's "
          "experts too), fsdp+tensor, expert (a mixture's experts over the model axis, the rest replicated) or "
          "fsdp+expert.", {DUMP: "sharding"}, vertex_default="fsdp",
          choices=("replicate", "fsdp", "tensor", "fsdp+tensor", "expert", "fsdp+expert"), group="dump"),
    Param("dump_model_parallel", int, 0, "Devices of the dump mesh's model axis with dump_sharding tensor, "
          "fsdp+tensor, expert or fsdp+expert (0: all the devices of a host).", {DUMP: "model_parallel"}, min=0,
          group="dump"),
    Param("dump_attention", str, "auto", "The teacher's attention in the dump: auto (per backend and sequence "
          "length), dense, blocked "
          "(never builds the [L, L] scores; the CPU choice for long sequences), pallas_gpu (the Pallas flash "
          "kernel; GPU) or pallas_tpu (splash attention; TPU); the kernels with dump_sharding replicate.",
          {DUMP: "attention"},
          choices=("auto", "dense", "blocked", "pallas_gpu", "pallas_tpu"), group="dump"),
    Param("dump_device_batch", int, 0, "Examples per kernel on each device of the dump with dump_sharding "
          "replicate; must divide dump_batch_size / devices (0: the backend's default, 1 on CPU, 8 elsewhere).",
          {DUMP: "device_batch"}, min=0,
          group="dump"),
    Param("dump_vocab_chunk", int, 0, "Vocabulary entries per chunk of the teacher's output head and "
          "selection in the dump (0: 32768; smaller bounds the selection's memory for large vocabularies).",
          {DUMP: "vocab_chunk"}, min=0,
          group="dump"),
    # min: the holder rewrites the lease every quarter of it, and GCS takes about one write per second per
    # object; max: a retried dump may wait this long, its machines idle, for a gone attempt's lease.
    Param("dump_lease_timeout_s", float, 120.0, "Seconds without a refresh after which the dump's lease on its "
          "store is stale (its holder refreshes it every quarter of this). A retried dump that finds the "
          "lease of an earlier attempt waits until it would be stale: not refreshed meanwhile (the attempt's "
          "machine is gone), it takes the lease over; refreshed, another dump is writing the store and the "
          "task fails.", {DUMP: "lease_timeout_s"}, min=10.0, max=3600.0, group="dump"),
    # ---- verification
    Param("verify_sample", int, 256, "Records whose values verify reads in full.", {VERIFY: "sample"}, min=0,
          variants=ALL, group="verify"),
    Param("spot_check", int, 0, "Store steps recomputed with the teacher and compared (0: none).",
          {VERIFY: "spot_check"}, min=0, group="verify"),
    # ---- training
    Param("train_num_steps", int, 1000, "Student optimizer steps (the dump's steps are dump_num_steps).",
          {TRAIN: "num_steps", TRAIN_PLAN: "num_steps"}, min=1, variants=ALL,
          group="train"),
    Param("train_batch_size", int, 8, "Student examples per micro-step, over all devices (an optimizer step "
          "reads grad_accum micro-steps).", {TRAIN: "batch_size", TRAIN_PLAN: "batch_size"}, min=1,
          variants=ALL, group="train"),
    Param("learning_rate", float, 3e-4, "Peak AdamW learning rate.", _to(TRAIN, TRAIN_PLAN), min=0.0,
          variants=ALL, group="train"),
    Param("warmup_steps", int, -1, "Learning-rate warm-up steps (-1: the default, min(100, train_num_steps // "
          "10)).", _to(TRAIN, TRAIN_PLAN),
          min=-1, variants=ALL, group="train"),
    Param("train_seed", int, 0, "Seed of the training shuffle.", {TRAIN: "seed", TRAIN_PLAN: "seed"}, min=0,
          variants=ALL, group="train"),
    Param("loss", str, "", "KD loss (docs/LOSSES.md); empty: the store's default, hybrid_kl for a hybrid "
          "store, topk_tail_kl for a top-k one, sampled_kl for a sampled one.", _to(TRAIN, TRAIN_PLAN),
          choices=("", *OFFLINE_LOSSES), variants=ALL, group="train"),
    Param("alpha", float, 1.0, "Weight of the KD loss; 1 - alpha weighs the next-token cross-entropy.",
          _to(TRAIN, TRAIN_PLAN), min=0.0, max=1.0, variants=ALL, group="train"),
    Param("alpha_end", float, -1.0, "alpha at the last step with a linear or cosine alpha_schedule "
          "(-1: alpha).", _to(TRAIN, TRAIN_PLAN), min=-1.0, max=1.0, variants=ALL, group="train"),
    Param("alpha_schedule", str, "constant", "How alpha moves to alpha_end.", _to(TRAIN, TRAIN_PLAN),
          choices=("constant", "linear", "cosine"), variants=ALL, group="train"),
    Param("temperature", float, 1.0, "KD temperature T (the KD loss is scaled by T^2).", _to(TRAIN, TRAIN_PLAN),
          min=1e-6, variants=ALL, group="train"),
    Param("jsd_beta", float, 0.5, "The *_jsd losses (topk_tail_jsd, sampled_jsd): the weight beta of the mixture "
          "m = beta p + (1 - beta) q (p the teacher's distribution, q the student's) in their generalized JSD, "
          "beta KL(p || m) + (1 - beta) KL(q || m) (0.5: the Jensen-Shannon divergence); in (0, 1). Part of the "
          "train key only with a *_jsd loss.", _to(TRAIN, TRAIN_PLAN), min=0.0, max=1.0, exclusive=True,
          variants=ALL, group="train"),
    Param("skew", float, 0.1, "The *_skew_kl / *_skew_reverse_kl losses: the weight a of their mixture, "
          "KL(p || a p + (1 - a) q) and KL(q || a q + (1 - a) p); in (0, 1). Part of the train key only with a "
          "*_skew_* loss.", _to(TRAIN, TRAIN_PLAN), min=0.0, max=1.0, exclusive=True, variants=ALL,
          group="train"),
    Param("allow_biased_temperature", bool, False, "Accept a sampled_* loss at a temperature other than the "
          "store's proposal_temperature (refused by default: the importance weights are then self-normalised, a "
          "biased gradient; the training logs the bias measured for its number of draws). For the sampled_* "
          "losses only: refused with a loss of another kind given. Part of the train key when set.",
          _to(TRAIN, TRAIN_PLAN), variants=ALL, group="train"),
    Param("checkpoint_every", int, 500, "Optimizer steps between checkpoints.", _to(TRAIN), min=1,
          variants=ALL, group="train"),
    Param("grad_accum", int, 1, "Micro-batches accumulated per optimizer step.", _to(TRAIN, TRAIN_PLAN), min=1,
          variants=ALL, group="train"),
    Param("eval_data", str, "", "Held-out data for the student's cross-entropy (empty: no evaluation).",
          _to(TRAIN, TRAIN_PLAN), variants=ALL, group="train"),
    Param("eval_teacher", str, "", "With eval_data: a teacher (an HF checkpoint folder or gs:// prefix, or "
          "preset:NAME) run on it after training: KL(teacher || student) over the full vocabulary, top-1 "
          "agreement, the student's mass on the teacher's top-k and the tail-shape KL outside it (k: the store's "
          "top_k for a top-k store, else 64), in the metrics (eval_teacher_*), the report and eval.json (empty: "
          "none). Not part of the train key, as eval_data: the training task of a complete student not yet "
          "measured against it runs again, from its last checkpoint, to evaluate it.",
          _to(TRAIN, TRAIN_PLAN), variants=ALL, group="train"),
    Param("eval_store", str, "", "A held-out logit store (local or gs://; complete, of the training store's "
          "vocabulary, seq_len and tokenizer) evaluated after training: the student's cross-entropy on its "
          "examples and, against its teacher values, the KL over its k + 1 bins (a lower bound), top-1 agreement "
          "and top-k mass (a top-k store, or a hybrid store's head) or the KL estimated from its draws (a sampled "
          "store at proposal temperature 1), in the metrics (eval_*, eval_teacher_*), the report and eval.json "
          "(empty: none). Excludes eval_data. Not part of the train key, as eval_data.",
          _to(TRAIN, TRAIN_PLAN), variants=ALL, group="train"),
    Param("allow_tokenizer_mismatch", bool, False, "Train a student whose tokenizer.json differs from the one "
          "the store's data was tokenized with (refused by default, naming the first differing ids); the "
          "export then ships the student's tokenizer.", _to(TRAIN, TRAIN_PLAN), variants=ALL, group="train"),
    Param("ce_baseline", bool, False, "Also train a CE-only student (alpha = 0) on the same steps, to compare.",
          variants=ALL, group="train"),
    # ---- resources of the plain (kfp.local / Kubeflow) variant
    Param("dump_cpu", str, "4", "CPU request of the dump task.", variants=LOCAL, group="resources"),
    Param("dump_memory", str, "16G", "Memory request of the dump task.", variants=LOCAL, group="resources"),
    Param("dump_accelerator_type", str, "", "Accelerator of the dump (Kubeflow: e.g. nvidia.com/gpu; Vertex: "
          + ACCELERATORS_HELP + ").", vertex_default="NVIDIA_H100_80GB", group="resources"),
    Param("dump_accelerator_count", int, 0, "Accelerators per dump host.", vertex_default=8, min=0,
          group="resources"),
    Param("train_cpu", str, "4", "CPU request of the training task.", variants=PLAIN, group="resources"),
    Param("train_memory", str, "16G", "Memory request of the training task.", variants=PLAIN, group="resources"),
    Param("train_accelerator_type", str, "", "Accelerator of the training (as dump_accelerator_type).",
          vertex_default="NVIDIA_H100_80GB", variants=ALL, group="resources"),
    Param("train_accelerator_count", int, 0, "Accelerators per training host.", vertex_default=8, min=0,
          variants=ALL, group="resources"),
    # ---- Vertex AI custom jobs (one set per job: _job_params below)
    *_job_params("dump", "dump", strategy="SPOT"),
    *_job_params("train", "training", strategy="STANDARD"),
    Param("job_labels", dict, {}, "Labels of the dump and training custom jobs (submit --labels sets them and "
          "the pipeline job's).", variants=VERTEX, group="vertex"),
    Param("tensorboard", str, "", "Vertex AI TensorBoard instance (projects/P/locations/R/tensorboards/ID) the "
          "training job streams to; needs base_output_directory.", variants=VERTEX, group="vertex"),
    Param("base_output_directory", str, "", "gs:// folder of the training job's Vertex outputs (TensorBoard "
          "logs under it when tensorboard is set).", variants=VERTEX, group="vertex"),
    Param("verify_cpu", str, "8", "CPU request of the verify task.", variants=VERTEX, group="vertex"),
    Param("verify_memory", str, "32G", "Memory request of the verify task.", variants=VERTEX, group="vertex"),
    # ---- Vertex AI Model Registry
    Param("register_model", bool, False, "Upload the KD student's Hugging Face export to the Model Registry.",
          variants=VERTEX, group="registry"),
    Param("model_display_name", str, "logit-distill-student", "Display name of the registered model.",
          variants=VERTEX, group="registry"),
    Param("serving_image", str, "", "Serving container of the registered model (e.g. a vLLM image, pinned); "
          "required with register_model.", variants=VERTEX, group="registry"),
    Param("model_version_aliases", list, [], "Version aliases of the registered model version (e.g. "
          "[\"candidate\"]; each [a-z][a-zA-Z0-9-]{0,126}[a-z0-9]).", variants=VERTEX, group="registry"),
    Param("parent_model", str, "", "The registered model to upload the student as a new version of "
          "(projects/P/locations/R/models/ID; empty: a new model each run).", variants=VERTEX, group="registry"),
)
# fmt: on

BY_NAME = {p.name: p for p in PARAMS}
assert len(BY_NAME) == len(PARAMS), "a parameter is listed twice"


def of(variant: str) -> list[Param]:
    """The parameters of a variant, in the table's order."""
    return [p for p in PARAMS if variant in p.variants]


def defaults(variant: str) -> dict:
    """name -> default of every parameter with one."""
    return {p.name: p.default_in(variant) for p in of(variant) if p.default_in(variant) is not REQUIRED}


def required(variant: str) -> list[str]:
    return [p.name for p in of(variant) if p.default_in(variant) is REQUIRED]


def args_for(component: str, p: dict) -> dict:
    """The inputs of ``component`` fed by pipeline parameters: ``{input_name: p[param]}``."""
    out = {}
    for param in PARAMS:
        if component in param.to and param.name in p:
            out[param.to[component] or param.name] = p[param.name]
    return out


def inputs_of(component: str) -> dict[str, Param]:
    """``{input_name: Param}`` of the inputs of ``component`` that pipeline parameters feed."""
    return {(param.to[component] or param.name): param for param in PARAMS if component in param.to}


# ---------------------------------------------------------------- the pipeline functions


def docstring(summary: str, variant: str) -> str:
    """A Google-style docstring whose ``Args:`` describe every parameter (kfp compiles them into the YAML)."""
    lines = [summary, "", "Args:"]
    for p in of(variant):
        lines.append(f"    {p.name}: {_described(p, variant)}")
    return "\n".join(lines) + "\n"


def _described(p: Param, variant: str) -> str:
    text = p.help
    if p.choices is not None:
        text += " One of: " + ", ".join('""' if c == "" else str(c) for c in p.choices) + "."
    if p.default_in(variant) is REQUIRED:
        text += " Required."
    return text


def pipeline_function(variant: str, name: str, summary: str, body: Callable[[dict], None]) -> Callable:
    """A function with the variant's parameters as its signature (required ones first) and docstring,
    calling ``body({name: value})``; ``dsl.pipeline`` turns it into the pipeline."""
    ps = of(variant)
    ordered = [p for p in ps if p.default_in(variant) is REQUIRED] + \
              [p for p in ps if p.default_in(variant) is not REQUIRED]
    names = [p.name for p in ordered]

    def pipeline(*args):
        return body(dict(zip(names, args)))

    pipeline.__signature__ = inspect.Signature([
        inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default_in(variant),
                          annotation=p.type) for p in ordered])
    pipeline.__doc__ = docstring(summary, variant)
    pipeline.__name__ = pipeline.__qualname__ = name.replace("-", "_")
    return pipeline


def input_descriptions(component: str, prefix: str = "") -> dict[str, str]:
    """``{prefix + input_name: description}`` of the inputs of ``component`` that pipeline parameters feed
    (for a component that takes another's inputs, e.g. the preflight's)."""
    return {prefix + name: _described(param, "local").replace(" Required.", "")
            for name, param in inputs_of(component).items()}


def describe(func: Callable, extra: dict[str, str] | None = None) -> Callable:
    """Give a component function a Google-style ``Args:`` docstring: the descriptions of the inputs that
    pipeline parameters feed, from the table, plus ``extra`` (the component's own inputs). The function
    is returned (its source, which the component runs, is untouched)."""
    component = func.__name__
    base = (getattr(func, "__ld_summary__", None) or inspect.getdoc(func) or "").split("\nArgs:")[0].rstrip()
    func.__ld_summary__ = base
    fed = inputs_of(component)
    lines = [base, "", "Args:"]
    for arg in inspect.signature(func).parameters:
        if arg in fed:
            lines.append(f"    {arg}: {_described(fed[arg], 'local').replace(' Required.', '')}")
        elif extra and arg in extra:
            lines.append(f"    {arg}: {extra[arg]}")
    func.__doc__ = "\n".join(lines) + "\n"
    return func


# ---------------------------------------------------------------- name=value strings (submit, run_local)


def parse_value(param: Param, text: str) -> Any:
    """The typed value of ``text`` for ``param``; ValueError with a one-line reason."""
    try:
        if param.type is bool:
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return low in ("true", "1", "yes")
        if param.type is int:
            return int(text)
        if param.type is float:
            return float(text)
        if param.type in (dict, list):
            value = json.loads(text)
            if not isinstance(value, param.type):
                raise ValueError
            return value
    except ValueError:
        raise ValueError(f"{param.name}={text!r} is not a valid {param.type.__name__}") from None
    return text


def parse_pairs(pairs: list[str], variant: str) -> dict:
    """``["name=value", ...]`` -> ``{name: typed value}``, checked against the variant's parameters."""
    known = {p.name: p for p in of(variant)}
    values = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"expected name=value, got {pair!r}")
        if name not in known:
            raise ValueError(renamed_hint(name, known) or
                             f"unknown parameter {name!r}; the pipeline has: {', '.join(sorted(known))}")
        values[name] = parse_value(known[name], text)
    return values


def renamed_hint(name: str, known) -> str | None:
    """The one line that refuses an old parameter name and names the new one (None: not an old name)."""
    new = RENAMED.get(name)
    if new is None or new not in known:
        return None
    return f"parameter {name!r} is now {new!r} (each parameter names its stage): give {new}=..."


def check(values: dict, variant: str) -> list[str]:
    """Problems of a set of values (missing required ones, choices, ranges, and what Vertex needs), one line
    each. Values not given are taken at their defaults."""
    known = {p.name: p for p in of(variant)}
    problems = [f"missing required parameter {n} (give {n}=...)" for n in required(variant) if n not in values]
    for name, value in values.items():
        if name in known:
            why = known[name].problem(value, variant)
            if why:
                problems.append(why)
    given = {**defaults(variant), **values}
    if given.get("eval_store") and (given.get("eval_data") or given.get("eval_teacher")):
        problems.append("eval_store holds its own held-out examples and the teacher's values on them; give "
                        "eval_store alone, or eval_data (with eval_teacher for the teacher's measures)")
    if given.get("eval_teacher") and not given.get("eval_data"):
        problems.append("eval_teacher runs the teacher on eval_data; give eval_data too")
    if variant in BOTH and given.get("selection") == "sampled" and not given.get("samples"):
        problems.append("selection sampled needs samples=N (draws per position, 1 to 65535): a sampled store has "
                        "no default N")
    if variant in VERTEX:
        from pipelines.vertex_checks import problems as vertex_problems

        problems += vertex_problems({**defaults(variant), **values}, variant)
    return problems


# ---------------------------------------------------------------- docs


def markdown_table() -> str:
    """The parameter table of docs/PIPELINE.md."""
    rows = ["| parameter | type | " + " | ".join(f"`{NAMES[v]}`" for v in VARIANTS) + " | description |",
            "| --- | --- | " + " | ".join("---" for _ in VARIANTS) + " | --- |"]

    def shown(p: Param, variant: str) -> str:
        if variant not in p.variants:
            return "-"
        d = p.default_in(variant)
        return "**required**" if d is REQUIRED else f"`{json.dumps(d)}`"

    for p in PARAMS:
        rows.append(f"| `{p.name}` | {p.type.__name__} | " + " | ".join(shown(p, v) for v in VARIANTS)
                    + f" | {_described(p, 'vertex').replace(' Required.', '').replace('|', '/')} |")
    return "\n".join(rows) + "\n"
