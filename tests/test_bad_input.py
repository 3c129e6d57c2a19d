"""Bad input and faults: each ends with one line on stderr, a documented exit code (docs/ERRORS.md),
no traceback, and every file that existed before byte-identical afterwards.

Sections: outputs never overlap inputs; one-line failures of options, OS errors and archives;
the dump lease (two dumps at once); GCS failures. Shared helpers are at the top.
"""

from __future__ import annotations

import os

import pytest

from logit_distill import paths
from logit_distill.cli import main
from logit_distill.errors import InputError

from store_helpers import small_manifest, write_store


# ----------------------------------------------------------------- helpers


def snapshot(root) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    out = {}
    for folder, _, files in os.walk(str(root)):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, str(root))] = f.read()
    return out


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *, command, exit_code=2, contains=()):
    """Exit ``exit_code``; the last stderr line is ``logit-distill <command>: error: ...``, the only error line."""
    assert code == exit_code, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "no message on stderr"
    assert lines[-1].startswith(f"logit-distill {command}: error: "), err
    assert sum("error" in line.lower() for line in lines) == 1, err
    for text in contains:
        assert text in lines[-1], lines[-1]


@pytest.fixture
def small_store(tmp_path):
    uri = str(tmp_path / "store")
    write_store(uri, small_manifest(num_steps=4, steps_per_file=2))
    return uri


# ----------------------------------------------------------------- outputs never overlap inputs


def test_verify_report_json_on_the_manifest_is_refused(small_store, tmp_path, capsys):
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "verify", "--store", small_store, "--no-progress",
                           "--report-json", os.path.join(small_store, "manifest.json"))
    assert_one_line_error(code, err, command="verify", contains=("--report-json", "logit store"))
    assert snapshot(tmp_path) == before


def test_verify_report_md_on_a_chunk_is_refused(small_store, tmp_path, capsys):
    chunk = next(n for n in os.listdir(small_store) if n.startswith("chunk-"))
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "verify", "--store", small_store, "--no-progress",
                           "--report-md", os.path.join(small_store, chunk))
    assert_one_line_error(code, err, command="verify", contains=("--report-md",))
    assert snapshot(tmp_path) == before


def test_verify_report_json_on_a_folder_is_refused(small_store, tmp_path, capsys):
    folder = tmp_path / "reports"
    folder.mkdir()
    (folder / "keep.txt").write_text("keep")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "verify", "--store", small_store, "--no-progress", "--report-json", folder)
    assert_one_line_error(code, err, command="verify", contains=("existing folder",))
    assert snapshot(tmp_path) == before


def test_verify_report_next_to_the_store_is_written_atomically(small_store, tmp_path, capsys):
    report = tmp_path / "reports" / "verify.json"
    code, out, _ = run_cli(capsys, "verify", "--store", small_store, "--no-progress", "--report-json", report)
    assert code == 0 and "verify passed" in out
    assert report.read_text().startswith("{")
    assert os.listdir(report.parent) == ["verify.json"]  # no temporary left


def test_train_output_empty_is_refused(small_store, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "train", "--store", small_store, "--student", "preset:tiny-qwen3",
                           "--output", "", "--num-steps", "1", "--batch-size", "4", "--no-progress")
    assert_one_line_error(code, err, command="train", contains=("--output is empty",))
    assert snapshot(tmp_path) == before


def test_train_output_inside_the_store_is_refused(small_store, tmp_path, capsys):
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "train", "--store", small_store, "--student", "preset:tiny-qwen3",
                           "--output", os.path.join(small_store, "student"), "--num-steps", "1",
                           "--batch-size", "4", "--no-progress")
    assert_one_line_error(code, err, command="train", contains=("lies inside the logit store",))
    assert snapshot(tmp_path) == before


def test_dump_output_empty_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"text": "alpha beta"}\n')
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "dump", "--teacher", "preset:tiny-qwen3", "--data", "data.jsonl",
                           "--output", " ", "--quiet")
    assert_one_line_error(code, err, command="dump", contains=("--output is empty",))
    assert snapshot(tmp_path) == before


def test_dump_output_inside_another_store_is_refused(small_store, tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text('{"text": "alpha beta"}\n')
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "dump", "--teacher", "preset:tiny-qwen3", "--data", tmp_path / "data.jsonl",
                           "--output", os.path.join(small_store, "nested"), "--quiet")
    assert_one_line_error(code, err, command="dump", contains=("lies inside the logit store",))
    assert snapshot(tmp_path) == before


