"""The KFP components: unit tests that call each component's Python function directly with
artifacts in a temporary folder, and one run of each as a task under kfp.local."""

import json
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # components/ at the repo root

from kfp import dsl  # noqa: E402
from kfp.dsl import HTML, Dataset, Markdown, Metrics, Model  # noqa: E402

import components  # noqa: E402

TEACHER = "preset:tiny-qwen3"
STUDENT = "preset:tiny-qwen3@1"
SETTINGS = dict(num_steps=6, selection="topk", top_k=8, seq_len=32, batch_size=4, steps_per_file=2)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Pre-tokenized train / eval data (byte ids)."""
    from logit_distill.data import write_pretokenized

    root = tmp_path_factory.mktemp("components")
    rng = np.random.default_rng(0)
    data = str(root / "train.array_record")
    eval_data = str(root / "eval.array_record")
    write_pretokenized(data, [rng.integers(0, 256, 32, dtype=np.int32) for _ in range(40)])
    write_pretokenized(eval_data, [rng.integers(0, 256, 32, dtype=np.int32) for _ in range(8)])
    return {"root": root, "data": data, "eval_data": eval_data}


def _plan(work, **kwargs):
    return components.plan_dump.plan_dump(teacher=TEACHER, data=work["data"], output_root=str(work["root"] / "out"),
                                          **SETTINGS, **kwargs)


@pytest.fixture(scope="module")
def dumped(work):
    """A complete store made by the dump component's function."""
    plan = _plan(work)
    store = Dataset(name="store", uri=str(work["root"] / "artifacts" / "store"))
    metrics = Metrics(name="metrics", uri=str(work["root"] / "artifacts" / "metrics"))
    out = components.dump_teacher_topk.dump_teacher_topk(
        teacher=TEACHER, data=work["data"], store_uri=plan.store_uri, dump_key=plan.dump_key, store=store,
        metrics=metrics, **SETTINGS)
    return {"plan": plan, "store": store, "metrics": metrics, "out": out}


def test_plan_and_preflight_default_to_the_hybrid_store(work, capsys):
    """No selection, top_k or samples (the pipeline's defaults: hybrid, 0, 0): the store the command line
    writes without those flags, hybrid top-4 + 16 tail draws; preflight checks its training (hybrid_kl)."""
    from logit_distill.dump import DumpConfig, plan_dump
    from logit_distill.store import dump_key

    settings = {k: v for k, v in SETTINGS.items() if k not in ("selection", "top_k")}
    root = str(work["root"] / "defaults")
    plan = components.plan_dump.plan_dump(teacher=TEACHER, data=work["data"], output_root=root, **settings)
    manifest = plan_dump(DumpConfig(teacher=TEACHER, data=work["data"], output="", **settings)).manifest
    explicit = plan_dump(DumpConfig(teacher=TEACHER, data=work["data"], output="", selection="hybrid", top_k=4,
                                    samples=16, **settings)).manifest
    assert plan.dump_key == dump_key(manifest) == dump_key(explicit)
    shapes = manifest["shapes"]
    assert (shapes["selection"], shapes["top_k"], shapes["num_samples"]) == ("hybrid", 4, 16)
    train = dict(train_student=STUDENT, train_num_steps=2, train_batch_size=4)
    output = components.preflight.preflight(teacher=TEACHER, data=work["data"], output_root=root, **settings,
                                            **train)
    assert output.startswith(root + "/students/")
    with pytest.raises(SystemExit) as e:  # a sampled store has no default N
        components.preflight.preflight(teacher=TEACHER, data=work["data"], output_root=root, selection="sampled",
                                       **settings, **train)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith("logit-distill preflight: error: --selection sampled needs "
                                                    "--samples N"), err
    # a mistyped held-out store or evaluation teacher: one line, before any dump (the pipeline's preflight task
    # fails with it: no dump and no training task starts)
    typo = str(work["root"] / "heldout-typo")
    for given, line in ((dict(train_eval_store=typo), f"{typo} is not a logit store: it does not exist"),
                        (dict(train_eval_data=work["eval_data"], train_eval_teacher=typo),
                         f"{typo}/config.json: no config.json")):
        with pytest.raises(SystemExit) as e:
            components.preflight.preflight(teacher=TEACHER, data=work["data"], output_root=root, **settings, **train,
                                           **given)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and err[-1].startswith(f"logit-distill preflight: error: {line}"), err
    assert not os.path.exists(os.path.join(root, "teacher_topk"))  # nothing written
    assert components.preflight.preflight(teacher=TEACHER, data=work["data"], output_root=root, **settings, **train,
                                          train_eval_data=work["eval_data"], train_eval_teacher=TEACHER) == output


