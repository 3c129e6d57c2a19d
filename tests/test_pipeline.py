"""The pipeline: compiled YAML current and valid, DAG shape, Vertex submit dry run, and a local
run under kfp.local whose dump was killed mid-stream and resumes."""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # components/ and pipelines/ at the repo root

from pipelines import compile as compile_mod  # noqa: E402
from vertex_standin import tasks_by_name as _tasks  # noqa: E402  (every task of a compiled pipeline, by name)

COMPILED = os.path.join(REPO, "compiled")


@functools.lru_cache(maxsize=None)
def _spec(name: str) -> dict:
    """A compiled pipeline, parsed once per session (the tests only read it)."""
    with open(os.path.join(COMPILED, name)) as f:
        return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@pytest.mark.slow
def test_compiled_is_current(tmp_path):
    written = compile_mod.compile_all(str(tmp_path))
    assert {f"components/{n}" for n in ("plan_dump", "dump_teacher_topk", "verify_logits",
                                         "train_offline_student")} <= set(written)
    for variant, path in written.items():
        name = os.path.relpath(path, tmp_path)
        with open(path, "rb") as a, open(os.path.join(COMPILED, name), "rb") as b:
            assert a.read() == b.read(), f"compiled/{name} is stale: run `make compile`"
    with open(compile_mod.DOC, encoding="utf-8") as f:
        text = f.read()
    assert compile_mod.doc_with_table(text) == text, "docs/PIPELINE.md's parameter table is stale: `make compile`"


def test_parameters_have_one_home():
    """Every variant, its descriptions and the components' defaults come from pipelines/params.py."""
    import inspect

    from pipelines import params
    from pipelines.pipeline import _DEFAULT

    for variant in params.VARIANTS:
        inputs = _DEFAULT[variant].component_spec.inputs
        assert set(inputs) == {p.name for p in params.of(variant)}, variant
        for p in params.of(variant):
            spec = inputs[p.name]
            assert spec.description and spec.description.startswith(p.help), p.name
            d = p.default_in(variant)
            assert (spec.optional, spec.default) == ((False, None) if d is params.REQUIRED else (True, d)), p.name
    # the shared settings have one default in every variant (only the production-minded ones differ)
    differ = {p.name for p in params.PARAMS if p.vertex_default is not None}
    assert differ == {"seq_len", "dump_dtype", "dump_sharding", "dump_accelerator_type", "dump_accelerator_count",
                      "train_accelerator_type", "train_accelerator_count"}
    # a component's own default of an input a parameter feeds is the parameter's (plain) default
    import components

    for module in (components.plan_dump, components.dump_teacher_topk, components.verify_logits,
                   components.plan_training, components.train_offline_student):
        fn = getattr(module, module.__name__.rsplit(".", 1)[-1])
        fed = params.inputs_of(fn.__name__)
        assert fed, fn.__name__
        for arg, sig in inspect.signature(fn).parameters.items():
            if arg in fed and sig.default is not inspect.Parameter.empty and fed[arg].default is not params.REQUIRED:
                assert sig.default == fed[arg].default, (fn.__name__, arg)
        compiled = module.component.component_spec.inputs
        assert all(spec.description for spec in compiled.values()), fn.__name__
    # every root parameter of the compiled YAML has a description
    for name in compile_mod.OUTPUTS.values():
        defs = _spec(name)["root"]["inputDefinitions"]["parameters"]
        assert all(d.get("description") for d in defs.values()), name


def test_each_parameter_names_its_stage_and_old_names_are_refused(capsys):
    """dump_num_steps / train_num_steps and the other renamed ones: an old name is refused in one line naming
    the new one, by submit and run_local (also from Python)."""
    from pipelines import params, run_local, submit

    for old, new in params.RENAMED.items():
        assert old not in params.BY_NAME and new in params.BY_NAME
    base = ["--project", "p", "--region", "us-central1", "--pipeline-root", "gs://b/root", "--dry-run",
            "--image", IMAGE]
    assert submit.main(base + REQUIRED + ["train_steps=20000"]) == 2
    err = capsys.readouterr().err
    assert err == ("submit: error: parameter 'train_steps' is now 'train_num_steps' (each parameter names its "
                   "stage): give train_num_steps=...\n")
    assert run_local.main(["num_steps=32"]) == 2
    assert "'num_steps' is now 'dump_num_steps'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="'lease_timeout_s' is now 'dump_lease_timeout_s'"):
        run_local.run("logit-distill", {"lease_timeout_s": 60.0}, echo=None)


