"""The distillation pipelines: plan -> [dump, unless the store is complete] -> verify -> train.

Three pipelines from one DAG, built by ``build_pipelines(image)``; their
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
  the replica count (hosts), retry windows and worker-restart policy as
  compile options. A task retry of either creates a new custom job, never
  re-attaching to the failed one (``pipelines/launcher_guard.py`` runs before
  GCPC's launcher). Optionally the KD student is uploaded to the Model
  Registry.
- ``logit-distill-from-store`` (``distill_from_store``): an existing store ->
  verify -> train (plain components).

``plan_dump`` names the store (``<output_root>/teacher_topk/<dump_key>``) and
scans its names: when it is already complete the dump task is skipped
(``dsl.If`` / ``dsl.Else``), so no accelerator is provisioned and no teacher
loaded. The dump key is a string input of the dump, so Vertex's cache
fingerprint of the dump includes it, and the store's state (a digest of its
committed chunk names) is an input of verify, so a changed store is verified
again. A store that fails verification fails the run (``verification_failed``)
with the report's first failing check. See docs/PIPELINE.md.
"""

import copy
import inspect

from kfp import dsl
from kfp.dsl import Dataset

import components
from components.image import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE
from pipelines import launcher_guard, params

PIPELINE_NAME = "logit-distill"
VERTEX_PIPELINE_NAME = "logit-distill-vertex"
FROM_STORE_PIPELINE_NAME = "logit-distill-from-store"
DUMP_RETRIES = 3
TRAIN_RETRIES = 3
# How long after a task's first failure its retries may still start (retryPolicy.backoffMaxDuration is a
# window, not a cap on the wait between tries): a dump or a training runs for days.
RETRY_WINDOW = "604800s"
LOCAL_SUMMARY = ("Offline distillation: dump the teacher's top-k log-probs into a resumable store, verify it, "
                 "train a student from it (plain components: kfp.local and Kubeflow Pipelines).")
VERTEX_SUMMARY = ("Offline distillation on Vertex AI: the teacher dump and the student training run as custom "
                  "jobs (machine, accelerator, TPU, Spot) as the pipeline's service account; both resume across "
                  "retries and preemptions, and a complete store is not dumped again.")
FROM_STORE_SUMMARY = ("Offline distillation from an existing logit store: verify it, train a student from it "
                      "(plain components: kfp.local and Kubeflow Pipelines).")


# The command GCPC 2.22 gives a custom job's launcher container, which _guard_launcher replaces.
GCPC_LAUNCHER_COMMAND = ["python3", "-u", "-m", launcher_guard.LAUNCHER]


def _guard_launcher(job):
    """Run pipelines/launcher_guard.py (its source, embedded) before GCPC's launcher, with the launcher's own
    arguments: a task retry creates a new custom job instead of re-attaching to the failed one."""
    container = job.component_spec.implementation.container
    if list(container.command) != GCPC_LAUNCHER_COMMAND:
        raise RuntimeError(f"GCPC's custom job launcher command is {container.command}, not "
                           f"{GCPC_LAUNCHER_COMMAND}: check pipelines/launcher_guard.py against this GCPC")
    container.command = ["python3", "-u", "-c", inspect.getsource(launcher_guard)]
    return job


def _retry(task, retries: int, window: str):
    task.set_retry(num_retries=retries, backoff_duration="60s", backoff_factor=2.0, backoff_max_duration=window)