def test_a_complete_student_is_complete_for_the_evaluation_it_holds(tmp_path):
    """plan_training skips the training of a folder whose export and eval.json hold what is asked for: the held-out
    data or store, and against eval_teacher when given (the evaluation settings are not in the train key)."""
    from logit_distill.train.key import training_state

    out = tmp_path / "student"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "config.json").write_text("{}")
    assert training_state(str(out)) == "complete"
    assert training_state(str(out), "heldout") == "exported, not evaluated on heldout"
    (out / "eval.json").write_text(json.dumps({"data": "heldout", "cross_entropy": 1.0}))
    assert training_state(str(out), "heldout") == "complete"
    assert training_state(str(out), "heldout", eval_teacher="preset:t") == \
        "exported, not evaluated on heldout against teacher preset:t"
    (out / "eval.json").write_text(json.dumps({"data": "heldout", "teacher": {"against": "teacher preset:t"}}))
    assert training_state(str(out), "heldout", eval_teacher="preset:t") == "complete"
    assert training_state(str(out), "heldout", eval_teacher="preset:u").endswith("against teacher preset:u")
    assert training_state(str(out), eval_store="gs://b/held") == "exported, not evaluated on gs://b/held"
    (out / "eval.json").write_text(json.dumps({"data": "gs://b/held", "teacher": {"against": "store gs://b/held"}}))
    assert training_state(str(out), eval_store="gs://b/held") == "complete"


def test_plan_dump_names_the_store_by_its_fingerprint(work):
    from logit_distill.dump import DumpConfig, plan_dump
    from logit_distill.store import dump_key

    plan = _plan(work, run_name="logit-distill-vertex-20261201")
    assert len(plan.dump_key) == 16 and int(plan.dump_key, 16) >= 0
    assert plan.store_uri == str(work["root"] / "out") + "/teacher_topk/" + plan.dump_key
    assert plan.job_display_name == f"logit-distill-vertex-20261201-dump-{plan.dump_key}"
    config = DumpConfig(teacher=TEACHER, data=work["data"], output="", **SETTINGS)
    assert plan.dump_key == dump_key(plan_dump(config).manifest)
    assert plan.complete is False
    # a TPU slice of 2x4 chips on 4-chip hosts is 2 processes: the plan's key is the 2-process layout
    tpu = components.plan_dump.plan_dump(teacher=TEACHER, data=work["data"], output_root=str(work["root"] / "x"),
                                         tpu_topology="2x4", machine_type="ct5lp-hightpu-4t", **SETTINGS)
    assert tpu.dump_key == dump_key(plan_dump(config, num_processes=2).manifest) != plan.dump_key
    assert tpu.store_uri == str(work["root"] / "x") + "/teacher_topk/" + tpu.dump_key


def test_dump_writes_the_store_and_its_metrics(work, dumped):
    store, metrics, plan = dumped["store"], dumped["metrics"], dumped["plan"]
    assert store.uri == plan.store_uri  # the artifact IS the store
    assert os.path.exists(os.path.join(store.uri, "manifest.json"))
    assert store.metadata["dump_key"] == plan.dump_key
    m = metrics.metadata
    assert m["examples"] == 24 and m["positions"] == 24 * 32
    assert m["chunks_written_this_attempt"] == 3 and m["resumed_from_step"] == 0
    assert m["bytes_per_entry"] > 0 and m["tokens_per_s"] > 0
    assert dumped["out"].complete is True
    # the plan now finds the store complete, with the state the dump reported
    again = _plan(work)
    assert again.complete is True and again.store_state == dumped["out"].store_state