@pytest.mark.parametrize("name", sorted(compile_mod.OUTPUTS.values()))
def test_compiled_yaml_is_a_pipeline_spec_with_the_dag(name):
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    d = _spec(name)
    json_format.ParseDict(d, pipeline_spec_pb2.PipelineSpec())
    tasks = _tasks(d)
    root = d["root"]["dag"]["tasks"]
    assert {"import-store", "verify-logits", "plan-kd", "train-offline-student", "kd-outcome", "use-existing-kd",
            "plan-ce-baseline", "train-ce-baseline", "ce-baseline-outcome", "use-existing-ce-baseline",
            "verification-failed"} <= set(tasks)
    if "from_store" not in name:
        assert {"plan-dump", "dump-teacher-topk", "dump-outcome", "use-existing-store"} <= set(tasks)
        assert "plan-dump" in root and "dump-teacher-topk" not in root  # the dump runs only when needed
        assert tasks["dump-teacher-topk"]["retryPolicy"]["maxRetryCount"] == 3
        # the run fails with the dump's own error, unretried; the state goes on only from there
        gate = tasks["dump-outcome"]["inputs"]["parameters"]
        assert {k: gate[k]["taskOutputParameter"] for k in ("error", "exit_code", "value")} == {
            "error": {"outputParameterKey": "error", "producerTask": "dump-teacher-topk"},
            "exit_code": {"outputParameterKey": "exit_code", "producerTask": "dump-teacher-topk"},
            "value": {"outputParameterKey": "store_state", "producerTask": "dump-teacher-topk"}}
        assert "retryPolicy" not in tasks["dump-outcome"]
    # the training runs only when its folder is not complete (plan-kd, a CPU task), retried for preemptions
    # only: its deterministic failures end the run through kd-outcome
    assert "retryPolicy" not in tasks["kd-outcome"] and "retryPolicy" not in tasks["plan-kd"]
    assert tasks["train-offline-student"]["retryPolicy"]["maxRetryCount"] == 3
    for task in ("train-offline-student", "train-ce-baseline"):
        assert tasks[task]["inputs"]["parameters"]["output_dir"]["componentInputParameter"].endswith("-output")
    # verify -> train if it passed, else the run fails
    conds = [t for t in tasks.values() if t.get("triggerPolicy")]
    assert any("verify-logits-Output" in c["triggerPolicy"]["condition"] for c in conds)
    images = json.dumps(d["deploymentSpec"]) + json.dumps(d["components"])
    assert ":latest" not in images


NEVER_CACHED = {"plan-dump", "dump-teacher-topk", "dump-outcome", "use-existing-store", "plan-kd",
                "train-offline-student", "kd-outcome", "use-existing-kd", "plan-ce-baseline", "train-ce-baseline",
                "ce-baseline-outcome", "use-existing-ce-baseline"}


@pytest.mark.parametrize("name", sorted(compile_mod.OUTPUTS.values()))
def test_what_a_resubmit_reruns(name):
    """Each task's caching, as Vertex keys it (input values, input artifact IDs, output definitions, image,
    command, arguments: docs/PIPELINE.md, "What a resubmit re-runs"). Over a complete store: the dump is not
    run (its branch is not taken, and it is never cached: a hit would be stale by construction); verify is a
    cache hit, since every input artifact of a cached task comes from an importer that gives the same store
    the same artifact (reimport=False, keyed by URI and state) and its parameters are values; a complete
    student is not trained again (plan-<role> skips the training, which is never cached either). The plans
    read the store and the folders as they are now: never cached."""
    d = _spec(name)
    tasks = _tasks(d)
    caching = {t: task.get("cachingOptions", {}).get("enableCache", False) for t, task in tasks.items()}
    assert {t for t in NEVER_CACHED if t in tasks} == {t for t in tasks if t in NEVER_CACHED and not caching[t]}
    from_store = "from_store" in name
    assert caching["verify-logits"] is (not from_store)  # an external store has no state to key on
    importers = {t: d["deploymentSpec"]["executors"][d["components"][task["componentRef"]["name"]]["executorLabel"]]
                 for t, task in tasks.items() if task["componentRef"]["name"].startswith("comp-importer")}
    for t, executor in importers.items():
        assert executor["importer"].get("reimport", False) is False, t
    producers = {}  # task key -> display name, for artifacts handed between tasks
    for dag in [d["root"]["dag"]] + [c["dag"] for c in d["components"].values() if "dag" in c]:
        producers.update({key: task["taskInfo"]["name"] for key, task in dag["tasks"].items()})
    for t, task in tasks.items():
        if not caching[t]:
            continue
        for art in task.get("inputs", {}).get("artifacts", {}).values():
            producer = art.get("taskOutputArtifact", {}).get("producerTask")
            assert producer is None or producers[producer] in importers, (t, producer)
    store = importers["import-store"]["importer"]
    if not from_store:
        assert store["metadata"] == {"store_state": "{{$.inputs.parameters['metadata']}}"}
        state = tasks["import-store"]["inputs"]["parameters"]["metadata"]["taskOutputParameter"]
        assert tasks["verify-logits"]["inputs"]["parameters"]["store_state"]["taskOutputParameter"] == state
        assert tasks["verify-logits"]["inputs"]["artifacts"]["store"]["taskOutputArtifact"]["producerTask"] == \
            "importer"
        # no other task makes an artifact at the store's URI: plan-dump has no artifact output
        plan = d["components"][tasks["plan-dump"]["componentRef"]["name"]]
        assert "artifacts" not in plan.get("outputDefinitions", {})


