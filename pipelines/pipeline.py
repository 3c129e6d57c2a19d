"""The distillation pipelines: plan -> [dump, unless the store is complete] -> verify -> [train, unless done].

Four pipelines from one DAG, built by ``build_pipelines(image)``; their
parameters (signature, defaults, descriptions, which component input each
feeds, allowed values) come from one table, ``pipelines/params.py``:

- ``logit-distill`` (``distill_pipeline``): plain lightweight components with
  CPU / memory / accelerator requests as pipeline parameters. It runs under
  ``kfp.local`` (``make demo``, ``python -m pipelines.run_local``) and on
  Kubeflow Pipelines.
- ``logit-distill-vertex`` (``distill_pipeline_vertex``): the dump and the
  training run as Vertex AI custom jobs (google-cloud-pipeline-components'
  ``create_custom_training_job_from_component``) as the pipeline's own service
  account, in its network, with its encryption key (GCPC's run-time
  placeholders), with machine, accelerator, TPU topology, scheduling (Spot,
  FLEX_START), timeout, boot disk, reservation and labels as parameters, and
  the replica count (hosts), retry counts, the longest backoff between retries
  and the worker-restart policy as compile options. The custom jobs' launcher
  runs ``pipelines/launcher_guard.py`` first (typed job fields, and a task
  retry that creates a new job instead of re-attaching to the failed one).
  Optionally the KD student is uploaded to the Model Registry.
- ``logit-distill-from-store`` (``distill_from_store``): an existing store ->
  verify -> train (plain components).
- ``logit-distill-from-store-vertex`` (``distill_from_store_vertex``): the same
  with the training as a Vertex custom job, with the main Vertex pipeline's
  machine, identity, network and registry parameters.

The DAG, and what each task's cache does (Vertex's cache key of a task is its
input values and input artifact IDs, its output definitions and its
component's image, command and arguments; docs/PIPELINE.md, "What a resubmit
re-runs"):

1. ``plan-dump`` (CPU, never cached) names the store
   (``<output_root>/teacher_topk/<dump_key>``) and scans its names. Every
   setting is checked here, on the CPU image, before any accelerator job: a
   preflight task that checks the teacher, student, tokenizer, data and eval
   data goes right after it, before the dump and the training.
2. Store incomplete: ``dump-teacher-topk`` (an accelerator job, never cached: a
   hit would be stale by construction, since the dump only runs for an
   incomplete store) then ``dump-outcome`` (``fail_on_error``: the dump's
   deterministic failure ends the run with its own line, unretried). Store
   complete: ``use-existing-store`` (CPU).
3. ``import-store``: the store as a ``Dataset`` imported by its URI and state
   (``reimport=False``): the same artifact, hence the same cache key, for every
   run over the same store.
4. ``verify-logits`` (CPU, cached): a resubmit over a verified store is a hit.
5. Per student (the KD student, optionally a CE-only baseline):
   ``plan-<role>`` (CPU, never cached) names its training folder and reads
   whether it is done; not done: the training (an accelerator job, never
   cached, for the dump's reason) then ``<role>-outcome``; done:
   ``use-existing-<role>`` (CPU). Then, on Vertex, the optional upload.
"""

import copy
import inspect

from kfp import dsl
from kfp.dsl import Dataset

import components
from components.image import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE
from pipelines import launcher_guard, params