def test_dump_again_is_a_no_op(work, dumped, monkeypatch):
    """A complete store: the scan finds every chunk before the teacher is loaded, and nothing else runs."""
    import logit_distill.models

    def tripwire(*args, **kwargs):
        raise AssertionError("the teacher was loaded for a complete store")

    monkeypatch.setattr(logit_distill.models, "load_model", tripwire)
    plan = dumped["plan"]
    metrics = Metrics(name="metrics", uri=str(work["root"] / "again" / "metrics"))
    store = Dataset(name="store", uri=str(work["root"] / "again" / "store"))
    out = components.dump_teacher_topk.dump_teacher_topk(
        teacher=TEACHER, data=work["data"], store_uri=plan.store_uri, dump_key=plan.dump_key, store=store,
        metrics=metrics, **SETTINGS)
    assert out.resumed_from_step == SETTINGS["num_steps"]
    assert metrics.metadata["chunks_written_this_attempt"] == 0


def test_dump_records_a_deterministic_failure_instead_of_failing(work, dumped, capsys):
    """A key of other settings is bad input (exit 2): the task succeeds with the one-line error and its code
    as outputs (fail_on_error then fails the run, unretried), and nothing is written."""
    plan = dumped["plan"]
    before = sorted(os.listdir(plan.store_uri))
    out = components.dump_teacher_topk.dump_teacher_topk(
        teacher=TEACHER, data=work["data"], store_uri=plan.store_uri, dump_key=plan.dump_key,
        store=Dataset(uri=str(work["root"] / "x")), metrics=Metrics(uri=str(work["root"] / "y")),
        **{**SETTINGS, "top_k": 4})
    assert out.exit_code == 2 and out.error.startswith("logit-distill dump: error: dump_key ")
    assert "does not match these settings" in out.error and out.store_state == "" and not out.complete
    assert out.error in capsys.readouterr().err
    assert sorted(os.listdir(plan.store_uri)) == before
    assert dumped["out"].exit_code == 0 and dumped["out"].error == ""


def test_fail_on_error_ends_the_run_with_the_stages_line_or_passes_its_value(capsys):
    fail = components.fail_on_error.fail_on_error
    assert fail(stage="dump", error="", exit_code=0, value="state-1") == "state-1"
    with pytest.raises(SystemExit) as e:
        fail(stage="train", error="logit-distill train: error: data path not found: x.jsonl", exit_code=2)
    assert e.value.code == 2
    assert capsys.readouterr().err == "logit-distill train: error: data path not found: x.jsonl\n"