def test_compiled_pipelines_carry_the_lease_timeout_and_the_tokenizer_switch():
    """dump_lease_timeout_s (the dump's lease) and allow_tokenizer_mismatch (the training) are pipeline
    parameters with their defaults, fed to the dump task and to both training tasks."""
    for name in compile_mod.OUTPUTS.values():
        d = _spec(name)
        root = d["root"]["inputDefinitions"]["parameters"]
        allow = root["allow_tokenizer_mismatch"]
        assert (allow["parameterType"], allow["defaultValue"]) == ("BOOLEAN", False), name
        tasks = _tasks(d)
        for task in ("train-offline-student", "train-ce-baseline"):
            fed = tasks[task]["inputs"]["parameters"]["allow_tokenizer_mismatch"]
            assert fed["componentInputParameter"].endswith("allow_tokenizer_mismatch"), (name, task)
        if "from_store" in name:
            assert "dump_lease_timeout_s" not in root  # no dump
            continue
        lease = root["dump_lease_timeout_s"]
        assert (lease["parameterType"], lease["defaultValue"]) == ("NUMBER_DOUBLE", 120.0), name
        assert "stale" in lease["description"]
        fed = tasks["dump-teacher-topk"]["inputs"]["parameters"]["lease_timeout_s"]
        assert fed["componentInputParameter"].endswith("dump_lease_timeout_s"), name
    component = yaml.safe_load(open(os.path.join(COMPILED, "components", "dump_teacher_topk.yaml")))
    (spec,) = component["components"].values()
    assert spec["inputDefinitions"]["parameters"]["lease_timeout_s"]["defaultValue"] == 120.0


def _custom_job_inputs(d: dict, task: str) -> dict:
    return _tasks(d)[task]["inputs"]["parameters"]


VERTEX_JOBS = [("logit_distill_pipeline_vertex.yaml", "dump-teacher-topk", "dump"),
               ("logit_distill_pipeline_vertex.yaml", "train-offline-student", "train"),
               ("logit_distill_pipeline_vertex.yaml", "train-ce-baseline", "train"),
               ("logit_distill_from_store_vertex.yaml", "train-offline-student", "train"),
               ("logit_distill_from_store_vertex.yaml", "train-ce-baseline", "train")]


@pytest.mark.parametrize("name, task, which", VERTEX_JOBS)
def test_vertex_variants_run_dump_and_train_as_custom_jobs_as_the_pipeline(name, task, which):
    """Both Vertex pipelines: each job runs as the pipeline's service account, in its network, with its key,
    named after the run and the key (from its plan), with the machine, scheduling and labels as parameters.
    (tests/test_launcher_guard.py creates these jobs through GCPC's own code.)"""
    d = _spec(name)
    inputs = _custom_job_inputs(d, task)
    assert inputs["service_account"]["runtimeValue"]["constant"] == "{{$.pipeline_service_account}}"
    assert inputs["network"]["runtimeValue"]["constant"] == "{{$.pipeline_network}}"
    assert inputs["encryption_spec_key_name"]["runtimeValue"]["constant"] == "{{$.pipeline_encryption_key_name}}"
    assert inputs["labels"]["componentInputParameter"].endswith("job_labels")
    assert inputs["display_name"]["componentInputParameter"].endswith("-job_display_name")
    for key in ("strategy", "timeout", "max_wait_duration"):
        assert inputs[key]["componentInputParameter"].endswith(f"{which}_{key}")
    (pool,) = inputs["worker_pool_specs"]["runtimeValue"]["constant"]
    assert "kfp.dsl.executor_main" in " ".join(pool["container_spec"]["command"])
    machine = pool["machine_spec"]
    for key in ("machine_type", "accelerator_type", "accelerator_count", "tpu_topology", "reservation_affinity"):
        assert f"{which}_{key}" in machine[key]
    assert f"{which}_boot_disk_size_gb" in pool["disk_spec"]["boot_disk_size_gb"]
    if which == "train":
        assert inputs["tensorboard"]["componentInputParameter"].endswith("tensorboard")
    job = d["components"][_tasks(d)[task]["componentRef"]["name"]]
    assert job["inputDefinitions"]["parameters"]["restart_job_on_worker_restart"]["defaultValue"] is False
    root_params = d["root"]["inputDefinitions"]["parameters"]
    assert root_params[f"{which}_strategy"]["defaultValue"] == ("SPOT" if which == "dump" else "STANDARD")
    # the plans name the jobs after the run ({{$.pipeline_job_name}})
    for plan in ("plan-dump", "plan-kd") if which == "dump" else ("plan-kd",):
        run_name = _tasks(d)[plan]["inputs"]["parameters"]["run_name"]["runtimeValue"]["constant"]
        assert run_name == "{{$.pipeline_job_name}}"


@pytest.mark.parametrize("name", ["logit_distill_pipeline_vertex.yaml", "logit_distill_from_store_vertex.yaml"])
def test_the_model_upload_has_the_key_a_parent_and_aliases(name):
    """The optional Model Registry upload of the KD student's export: with the pipeline's encryption key, the
    version aliases, and as a new version of parent_model when one is given."""
    d = _spec(name)
    tasks = _tasks(d)
    for upload in ("register-student", "register-student-version"):
        inputs = tasks[upload]["inputs"]["parameters"]
        assert inputs["encryption_spec_key_name"]["runtimeValue"]["constant"] == "{{$.pipeline_encryption_key_name}}"
        assert inputs["version_aliases"]["componentInputParameter"].endswith("model_version_aliases")
    assert "parent_model" in tasks["register-student-version"]["inputs"]["artifacts"]
    assert "parent_model" not in tasks["register-student"]["inputs"].get("artifacts", {})
    parent = tasks["parent-model"]["inputs"]["parameters"]
    assert parent["uri"]["componentInputParameter"].endswith("parent_model")
    # the export comes from the training, or from the complete folder when the training was skipped
    export = tasks["student-hf-export"]["inputs"]["parameters"]["uri"]
    assert export["componentInputParameter"].startswith("pipelinechannel--condition-branches")