PIPELINE_NAME = params.NAMES["local"]
VERTEX_PIPELINE_NAME = params.NAMES["vertex"]
FROM_STORE_PIPELINE_NAME = params.NAMES["from_store"]
FROM_STORE_VERTEX_PIPELINE_NAME = params.NAMES["from_store_vertex"]
# Compile options: the retries of the dump and of each training (a retry is for a preemption or a crash:
# the tool's own deterministic failures are never retried), and the longest wait between two retries:
# retryPolicy.backoffMaxDuration is "the maximum backoff duration between subsequent retries" (Vertex AI
# docs, configure-retries; default 3600s). The waits are 60 s, 120 s, 240 s, ... up to it.
DUMP_RETRIES = 3
TRAIN_RETRIES = 3
FIRST_BACKOFF = "60s"
MAX_BACKOFF = "3600s"
SUMMARIES = {
    "local": ("Offline distillation: dump the teacher's top-k log-probs into a resumable store, verify it, "
              "train a student from it (plain components: kfp.local and Kubeflow Pipelines)."),
    "vertex": ("Offline distillation on Vertex AI: the teacher dump and the student training run as custom "
               "jobs (machine, accelerator, TPU, Spot) as the pipeline's service account; both resume across "
               "retries and preemptions, and a complete store or student is not made again."),
    "from_store": ("Offline distillation from an existing logit store: verify it, train a student from it "
                   "(plain components: kfp.local and Kubeflow Pipelines)."),
    "from_store_vertex": ("Offline distillation on Vertex AI from an existing logit store: verify it, train "
                          "students from it as custom jobs (machine, accelerator, TPU, Spot) as the pipeline's "
                          "service account."),
}
# The CE-only baseline: the same student and steps with the KD loss off.
CE_BASELINE = {"alpha": 0.0, "alpha_end": -1.0, "alpha_schedule": "constant"}

# The command GCPC 2.22 gives a custom job's launcher container, which _guard_launcher replaces.
GCPC_LAUNCHER_COMMAND = ["python3", "-u", "-m", launcher_guard.LAUNCHER]


def _guard_launcher(job):
    """Run pipelines/launcher_guard.py (its source, embedded) before GCPC's launcher, with the launcher's own
    arguments: the job's typed fields typed, and a task retry that creates a new custom job."""
    container = job.component_spec.implementation.container
    if list(container.command) != GCPC_LAUNCHER_COMMAND:
        raise RuntimeError(f"GCPC's custom job launcher command is {container.command}, not "
                           f"{GCPC_LAUNCHER_COMMAND}: check pipelines/launcher_guard.py against this GCPC")
    container.command = ["python3", "-u", "-c", inspect.getsource(launcher_guard)]
    return job


def _retry(task, retries: int, max_backoff: str) -> None:
    if retries > 0:
        task.set_retry(num_retries=retries, backoff_duration=FIRST_BACKOFF, backoff_factor=2.0,
                       backoff_max_duration=max_backoff)


def _outcome(ops: dict, stage: str, task, value: str, display_name: str):
    """``fail_on_error`` after ``task``: the run fails with the task's one-line error, else ``value`` goes on."""
    gate = ops["fail_on_error"](stage=stage, error=task.outputs["error"], exit_code=task.outputs["exit_code"],
                                value=task.outputs[value])
    gate.set_display_name(display_name)
    gate.set_caching_options(False)
    return gate


def _plan_and_dump(p: dict, ops: dict, dump_op, dump_extra, plan_extra: dict, resources, retries: int,
                   max_backoff: str):
    """plan -> dump if the store is incomplete, else reuse it -> the store imported by URI and state.
    Returns (store artifact, store state)."""
    plan = ops[params.PLAN](**plan_extra, run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                            **params.args_for(params.PLAN, p))
    plan.set_display_name("plan-dump")
    plan.set_caching_options(False)  # cheap, and it reads the data's identity and the store: never stale
    # The whole run checked on the CPU image (the teacher's and the KD student's configs and tokenizers, the
    # data, the eval data, the training folder, every setting) before the dump's accelerators start.
    pre = ops[params.PREFLIGHT](**plan_extra, **params.args_for(params.PLAN, p),
                                **{f"train_{k}": v for k, v in params.args_for(params.TRAIN_PLAN, p).items()
                                   if k != "output_root"})
    pre.set_display_name("preflight")
    pre.set_caching_options(False)  # it reads the folders as they are now
    with dsl.If(plan.outputs["complete"] == False, name="store-incomplete"):  # noqa: E712 - a KFP condition
        dump = dump_op(store_uri=plan.outputs["store_uri"], dump_key=plan.outputs["dump_key"],
                       **params.args_for(params.DUMP, p), **dump_extra(plan))
        dump.set_display_name("dump-teacher-topk")
        dump.after(pre)
        resources(dump, "dump")
        _retry(dump, retries, max_backoff)
        dump.set_caching_options(False)  # it runs for an incomplete store only: a cache hit would be stale
        dumped = _outcome(ops, "dump", dump, "store_state", "dump-outcome")
    with dsl.Else(name="store-complete"):
        reuse = ops["use_existing_store"](store_uri=plan.outputs["store_uri"],
                                          store_state=plan.outputs["store_state"])
        reuse.set_display_name("use-existing-store")
        reuse.after(pre)
        reuse.set_caching_options(False)
    state = dsl.OneOf(dumped.output, reuse.outputs["store_state"])
    # One artifact per store content: the dump's own output when it ran in this pipeline (same URI and
    # state), else one imported once; every later run gets the same artifact ID, so verify hits the cache.
    imported = dsl.importer(artifact_uri=plan.outputs["store_uri"], artifact_class=Dataset, reimport=False,
                            metadata={"store_state": state})
    imported.set_display_name("import-store")
    return imported.output, state


