"""A user's files are never overwritten, and the command line reads like one tool.

Each case ends with one line on stderr and a documented exit code (or succeeds as documented), and
every file that existed before is byte-identical afterwards. Sections: outputs that land in a user's
files; one trainer per output; failures that are one line (the environment, a student's module,
flags, a path that is no store, signals, abbreviations); the store is self-sufficient; one voice
(summaries, --json, the training report); training defaults (top-k = V, batches larger than the store).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from logit_distill.cli import main
from test_bad_input import assert_one_line_error, run_cli, snapshot

CORPUS_DOCS = 60


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """A real dump of a tiny teacher over a small JSONL corpus (with a second text field), a student
    with the same tokenizer, and the held-out data."""
    from dump_helpers import teacher_dir, write_corpus
    from logit_distill.dump import DumpConfig, run_dump

    root = tmp_path_factory.mktemp("dumped")
    teacher = teacher_dir(root / "models")
    data_dir = root / "data"
    data_dir.mkdir()
    data = write_corpus(data_dir / "train.jsonl", num_docs=CORPUS_DOCS)
    with open(data) as f, open(data_dir / "body.jsonl", "w") as g:  # the same texts under "body"
        for line in f:
            g.write(json.dumps({"body": json.loads(line)["text"]}) + "\n")
    store = str(root / "store")
    run_dump(DumpConfig(teacher=teacher, data=data, output=store, selection="topk", top_k=8, seq_len=32, batch_size=4, num_steps=6,
                        steps_per_file=2, progress=False))
    student = teacher_dir(root / "models", seed=1)
    env = dict(os.environ)  # with the run's shared JAX compilation cache (tests/conftest.py)
    return {"root": root, "teacher": teacher, "data": data, "data_dir": str(data_dir), "store": store,
            "student": student, "body": str(data_dir / "body.jsonl"), "env": env}


TRAIN = ("--num-steps", "2", "--batch-size", "4", "--checkpoint-every", "2", "--no-progress")
# The training of the race and full-disk tests; its uninterrupted run, trained once, is their reference.
TRAIN_8 = ("--num-steps", "8", "--batch-size", "4", "--checkpoint-every", "2", "--no-progress", "--no-report")


@pytest.fixture(scope="module")
def uninterrupted(dumped, tmp_path_factory):
    """The HF export of an uninterrupted ``train`` with TRAIN_8 (in this process: the same weights as the CLI's)."""
    from logit_distill.cli import main

    out = tmp_path_factory.mktemp("uninterrupted") / "o"
    assert main(["train", "--store", dumped["store"], "--student", dumped["student"], *TRAIN_8, "--output", str(out)]) == 0
    return str(out / "hf")


def _cli(*args, env, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "logit_distill.cli", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=timeout)


def _one_line(proc, command, exit_code=2, contains=()):
    assert_one_line_error(proc.returncode, proc.stderr, command=command, exit_code=exit_code, contains=contains)


# ----------------------------------------------------------------- outputs never land in a user's files


@pytest.mark.parametrize("flag,target", [
    ("--report-md", "teacher/model.safetensors"), ("--report-json", "teacher/config.json"),
    ("--report-json", "teacher/new-report.json"),  # inside the teacher's folder, even a new name
    ("--report-json", "data/train.jsonl"),
])
def test_verify_reports_never_replace_a_users_files(dumped, capsys, flag, target):
    folder, name = target.split("/")
    where = {"teacher": dumped["teacher"], "data": dumped["data_dir"]}[folder]
    before = snapshot(dumped["root"])
    code, _, err = run_cli(capsys, "verify", "--store", dumped["store"], "--teacher", dumped["teacher"],
                           "--spot-check", "1", "--data", dumped["data"], "--no-progress", flag,
                           os.path.join(where, name))
    assert_one_line_error(code, err, command="verify", contains=(flag,))
    assert snapshot(dumped["root"]) == before


def test_a_report_replaces_only_a_report(dumped, tmp_path, capsys):
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": 1}')
    code, _, err = run_cli(capsys, "verify", "--store", dumped["store"], "--no-progress", "--report-json", mine)
    assert_one_line_error(code, err, command="verify", contains=("not a report logit-distill wrote",))
    assert mine.read_text() == '{"my": 1}'
    report, md = tmp_path / "r.json", tmp_path / "r.md"
    for _ in range(2):  # the second run replaces the reports the first wrote
        code, _, err = run_cli(capsys, "verify", "--store", dumped["store"], "--no-progress", "--report-json", report,
                               "--report-md", md)
        assert code == 0, err
    assert json.loads(report.read_text())["report"] == "logit-distill verify"


def test_train_output_with_a_users_files_is_refused(dumped, tmp_path, capsys):
    out = tmp_path / "u"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"my":1}\n')
    (out / "eval.json").write_text("{}")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "train", "--store", dumped["store"], "--student", dumped["student"], "--output",
                           out, "--eval-data", dumped["data"], *TRAIN)
    assert_one_line_error(code, err, command="train", contains=("not a training output", "train_config.json"))
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("inside", ["store", "student", "data"])
def test_train_output_inside_an_input_is_refused(dumped, capsys, inside):
    base = {"store": dumped["store"], "student": dumped["student"], "data": dumped["data_dir"]}[inside]
    before = snapshot(dumped["root"])
    code, _, err = run_cli(capsys, "train", "--store", dumped["store"], "--student", dumped["student"], "--output",
                           os.path.join(base, "out"), "--eval-data", dumped["data_dir"], *TRAIN)
    assert_one_line_error(code, err, command="train", contains=("--output",))
    assert snapshot(dumped["root"]) == before