def test_vertex_custom_jobs_run_the_retry_guard_then_gcpcs_launcher_with_its_arguments(tmp_path):
    """The dump and train jobs' launcher containers run pipelines/launcher_guard.py (its source, embedded: GCPC's
    image lacks this package) and pass GCPC's own launcher arguments on; tests/test_launcher_guard.py runs it."""
    import inspect

    from google_cloud_pipeline_components.v1.custom_job import component
    from kfp import compiler

    from pipelines import launcher_guard
    from pipelines.pipeline import GCPC_LAUNCHER_COMMAND

    compiler.Compiler().compile(component.custom_training_job, str(tmp_path / "gcpc.yaml"))
    with open(tmp_path / "gcpc.yaml") as f:
        (gcpc,) = [e["container"] for e in yaml.safe_load(f)["deploymentSpec"]["executors"].values()]
    assert gcpc["command"] == GCPC_LAUNCHER_COMMAND  # what the guard hands over to (launcher_guard.LAUNCHER)
    for name, task, _ in VERTEX_JOBS:
        d = _spec(name)
        tasks = _tasks(d)
        executor = d["components"][tasks[task]["componentRef"]["name"]]["executorLabel"]
        container = d["deploymentSpec"]["executors"][executor]["container"]
        assert container["command"] == ["python3", "-u", "-c", inspect.getsource(launcher_guard)], task
        assert container["args"] == gcpc["args"] and container["image"] == gcpc["image"], task
    assert GCPC_LAUNCHER_COMMAND[-1] == launcher_guard.LAUNCHER


def _compile_vertex(path, **options) -> dict:
    from kfp import compiler

    from pipelines.pipeline import build_pipelines

    compiler.Compiler().compile(build_pipelines(**options)["vertex"], str(path))
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.mark.slow
def test_multi_host_and_tpu_compiles(tmp_path):
    d = _compile_vertex(tmp_path / "multi.yaml", dump_replicas=2, train_replicas=2, dump_retries=5,
                        train_retries=0, max_backoff="600s")
    tasks = _tasks(d)
    for task in ("dump-teacher-topk", "train-offline-student"):
        job = d["components"][tasks[task]["componentRef"]["name"]]
        assert job["inputDefinitions"]["parameters"]["restart_job_on_worker_restart"]["defaultValue"] is True
        pools = tasks[task]["inputs"]["parameters"]["worker_pool_specs"]["runtimeValue"]["constant"]
        assert [p["replica_count"] for p in pools] == [1, 1]
    # retries are compile options; backoffMaxDuration is the longest wait between two retries (Vertex's meaning)
    assert tasks["dump-teacher-topk"]["retryPolicy"] == {"maxRetryCount": 5, "backoffDuration": "60s",
                                                         "backoffFactor": 2.0, "backoffMaxDuration": "600s"}
    assert "retryPolicy" not in tasks["train-offline-student"]
    default = _tasks(_spec("logit_distill_pipeline_vertex.yaml"))
    assert default["dump-teacher-topk"]["retryPolicy"]["backoffMaxDuration"] == "3600s"
    assert compile_mod.main(["--out-dir", str(tmp_path / "x"), "--dump-retries", "-1"]) == 2
    assert compile_mod.main(["--out-dir", str(tmp_path / "x"), "--max-backoff", "1h"]) == 2
    # the plan counts the job's processes from the replicas and the TPU slice, as the dump will find them
    plan = tasks["plan-dump"]["inputs"]["parameters"]
    assert plan["num_processes"]["runtimeValue"]["constant"] == 2
    assert plan["tpu_topology"]["componentInputParameter"] == "dump_tpu_topology"
    # a TPU slice compiled as one replica: the whole job restarts with a worker when asked
    d = _compile_vertex(tmp_path / "tpu.yaml", restart_job_on_worker_restart=True)
    job = d["components"][_tasks(d)["dump-teacher-topk"]["componentRef"]["name"]]
    assert job["inputDefinitions"]["parameters"]["restart_job_on_worker_restart"]["defaultValue"] is True
    from logit_distill.distributed import planned_processes

    assert planned_processes(1, "4x4", "ct5lp-hightpu-4t") == 4
    assert planned_processes(1, "2x2x2", "cloud-tpu") == 2
    assert planned_processes(2, "", "a3-highgpu-8g") == 2


IMAGE = "us-central1-docker.pkg.dev/proj/repo/logit-distill:0.1.0-cuda"
CPU_IMAGE = "us-central1-docker.pkg.dev/proj/repo/logit-distill:0.1.0-cpu"
REQUIRED = ["teacher=gs://bucket/teacher", "data=gs://bucket/data/*.array_record", "student=gs://bucket/student",
            "output_root=gs://bucket/out", "dump_num_steps=1000"]
KEY = "projects/proj/locations/us-central1/keyRings/distill/cryptoKeys/store"