def _train(store, p: dict, ops: dict, train_op, train_extra, resources, retries: int, max_backoff: str, *,
           role: str, title: str, overrides: dict):
    """plan-<role> -> the training unless its folder is complete, else the existing student. Returns the
    export folder (a channel)."""
    name = "train-offline-student" if role == "kd" else f"train-{role}"
    plan = ops[params.TRAIN_PLAN](store=store, role=role, run_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
                                  **{**params.args_for(params.TRAIN_PLAN, p), **overrides})
    plan.set_display_name(f"plan-{role}")
    plan.set_caching_options(False)  # it reads the folder as it is now
    with dsl.If(plan.outputs["complete"] == False, name=f"{role}-to-train"):  # noqa: E712
        train = train_op(store=store, title=title, output_dir=plan.outputs["output"],
                         **{**params.args_for(params.TRAIN, p), **overrides}, **train_extra(plan))
        train.set_display_name(name)
        resources(train, "train")
        _retry(train, retries, max_backoff)
        train.set_caching_options(False)  # it runs for an unfinished folder only: a cache hit would be stale
        trained = _outcome(ops, "train", train, "hf_dir", f"{role}-outcome")
    with dsl.Else(name=f"{role}-trained"):
        done = ops["use_existing_student"](output=plan.outputs["output"])
        done.set_display_name(f"use-existing-{role}")
        done.set_caching_options(False)
    return dsl.OneOf(trained.output, done.outputs["hf_dir"])


def _verify_and_train(store, store_state, p: dict, ops: dict, train_op, train_extra, resources, retries: int,
                      max_backoff: str, after_train=None, verify_cached: bool = True) -> None:
    """verify -> (if passed) the KD student [+ a CE-only baseline] [+ ``after_train(export)``], else fail."""
    verify = ops[params.VERIFY](store=store, store_state=store_state, **params.args_for(params.VERIFY, p))
    verify.set_display_name("verify-logits")
    verify.set_caching_options(verify_cached)
    resources(verify, "verify")
    common = dict(train_op=train_op, train_extra=train_extra, resources=resources, retries=retries,
                  max_backoff=max_backoff)
    with dsl.If(verify.outputs["Output"] == True, name="verified"):  # noqa: E712
        export = _train(store, p, ops, **common, role="kd", title="KD student", overrides={})
        if after_train is not None:
            after_train(export)
        with dsl.If(p["ce_baseline"] == True, name="ce-baseline"):  # noqa: E712
            _train(store, p, ops, **common, role="ce-baseline", title="CE-only baseline (alpha = 0)",
                   overrides=CE_BASELINE)
    with dsl.Else(name="not-verified"):
        failed = ops["verification_failed"](report=verify.outputs["report"])
        failed.set_display_name("verification-failed")