def test_dump_output_equal_to_the_data_is_refused(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text('{"text": "alpha beta"}\n')
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "dump", "--teacher", "preset:tiny-qwen3", "--data", data,
                           "--output", data, "--quiet")
    assert_one_line_error(code, err, command="dump", contains=("is also the input --data",))
    assert snapshot(tmp_path) == before


def test_dump_output_that_is_a_regular_file_is_refused(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text('{"text": "alpha beta"}\n')
    target = tmp_path / "out"
    target.write_text("not a folder")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "dump", "--teacher", "preset:tiny-qwen3", "--data", tmp_path / "data.jsonl",
                           "--output", target, "--quiet")
    assert_one_line_error(code, err, command="dump", contains=("existing file",))
    assert snapshot(tmp_path) == before


def test_preset_output_empty_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "preset", "tiny-qwen3", "--output", "")
    assert_one_line_error(code, err, command="preset", contains=("--output is empty",))
    assert os.listdir(tmp_path) == []


def test_paths_refuse_an_empty_base():
    for call in (lambda: paths.join("", "x"), lambda: paths.join("  ", "x"), lambda: paths.exists(""),
                 lambda: paths.write_bytes_atomic("", b"x"), lambda: paths.makedirs("")):
        with pytest.raises(InputError, match="empty path"):
            call()
    assert paths.join("/", "x") == "/x"  # the root itself, given on purpose, still works


# ----------------------------------------------------------------- options and one-line failures


def test_dump_typo_in_array_record_options_creates_nothing(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text('{"text": "alpha beta"}\n')
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "dump", "--teacher", "preset:tiny-qwen3", "--data", tmp_path / "data.jsonl",
                           "--output", tmp_path / "s", "--quiet", "--array-record-options", "group_size:1,zstdd:3")
    assert_one_line_error(code, err, command="dump", contains=("--array-record-options", "zstdd"))
    assert snapshot(tmp_path) == before and not (tmp_path / "s").exists()


# ----------------------------------------------------------------- one writer per store: the dump lease


@pytest.fixture(scope="module")
def dump_setup(tmp_path_factory):
    from dump_helpers import teacher_dir, write_corpus

    root = tmp_path_factory.mktemp("lease")
    return {"teacher": teacher_dir(root), "data": write_corpus(root / "corpus.jsonl", num_docs=40)}


LEASE_DUMP = {"num_steps": 4, "steps_per_file": 1, "batch_size": 2, "seq_len": 16, "top_k": 4}


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_two_dumps_at_once_never_crash_or_corrupt(where, dump_setup, tmp_path, request):
    """Two dumps on one output, started 0-3 s apart, five times: each ends with exit 0 or the one-line
    refusal naming the holder; the store verifies and equals an uninterrupted dump's."""
    import subprocess
    import sys
    import time

    from dump_helpers import chunk_bytes, dump_args
    from logit_distill.dump import DumpConfig, run_dump
    from logit_distill.verify import verify_store

    root = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_bucket")
    reference = paths.join(root, "reference")
    run_dump(DumpConfig(teacher=dump_setup["teacher"], data=dump_setup["data"], output=reference,
                        progress=False, **LEASE_DUMP))
    want = chunk_bytes(reference)
    for i, delay in enumerate((0.0, 0.75, 1.5, 2.25, 3.0)):
        out = paths.join(root, f"both-{i}")
        cmd = [sys.executable, "-m", "logit_distill.cli",
               *dump_args(dump_setup["teacher"], dump_setup["data"], out, **LEASE_DUMP)]
        first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        second = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        codes = []
        for proc in (first, second):
            _, err = proc.communicate(timeout=300)
            assert "Traceback" not in err, err
            assert proc.returncode in (0, 2), err
            if proc.returncode == 2:
                last = err.strip().splitlines()[-1]
                assert last.startswith("logit-distill dump: error: ") and "being written by another dump" in last
                assert "process " in last  # names the holder
            codes.append(proc.returncode)
        assert 0 in codes, codes
        assert verify_store(out, progress=False).passed
        assert chunk_bytes(out) == want, f"round {i} (delay {delay} s) differs from the uninterrupted dump"
        assert not paths.exists(paths.join(out, "lease.json"))  # released