@pytest.mark.slow
def test_a_retried_dump_takes_over_a_gone_attempts_lease_at_the_configured_timeout(work, tmp_path, monkeypatch):
    """The dump's retry may start before the lease of the attempt it replaces is stale (the task backs off
    60 s; a lease is stale after lease_timeout_s): the dump waits until it would be stale, takes it over and
    completes the store, holding its own lease with the configured timeout. A lease its holder keeps
    refreshing (another dump writing the store now) fails the task instead."""
    import time

    from logit_distill.errors import StoreBusyError
    from logit_distill.store.lease import Lease

    def plan(root):
        return components.plan_dump.plan_dump(teacher=TEACHER, data=work["data"], output_root=str(tmp_path / root),
                                              **SETTINGS)

    def dump(planned, **kwargs):
        return components.dump_teacher_topk.dump_teacher_topk(
            teacher=TEACHER, data=work["data"], store_uri=planned.store_uri, dump_key=planned.dump_key,
            store=Dataset(uri=str(tmp_path / "a" / "store")), metrics=Metrics(uri=str(tmp_path / "a" / "m")),
            **SETTINGS, **kwargs)

    held = []
    acquire = Lease.acquire

    def spy(self):
        acquire(self)
        held.append((self.timeout_s, self.previous))
        return self

    monkeypatch.setattr(Lease, "acquire", spy)
    # the preempted attempt's lease: another machine, the configured timeout (3 s), refreshed 1 s ago
    gone = plan("gone")
    os.makedirs(gone.store_uri)
    lease = os.path.join(gone.store_uri, "lease.json")
    with open(lease, "w") as f:
        json.dump({"host": "preempted-vm", "pid": 7, "token": "a" * 32, "timeout_s": 3.0,
                   "acquired_at": "2026-01-01T00:00:00Z"}, f)
    os.utime(lease, (time.time() - 1.0,) * 2)
    start = time.monotonic()
    out = dump(gone, lease_timeout_s=3.0)
    assert time.monotonic() - start >= 2.0  # waited for the lease to go stale instead of failing
    assert out.complete is True and not os.path.exists(lease)
    ((timeout, previous),) = held
    assert timeout == 3.0 and previous["host"] == "preempted-vm"

    # a live holder, refreshing its lease: the dump watches it, then fails naming it (bad input, exit 2:
    # recorded for fail_on_error, not retried)
    busy = plan("busy")
    live = acquire(Lease(busy.store_uri, timeout_s=3.0))
    try:
        refused = dump(busy, lease_timeout_s=3.0)
        assert refused.exit_code == StoreBusyError.exit_code == 2
        assert "being written by another dump" in refused.error
        assert os.listdir(busy.store_uri) == ["lease.json"]  # the refused dump wrote nothing
    finally:
        live.release()


def test_verify_passes_a_good_store_and_fails_a_damaged_one(work, dumped, tmp_path):
    import shutil

    metrics, report = Metrics(uri=str(tmp_path / "m")), Markdown(uri=str(tmp_path / "report.md"))
    ok = components.verify_logits.verify_logits(store=dumped["store"], metrics=metrics, report=report,
                                                expected_steps=SETTINGS["num_steps"], data=work["data"],
                                                teacher=TEACHER, spot_check=2, sample=8)
    assert ok is True
    text = open(report.path).read()
    assert "PASSED" in text and "| coverage |" in text
    assert metrics.metadata["passed"] == 1 and metrics.metadata["examples"] == 24

    bad = tmp_path / "bad"
    shutil.copytree(dumped["store"].uri, bad)
    victim = sorted(p for p in os.listdir(bad) if p.endswith(".array_record"))[0]
    os.remove(bad / victim)
    metrics, report = Metrics(uri=str(tmp_path / "m2")), Markdown(uri=str(tmp_path / "r2.md"))
    ok = components.verify_logits.verify_logits(store=Dataset(uri=str(bad)), metrics=metrics, report=report)
    assert ok is False
    assert "FAILED" in open(report.path).read() and metrics.metadata["passed"] == 0
    assert metrics.metadata["check_coverage"] == 0
    assert "check_spot_check" not in metrics.metadata  # skipped checks are no numbers
    assert report.metadata["first_failure"].startswith("verify failed: ")


class _Planned(Exception):
    """Raised in place of the planning or the training: the config a component built is what the test reads."""


def _capture(monkeypatch, module, name: str) -> list:
    seen = []

    def stop(*args, **kwargs):
        seen.append(args[-1])  # plan_training(config), plan_training_on(dump_plan, config), train_student(config)
        raise _Planned

    monkeypatch.setattr(module, name, stop)
    return seen


