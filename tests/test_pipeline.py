"""The pipeline: compiled YAML current and valid, DAG shape, Vertex submit dry run, and a local
run under kfp.local whose dump was killed mid-stream and resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # components/ and pipelines/ at the repo root

from pipelines import compile as compile_mod  # noqa: E402

COMPILED = os.path.join(REPO, "compiled")


def _spec(name: str) -> dict:
    with open(os.path.join(COMPILED, name)) as f:
        return yaml.safe_load(f)


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
    """Both variants, their descriptions and the components' defaults come from pipelines/params.py."""
    import inspect

    from pipelines import params
    from pipelines.pipeline import distill_pipeline, distill_pipeline_vertex

    for variant, pipe in (("local", distill_pipeline), ("vertex", distill_pipeline_vertex)):
        inputs = pipe.component_spec.inputs
        assert set(inputs) == {p.name for p in params.of(variant)}
        for p in params.of(variant):
            spec = inputs[p.name]
            assert spec.description and spec.description.startswith(p.help), p.name
            d = p.default_in(variant)
            assert (spec.optional, spec.default) == ((False, None) if d is params.REQUIRED else (True, d)), p.name
    # the shared settings have one default in both variants (only the production-minded ones differ)
    differ = {p.name for p in params.PARAMS if p.vertex_default is not None}
    assert differ == {"seq_len", "dtype", "sharding", "dump_accelerator_type", "dump_accelerator_count",
                      "train_accelerator_type", "train_accelerator_count"}
    # a component's own default of an input a parameter feeds is the parameter's (plain) default
    import components

    for module in (components.plan_dump, components.dump_teacher_topk, components.verify_logits,
                   components.train_offline_student):
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


def _tasks(d: dict) -> dict:
    """Every task of a compiled pipeline, in the root DAG or a condition's sub-DAG, by display name."""
    found = {}
    for dag in [d["root"]["dag"]] + [c["dag"] for c in d["components"].values() if "dag" in c]:
        for key, task in dag["tasks"].items():
            found[task.get("taskInfo", {}).get("name", key)] = task
    return found


@pytest.mark.parametrize("name", sorted(compile_mod.OUTPUTS.values()))
def test_compiled_yaml_is_a_pipeline_spec_with_the_dag(name):
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    d = _spec(name)
    json_format.ParseDict(d, pipeline_spec_pb2.PipelineSpec())
    tasks = _tasks(d)
    root = d["root"]["dag"]["tasks"]
    assert {"verify-logits", "train-offline-student", "train-ce-baseline", "verification-failed"} <= set(tasks)
    verify = tasks["verify-logits"]
    if name != "logit_distill_from_store.yaml":
        assert {"plan-dump", "dump-teacher-topk", "use-existing-store"} <= set(tasks)
        assert "plan-dump" in root and "dump-teacher-topk" not in root  # the dump runs only when needed
        dump = tasks["dump-teacher-topk"]
        assert dump["retryPolicy"]["maxRetryCount"] >= 1
        assert dump["retryPolicy"]["backoffMaxDuration"] == "604800s"  # the window covers a long dump
        assert dump["cachingOptions"] == {"enableCache": True}  # no static cacheKey
        assert verify["inputs"]["artifacts"]["store"]["taskOutputArtifact"] == {
            "outputArtifactKey": "store", "producerTask": "plan-dump"}
        # verify's cache key covers the store's state: from the dump, or from the plan when it was complete
        state = verify["inputs"]["parameters"]["store_state"]["taskOutputParameter"]
        branches = d["components"][root[state["producerTask"]]["componentRef"]["name"]]
        oneof = branches["outputDefinitions"]["parameters"][state["outputParameterKey"]]
        assert oneof["parameterType"] == "STRING"
        text = json.dumps(branches["dag"])
        assert "dump-teacher-topk" in text and "use-existing-store" in text
    else:
        assert verify["cachingOptions"] == {}  # an external store: verified on every run
    assert tasks["train-offline-student"]["retryPolicy"]["maxRetryCount"] >= 1
    # verify -> train if it passed, else the run fails
    conds = [t for t in tasks.values() if t.get("triggerPolicy")]
    assert any("verify-logits-Output" in c["triggerPolicy"]["condition"] for c in conds)
    images = json.dumps(d["deploymentSpec"]) + json.dumps(d["components"])
    assert ":latest" not in images