def test_submit_dry_run_builds_the_job_offline(tmp_path):
    from google.auth.credentials import AnonymousCredentials

    from pipelines import submit

    job, values, path, spec = submit.build_job(
        project="proj", region="us-central1", pipeline_root="gs://bucket/root", image=IMAGE, cpu_image=CPU_IMAGE,
        params=REQUIRED + ["top_k=32", "ce_baseline=true", "learning_rate=0.001", "dump_lease_timeout_s=300",
                           "allow_tokenizer_mismatch=yes"], labels={"team": "distill"},
        credentials=AnonymousCredentials(), work_dir=str(tmp_path), encryption_key=KEY)
    runtime = job._gca_resource.runtime_config
    assert runtime.gcs_output_directory == "gs://bucket/root"
    assert values == {"teacher": "gs://bucket/teacher", "data": "gs://bucket/data/*.array_record",
                      "student": "gs://bucket/student", "output_root": "gs://bucket/out", "dump_num_steps": 1000,
                      "top_k": 32, "ce_baseline": True, "learning_rate": 0.001, "dump_lease_timeout_s": 300.0,
                      "allow_tokenizer_mismatch": True, "job_labels": {"team": "distill"}}
    assert runtime.parameter_values["dump_lease_timeout_s"] == 300.0
    assert runtime.parameter_values["allow_tokenizer_mismatch"] is True
    assert dict(job._gca_resource.labels)["team"] == "distill"
    # the pipeline job's key (its custom jobs and the upload take it from {{$.pipeline_encryption_key_name}})
    assert job._gca_resource.encryption_spec.kms_key_name == KEY
    with open(path) as f:
        text = f.read()
    assert IMAGE in text and CPU_IMAGE in text and "YOUR_PROJECT" not in text
    # the dump and the training on the accelerator image, plan and verify on the CPU image
    assert set(submit.images_of(spec)) == {IMAGE, CPU_IMAGE,
                                           "gcr.io/ml-pipeline/google-cloud-pipeline-components:2.22.0"}

    def caching(job) -> dict:
        d = type(job._gca_resource).to_dict(job._gca_resource)["pipeline_spec"]
        return {t["taskInfo"]["name"]: t.get("cachingOptions", {}).get("enableCache", False)
                for t in _tasks(d).values()}

    # caching is left as compiled unless asked: verify cached, the plan and the dump never
    assert caching(job)["verify-logits"] is True and caching(job)["plan-dump"] is False
    assert caching(job)["dump-teacher-topk"] is False
    job2, *_ = submit.build_job(project="p", region="us-central1", pipeline_root="gs://b/r", image=IMAGE,
                                params=REQUIRED,
                                enable_caching=False, job_id="my-run-1", credentials=AnonymousCredentials(),
                                work_dir=str(tmp_path))
    assert job2.job_id == "my-run-1"
    assert not any(caching(job2).values())


def test_submit_builds_the_from_store_vertex_pipeline(tmp_path, capsys):
    """logit-distill-from-store-vertex: submitted like the main one, with its own parameters and checks."""
    from pipelines import submit

    base = ["--project", "p", "--region", "us-central1", "--pipeline-root", "gs://b/root", "--dry-run",
            "--image", IMAGE, "--pipeline", "logit-distill-from-store-vertex"]
    store = ["store=gs://b/out/teacher_topk/0123456789abcdef", "student=gs://b/student", "output_root=gs://b/out"]
    assert submit.main(base + store + ["train_machine_type=g2-standard-24", "train_accelerator_type=NVIDIA_L4",
                                       "train_accelerator_count=2"]) == 0
    out = capsys.readouterr().out
    assert "'logit-distill-from-store-vertex' from " in out and "logit_distill_from_store_vertex.yaml" in out
    assert "  train_machine_type = \"g2-standard-24\"\n" in out and "dump_machine_type" not in out
    assert submit.main(base + ["store=/tmp/store", *store[1:]]) == 2
    assert "store='/tmp/store' is not in Cloud Storage" in capsys.readouterr().err