def _verify_and_train(store, store_state, p: dict, ops: dict, train_op, train_extra: dict, resources,
                      train_retries: int, retry_window: str, after_train=None) -> None:
    """verify -> (if passed) train [+ a CE-only baseline] [+ ``after_train(train)``], else fail the run."""
    verify = ops[params.VERIFY](store=store, store_state=store_state, **params.args_for(params.VERIFY, p))
    verify.set_display_name("verify-logits")
    resources(verify, "verify")
    train_args = {**params.args_for(params.TRAIN, p), **train_extra}
    with dsl.If(verify.outputs["Output"] == True, name="verified"):  # noqa: E712 - a KFP condition
        train = train_op(store=store, title="KD student", **train_args)
        train.set_display_name("train-offline-student")
        resources(train, "train")
        _retry(train, train_retries, retry_window)
        if after_train is not None:
            after_train(train)
        with dsl.If(p["ce_baseline"] == True, name="ce-baseline"):  # noqa: E712
            base_args = {**train_args, "alpha": 0.0, "alpha_end": -1.0, "alpha_schedule": "constant"}
            base = train_op(store=store, title="CE-only baseline (alpha = 0)", **base_args)
            base.set_display_name("train-ce-baseline")
            resources(base, "train")
            _retry(base, train_retries, retry_window)
    with dsl.Else(name="not-verified"):
        failed = ops["verification_failed"](report=verify.outputs["report"])
        failed.set_display_name("verification-failed")


def _plan_and_dump(p: dict, ops: dict, dump_op, dump_extra: dict, plan_extra: dict, retries: int,
                   retry_window: str):
    """plan -> dump if the store is incomplete, else reuse it. Returns (store artifact, store state)."""
    plan = ops[params.PLAN](**plan_extra, **params.args_for(params.PLAN, p))
    plan.set_display_name("plan-dump")
    plan.set_caching_options(False)  # cheap, and it reads the data's identity and the store: never stale
    with dsl.If(plan.outputs["complete"] == False, name="store-incomplete"):  # noqa: E712
        dump = dump_op(store_uri=plan.outputs["store_uri"], dump_key=plan.outputs["dump_key"],
                       **params.args_for(params.DUMP, p), **dump_extra)
        dump.set_display_name("dump-teacher-topk")
        _retry(dump, retries, retry_window)
        dump.set_caching_options(True)  # the dump key is an input: a hit only for the same store
    with dsl.Else(name="store-complete"):
        reuse = ops["use_existing_store"](store_uri=plan.outputs["store_uri"],
                                          store_state=plan.outputs["store_state"])
        reuse.set_display_name("use-existing-store")
        reuse.set_caching_options(False)
    # (kfp.local resolves dsl.OneOf for parameters only: the store artifact is plan's in both branches.)
    state = dsl.OneOf(dump.outputs["store_state"], reuse.outputs["store_state"])
    return plan.outputs["store"], state, dump