def build_pipelines(image: str = DEFAULT_IMAGE, *, cpu_image: str | None = DEFAULT_CPU_IMAGE, dump_replicas: int = 1,
                    train_replicas: int = 1, dump_retries: int = DUMP_RETRIES, train_retries: int = TRAIN_RETRIES,
                    max_backoff: str = MAX_BACKOFF, restart_job_on_worker_restart: bool | None = None) -> dict:
    """``{"local", "vertex", "from_store", "from_store_vertex": pipeline}``: dump and train on ``image``, the
    CPU steps on ``cpu_image`` (default ``image``). ``restart_job_on_worker_restart`` defaults to
    ``replicas > 1`` per job (give True for a multi-host TPU slice compiled as one replica)."""
    components.check_image(image)
    ops = components.build_all(image, cpu_image)

    def kfp_resources(task, which: str, p: dict):
        task.set_cpu_limit(p[f"{which}_cpu"])
        task.set_memory_limit(p[f"{which}_memory"])
        task.set_accelerator_type(p[f"{which}_accelerator_type"])
        task.set_accelerator_limit(p[f"{which}_accelerator_count"])

    def requested(p: dict, which: str = "train") -> dict:
        # (Also a task input: kfp declares a condition's sub-DAG inputs only for channels used as task inputs,
        # not for the resource fields set by kfp_resources.)
        return {"resources": {k: p[f"{which}_{k}"] for k in ("cpu", "memory", "accelerator_type",
                                                             "accelerator_count")}}

    def local_body(p: dict) -> None:
        def resources(task, which):
            if which in ("dump", "train"):
                kfp_resources(task, which, p)

        store, state = _plan_and_dump(p, ops, ops[params.DUMP], lambda plan: requested(p, "dump"),
                                      {"num_processes": 1}, resources, dump_retries, max_backoff)
        _verify_and_train(store, state, p, ops, ops[params.TRAIN], lambda plan: requested(p), resources,
                          train_retries, max_backoff)

    def imported_store(p: dict):
        imported = dsl.importer(artifact_uri=p["store"], artifact_class=Dataset, reimport=False)
        imported.set_display_name("import-store")
        return imported.output

    def from_store_body(p: dict) -> None:
        # No state to key verify's cache on (the store is outside the pipeline): verify every run.
        _verify_and_train(imported_store(p), "", p, ops, ops[params.TRAIN], lambda plan: requested(p),
                          lambda task, which: kfp_resources(task, which, p) if which == "train" else None,
                          train_retries, max_backoff, verify_cached=False)

    from google_cloud_pipeline_components import _placeholders
    from google_cloud_pipeline_components.v1.custom_job import create_custom_training_job_from_component

    def custom_job(name: str, replicas: int):
        restart = replicas > 1 if restart_job_on_worker_restart is None else restart_job_on_worker_restart
        return _guard_launcher(create_custom_training_job_from_component(
            ops[name], display_name=name.replace("_", "-"), replica_count=replicas,
            # JAX's multi-controller runtime cannot survive a worker leaving and rejoining: restart them all.
            restart_job_on_worker_restart=restart))

    dump_job = custom_job(params.DUMP, dump_replicas)
    train_job = custom_job(params.TRAIN, train_replicas)

    def job_settings(job, which: str, p: dict, display_name) -> dict:
        """The custom job's inputs: its display name, worker pools with the machine as pipeline parameters,
        scheduling, and the pipeline job's own identity, network and encryption key (resolved by Vertex at
        run time)."""
        pools = copy.deepcopy(job.component_spec.inputs["worker_pool_specs"].default)
        for pool in pools:
            pool["machine_spec"] = {
                "machine_type": p[f"{which}_machine_type"],
                "accelerator_type": p[f"{which}_accelerator_type"],
                "accelerator_count": p[f"{which}_accelerator_count"],
                "tpu_topology": p[f"{which}_tpu_topology"],
                "reservation_affinity": p[f"{which}_reservation_affinity"],
            }
            pool["disk_spec"] = {"boot_disk_type": p[f"{which}_boot_disk_type"],
                                 "boot_disk_size_gb": p[f"{which}_boot_disk_size_gb"]}
        return dict(
            display_name=display_name, worker_pool_specs=pools, strategy=p[f"{which}_strategy"],
            timeout=p[f"{which}_timeout"], max_wait_duration=p[f"{which}_max_wait_duration"],
            labels=p["job_labels"], service_account=_placeholders.SERVICE_ACCOUNT_PLACEHOLDER,
            network=_placeholders.NETWORK_PLACEHOLDER,
            encryption_spec_key_name=_placeholders.ENCRYPTION_SPEC_KMS_KEY_NAME_PLACEHOLDER,
        )

    def vertex_train_extra(p: dict):
        def extra(plan) -> dict:
            return {**job_settings(train_job, "train", p, plan.outputs["job_display_name"]),
                    "tensorboard": p["tensorboard"], "base_output_directory": p["base_output_directory"]}
        return extra

    def vertex_resources(p: dict):
        def resources(task, which: str):
            if which == "verify":  # an ordinary Vertex pipeline task; dump and train are custom jobs
                task.set_cpu_limit(p["verify_cpu"])
                task.set_memory_limit(p["verify_memory"])
        return resources

    def register(p: dict):
        def after_train(export):
            with dsl.If(p["register_model"] == True, name="register-model"):  # noqa: E712
                _register(export, p)
        return after_train

    def vertex_body(p: dict) -> None:
        plan_extra = {"num_processes": dump_replicas, "tpu_topology": p["dump_tpu_topology"],
                      "machine_type": p["dump_machine_type"]}
        store, state = _plan_and_dump(
            p, ops, dump_job, lambda plan: job_settings(dump_job, "dump", p, plan.outputs["job_display_name"]),
            plan_extra, vertex_resources(p), dump_retries, max_backoff)
        _verify_and_train(store, state, p, ops, train_job, vertex_train_extra(p), vertex_resources(p),
                          train_retries, max_backoff, after_train=register(p))

    def from_store_vertex_body(p: dict) -> None:
        _verify_and_train(imported_store(p), "", p, ops, train_job, vertex_train_extra(p), vertex_resources(p),
                          train_retries, max_backoff, after_train=register(p), verify_cached=False)

    bodies = {"local": local_body, "vertex": vertex_body, "from_store": from_store_body,
              "from_store_vertex": from_store_vertex_body}
    return {variant: dsl.pipeline(name=params.NAMES[variant], description=SUMMARIES[variant])(
        params.pipeline_function(variant, params.NAMES[variant], SUMMARIES[variant], body))
        for variant, body in bodies.items()}


