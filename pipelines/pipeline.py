"""The distillation pipeline: plan -> dump -> verify -> (if verified) train.

Two variants of one DAG, built by ``build_pipelines(image)``:

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

PIPELINE_NAME = "logit-distill"
VERTEX_PIPELINE_NAME = "logit-distill-vertex"
DUMP_RETRIES = 3


def _add_verify_and_train(dump, p: dict, ops: dict, train_op, train_extra: dict, resources) -> None:
    """verify -> (if passed) train, and (if ce_baseline) a CE-only student on the same steps."""
    verify = ops["verify_logits"](
        store=dump.outputs["store"], expected_steps=p["num_steps"], data=p["data"], tokenizer=p["tokenizer"],
        teacher=p["teacher"], spot_check=p["spot_check"], sample=p["verify_sample"],
    )
    verify.set_display_name("verify-logits")
    resources(verify, "verify")
    train_args = dict(
        store=dump.outputs["store"], student=p["student"], num_steps=p["train_steps"],
        batch_size=p["train_batch_size"], learning_rate=p["learning_rate"], warmup_steps=p["warmup_steps"],
        seed=p["train_seed"], loss=p["loss"], temperature=p["temperature"], checkpoint_every=p["checkpoint_every"],
        eval_data=p["eval_data"], grad_accum=p["grad_accum"], **train_extra,
    )
    with dsl.If(verify.outputs["Output"] == True, name="verified"):  # noqa: E712 - a KFP condition
        train = train_op(alpha=p["alpha"], alpha_end=p["alpha_end"], alpha_schedule=p["alpha_schedule"],
                         title="KD student", **train_args)
        train.set_display_name("train-offline-student")
        resources(train, "train")
        with dsl.If(p["ce_baseline"] == True, name="ce-baseline"):  # noqa: E712
            base = train_op(alpha=0.0, alpha_end=-1.0, alpha_schedule="constant",
                            title="CE-only baseline (alpha = 0)", **train_args)
            base.set_display_name("train-ce-baseline")
            resources(base, "train")


def _plan_and_dump(p: dict, ops: dict, dump_op, dump_extra: dict, retries: int):
    settings = dict(teacher=p["teacher"], data=p["data"], num_steps=p["num_steps"], top_k=p["top_k"],
                    seq_len=p["seq_len"], batch_size=p["batch_size"], steps_per_file=p["steps_per_file"],
                    codec=p["codec"], data_seed=p["data_seed"], packing=p["packing"], dtype=p["dtype"],
                    text_field=p["text_field"], tokenizer=p["tokenizer"])
    plan = ops["plan_dump"](output_root=p["output_root"], num_processes=p.get("num_processes", 1), **settings)
    plan.set_display_name("plan-dump")
    plan.set_caching_options(False)  # cheap, and it reads the data's identity: never stale
    dump = dump_op(store_uri=plan.outputs["store_uri"], dump_key=plan.outputs["dump_key"], **settings,
                   **dump_extra)
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

    @dsl.pipeline(name=PIPELINE_NAME, description=(
        "Offline distillation: dump the teacher's top-k log-probs into a resumable store, verify it, "
        "train a student from it (plain components: kfp.local and Kubeflow Pipelines)."))
    def distill_pipeline(
        teacher: str = "preset:demo-teacher",
        data: str = "",
        student: str = "preset:tiny-qwen3",
        output_root: str = "",
        num_steps: int = 32,
        top_k: int = 64,
        seq_len: int = 128,
        batch_size: int = 8,
        steps_per_file: int = 8,
        codec: str = "default",
        data_seed: int = 0,
        packing: bool = True,
        dtype: str = "float32",
        text_field: str = "text",
        tokenizer: str = "",
        verify_sample: int = 64,
        spot_check: int = 4,
        train_steps: int = 300,
        train_batch_size: int = 16,
        learning_rate: float = 3e-3,
        warmup_steps: int = -1,
        loss: str = "topk_tail_kl",
        alpha: float = 1.0,
        alpha_end: float = -1.0,
        alpha_schedule: str = "constant",
        temperature: float = 1.0,
        checkpoint_every: int = 500,
        grad_accum: int = 1,
        train_seed: int = 0,
        eval_data: str = "",
        ce_baseline: bool = False,
        dump_cpu: str = "4",
        dump_memory: str = "16G",
        dump_accelerator_type: str = "",
        dump_accelerator_count: int = 0,
        train_cpu: str = "4",
        train_memory: str = "16G",
        train_accelerator_type: str = "",
        train_accelerator_count: int = 0,
    ):
        p = dict(locals())
        dump = _plan_and_dump(p, ops, ops["dump_teacher_topk"], {}, dump_retries)
        kfp_resources(dump, "dump", p)
        requested = {"cpu": train_cpu, "memory": train_memory, "accelerator_type": train_accelerator_type,
                     "accelerator_count": train_accelerator_count}
        _add_verify_and_train(dump, p, ops, ops["train_offline_student"], {"resources": requested},
                              lambda task, which: kfp_resources(task, which, p))

    from google_cloud_pipeline_components.v1.custom_job import create_custom_training_job_from_component

    dump_job = create_custom_training_job_from_component(
        ops["dump_teacher_topk"], display_name="dump-teacher-topk", replica_count=dump_replicas)
    train_job = create_custom_training_job_from_component(
        ops["train_offline_student"], display_name="train-offline-student", replica_count=train_replicas)

    def worker_pools(job, machine_type, accelerator_type, accelerator_count):
        """The job's worker pools (image, command) with the machine as pipeline parameters."""
        pools = copy.deepcopy(job.component_spec.inputs["worker_pool_specs"].default)
        for pool in pools:
            pool["machine_spec"] = {"machine_type": machine_type, "accelerator_type": accelerator_type,
                                    "accelerator_count": accelerator_count}
        return pools

    @dsl.pipeline(name=VERTEX_PIPELINE_NAME, description=(
        "Offline distillation on Vertex AI: the teacher dump and the student training run as custom jobs "
        "(machine, accelerator, Spot); the dump resumes across retries and preemptions."))
    def distill_pipeline_vertex(
        teacher: str,
        data: str,
        student: str,
        output_root: str,
        num_steps: int,
        top_k: int = 64,
        seq_len: int = 2048,
        batch_size: int = 8,
        steps_per_file: int = 50,
        codec: str = "default",
        data_seed: int = 0,
        packing: bool = True,
        dtype: str = "bfloat16",
        text_field: str = "text",
        tokenizer: str = "",
        sharding: str = "fsdp",
        verify_sample: int = 256,
        spot_check: int = 0,
        train_steps: int = 1000,
        train_batch_size: int = 8,
        learning_rate: float = 3e-4,
        warmup_steps: int = -1,
        loss: str = "topk_kl",
        alpha: float = 0.5,
        alpha_end: float = -1.0,
        alpha_schedule: str = "constant",
        temperature: float = 1.0,
        checkpoint_every: int = 500,
        grad_accum: int = 1,
        train_seed: int = 0,
        eval_data: str = "",
        ce_baseline: bool = False,
        dump_machine_type: str = "a3-highgpu-8g",
        dump_accelerator_type: str = "NVIDIA_H100_80GB",
        dump_accelerator_count: int = 8,
        dump_strategy: str = "SPOT",
        train_machine_type: str = "a3-highgpu-8g",
        train_accelerator_type: str = "NVIDIA_H100_80GB",
        train_accelerator_count: int = 8,
        train_strategy: str = "STANDARD",
        verify_cpu: str = "8",
        verify_memory: str = "32G",
    ):
        p = dict(locals())
        p["num_processes"] = dump_replicas
        dump = _plan_and_dump(p, ops, dump_job, dict(
            sharding=sharding, strategy=dump_strategy,
            worker_pool_specs=worker_pools(dump_job, dump_machine_type, dump_accelerator_type,
                                           dump_accelerator_count)), dump_retries)
        train_extra = dict(strategy=train_strategy, worker_pool_specs=worker_pools(
            train_job, train_machine_type, train_accelerator_type, train_accelerator_count))

        def vertex_resources(task, which: str):
            if which == "verify":  # an ordinary Vertex pipeline task; dump and train are custom jobs
                task.set_cpu_limit(verify_cpu)
                task.set_memory_limit(verify_memory)

        _add_verify_and_train(dump, p, ops, train_job, train_extra, vertex_resources)

    return {"local": distill_pipeline, "vertex": distill_pipeline_vertex}


_DEFAULT = build_pipelines()
distill_pipeline = _DEFAULT["local"]
distill_pipeline_vertex = _DEFAULT["vertex"]
