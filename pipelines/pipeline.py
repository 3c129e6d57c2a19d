"""The distillation pipeline: plan -> dump -> verify -> (if verified) train.

Two variants of one DAG, built by ``build_pipelines(image)``; their parameters
(signature, defaults, descriptions, which component input each feeds) come
from one table, ``pipelines/params.py``:

- ``logit-distill`` (``distill_pipeline``): plain lightweight components with
  CPU / memory / accelerator requests as pipeline parameters. It runs under
  ``kfp.local`` (``make demo``) and on Kubeflow Pipelines.
- ``logit-distill-vertex`` (``distill_pipeline_vertex``): the dump and the
  training run as Vertex AI custom jobs (google-cloud-pipeline-components'
  ``create_custom_training_job_from_component``) with machine type,
  accelerator type / count and Spot scheduling as pipeline parameters and the
  replica count (hosts) as a compile option.

The store is named by ``plan_dump`` (``<output_root>/teacher_topk/<dump_key>``)
and the key is a string input of the dump, so Vertex's cache fingerprint of the
dump includes it. kfp 2.17's ``set_caching_options(cache_key=...)`` takes a
compile-time string only (it is written verbatim into the task spec), so no
static key is set: a constant key would make every dump a hit. See
docs/PIPELINE.md.
"""

import copy

from kfp import dsl

import components
from components.image import DEFAULT_IMAGE
from pipelines import params

PIPELINE_NAME = "logit-distill"
VERTEX_PIPELINE_NAME = "logit-distill-vertex"
DUMP_RETRIES = 3
LOCAL_SUMMARY = ("Offline distillation: dump the teacher's top-k log-probs into a resumable store, verify it, "
                 "train a student from it (plain components: kfp.local and Kubeflow Pipelines).")
VERTEX_SUMMARY = ("Offline distillation on Vertex AI: the teacher dump and the student training run as custom "
                  "jobs (machine, accelerator, Spot); the dump resumes across retries and preemptions.")


def _add_verify_and_train(dump, p: dict, ops: dict, train_op, train_extra: dict, resources) -> None:
    """verify -> (if passed) train, and (if ce_baseline) a CE-only student on the same steps."""
    verify = ops[params.VERIFY](store=dump.outputs["store"], **params.args_for(params.VERIFY, p))
    verify.set_display_name("verify-logits")
    resources(verify, "verify")
    train_args = {**params.args_for(params.TRAIN, p), **train_extra}
    with dsl.If(verify.outputs["Output"] == True, name="verified"):  # noqa: E712 - a KFP condition
        train = train_op(store=dump.outputs["store"], title="KD student", **train_args)
        train.set_display_name("train-offline-student")
        resources(train, "train")
        with dsl.If(p["ce_baseline"] == True, name="ce-baseline"):  # noqa: E712
            base_args = {**train_args, "alpha": 0.0, "alpha_end": -1.0, "alpha_schedule": "constant"}
            base = train_op(store=dump.outputs["store"], title="CE-only baseline (alpha = 0)", **base_args)
            base.set_display_name("train-ce-baseline")
            resources(base, "train")


def _plan_and_dump(p: dict, ops: dict, dump_op, dump_extra: dict, retries: int, num_processes: int):
    plan = ops[params.PLAN](num_processes=num_processes, **params.args_for(params.PLAN, p))
    plan.set_display_name("plan-dump")
    plan.set_caching_options(False)  # cheap, and it reads the data's identity: never stale
    dump = dump_op(store_uri=plan.outputs["store_uri"], dump_key=plan.outputs["dump_key"],
                   **params.args_for(params.DUMP, p), **dump_extra)
    dump.set_display_name("dump-teacher-topk")
    dump.set_retry(num_retries=retries, backoff_duration="60s", backoff_factor=2.0, backoff_max_duration="3600s")
    dump.set_caching_options(True)  # the dump key is an input: a hit only for the same store
    return dump


def build_pipelines(image: str = DEFAULT_IMAGE, *, dump_replicas: int = 1, train_replicas: int = 1,
                    dump_retries: int = DUMP_RETRIES) -> dict:
    """``{"local": pipeline, "vertex": pipeline}`` with every component on ``image``."""
    components.check_image(image)
    ops = components.build_all(image)

    def kfp_resources(task, which: str, p: dict):
        # (The train tasks also get these values as their `resources` input: kfp 2.17 declares a
        # condition's sub-DAG inputs only for channels used as task inputs, not for resource fields.)
        if which == "verify":
            return
        task.set_cpu_limit(p[f"{which}_cpu"])
        task.set_memory_limit(p[f"{which}_memory"])
        task.set_accelerator_type(p[f"{which}_accelerator_type"])
        task.set_accelerator_limit(p[f"{which}_accelerator_count"])

    def local_body(p: dict) -> None:
        dump = _plan_and_dump(p, ops, ops[params.DUMP], {}, dump_retries, 1)
        kfp_resources(dump, "dump", p)
        requested = {k: p[f"train_{k}"] for k in ("cpu", "memory", "accelerator_type", "accelerator_count")}
        _add_verify_and_train(dump, p, ops, ops[params.TRAIN], {"resources": requested},
                              lambda task, which: kfp_resources(task, which, p))

    distill_pipeline = dsl.pipeline(name=PIPELINE_NAME, description=LOCAL_SUMMARY)(
        params.pipeline_function("local", PIPELINE_NAME, LOCAL_SUMMARY, local_body))

    from google_cloud_pipeline_components.v1.custom_job import create_custom_training_job_from_component

    dump_job = create_custom_training_job_from_component(
        ops[params.DUMP], display_name="dump-teacher-topk", replica_count=dump_replicas)
    train_job = create_custom_training_job_from_component(
        ops[params.TRAIN], display_name="train-offline-student", replica_count=train_replicas)

    def worker_pools(job, machine_type, accelerator_type, accelerator_count):
        """The job's worker pools (image, command) with the machine as pipeline parameters."""
        pools = copy.deepcopy(job.component_spec.inputs["worker_pool_specs"].default)
        for pool in pools:
            pool["machine_spec"] = {"machine_type": machine_type, "accelerator_type": accelerator_type,
                                    "accelerator_count": accelerator_count}
        return pools

    def vertex_body(p: dict) -> None:
        dump = _plan_and_dump(p, ops, dump_job, dict(
            strategy=p["dump_strategy"],
            worker_pool_specs=worker_pools(dump_job, p["dump_machine_type"], p["dump_accelerator_type"],
                                           p["dump_accelerator_count"])), dump_retries, dump_replicas)
        train_extra = dict(strategy=p["train_strategy"], worker_pool_specs=worker_pools(
            train_job, p["train_machine_type"], p["train_accelerator_type"], p["train_accelerator_count"]))

        def vertex_resources(task, which: str):
            if which == "verify":  # an ordinary Vertex pipeline task; dump and train are custom jobs
                task.set_cpu_limit(p["verify_cpu"])
                task.set_memory_limit(p["verify_memory"])

        _add_verify_and_train(dump, p, ops, train_job, train_extra, vertex_resources)

    distill_pipeline_vertex = dsl.pipeline(name=VERTEX_PIPELINE_NAME, description=VERTEX_SUMMARY)(
        params.pipeline_function("vertex", VERTEX_PIPELINE_NAME, VERTEX_SUMMARY, vertex_body))
    return {"local": distill_pipeline, "vertex": distill_pipeline_vertex}


_DEFAULT = build_pipelines()
distill_pipeline = _DEFAULT["local"]
distill_pipeline_vertex = _DEFAULT["vertex"]