@pytest.mark.parametrize("case", ["loss_settings_and_teacher", "held_out_store"])
def test_the_pipeline_parameters_reach_the_training_config(work, dumped, monkeypatch, tmp_path, case):
    """The pipeline's values (its table, routed by params.args_for as the DAG routes them) reach TrainConfig in
    the preflight, the training plan and the training alike: jsd_beta, skew, allow_biased_temperature,
    eval_teacher, eval_store and every other training parameter; the three name the same training folder."""
    import dataclasses

    import logit_distill.train
    import logit_distill.train.plan
    from logit_distill.train import TrainConfig
    from pipelines import params

    given = {"loss_settings_and_teacher": dict(loss="topk_tail_jsd", jsd_beta=0.25, skew=0.3,
                                               allow_biased_temperature=True, eval_data=work["eval_data"],
                                               eval_teacher=TEACHER),
             "held_out_store": dict(loss="topk_tail_skew_kl", skew=0.3, eval_store=str(tmp_path / "held-out"))}[case]
    p = {**params.defaults("local"), "teacher": TEACHER, "data": work["data"], "student": STUDENT,
         "output_root": str(work["root"] / "out"), "dump_num_steps": SETTINGS["num_steps"],
         "dump_batch_size": SETTINGS["batch_size"], "train_num_steps": 2, "train_batch_size": 4,
         "learning_rate": 1e-3, "warmup_steps": 1, "train_seed": 3, "alpha": 0.5, "temperature": 2.0,
         "grad_accum": 2, "allow_tokenizer_mismatch": True,
         **{k: SETTINGS[k] for k in ("selection", "top_k", "seq_len", "steps_per_file")}, **given}

    configs = {}
    seen = _capture(monkeypatch, logit_distill.train.plan, "plan_training_on")
    with pytest.raises(_Planned):
        components.preflight.preflight(**params.args_for(params.PLAN, p), **{
            f"train_{k}": v for k, v in params.args_for(params.TRAIN_PLAN, p).items() if k != "output_root"})
    configs["preflight"] = seen[-1]
    seen = _capture(monkeypatch, logit_distill.train, "plan_training")
    with pytest.raises(_Planned):
        components.plan_training.plan_training(store=dumped["store"], **params.args_for(params.TRAIN_PLAN, p))
    configs["plan"] = seen[-1]
    seen = _capture(monkeypatch, logit_distill.train, "train_student")
    with pytest.raises(_Planned):
        components.train_offline_student.train_offline_student(
            store=dumped["store"], model=Model(uri=str(tmp_path / "model")), metrics=Metrics(uri=str(tmp_path / "m")),
            report=HTML(uri=str(tmp_path / "r.html")), **params.args_for(params.TRAIN, p))
    configs["train"] = dataclasses.replace(seen[-1], checkpoint_every=500, log_every=None)  # the training's own

    want = TrainConfig.from_flat(
        store=dumped["store"].uri, output=configs["plan"].output, student=STUDENT, num_steps=2, batch_size=4,
        learning_rate=1e-3, warmup_steps=1, seed=3, loss=given["loss"], alpha=0.5, alpha_end=-1.0,
        alpha_schedule="constant", temperature=2.0, grad_accum=2, allow_tokenizer_mismatch=True, progress=False,
        **{k: v for k, v in given.items() if k != "loss"})
    assert configs == {"preflight": want, "plan": want, "train": want}
    assert configs["plan"].output.startswith(str(work["root"] / "out" / "students") + os.sep)
    for name in ("jsd_beta", "skew", "allow_biased_temperature", "eval_data", "eval_teacher", "eval_store"):
        assert getattr(want, name) == given.get(name, getattr(TrainConfig, name)), name