def test_a_glob_protects_what_it_matches(dumped, tmp_path, capsys):
    data = tmp_path / "corpus"
    data.mkdir()
    shutil.copy(dumped["data"], data / "a.jsonl")
    code, _, err = run_cli(capsys, "verify", "--store", dumped["store"], "--no-progress", "--data",
                           str(data / "*.jsonl"), "--report-json", data / "report.jsonl")
    assert_one_line_error(code, err, command="verify", contains=("would join the data set",))
    assert sorted(os.listdir(data)) == ["a.jsonl"]


# ----------------------------------------------------------------- one trainer per output


@pytest.mark.slow
def test_two_trainers_on_one_output(dumped, uninterrupted, tmp_path):
    """Two ``train`` runs started 0-2 s apart on one output, three rounds: each ends with exit 0 or the
    one-line refusal naming the holder; the output's weights equal an uninterrupted run's."""
    import time

    from test_train_helpers import max_weight_diff

    args = ("train", "--store", dumped["store"], "--student", dumped["student"], *TRAIN_8)
    for delay in (0.0, 1.0, 2.0):
        out = tmp_path / f"race-{delay}"
        first = subprocess.Popen([sys.executable, "-m", "logit_distill.cli", *args, "--output", str(out)],
                                 env=dumped["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        second = _cli(*args, "--output", out, env=dumped["env"])
        _, first_err = first.communicate(timeout=600)
        codes = sorted((first.returncode, second.returncode))
        assert codes in ([0, 0], [0, 2]), (first_err, second.stderr)
        for code, err in ((first.returncode, first_err), (second.returncode, second.stderr)):
            if code == 2:
                _one_line(subprocess.CompletedProcess([], code, "", err), "train",
                          contains=("being written by another training",))
        assert max_weight_diff(str(out / "hf"), uninterrupted) <= 1e-6


# ----------------------------------------------------------------- one-line failures


def test_a_bad_environment_variable_is_named(dumped, tmp_path):
    env = {**dumped["env"], "LOGIT_DISTILL_GCS_PROBE_TIMEOUT": "abc"}
    proc = _cli("verify", "--store", dumped["store"], "--no-progress", env=env)
    _one_line(proc, "verify", contains=("LOGIT_DISTILL_GCS_PROBE_TIMEOUT='abc'", "a number of seconds"))


def test_an_unknown_environment_variable_is_warned_about(dumped, capsys, monkeypatch):
    monkeypatch.setenv("LOGIT_DISTILL_CACHEE", "/tmp/x")
    code, _, err = run_cli(capsys, "verify", "--store", dumped["store"], "--no-progress")
    assert code == 0, err
    assert "warning: environment variable LOGIT_DISTILL_CACHEE is not one logit-distill reads (did you mean " \
           "LOGIT_DISTILL_CACHE?)" in err


def test_a_student_module_that_exits_on_import_is_one_line(dumped, tmp_path):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    env = {**dumped["env"], "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "o"
    proc = _cli("train", "--store", dumped["store"], "--student", "flax:exits_on_import:make", "--output", out,
                *TRAIN, env=env)
    _one_line(proc, "train", contains=("exits_on_import", "sys.exit(3)"))
    assert not out.exists()


@pytest.mark.parametrize("flags,message", [
    (("--max-eval-examples", "0"), "--max-eval-examples must be an integer >= 1"),
    (("--grad-accum", "0"), "--grad-accum must be an integer >= 1"),
    (("--alpha", "1.5"), "--alpha must be a finite number in [0, 1]"),
    (("--warmup-steps", "5"), "--warmup-steps 5 must be below --num-steps 2"),
    (("--batch-size", "1000"), "--batch-size 1000 exceeds the 24 examples of store"),
])
def test_flags_are_checked_before_any_work(dumped, tmp_path, capsys, flags, message):
    out = tmp_path / "o"
    args = [a for a in TRAIN]
    i = args.index("--batch-size") if "--batch-size" in flags else None
    if i is not None:
        del args[i:i + 2]
    code, _, err = run_cli(capsys, "train", "--store", dumped["store"], "--student", dumped["student"], "--output", out,
                           "--eval-data", dumped["data"], *args, *flags)
    assert_one_line_error(code, err, command="train", contains=(message,))
    assert not out.exists()


@pytest.mark.parametrize("command", ["train", "verify"])
def test_a_store_flag_on_a_teacher_folder_is_bad_input(dumped, tmp_path, capsys, command):
    extra = ("--student", dumped["student"], "--output", tmp_path / "o", *TRAIN) if command == "train" \
        else ("--no-progress",)
    code, _, err = run_cli(capsys, command, "--store", dumped["teacher"], *extra)
    assert_one_line_error(code, err, command=command, contains=("is not a logit store: it holds no manifest.json",))


def test_sigterm_is_exit_130_like_ctrl_c(dumped):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "logit_distill.cli", "verify", "--store", dumped["store"],
                             "--teacher", dumped["teacher"], "--spot-check", "24", "--no-progress"],
                            env=dumped["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:  # it finished first
        return
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("logit-distill verify: interrupted"), err


@pytest.mark.parametrize("argv", [
    ("dump", "--teacher", "preset:tiny-qwen3", "--data", "d.jsonl", "--output", "s", "--top", "16"),
    ("train", "--store", "s", "--student", "x", "--output", "o", "--num-steps", "1", "--batch-size", "4",
     "--learning", "0.1"),
    ("verify", "--store", "s", "--spot", "1"),
])
def test_abbreviated_flags_are_refused(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unrecognized arguments" in err and len(err.strip().splitlines()) == 1, err


def test_preset_list_works(capsys):
    code, out, _ = run_cli(capsys, "preset", "--list")
    assert code == 0 and "tiny-qwen3" in out.split()


# ----------------------------------------------------------------- the store is self-sufficient


def test_verify_data_uses_the_stores_tokenizer_from_any_folder(dumped, tmp_path):
    proc = _cli("verify", "--store", dumped["store"], "--data", dumped["data"], "--no-progress", env=dumped["env"],
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "data_alignment: passed" in proc.stderr


@pytest.mark.slow
def test_a_flax_student_evaluates_and_exports_with_the_stores_tokenizer(dumped, tmp_path):
    """From another folder, with no tokenizer given: the store's copy reads the held-out data and ships
    with the export."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**dumped["env"], "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "o"
    proc = _cli("train", "--store", dumped["store"], "--student",
                "flax:examples.students.tiny_transformer:make?num_layers=1&width=32&num_heads=2", "--output", out,
                "--eval-data", dumped["data"], *TRAIN, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "eval.json").read_text())["num_tokens"] > 0
    assert (out / "student" / "tokenizer.json").read_bytes() == \
        open(os.path.join(dumped["store"], "tokenizer.json"), "rb").read()


def test_train_text_field_reads_the_eval_data(dumped, tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = run_cli(capsys, "train", "--store", dumped["store"], "--student", dumped["student"], "--output", out,
                           "--eval-data", dumped["body"], *TRAIN)
    assert_one_line_error(code, err, command="train", contains=("nor 'text' (fields: ['body'])", "--text-field"))
    code, _, err = run_cli(capsys, "train", "--store", dumped["store"], "--student", dumped["student"], "--output", out,
                           "--eval-data", dumped["body"], "--text-field", "body", *TRAIN)
    assert code == 0, err
    assert json.loads((out / "eval.json").read_text())["num_tokens"] > 0


# ----------------------------------------------------------------- one voice


@pytest.mark.slow
def test_every_command_ends_with_one_summary_line_on_stderr(dumped, tmp_path, capsys):
    out = tmp_path / "o"
    code, stdout, err = run_cli(capsys, "train", "--store", dumped["store"], "--student", dumped["student"],
                                "--output", out, *TRAIN)
    assert code == 0 and stdout == "", (stdout, err)
    lines = err.strip().splitlines()
    assert lines[0].startswith("logit-distill train: training 2 steps of 4 x 1 examples of 32 tokens"), lines
    assert lines[-1].startswith(f"logit-distill train: {out}: final training loss "), lines
    assert len(lines) <= 6, lines  # the start line, a line per logged step, the summary
    code, stdout, err = run_cli(capsys, "train", "--store", dumped["store"], "--student", dumped["student"],
                                "--output", out, *TRAIN, "--json")
    assert code == 0 and json.loads(stdout)["final_step"] == 2
    code, stdout, err = run_cli(capsys, "verify", "--store", dumped["store"], "--no-progress")
    assert code == 0 and stdout == "" and err.strip().splitlines()[-1].startswith("logit-distill verify: passed: ")
    code, stdout, _ = run_cli(capsys, "verify", "--store", dumped["store"], "--no-progress", "--json")
    assert json.loads(stdout)["passed"] is True


@pytest.mark.slow
def test_the_cli_train_writes_the_report(dumped, tmp_path, capsys):
    out = tmp_path / "o"
    code, _, err = run_cli(capsys, "train", "--store", dumped["store"], "--student", dumped["student"], "--output", out,
                           "--eval-data", dumped["data"], *TRAIN)
    assert code == 0, err
    report = (out / "report.md").read_text()
    assert "![training curves](loss.png)" in report and "held-out cross-entropy" in report
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_verify_report_labels_the_entropy_a_lower_bound(dumped, tmp_path, capsys):
    report = tmp_path / "r.json"
    code, _, _ = run_cli(capsys, "verify", "--store", dumped["store"], "--no-progress", "--report-json", report)
    figures = json.loads(report.read_text())["figures"]
    assert code == 0 and figures["teacher_entropy_lower_bound_nats"] > 0
    assert "mean_teacher_entropy_nats" not in figures


# ----------------------------------------------------------------- training defaults


@pytest.mark.slow
def test_a_store_whose_top_k_is_the_vocabulary_trains_with_the_exact_loss(tmp_path, capsys):
    from logit_distill import store as store_mod
    from logit_distill.store.synthetic import synthetic_step
    from test_train_helpers import make_model_dir

    V = 258
    m = store_mod.build_manifest(seq_len=16, top_k=V, vocab_size=V, codec="exact", num_steps=2, examples_per_step=4,
                                 steps_per_file=1, content={"teacher": "synthetic"})
    uri = str(tmp_path / "s")
    store_mod.init_store(uri, m)
    store_mod.write_examples(uri, m, 0, {s: synthetic_step(m, s, 0) for s in range(2)})
    student = make_model_dir(str(tmp_path / "student"), seed=2)
    out = tmp_path / "o"
    code, _, err = run_cli(capsys, "train", "--store", uri, "--student", student, "--output", out, *TRAIN)
    assert code == 0, err
    assert json.loads((out / "train_config.json").read_text())["loss"] == "topk_kl"
    assert "warning" not in err


@pytest.mark.slow
@pytest.mark.parametrize("size,kept_checkpoints", [("2m", 0), ("3m", 1)], ids=["first-checkpoint", "later"])
def test_checkpoint_on_a_full_disk_is_one_line_and_resumes_exactly(dumped, uninterrupted, tmp_path, small_fs, size,
                                                                   kept_checkpoints):
    """Training on a tiny tmpfs that fills at the first checkpoint, or at a later one: one line, exit 2,
    no hang; the last good checkpoint is kept; re-run from a copy with space: the weights of an
    uninterrupted run."""
    from test_train_helpers import max_weight_diff

    small_fs.mount(size)
    args = ("train", "--store", dumped["store"], "--student", dumped["student"], *TRAIN_8, "--keep-checkpoints", "10")
    full = small_fs.path / "o"
    proc = _cli(*args, "--output", full, env=dumped["env"])
    _one_line(proc, "train", contains=("No space left on device", "checkpoints"))
    kept = sorted(int(n) for n in os.listdir(full / "checkpoints") if n.isdigit()) \
        if (full / "checkpoints").exists() else []
    assert len(kept) == kept_checkpoints, kept
    moved = tmp_path / "o"
    shutil.copytree(full, moved)
    again = _cli(*args, "--output", moved, env=dumped["env"])
    assert again.returncode == 0, again.stderr
    assert max_weight_diff(str(moved / "hf"), uninterrupted) <= 1e-6