# Each case submit --dry-run must refuse in one line (what Vertex would reject, or misbehave on).
REFUSED = [
    ([], "placeholder image"),
    (["--image", "example.com/ld:latest"], "latest"),
    (["--image", IMAGE, "dump_strategy=PREEMPTIBLE_PLEASE"], "dump_strategy='PREEMPTIBLE_PLEASE' is not one of"),
    (["--image", IMAGE, "dump_dtype=float8"], "dump_dtype='float8' is not one of"),
    (["--image", IMAGE, "train_num_steps=-5"], "train_num_steps=-5 is below its minimum"),
    (["--image", IMAGE, "output_root=/tmp/out"], "output_root='/tmp/out' is not in Cloud Storage"),
    (["--image", IMAGE, "dump_num_steps=many"], "dump_num_steps='many' is not a valid int"),
    (["--image", IMAGE, "nonsense=1"], "unknown parameter 'nonsense'"),
    (["--image", IMAGE, "num_steps=20000"], "'num_steps' is now 'dump_num_steps'"),
    (["--image", IMAGE, "--labels", "Team=X"], "--labels"),
    (["--image", IMAGE, "register_model=true"], "needs serving_image"),
    (["--image", IMAGE, "dump_lease_timeout_s=5"], "dump_lease_timeout_s=5.0 is below its minimum 10"),
    (["--image", IMAGE, "eval_store=/tmp/held-out"], "eval_store='/tmp/held-out' is not in Cloud Storage"),
    (["--image", IMAGE, "eval_data=gs://b/e", "eval_teacher=/tmp/teacher"],
     "eval_teacher='/tmp/teacher' is not in Cloud Storage: a Vertex job cannot read this machine's disk; give "
     "gs://... or preset:..."),
    (["--image", IMAGE, "eval_teacher=preset:tiny-qwen3"], "eval_teacher runs the teacher on eval_data"),
    (["--image", IMAGE, "jsd_beta=1"], "jsd_beta=1.0 is not in the open interval (0, 1)"),
    (["--image", IMAGE, "dump_lease_timeout_s=nan"], "dump_lease_timeout_s=nan is not a finite number"),
    (["--image", IMAGE, "dump_lease_timeout_s=1e9"], "dump_lease_timeout_s=1000000000.0 is above its maximum 3600"),
    (["--image", IMAGE, "allow_tokenizer_mismatch=perhaps"], "allow_tokenizer_mismatch='perhaps' is not a valid bool"),
    (["--image", IMAGE, "--project", ""], "--project is empty"),
    # the cases of a first production run: a TPU machine with the default H100 x 8, an accelerator type that is
    # not Vertex's, a local teacher, an experiment name Vertex rejects, a reservation that is not one
    (["--image", IMAGE, "dump_machine_type=ct5lp-hightpu-4t"],
     "dump_accelerator_type='NVIDIA_H100_80GB' on dump_machine_type='ct5lp-hightpu-4t': it takes TPU_V5_LITEPOD x 4"),
    (["--image", IMAGE, "dump_accelerator_type=NVIDIA_H100"],
     "dump_accelerator_type='NVIDIA_H100' is not a Vertex accelerator type (one of NVIDIA_H100_80GB"),
    (["--image", IMAGE, "teacher=/models/Qwen3-8B"], "teacher='/models/Qwen3-8B' is not in Cloud Storage"),
    (["--image", IMAGE, "--experiment", "Qwen3 KD!"], "--experiment 'Qwen3 KD!' is not a Vertex AI Experiment name"),
    (["--image", IMAGE, 'dump_reservation_affinity={"foo":1}'],
     'dump_reservation_affinity={"foo": 1} is not a ReservationAffinity'),
    (["--image", IMAGE, "train_accelerator_count=4"], "train_accelerator_count=4 on train_machine_type='a3-highgpu-8g'"),
    (["--image", IMAGE, "train_tpu_topology=2x2"], "train_tpu_topology='2x2' on train_machine_type='a3-highgpu-8g'"),
    (["--image", IMAGE, "eval_data=heldout.jsonl"], "eval_data='heldout.jsonl' is not in Cloud Storage"),
    (["--image", IMAGE, "model_version_aliases=[\"Candidate\"]"], "'Candidate' is not a version alias"),
    (["--image", IMAGE, "parent_model=my-model"], "parent_model='my-model' is not a model's resource name"),
    (["--image", IMAGE, "--encryption-key", "my-key"], "--encryption-key 'my-key' is not a Cloud KMS key name"),
    (["--image", IMAGE, "--pipeline", "logit-distill-from-store-vertex", "store=gs://b/s", "output_root=out"],
     "output_root='out' is not in Cloud Storage"),
]