def _register(export, p: dict) -> None:
    """The student's export as an unmanaged container model -> Vertex AI Model Registry, with the pipeline
    job's encryption key: a new version of ``parent_model`` when given, else a new model."""
    from google_cloud_pipeline_components import _placeholders
    from google_cloud_pipeline_components.types.artifact_types import UnmanagedContainerModel, VertexModel
    from google_cloud_pipeline_components.v1.model import ModelUploadOp

    model = dsl.importer(artifact_uri=export, artifact_class=UnmanagedContainerModel,
                         metadata={"containerSpec": {"imageUri": p["serving_image"]}})
    model.set_display_name("student-hf-export")
    upload = dict(display_name=p["model_display_name"], unmanaged_container_model=model.output,
                  version_aliases=p["model_version_aliases"], labels=p["job_labels"],
                  encryption_spec_key_name=_placeholders.ENCRYPTION_SPEC_KMS_KEY_NAME_PLACEHOLDER,
                  location=_placeholders.LOCATION_PLACEHOLDER, project=_placeholders.PROJECT_ID_PLACEHOLDER)
    with dsl.If(p["parent_model"] != "", name="new-version"):
        parent = dsl.importer(artifact_uri=p["parent_model"], artifact_class=VertexModel, reimport=False,
                              metadata={"resourceName": p["parent_model"]})
        parent.set_display_name("parent-model")
        ModelUploadOp(parent_model=parent.output, **upload).set_display_name("register-student-version")
    with dsl.Else(name="new-model"):
        ModelUploadOp(**upload).set_display_name("register-student")


_DEFAULT = build_pipelines()
distill_pipeline = _DEFAULT["local"]
distill_pipeline_vertex = _DEFAULT["vertex"]
distill_from_store = _DEFAULT["from_store"]
distill_from_store_vertex = _DEFAULT["from_store_vertex"]