@pytest.mark.slow
def test_train_exports_the_student_and_reports_the_curves(work, dumped, tmp_path):
    model = Model(uri=str(tmp_path / "model"))
    metrics, report = Metrics(uri=str(tmp_path / "m")), HTML(uri=str(tmp_path / "report.html"))
    components.train_offline_student.train_offline_student(
        store=dumped["store"], student=STUDENT, num_steps=4, batch_size=4, model=model, metrics=metrics,
        report=report, learning_rate=1e-3, eval_data=work["eval_data"], eval_teacher=TEACHER, log_every=1,
        checkpoint_every=2, resources={"cpu": "2"})
    assert os.path.exists(os.path.join(model.uri, "hf", "config.json"))
    assert os.path.exists(os.path.join(model.uri, "metrics.jsonl"))
    assert model.metadata["hf_dir"].endswith("hf") and model.metadata["resources_requested"] == {"cpu": "2"}
    m = metrics.metadata
    assert model.metadata["num_steps"] == 4 and np.isfinite(m["eval_cross_entropy"]) and np.isfinite(m["final_loss"])
    assert all(v != -1 for v in m.values())  # no sentinel numbers among the metrics
    # eval_teacher: the teacher-relative measures of eval.json are metrics too (k: the store's top_k)
    teacher = model.metadata["eval"]["teacher"]
    assert teacher["against"] == f"teacher {TEACHER}" and m["eval_teacher_k"] == SETTINGS["top_k"] == teacher["k"]
    for name in ("kl", "top1_agreement", "topk_mass", "tail_shape_kl"):
        assert m[f"eval_teacher_{name}"] == round(teacher[name], 6) and np.isfinite(m[f"eval_teacher_{name}"]), name
    assert 0 <= m["eval_teacher_top1_agreement"] <= 1 and m["eval_teacher_count"] == teacher["count"] > 0
    assert os.listdir(os.path.join(model.uri, "tensorboard"))  # event files
    page = open(report.path).read()
    assert "data:image/png;base64," in page and "held-out cross-entropy" in page
    assert f"against teacher {TEACHER}: KL(teacher || student)" in page and "<th>eval_teacher</th>" in page


@pytest.mark.slow
def test_plan_training_names_the_folder_and_says_whether_it_is_done(work, dumped, tmp_path, capsys):
    """plan_training (CPU) computes the same folder as the training task, reads whether its training is done
    (export, and the evaluation when eval_data is asked for) and refuses a mistyped eval_data in one line;
    use_existing_student hands a complete folder on."""
    root = str(tmp_path / "out")
    args = dict(store=dumped["store"], student=STUDENT, num_steps=2, batch_size=4, learning_rate=1e-3,
                output_root=root)

    def plan(**kwargs):
        return components.plan_training.plan_training(**args, role="kd", run_name="run-1", **kwargs)

    before = plan()
    assert (before.complete, before.state) == (False, "empty")
    assert before.job_display_name == f"run-1-kd-{os.path.basename(before.output)}"
    model = Model(uri=str(tmp_path / "model"))
    trained = components.train_offline_student.train_offline_student(
        **args, model=model, metrics=Metrics(uri=str(tmp_path / "m")), report=HTML(uri=str(tmp_path / "r.html")))
    assert model.uri == before.output and trained.exit_code == 0  # the training's own folder for these settings
    after = plan()
    assert (after.complete, after.state) == (True, "complete")
    evaluated = plan(eval_data=work["eval_data"])
    assert not evaluated.complete and evaluated.state == f"exported, not evaluated on {work['eval_data']}"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        plan(eval_data=str(tmp_path / "typo.jsonl"))
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"logit-distill train: error: data path not found: "
                                       f"{tmp_path / 'typo.jsonl'}; check the path\n")
    reused = Model(uri=str(tmp_path / "reused"))
    existing = components.use_existing_student.use_existing_student(output=after.output, model=reused)
    assert existing.hf_dir == os.path.join(after.output, "hf") and reused.uri == after.output
    assert reused.metadata["reused"] is True


def test_training_streams_tensorboard_to_a_run_per_student(gcs_bucket, monkeypatch, tmp_path):
    """On Vertex (AIP_TENSORBOARD_LOG_DIR set) each student logs into <log dir>/<its train key>/, a run of its
    own, and its event files are uploaded while it trains, not only at checkpoints."""
    from logit_distill import paths
    from logit_distill.train import tensorboard

    monkeypatch.setenv(tensorboard.ENV, gcs_bucket + "/vertex/logs")
    monkeypatch.setattr(tensorboard, "UPLOAD_EVERY_S", 0.0)
    writers = {key: tensorboard.TensorBoard(f"{gcs_bucket}/out/students/{key}") for key in ("kd0123", "ce4567")}
    for key, writer in writers.items():
        assert writer.uri == f"{gcs_bucket}/vertex/logs/{key}"
        writer.write({"step": 1, "loss": 2.5, "kd_loss": 2.0})
        (event,) = paths.list_files(writer.uri)  # uploaded at the step, before any checkpoint or close
        assert event["name"].startswith("events.out.tfevents.") and event["size"] > 0
    for writer in writers.values():
        writer.close()
    monkeypatch.delenv(tensorboard.ENV)
    assert tensorboard.log_dir_for(str(tmp_path / "students" / "k")) == str(tmp_path / "students" / "k" / "tensorboard")


