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


@pytest.mark.parametrize("name", sorted(compile_mod.OUTPUTS.values()))
def test_compiled_yaml_is_a_pipeline_spec_with_the_dag(name):
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    d = _spec(name)
    json_format.ParseDict(d, pipeline_spec_pb2.PipelineSpec())
    tasks = d["root"]["dag"]["tasks"]
    assert {"plan-dump", "dump-teacher-topk", "verify-logits"} <= set(tasks)
    dump = tasks["dump-teacher-topk"]
    assert dump["dependentTasks"] == ["plan-dump"]
    assert dump["retryPolicy"]["maxRetryCount"] >= 1
    assert dump["cachingOptions"] == {"enableCache": True}  # no static cacheKey
    params = dump["inputs"]["parameters"]
    assert params["dump_key"]["taskOutputParameter"] == {"outputParameterKey": "dump_key", "producerTask": "plan-dump"}
    assert params["store_uri"]["taskOutputParameter"]["producerTask"] == "plan-dump"
    assert tasks["verify-logits"]["dependentTasks"] == ["dump-teacher-topk"]
    assert tasks["verify-logits"]["inputs"]["artifacts"]["store"]["taskOutputArtifact"]["producerTask"] == \
        "dump-teacher-topk"
    # verify -> (if verified) train
    (cond,) = [t for t in tasks.values() if t.get("triggerPolicy")]
    assert "verify-logits-Output" in cond["triggerPolicy"]["condition"]
    assert "verify-logits" in cond["dependentTasks"]
    sub = d["components"][cond["componentRef"]["name"]]["dag"]["tasks"]
    assert sub["train-offline-student"]["componentRef"]["name"].startswith("comp-train-offline-student")
    images = json.dumps(d["deploymentSpec"]) + json.dumps(d["components"])
    assert ":latest" not in images


def test_vertex_variant_runs_dump_and_train_as_custom_jobs():
    d = _spec("logit_distill_pipeline_vertex.yaml")
    dump_comp = d["components"][d["root"]["dag"]["tasks"]["dump-teacher-topk"]["componentRef"]["name"]]
    pools = dump_comp["inputDefinitions"]["parameters"]["worker_pool_specs"]["defaultValue"]
    assert "kfp.dsl.executor_main" in " ".join(pools[0]["container_spec"]["command"])
    dump_inputs = d["root"]["dag"]["tasks"]["dump-teacher-topk"]["inputs"]["parameters"]
    machine = dump_inputs["worker_pool_specs"]["runtimeValue"]["constant"][0]["machine_spec"]
    assert "dump_machine_type" in machine["machine_type"] and "dump_accelerator_type" in machine["accelerator_type"]
    assert dump_inputs["strategy"]["componentInputParameter"] == "dump_strategy"
    root_params = d["root"]["inputDefinitions"]["parameters"]
    assert root_params["dump_strategy"]["defaultValue"] == "SPOT"


def test_submit_dry_run_builds_the_job_offline(tmp_path):
    from google.auth.credentials import AnonymousCredentials

    from pipelines import submit

    image = "us-central1-docker.pkg.dev/proj/repo/logit-distill:0.1.0-cuda"
    job, values, path = submit.build_job(
        project="proj", region="us-central1", pipeline_root="gs://bucket/root", image=image,
        params=["teacher=gs://bucket/teacher", "data=gs://bucket/data/*.array_record", "student=gs://bucket/student",
                "output_root=gs://bucket/out", "num_steps=1000", "top_k=32", "ce_baseline=true",
                "learning_rate=0.001"],
        credentials=AnonymousCredentials(), work_dir=str(tmp_path))
    runtime = job._gca_resource.runtime_config
    assert runtime.gcs_output_directory == "gs://bucket/root"
    assert values == {"teacher": "gs://bucket/teacher", "data": "gs://bucket/data/*.array_record",
                      "student": "gs://bucket/student", "output_root": "gs://bucket/out", "num_steps": 1000,
                      "top_k": 32, "ce_baseline": True, "learning_rate": 0.001}
    assert dict(runtime.parameter_values) == values
    with open(path) as f:
        text = f.read()
    assert image in text and "YOUR_PROJECT" not in text
    with pytest.raises(SystemExit, match="missing required"):
        submit.build_job(project="p", region="r", pipeline_root="gs://b/r", image=None, params=["teacher=x"],
                         credentials=AnonymousCredentials(), work_dir=str(tmp_path))
    with pytest.raises(ValueError, match="latest"):
        submit.with_image(text, "example.com/ld:latest")


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


def test_local_pipeline_resumes_a_killed_dump_and_trains(tmp_path):
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
    distill_pipeline(teacher=TEACHER, data=data, student=STUDENT, output_root=output_root, eval_data=eval_data,
                     verify_sample=16, spot_check=2, train_steps=3, train_batch_size=8, learning_rate=1e-3,
                     loss="topk_kl", alpha=0.5, **DUMP)
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
    assert not (run / "train-offline-student-2").exists()  # no CE baseline unless asked

    # 3. the same store as an uninterrupted dump: same manifest, same chunks (names carry SHA-256)
    reference = str(tmp_path / "reference")
    run_dump(DumpConfig(teacher=TEACHER, data=data, output=reference, progress=False, **DUMP))
    assert _chunks(reference) == _chunks(plan.store_uri)
    with open(os.path.join(reference, "manifest.json")) as a, open(os.path.join(plan.store_uri, "manifest.json")) as b:
        ref, got = json.load(a), json.load(b)
    assert ref["fingerprint"] == got["fingerprint"]
    assert {k: v for k, v in ref.items() if k != "info"} == {k: v for k, v in got.items() if k != "info"}


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