def test_compiled_pipelines_carry_the_lease_timeout_and_the_tokenizer_switch():
    """lease_timeout_s (the dump's lease) and allow_tokenizer_mismatch (the training) are pipeline
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
        if name == "logit_distill_from_store.yaml":
            assert "lease_timeout_s" not in root  # no dump
            continue
        lease = root["lease_timeout_s"]
        assert (lease["parameterType"], lease["defaultValue"]) == ("NUMBER_DOUBLE", 120.0), name
        assert "stale" in lease["description"]
        fed = tasks["dump-teacher-topk"]["inputs"]["parameters"]["lease_timeout_s"]
        assert fed["componentInputParameter"].endswith("lease_timeout_s"), name
    component = yaml.safe_load(open(os.path.join(COMPILED, "components", "dump_teacher_topk.yaml")))
    (spec,) = component["components"].values()
    assert spec["inputDefinitions"]["parameters"]["lease_timeout_s"]["defaultValue"] == 120.0


def _custom_job_inputs(d: dict, task: str) -> dict:
    return _tasks(d)[task]["inputs"]["parameters"]


def test_vertex_variant_runs_dump_and_train_as_custom_jobs_as_the_pipeline():
    d = _spec("logit_distill_pipeline_vertex.yaml")
    for task, which in (("dump-teacher-topk", "dump"), ("train-offline-student", "train")):
        inputs = _custom_job_inputs(d, task)
        # the job runs as the pipeline's service account, in its network, with its key
        assert inputs["service_account"]["runtimeValue"]["constant"] == "{{$.pipeline_service_account}}"
        assert inputs["network"]["runtimeValue"]["constant"] == "{{$.pipeline_network}}"
        assert inputs["encryption_spec_key_name"]["runtimeValue"]["constant"] == "{{$.pipeline_encryption_key_name}}"
        assert inputs["labels"]["componentInputParameter"].endswith("job_labels")
        for key in ("strategy", "timeout", "max_wait_duration"):
            assert inputs[key]["componentInputParameter"].endswith(f"{which}_{key}")
        (pool,) = inputs["worker_pool_specs"]["runtimeValue"]["constant"]
        assert "kfp.dsl.executor_main" in " ".join(pool["container_spec"]["command"])
        machine = pool["machine_spec"]
        for key in ("machine_type", "accelerator_type", "accelerator_count", "tpu_topology", "reservation_affinity"):
            assert f"{which}_{key}" in machine[key]
        assert f"{which}_boot_disk_size_gb" in pool["disk_spec"]["boot_disk_size_gb"]
    train = _custom_job_inputs(d, "train-offline-student")
    assert train["tensorboard"]["componentInputParameter"].endswith("tensorboard")
    job = d["components"][_tasks(d)["dump-teacher-topk"]["componentRef"]["name"]]
    assert job["inputDefinitions"]["parameters"]["restart_job_on_worker_restart"]["defaultValue"] is False
    root_params = d["root"]["inputDefinitions"]["parameters"]
    assert root_params["dump_strategy"]["defaultValue"] == "SPOT"
    assert root_params["dump_tpu_topology"]["defaultValue"] == ""
    # the optional Model Registry upload of the KD student's HF export
    tasks = _tasks(d)
    assert "register-student" in tasks and tasks["student-hf-export"]["inputs"]["parameters"]["uri"]


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
    d = _spec("logit_distill_pipeline_vertex.yaml")
    tasks = _tasks(d)
    for task in ("dump-teacher-topk", "train-offline-student", "train-ce-baseline"):
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


def test_multi_host_and_tpu_compiles(tmp_path):
    d = _compile_vertex(tmp_path / "multi.yaml", dump_replicas=2, train_replicas=2, dump_retry_window="14d")
    tasks = _tasks(d)
    for task in ("dump-teacher-topk", "train-offline-student"):
        job = d["components"][tasks[task]["componentRef"]["name"]]
        assert job["inputDefinitions"]["parameters"]["restart_job_on_worker_restart"]["defaultValue"] is True
        pools = tasks[task]["inputs"]["parameters"]["worker_pool_specs"]["runtimeValue"]["constant"]
        assert [p["replica_count"] for p in pools] == [1, 1]
    assert tasks["dump-teacher-topk"]["retryPolicy"]["backoffMaxDuration"] == f"{14 * 86400}s"
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
            "output_root=gs://bucket/out", "num_steps=1000"]


def test_submit_dry_run_builds_the_job_offline(tmp_path):
    from google.auth.credentials import AnonymousCredentials

    from pipelines import submit

    job, values, path, spec = submit.build_job(
        project="proj", region="us-central1", pipeline_root="gs://bucket/root", image=IMAGE, cpu_image=CPU_IMAGE,
        params=REQUIRED + ["top_k=32", "ce_baseline=true", "learning_rate=0.001", "lease_timeout_s=300",
                           "allow_tokenizer_mismatch=yes"], labels={"team": "distill"},
        credentials=AnonymousCredentials(), work_dir=str(tmp_path))
    runtime = job._gca_resource.runtime_config
    assert runtime.gcs_output_directory == "gs://bucket/root"
    assert values == {"teacher": "gs://bucket/teacher", "data": "gs://bucket/data/*.array_record",
                      "student": "gs://bucket/student", "output_root": "gs://bucket/out", "num_steps": 1000,
                      "top_k": 32, "ce_baseline": True, "learning_rate": 0.001, "lease_timeout_s": 300.0,
                      "allow_tokenizer_mismatch": True, "job_labels": {"team": "distill"}}
    assert runtime.parameter_values["lease_timeout_s"] == 300.0
    assert runtime.parameter_values["allow_tokenizer_mismatch"] is True
    assert dict(job._gca_resource.labels)["team"] == "distill"
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

    # caching is left as compiled unless asked: the dump cached, the plan never
    assert caching(job)["dump-teacher-topk"] is True and caching(job)["plan-dump"] is False
    job2, *_ = submit.build_job(project="p", region="us-central1", pipeline_root="gs://b/r", image=IMAGE,
                                params=REQUIRED,
                                enable_caching=False, job_id="my-run-1", credentials=AnonymousCredentials(),
                                work_dir=str(tmp_path))
    assert job2.job_id == "my-run-1"
    assert not any(caching(job2).values())


@pytest.mark.parametrize("args, message", [
    ([], "placeholder image"),
    (["--image", "example.com/ld:latest"], "latest"),
    (["--image", IMAGE, "dump_strategy=PREEMPTIBLE_PLEASE"], "dump_strategy='PREEMPTIBLE_PLEASE' is not one of"),
    (["--image", IMAGE, "dtype=float8"], "dtype='float8' is not one of"),
    (["--image", IMAGE, "train_steps=-5"], "train_steps=-5 is below its minimum"),
    (["--image", IMAGE, "output_root=/tmp/out"], "output_root='/tmp/out' is not a gs:// prefix"),
    (["--image", IMAGE, "num_steps=many"], "num_steps='many' is not a valid int"),
    (["--image", IMAGE, "nonsense=1"], "unknown parameter 'nonsense'"),
    (["--image", IMAGE, "--labels", "Team=X"], "--labels"),
    (["--image", IMAGE, "register_model=true"], "needs serving_image"),
    (["--image", IMAGE, "lease_timeout_s=5"], "lease_timeout_s=5.0 is below its minimum 10"),
    (["--image", IMAGE, "lease_timeout_s=nan"], "lease_timeout_s=nan is not a finite number"),
    (["--image", IMAGE, "lease_timeout_s=1e9"], "lease_timeout_s=1000000000.0 is above its maximum 3600"),
    (["--image", IMAGE, "allow_tokenizer_mismatch=perhaps"], "allow_tokenizer_mismatch='perhaps' is not a valid bool"),
    (["--image", IMAGE, "--project", ""], "--project is empty"),
])
def test_submit_refuses_bad_input_in_one_line(args, message, capsys):
    from pipelines import submit

    base = ["--project", "p", "--region", "us-central1", "--pipeline-root", "gs://b/root", "--dry-run"]
    given = [a for a in args if "=" in a and not a.startswith("-")]
    flags = [a for a in args if a not in given]
    pairs = {p.split("=")[0]: p for p in REQUIRED}
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
                        "--experiment", "kd-sweep"] + REQUIRED + ["top_k=32"])
    out = capsys.readouterr().out
    assert code == 0
    for p in params.of("vertex"):
        assert f"  {p.name} = " in out, p.name
    assert "  top_k = 32\n" in out and '  seq_len = 2048  (default)' in out
    assert IMAGE in out and "sa@p.iam.gserviceaccount.com" in out and "projects/1/global/networks/vpc" in out
    assert "kd-sweep" in out and "off for every task" in out and '"team": "distill"' in out
    assert out.rstrip().endswith("dry run: nothing submitted")


# ---------------------------------------------------------------- a local run that resumes a killed dump

TEACHER = "preset:small-qwen3"
STUDENT = "preset:tiny-qwen3"
DUMP = dict(num_steps=24, top_k=16, seq_len=128, batch_size=8, steps_per_file=3)

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

    from kfp.dsl import Dataset

    from components.plan_dump import plan_dump

    plan = plan_dump(teacher=TEACHER, data=data, output_root=output_root, store=Dataset(uri=str(tmp_path / "p")),
                     **DUMP)

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
                verify_sample=16, spot_check=2, train_steps=3, train_batch_size=8, learning_rate=1e-3,
                loss="topk_kl", alpha=0.5, **DUMP)
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

    # 4. a re-run on the complete store (run_local, as the demo does): no dump task, so no teacher loaded;
    #    the training of the same settings is found complete in its keyed folder
    from pipelines import run_local

    again = run_local.run("logit-distill", {**args, "spot_check": 0}, root=str(tmp_path / "again"), echo=None)
    assert again.ok, again.error
    assert "dump-teacher-topk" not in again.tasks and again.tasks["use-existing-store"] == "SUCCESS"
    assert read_executor_metrics(again.run_dir, "plan-dump")["complete"] is True
    retrained = read_executor_metrics(again.run_dir, "train-offline-student")
    assert retrained["model"]["uri"] == train["model"]["uri"]
    assert retrained["model"]["metadata"]["resumed_from_step"] == 3

    # 5. a chunk damaged in place (same name): verification fails, and with it the run, naming the check
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


def test_demo_runs_the_whole_pipeline_and_kd_beats_ce(tmp_path):
    """`make demo`: data sampled from the teacher, dump, verify, KD and CE-only students, summary."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pipelines.demo", "--out", str(tmp_path / "demo")],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    text = out.stdout[out.stdout.index("logit-distill demo: done"):]
    assert "verification     PASSED" in text
    values = {}
    for line in text.splitlines():
        for name in ("teacher", "KD student", "CE-only student"):
            if line.strip().startswith(name + " ") and "/" not in line:  # not the report paths
                values[name] = float(line.split()[-1])
    assert values["teacher"] < values["KD student"] < values["CE-only student"], values


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
    run_dump(DumpConfig(teacher=TEACHER, data=data, output=store, num_steps=4, top_k=8, seq_len=64,
                        batch_size=8, steps_per_file=2, progress=False))
    out = tmp_path / "out"
    args = [f"store={store}", f"student={STUDENT}", f"output_root={out}", "train_steps=24", "train_batch_size=4",
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
                           {"store": store, "student": STUDENT, "output_root": str(out), "train_steps": 24,
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