@pytest.mark.slow
def test_train_allows_another_tokenizer_only_when_asked(tmp_path):
    """allow_tokenizer_mismatch reaches the training: a student whose tokenizer.json differs from the store's
    is refused by default and trained when allowed, in a folder of its own (the flag is in the train key
    only when set, so earlier folders keep their keys)."""
    from dump_helpers import write_corpus
    from logit_distill.errors import InputError
    from logit_distill.train.key import train_output
    from test_train_helpers import make_model_dir, swap_tokenizer_ids, write_teacher_store

    teacher = make_model_dir(str(tmp_path / "teacher"), seed=1)
    student = swap_tokenizer_ids(make_model_dir(str(tmp_path / "student"), seed=2))
    store_uri = str(tmp_path / "store")
    write_teacher_store(store_uri, teacher, write_corpus(tmp_path / "corpus.jsonl", num_docs=40), seq_len=16,
                        top_k=8, examples_per_step=4)
    root = str(tmp_path / "out")

    def train(**kwargs):
        model = Model(uri=str(tmp_path / "model"))
        components.train_offline_student.train_offline_student(
            store=Dataset(uri=store_uri), student=student, num_steps=1, batch_size=4, model=model,
            metrics=Metrics(uri=str(tmp_path / "m")), report=HTML(uri=str(tmp_path / "r.html")), output_root=root,
            **kwargs)
        return model

    refused = Model(uri=str(tmp_path / "refused"))
    out = components.train_offline_student.train_offline_student(
        store=Dataset(uri=store_uri), student=student, num_steps=1, batch_size=4, model=refused,
        metrics=Metrics(uri=str(tmp_path / "m0")), report=HTML(uri=str(tmp_path / "r0.html")), output_root=root)
    assert out.exit_code == InputError.exit_code and re.search("another tokenizer.*allow-tokenizer-mismatch", out.error)
    assert out.error.startswith("logit-distill train: error: ") and out.hf_dir == ""
    model = train(allow_tokenizer_mismatch=True)
    settings = model.metadata["settings"]
    assert settings["allow_tokenizer_mismatch"] is True
    assert model.uri == train_output(root, store_uri, settings)
    plain = {k: v for k, v in settings.items() if k != "allow_tokenizer_mismatch"}
    assert model.uri != train_output(root, store_uri, plain)
    with open(os.path.join(model.uri, "hf", "tokenizer.json"), "rb") as a, \
            open(os.path.join(student, "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()  # the export ships the student's tokenizer


def test_components_compile_on_a_pinned_image_without_pip():
    from kfp import compiler

    built = components.build_all("example.com/ld:1.2.3")
    for comp in built.values():
        spec = comp.pipeline_spec
        (executor,) = spec.deployment_spec["executors"].values()
        container = executor["container"]
        assert container["image"] == "example.com/ld:1.2.3"
        assert "pip install" not in " ".join(container["command"])
    for bad in ("example.com/ld", "example.com/ld:latest", "ld:"):
        with pytest.raises(ValueError):
            components.build_all(bad)
    assert compiler  # the module imports


@pytest.mark.slow
def test_each_component_runs_as_a_kfp_local_task(work, tmp_path):
    """The components as tasks under kfp.local's SubprocessRunner (how KFP users test locally)."""
    from kfp import local

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    plan = components.plan_dump.component(teacher=TEACHER, data=work["data"],
                                          output_root=str(tmp_path / "out"), **SETTINGS)
    store_uri = plan.outputs["store_uri"]
    assert store_uri.endswith(plan.outputs["dump_key"])
    dump = components.dump_teacher_topk.component(teacher=TEACHER, data=work["data"], store_uri=store_uri,
                                                  dump_key=plan.outputs["dump_key"], **SETTINGS)
    assert dump.outputs["store"].uri == store_uri
    assert dump.outputs["metrics"].metadata["chunks_written_this_attempt"] == 3
    # kfp.local takes no artifact into a standalone task: verify and train run in a two-task pipeline
    # that imports the store.
    @dsl.pipeline(name="verify-and-train")
    def verify_and_train(store_uri: str, eval_data: str):
        imported = dsl.importer(artifact_uri=store_uri, artifact_class=Dataset, reimport=False)
        components.verify_logits.component(store=imported.output, expected_steps=SETTINGS["num_steps"])
        components.train_offline_student.component(store=imported.output, student=STUDENT, num_steps=2,
                                                   batch_size=4, eval_data=eval_data)

    verify_and_train(store_uri=store_uri, eval_data=work["eval_data"])
    (run,) = [d for d in (tmp_path / "root").iterdir() if d.name.startswith("verify-and-train")]
    with open(run / "verify-logits" / "executor_output.json") as f:
        assert json.load(f)["parameterValues"]["Output"] is True
    assert "PASSED" in (run / "verify-logits" / "report").read_text()
    train_dir = run / "train-offline-student"
    assert (train_dir / "model" / "hf" / "model.safetensors").exists()
    assert "data:image/png" in (train_dir / "report").read_text()
    with open(train_dir / "executor_output.json") as f:
        out = json.load(f)
    (metrics,) = out["artifacts"]["metrics"]["artifacts"]
    assert np.isfinite(metrics["metadata"]["eval_cross_entropy"])


def test_vertex_cluster_spec_names_the_coordinator_and_process():
    import json

    from logit_distill.distributed import vertex_cluster

    spec = {"cluster": {"workerpool0": ["chief:2222"], "workerpool1": ["w0:2222", "w1:2222"]},
            "task": {"type": "workerpool1", "index": 1}}
    assert vertex_cluster(json.dumps(spec)) == ("chief:8476", 3, 2)
    spec["task"] = {"type": "workerpool0", "index": 0}
    assert vertex_cluster(json.dumps(spec)) == ("chief:8476", 3, 0)
    assert vertex_cluster(json.dumps({"cluster": {"workerpool0": ["chief:2222"]}})) is None
    assert vertex_cluster(None) is None


@pytest.mark.slow
def test_two_host_dump_job_writes_outputs_from_process_0_only(work, tmp_path):
    """A 2-replica job as Vertex starts it (CLUSTER_SPEC): both hosts write their chunks; only process 0
    returns and writes the task's outputs; the other exits 0 without any."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = {**SETTINGS, "num_steps": 4}
    plan = components.plan_dump.plan_dump(teacher=TEACHER, data=work["data"], output_root=str(tmp_path / "out"),
                                          num_processes=2, **settings)
    kwargs = dict(teacher=TEACHER, data=work["data"], store_uri=plan.store_uri, dump_key=plan.dump_key, **settings)
    cluster = {"workerpool0": ["127.0.0.1:2222"], "workerpool1": ["127.0.0.1:2223"]}
    procs = []
    for pool in ("workerpool0", "workerpool1"):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "LOGIT_DISTILL_COORDINATOR_PORT": str(port),
               "CLUSTER_SPEC": json.dumps({"cluster": cluster, "task": {"type": pool, "index": 0}})}
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(__file__), "multihost_component.py"),
             os.path.dirname(os.path.dirname(os.path.abspath(__file__))), json.dumps(kwargs),
             str(tmp_path / pool)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    (line,) = [ln for ln in logs[0].splitlines() if ln.startswith("OUTPUTS ")]
    outputs = json.loads(line[len("OUTPUTS "):])
    assert outputs["store"] == plan.store_uri and outputs["metrics"]["chunks_written_this_attempt"] == 2
    assert "OUTPUTS " not in logs[1]  # process 1 returned nothing and wrote nothing
    names = os.listdir(plan.store_uri)
    assert sum("-p00000-" in n for n in names) == 2 and sum("-p00001-" in n for n in names) == 2