@pytest.mark.parametrize("args, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_submit_refuses_bad_input_in_one_line(args, message, capsys):
    from pipelines import submit

    base = ["--project", "p", "--region", "us-central1", "--pipeline-root", "gs://b/root", "--dry-run"]
    given = [a for a in args if "=" in a and not a.startswith("-")]
    flags = [a for a in args if a not in given]
    from_store = "logit-distill-from-store-vertex" in flags
    pairs = {} if from_store else {p.split("=")[0]: p for p in REQUIRED}
    if from_store:
        pairs["student"] = "student=gs://bucket/student"
    pairs.update({p.split("=")[0]: p for p in given})
    code = submit.main(base + flags + list(pairs.values()))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("submit: error: ") and message in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_submit_dry_run_prints_every_resolved_parameter(capsys):
    from pipelines import params, submit

    code = submit.main(["--project", "p", "--region", "us-central1", "--pipeline-root", "gs://b/root", "--dry-run",
                        "--image", IMAGE, "--service-account", "sa@p.iam.gserviceaccount.com", "--network",
                        "projects/1/global/networks/vpc", "--labels", "team=distill", "--no-cache",
                        "--experiment", "kd-sweep", "--encryption-key", KEY] + REQUIRED + ["top_k=32"])
    out = capsys.readouterr().out
    assert code == 0
    for p in params.of("vertex"):
        assert f"  {p.name} = " in out, p.name
    assert "  top_k = 32\n" in out and '  seq_len = 2048  (default)' in out
    assert IMAGE in out and "sa@p.iam.gserviceaccount.com" in out and "projects/1/global/networks/vpc" in out
    assert "kd-sweep" in out and "off for every task" in out and '"team": "distill"' in out
    assert f"encryption    {KEY}" in out
    assert out.rstrip().endswith("dry run: nothing submitted")


# ---------------------------------------------------------------- a local run that resumes a killed dump

TEACHER = "preset:small-qwen3"
STUDENT = "preset:tiny-qwen3"
DUMP = dict(num_steps=24, selection="topk", top_k=16, seq_len=128, batch_size=8, steps_per_file=3)  # the components' names
PIPELINE_DUMP = dict(dump_num_steps=24, selection="topk", top_k=16, seq_len=128, dump_batch_size=8, steps_per_file=3)

KILLABLE = r"""
import sys
sys.path.insert(0, sys.argv[1])
from kfp.dsl import Dataset, Metrics
from components.dump_teacher_topk import dump_teacher_topk
import json
kw = json.loads(sys.argv[2])
dump_teacher_topk(store=Dataset(uri=sys.argv[3] + "/store"), metrics=Metrics(uri=sys.argv[3] + "/metrics"), **kw)
"""


def _chunks(store: str) -> list[str]:
    return sorted(n for n in os.listdir(store) if n.endswith(".array_record") and not n.startswith("."))


@pytest.mark.slow
def test_local_pipeline_resumes_a_killed_dump_and_trains(tmp_path, capsys):
    import numpy as np
    from kfp import local

    from logit_distill.data import write_pretokenized
    from logit_distill.dump import DumpConfig, run_dump
    from pipelines.demo import read_executor_metrics
    from pipelines.pipeline import distill_pipeline

    rng = np.random.default_rng(1)
    data = str(tmp_path / "train.array_record")
    eval_data = str(tmp_path / "eval.array_record")
    write_pretokenized(data, [rng.integers(0, 256, 128, dtype=np.int32) for _ in range(200)])
    write_pretokenized(eval_data, [rng.integers(0, 256, 128, dtype=np.int32) for _ in range(8)])
    output_root = str(tmp_path / "out")

    from components.plan_dump import plan_dump

    plan = plan_dump(teacher=TEACHER, data=data, output_root=output_root, **DUMP)

    # 1. the dump, killed (SIGKILL: no clean-up) once its first chunks are committed
    kw = dict(teacher=TEACHER, data=data, store_uri=plan.store_uri, dump_key=plan.dump_key, **DUMP)
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE, REPO, json.dumps(kw), str(tmp_path / "killed")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if os.path.isdir(plan.store_uri) and _chunks(plan.store_uri):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the dump finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    killed_with = len(_chunks(plan.store_uri))
    assert 1 <= killed_with < DUMP["num_steps"] // DUMP["steps_per_file"]

    # 2. the pipeline under kfp.local: plan -> dump (resumes) -> verify -> train
    root = tmp_path / "kfp"
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root))
    args = dict(teacher=TEACHER, data=data, student=STUDENT, output_root=output_root, eval_data=eval_data,
                verify_sample=16, spot_check=2, train_num_steps=3, train_batch_size=8, learning_rate=1e-3,
                loss="topk_kl", alpha=0.5, **PIPELINE_DUMP)
    distill_pipeline(**args)
    (run,) = [d for d in root.iterdir() if d.name.startswith("logit-distill")]
    dump = read_executor_metrics(str(run), "dump-teacher-topk")
    assert dump["store"]["uri"] == plan.store_uri
    m = dump["metrics"]["metadata"]
    assert m["resumed_from_step"] > 0
    assert m["chunks_present_at_start"] == killed_with
    assert m["chunks_written_this_attempt"] == DUMP["num_steps"] // DUMP["steps_per_file"] - killed_with
    assert read_executor_metrics(str(run), "verify-logits")["Output"] is True
    train = read_executor_metrics(str(run), "train-offline-student")
    assert os.path.exists(os.path.join(train["model"]["uri"], "hf", "config.json"))
    assert train["model"]["uri"].startswith(os.path.join(output_root, "students", ""))  # keyed, resumable
    assert not (run / "train-offline-student-2").exists()  # no CE baseline unless asked

    # 3. the same store as an uninterrupted dump: same manifest, same chunks (names carry SHA-256)
    reference = str(tmp_path / "reference")
    run_dump(DumpConfig(teacher=TEACHER, data=data, output=reference, progress=False, **DUMP))
    assert _chunks(reference) == _chunks(plan.store_uri)
    with open(os.path.join(reference, "manifest.json")) as a, open(os.path.join(plan.store_uri, "manifest.json")) as b:
        ref, got = json.load(a), json.load(b)
    assert ref["fingerprint"] == got["fingerprint"]
    assert {k: v for k, v in ref.items() if k != "info"} == {k: v for k, v in got.items() if k != "info"}

    # 4. a re-run on the complete store (run_local, as the demo does): no dump task, so no teacher loaded; the
    #    student of the same settings is found complete in its keyed folder by a CPU task: no training task
    from pipelines import run_local

    again = run_local.run("logit-distill", {**args, "spot_check": 0}, root=str(tmp_path / "again"), echo=None)
    assert again.ok, again.error
    assert "dump-teacher-topk" not in again.tasks and again.tasks["use-existing-store"] == "SUCCESS"
    assert "train-offline-student" not in again.tasks and again.tasks["use-existing-student"] == "SUCCESS"
    assert read_executor_metrics(again.run_dir, "plan-dump")["complete"] is True
    reused = read_executor_metrics(again.run_dir, "use-existing-student")
    assert reused["model"]["uri"] == train["model"]["uri"] and reused["model"]["metadata"]["eval"]["num_tokens"]

    # 5. a mistyped eval_data, for a store not yet dumped, fails the run in the preflight, a CPU task, with the
    #    tool's own line: no dump and no training task starts (on Vertex: no accelerator job)
    missing = str(tmp_path / "heldout-typo.array_record")
    bad = run_local.run("logit-distill", {**args, "spot_check": 0, "eval_data": missing,
                                          "output_root": str(tmp_path / "fresh-root")},
                        root=str(tmp_path / "bad-eval"), echo=None)
    assert not bad.ok and bad.tasks["preflight"] == "FAILURE", bad.tasks
    assert "dump-teacher-topk" not in bad.tasks and "train-offline-student" not in bad.tasks
    assert bad.error.endswith(f"logit-distill preflight: error: data path not found: {missing}; check the path"), bad.error

    # 6. a deterministic failure of the dump (two chunks for one step range: exit 4) is not retried: the dump
    #    task runs once though it has 3 retries, and the run fails with the dump's own line
    chunks = _chunks(plan.store_uri)
    duplicate = os.path.join(plan.store_uri, chunks[0][:-len("0123456789abcdef.array_record")]
                             + "f" * 16 + ".array_record")
    shutil.copyfile(os.path.join(plan.store_uri, chunks[0]), duplicate)
    failed = run_local.run("logit-distill", {**args, "spot_check": 0}, root=str(tmp_path / "dup"), echo=None)
    os.remove(duplicate)
    assert not failed.ok and failed.tasks["dump-teacher-topk"] == "SUCCESS"
    outputs = read_executor_metrics(failed.run_dir, "dump-teacher-topk")
    assert outputs["exit_code"] == 4 and outputs["error"].startswith("logit-distill dump: error: ")
    assert failed.error.endswith(outputs["error"]) and "verify-logits" not in failed.tasks
    with open(failed.log) as f:
        assert run_local._ANSI.sub("", f.read()).count("Executing task 'dump-teacher-topk'") == 1

    # 7. a chunk damaged in place (same name): verification fails, and with it the run, naming the check
    victim = os.path.join(plan.store_uri, _chunks(plan.store_uri)[1])
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    capsys.readouterr()
    code = run_local.main(["--root", str(tmp_path / "bad")]
                          + [f"{k}={v}" for k, v in {**args, "spot_check": 0}.items()])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("run_local: error:")]
    assert "verification-failed" in line and "verify failed: integrity" in line, line
    assert "verification-failed" in out and "train-offline-student" not in out