def build_pipelines(image: str = DEFAULT_IMAGE, *, cpu_image: str | None = DEFAULT_CPU_IMAGE, dump_replicas: int = 1,
                    train_replicas: int = 1, dump_retries: int = DUMP_RETRIES, train_retries: int = TRAIN_RETRIES,
                    dump_retry_window: str = RETRY_WINDOW, train_retry_window: str = RETRY_WINDOW,
                    restart_job_on_worker_restart: bool | None = None) -> dict:
    """``{"local": ..., "vertex": ..., "from_store": ...}``: dump and train on ``image``, the CPU steps on
    ``cpu_image`` (default ``image``). ``restart_job_on_worker_restart`` defaults to ``replicas > 1`` per job
    (give True for a multi-host TPU slice compiled as one replica)."""
    components.check_image(image)
    ops = components.build_all(image, cpu_image)

    def kfp_resources(task, which: str, p: dict):
        if which == "verify":
            return
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
        store, state, dump = _plan_and_dump(p, ops, ops[params.DUMP], requested(p, "dump"), {"num_processes": 1},
                                            dump_retries, dump_retry_window)
        kfp_resources(dump, "dump", p)
        _verify_and_train(store, state, p, ops, ops[params.TRAIN], requested(p),
                          lambda task, which: kfp_resources(task, which, p), train_retries, train_retry_window)

    def from_store_body(p: dict) -> None:
        imported = dsl.importer(artifact_uri=p["store"], artifact_class=Dataset, reimport=False)
        imported.set_display_name("import-store")
        # No state to key verify's cache on (the store is outside the pipeline): verify every run.
        store = imported.output

        def resources(task, which):
            if which == "verify":
                task.set_caching_options(False)
            else:
                kfp_resources(task, which, p)

        _verify_and_train(store, "", p, ops, ops[params.TRAIN], requested(p), resources, train_retries,
                          train_retry_window)

    pipes = {
        "local": dsl.pipeline(name=PIPELINE_NAME, description=LOCAL_SUMMARY)(
            params.pipeline_function("local", PIPELINE_NAME, LOCAL_SUMMARY, local_body)),
        "from_store": dsl.pipeline(name=FROM_STORE_PIPELINE_NAME, description=FROM_STORE_SUMMARY)(
            params.pipeline_function("from_store", FROM_STORE_PIPELINE_NAME, FROM_STORE_SUMMARY,
                                     from_store_body)),
    }

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

    def job_settings(job, which: str, p: dict) -> dict:
        """The custom job's inputs: worker pools with the machine as pipeline parameters, scheduling, and the
        pipeline job's own identity, network and encryption key (resolved by Vertex at run time)."""
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
            worker_pool_specs=pools, strategy=p[f"{which}_strategy"], timeout=p[f"{which}_timeout"],
            max_wait_duration=p[f"{which}_max_wait_duration"], labels=p["job_labels"],
            service_account=_placeholders.SERVICE_ACCOUNT_PLACEHOLDER,
            network=_placeholders.NETWORK_PLACEHOLDER,
            encryption_spec_key_name=_placeholders.ENCRYPTION_SPEC_KMS_KEY_NAME_PLACEHOLDER,
        )

    def vertex_body(p: dict) -> None:
        plan_extra = {"num_processes": dump_replicas, "tpu_topology": p["dump_tpu_topology"],
                      "machine_type": p["dump_machine_type"]}
        store, state, _ = _plan_and_dump(p, ops, dump_job, job_settings(dump_job, "dump", p), plan_extra,
                                         dump_retries, dump_retry_window)
        train_extra = {**job_settings(train_job, "train", p), "tensorboard": p["tensorboard"],
                       "base_output_directory": p["base_output_directory"]}

        def vertex_resources(task, which: str):
            if which == "verify":  # an ordinary Vertex pipeline task; dump and train are custom jobs
                task.set_cpu_limit(p["verify_cpu"])
                task.set_memory_limit(p["verify_memory"])

        def register(train):
            with dsl.If(p["register_model"] == True, name="register-model"):  # noqa: E712
                _register(train, p)

        _verify_and_train(store, state, p, ops, train_job, train_extra, vertex_resources, train_retries,
                          train_retry_window, after_train=register)

    pipes["vertex"] = dsl.pipeline(name=VERTEX_PIPELINE_NAME, description=VERTEX_SUMMARY)(
        params.pipeline_function("vertex", VERTEX_PIPELINE_NAME, VERTEX_SUMMARY, vertex_body))
    return pipes


def _register(train, p: dict) -> None:
    """The student's Hugging Face export as an unmanaged container model -> Vertex AI Model Registry."""
    from google_cloud_pipeline_components import _placeholders
    from google_cloud_pipeline_components.types.artifact_types import UnmanagedContainerModel
    from google_cloud_pipeline_components.v1.model import ModelUploadOp

    model = dsl.importer(artifact_uri=train.outputs["hf_dir"], artifact_class=UnmanagedContainerModel,
                         metadata={"containerSpec": {"imageUri": p["serving_image"]}})
    model.set_display_name("student-hf-export")
    upload = ModelUploadOp(display_name=p["model_display_name"], unmanaged_container_model=model.output,
                           version_aliases=p["model_version_aliases"], labels=p["job_labels"],
                           location=_placeholders.LOCATION_PLACEHOLDER,
                           project=_placeholders.PROJECT_ID_PLACEHOLDER)
    upload.set_display_name("register-student")


_DEFAULT = build_pipelines()
distill_pipeline = _DEFAULT["local"]
distill_pipeline_vertex = _DEFAULT["vertex"]
distill_from_store = _DEFAULT["from_store"]