@pytest.mark.slow
def test_from_store_pipeline_resumes_a_killed_training(tmp_path):
    """logit-distill-from-store (import -> verify -> train) under kfp.local; the training task killed after
    its first checkpoint resumes from it when the run is repeated (its folder is keyed by the settings)."""
    import numpy as np

    from logit_distill.data import write_pretokenized
    from logit_distill.dump import DumpConfig, run_dump
    from pipelines import run_local

    rng = np.random.default_rng(2)
    data = str(tmp_path / "train.array_record")
    write_pretokenized(data, [rng.integers(0, 256, 64, dtype=np.int32) for _ in range(64)])
    store = str(tmp_path / "store")
    run_dump(DumpConfig(teacher=TEACHER, data=data, output=store, num_steps=4, selection="topk", top_k=8, seq_len=64,
                        batch_size=8, steps_per_file=2, progress=False))
    out = tmp_path / "out"
    args = [f"store={store}", f"student={STUDENT}", f"output_root={out}", "train_num_steps=24", "train_batch_size=4",
            "checkpoint_every=4", "verify_sample=4", "learning_rate=0.001"]
    cmd = [sys.executable, "-m", "pipelines.run_local", "--pipeline", "logit-distill-from-store",
           "--root", str(tmp_path / "kfp")] + args

    def checkpoints() -> list[int]:
        found = []
        for ckpt in (out / "students").glob("*/checkpoints"):
            found += [int(n) for n in os.listdir(ckpt) if n.isdigit()]
        return found

    # 1. killed (the whole process group: the run and its task subprocess) once a checkpoint is committed
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None and not checkpoints():
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before a checkpoint could be seen"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    saved = max(checkpoints())
    assert 4 <= saved < 24

    # 2. the same run again: the training resumes from that checkpoint and finishes
    result = run_local.run("logit-distill-from-store",
                           {"store": store, "student": STUDENT, "output_root": str(out), "train_num_steps": 24,
                            "train_batch_size": 4, "checkpoint_every": 4, "verify_sample": 4,
                            "learning_rate": 0.001},
                           root=str(tmp_path / "kfp2"), echo=None)
    assert result.ok, result.error
    assert result.tasks["verify-logits"] == "SUCCESS" and result.tasks["train-offline-student"] == "SUCCESS"
    train = run_local.task_outputs(result.run_dir, "train-offline-student")
    meta = train["model"]["metadata"]
    assert meta["resumed_from_step"] >= saved and meta["num_steps"] == 24
    assert train["model"]["uri"].startswith(str(out / "students"))
    assert os.listdir(os.path.join(train["model"]["uri"], "tensorboard"))
