"""Bad input and faults: each ends with one line on stderr, a documented exit code (docs/ERRORS.md),
no traceback, and every file that existed before byte-identical afterwards.

Sections: outputs never overlap inputs; one-line failures of options, OS errors and archives;
the dump lease (two dumps at once); GCS failures; non-finite values, tokenizer identity and
caches (at the end, with its own helpers). Shared helpers are at the top.
"""

from __future__ import annotations

import os

import pytest

from logit_distill import paths
from logit_distill.cli import main
from logit_distill.errors import InputError
from logit_distill.verify import VerifyConfig
from logit_distill.train import TrainConfig

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
    code, _, err = run_cli(capsys, "verify", "--store", small_store, "--no-progress", "--report-json", report)
    assert code == 0 and err.splitlines()[-1].startswith("logit-distill verify: passed: ")
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
    assert_one_line_error(code, err, command="dump", contains=("is the input --data",))
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


def test_gcs_report_inside_the_store_is_refused(gcs_bucket, capsys):
    from dump_helpers import store_files

    uri = gcs_bucket + "/s"
    write_store(uri, small_manifest(num_steps=2, steps_per_file=1))
    before = store_files(uri)
    code, _, err = run_cli(capsys, "verify", "--store", uri, "--no-progress", "--report-md", uri + "/manifest.json")
    assert_one_line_error(code, err, command="verify", contains=("logit store gs://",))
    code, _, err = run_cli(capsys, "verify", "--store", uri, "--no-progress", "--report-json", gcs_bucket)
    assert_one_line_error(code, err, command="verify", contains=("existing folder",))
    assert store_files(uri) == before


def test_verify_report_under_a_regular_file_is_refused(small_store, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "verify", "--store", small_store, "--no-progress",
                           "--report-json", tmp_path / "afile" / "r.json")
    assert_one_line_error(code, err, command="verify", contains=("is a file, not a folder",))
    assert snapshot(tmp_path) == before


def test_debug_shows_the_traceback_then_the_line(small_store, tmp_path, capsys):
    code, _, err = run_cli(capsys, "--debug", "verify", "--store", small_store, "--no-progress",
                           "--report-json", os.path.join(small_store, "manifest.json"))
    assert code == 2 and "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("logit-distill verify: error: ")


@pytest.mark.parametrize("error,hint", [
    (PermissionError(13, "Permission denied", "/o/x"), "permissions"),
    (OSError(30, "Read-only file system", "/o/x"), "read-only"),
    (OSError(28, "No space left on device", "/o/x"), "free some space"),
    (IsADirectoryError(21, "Is a directory", "/o/x"), "give a file path"),
    (NotADirectoryError(20, "Not a directory", "/o/x"), "not a folder"),
])
def test_every_os_error_is_one_line_with_a_hint(error, hint):
    from logit_distill.failures import describe

    code, line = describe(error)
    assert code == 2 and "\n" not in line and line.startswith("error: ")
    assert "/o/x" in line and hint in line


def test_unexpected_errors_are_one_line_too():
    from logit_distill.failures import describe

    code, line = describe(RuntimeError("boom\nsecond line"))
    assert code == 1 and "\n" not in line and "--debug" in line


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
    env = dict(os.environ)  # with the run's shared JAX compilation cache (tests/conftest.py)
    return {"teacher": teacher_dir(root), "data": write_corpus(root / "corpus.jsonl", num_docs=40), "env": env}


LEASE_DUMP = {"num_steps": 4, "steps_per_file": 1, "batch_size": 2, "seq_len": 16, "top_k": 4, "selection": "topk"}


@pytest.mark.slow
def test_two_dumps_at_once_never_crash_or_corrupt(dump_setup, tmp_path, gcs_bucket):
    """Two dumps on one output, started 0, 1.5 and 3 s apart, locally and on the GCS emulator (the
    local and the GCS pair of a round run at the same time): each dump ends with exit 0 or the
    one-line refusal naming the holder; the store verifies and equals an uninterrupted dump's."""
    import subprocess
    import sys
    import time

    from dump_helpers import chunk_bytes, dump_args
    from logit_distill.dump import DumpConfig, run_dump
    from logit_distill.verify import verify_store

    roots = {"local": str(tmp_path), "gcs": gcs_bucket}
    reference = paths.join(str(tmp_path), "reference")
    run_dump(DumpConfig(teacher=dump_setup["teacher"], data=dump_setup["data"], output=reference,
                        progress=False, **LEASE_DUMP))
    want = chunk_bytes(reference)

    def start(out):
        cmd = dump_args(dump_setup["teacher"], dump_setup["data"], out, **LEASE_DUMP)
        return subprocess.Popen([sys.executable, "-m", "logit_distill.cli", *cmd], env=dump_setup["env"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    for i, delay in enumerate((0.0, 1.5, 3.0)):
        outs = {where: paths.join(root, f"both-{i}") for where, root in roots.items()}
        firsts = {where: start(out) for where, out in outs.items()}
        time.sleep(delay)
        seconds = {where: start(out) for where, out in outs.items()}
        for where, out in outs.items():
            codes = []
            for proc in (firsts[where], seconds[where]):
                _, err = proc.communicate(timeout=300)
                assert "Traceback" not in err, err
                assert proc.returncode in (0, 2), err
                if proc.returncode == 2:
                    last = err.strip().splitlines()[-1]
                    assert last.startswith("logit-distill dump: error: ") and "being written by another dump" in last
                    assert "process " in last  # names the holder
                codes.append(proc.returncode)
            assert 0 in codes, (where, delay, codes)
            assert verify_store(VerifyConfig(store=out, progress=False)).passed, (where, delay)
            assert chunk_bytes(out) == want, f"{where}, delay {delay} s: differs from the uninterrupted dump"
            assert not paths.exists(paths.join(out, "lease.json"))  # released


def _foreign_lease(store_uri, *, pid, age_s=0.0, host=None, timeout_s=60.0):
    """Write a lease as another dump would have: ``pid`` on ``host`` (default: this host)."""
    import json
    import socket
    import time

    from logit_distill.store.lease import _process_start

    record = {"host": host or socket.gethostname(), "pid": pid, "pid_start": _process_start(pid),
              "token": "f" * 32, "timeout_s": timeout_s, "acquired_at": "2026-01-01T00:00:00Z",
              "refreshed_at": time.time() - age_s}
    uri = paths.join(store_uri, "lease.json")
    paths.write_bytes_atomic(uri, json.dumps(record).encode())
    if paths.is_local(uri):
        os.utime(paths.local_path(uri), (time.time() - age_s,) * 2)
    return record


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_lease_refuses_a_live_holder_and_takes_over_only_when_allowed(where, tmp_path, request):
    import subprocess
    import sys

    from logit_distill.errors import StoreBusyError
    from logit_distill.store.lease import Lease

    root = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_bucket")
    store_uri = paths.join(root, "s")
    # A live holder (a process that runs, on this host): refused, naming it.
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _foreign_lease(store_uri, pid=live.pid)
        with pytest.raises(StoreBusyError, match=f"being written by another dump: process {live.pid} on "):
            Lease(store_uri, force_takeover=True).acquire()
        # The same holder, silent for longer than its timeout: stale; only --force-takeover takes it.
        _foreign_lease(store_uri, pid=live.pid, age_s=120, timeout_s=60)
        with pytest.raises(StoreBusyError, match="stale lease .* re-run with --force-takeover"):
            Lease(store_uri).acquire()
        taker = Lease(store_uri, force_takeover=True).acquire()
        assert taker.previous["pid"] == live.pid
        taker.release()
    finally:
        live.kill()
        live.wait()
    # A holder on this host whose process is gone: proven dead, taken over without asking.
    _foreign_lease(store_uri, pid=live.pid)
    lease = Lease(store_uri).acquire()
    assert lease.previous["pid"] == live.pid
    # A holder on another host is never presumed dead while its lease is fresh.
    lease.release()
    _foreign_lease(store_uri, pid=live.pid, host="elsewhere")
    with pytest.raises(StoreBusyError, match="on elsewhere"):
        Lease(store_uri).acquire()


def test_dump_refuses_a_stale_lease_until_force_takeover(dump_setup, tmp_path, capsys):
    """The lease of a dump on a machine that is gone: refused, then taken over with --force-takeover."""
    from dump_helpers import dump_args
    from logit_distill.verify import verify_store

    out = str(tmp_path / "s")
    _foreign_lease(out, pid=4242, host="gone-machine", age_s=300, timeout_s=60)
    leftover = os.path.join(out, ".tmp-0123abcd-p00000-s000000000.array_record")  # the gone dump's chunk in flight
    with open(leftover, "wb") as f:
        f.write(b"partial")
    before = snapshot(tmp_path)
    args = dump_args(dump_setup["teacher"], dump_setup["data"], out, **LEASE_DUMP)
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, command="dump",
                          contains=("stale lease of process 4242 on gone-machine", "--force-takeover"))
    assert snapshot(tmp_path) == before  # its temporary too: nothing proves its writer dead yet
    code, _, err = run_cli(capsys, *args, "--force-takeover")
    assert code == 0, err
    assert not os.path.exists(leftover)  # removed once the lease is ours
    assert verify_store(VerifyConfig(store=out, progress=False)).passed
    assert not os.path.exists(os.path.join(out, "lease.json"))


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_taker_that_waits_for_staleness_takes_a_gone_holders_lease_and_refuses_a_live_one(where, tmp_path,
                                                                                             request):
    """wait_for_stale (the pipeline's retried dump): a lease of another machine that is not stale yet is
    watched until it would be; not refreshed meanwhile, it is taken over; refreshed, it is refused."""
    import time

    from logit_distill.errors import StoreBusyError
    from logit_distill.store.lease import Lease

    root = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_bucket")
    store_uri = paths.join(root, "s")
    # a preempted attempt's lease, refreshed 0.5 s ago, timeout 2 s: without waiting, refused at once
    _foreign_lease(store_uri, pid=4242, host="preempted-vm", age_s=0.5, timeout_s=2.0)
    with pytest.raises(StoreBusyError, match="being written by another dump: process 4242 on preempted-vm"):
        Lease(store_uri, force_takeover=True).acquire()
    # waiting: taken over once stale, about 1.5 s later
    start = time.monotonic()
    taker = Lease(store_uri, timeout_s=2.0, force_takeover=True, wait_for_stale=True).acquire()
    assert 1.0 <= time.monotonic() - start < 10 and taker.previous["host"] == "preempted-vm"
    # a live holder (this taker, refreshing every 0.5 s): a second waiting taker watches it and is refused
    start = time.monotonic()
    with pytest.raises(StoreBusyError, match="being written by another dump"):
        Lease(store_uri, timeout_s=2.0, force_takeover=True, wait_for_stale=True).acquire()
    assert 1.0 <= time.monotonic() - start < 10  # it waited (for up to the lease's timeout) before refusing
    assert taker.lost is None
    taker.release()
    assert not paths.exists(paths.join(store_uri, "lease.json"))


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_a_holder_whose_lease_was_taken_over_stops(where, tmp_path, request):
    import time

    from logit_distill.errors import StoreBusyError
    from logit_distill.store.lease import Lease

    root = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_bucket")
    store_uri = paths.join(root, "s")
    first = Lease(store_uri, timeout_s=0.4).acquire()
    first._stop.set()  # its refresher stalls (e.g. a frozen machine) ...
    first._thread.join()
    time.sleep(0.6)  # ... until the lease is stale
    second = Lease(store_uri, force_takeover=True).acquire()
    first.refresh()  # the first holder wakes up: its refresh fails
    with pytest.raises(StoreBusyError, match="taken over by process"):
        first.check()
    first.release()  # does not delete the new holder's lease
    assert paths.exists(paths.join(store_uri, "lease.json"))
    second.release()
    assert not paths.exists(paths.join(store_uri, "lease.json"))


# ----------------------------------------------------------------- archives, Ctrl-C, OS errors


def _cli_subprocess(*args, env=None, timeout=120):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "logit_distill.cli", *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=timeout)


def _assert_one_line(proc, command, exit_code=2, contains=()):
    assert_one_line_error(proc.returncode, proc.stderr, command=command, exit_code=exit_code, contains=contains)


@pytest.mark.parametrize("fault", ["truncated", "mislabelled"])
def test_dump_bad_jsonl_gz_is_one_line(fault, tmp_path, capsys):
    import gzip

    body = "".join(f'{{"text": "alpha beta gamma {i}"}}\n' for i in range(200)).encode()
    data = tmp_path / "data.jsonl.gz"
    data.write_bytes(gzip.compress(body)[:-40] if fault == "truncated" else body)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "dump", "--teacher", "preset:tiny-qwen3", "--data", data,
                           "--output", tmp_path / "s", "--quiet", "--seq-len", "16", "--batch-size", "2",
                           "--top-k", "4")
    assert_one_line_error(code, err, command="dump", contains=("data.jsonl.gz", "truncated or not what its name"))
    assert snapshot(tmp_path) == before and not (tmp_path / "s").exists()


# ----------------------------------------------------------------- GCS failures: within 15 s, one line


@pytest.mark.slow
def test_unreachable_gcs_endpoint_fails_fast(tmp_path):
    import time

    from logit_distill.emulator import free_port

    (tmp_path / "data.jsonl").write_text('{"text": "alpha beta"}\n')
    t0 = time.perf_counter()
    proc = _cli_subprocess("dump", "--teacher", "preset:tiny-qwen3", "--data", tmp_path / "data.jsonl",
                           "--output", "gs://some-bucket/store", "--quiet",
                           env={"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}"})
    assert time.perf_counter() - t0 < 15
    _assert_one_line(proc, "dump", contains=("is not reachable",))


@pytest.mark.slow
def test_real_gcs_without_network_or_credentials_fails_fast(tmp_path):
    """No emulator: the real endpoint, from a machine without network (here) or without credentials
    (elsewhere): one line within 15 s either way."""
    import time

    (tmp_path / "data.jsonl").write_text('{"text": "alpha beta"}\n')
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    t0 = time.perf_counter()
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "logit_distill.cli", "dump", "--teacher", "preset:tiny-qwen3",
                           "--data", str(tmp_path / "data.jsonl"), "--output",
                           "gs://logit-distill-no-such-bucket-7f3a/store", "--quiet"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert time.perf_counter() - t0 < 15
    _assert_one_line(proc, "dump", contains=("is not reachable",))


def test_missing_bucket_fails_fast(gcs_emulator, small_store, capsys):
    import time

    t0 = time.perf_counter()
    code, _, err = run_cli(capsys, "verify", "--store", "gs://no-such-bucket-here/s", "--no-progress")
    assert_one_line_error(code, err, command="verify", contains=("bucket no-such-bucket-here does not exist",))
    code, _, err = run_cli(capsys, "train", "--store", small_store, "--student", "preset:tiny-qwen3",
                           "--output", "gs://no-such-bucket-here/o", "--num-steps", "1", "--batch-size", "4")
    assert_one_line_error(code, err, command="train", contains=("--output", "does not exist"))
    code, _, err = run_cli(capsys, "dump", "--teacher", "gs://no-such-teacher-bucket/m", "--data", small_store,
                           "--output", small_store + "-out")
    assert_one_line_error(code, err, command="dump", contains=("--teacher", "does not exist"))
    assert time.perf_counter() - t0 < 15


@pytest.mark.slow
def test_silent_gcs_endpoint_fails_within_the_probe_timeout(tmp_path):
    """An endpoint that accepts connections but never answers (a black-holed proxy)."""
    import socket
    import time

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        (tmp_path / "data.jsonl").write_text('{"text": "alpha beta"}\n')
        t0 = time.perf_counter()
        proc = _cli_subprocess("dump", "--teacher", "preset:tiny-qwen3", "--data", tmp_path / "data.jsonl",
                               "--output", "gs://some-bucket/store", "--quiet",
                               env={"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{server.getsockname()[1]}",
                                    "LOGIT_DISTILL_GCS_PROBE_TIMEOUT": "3"})
        elapsed = time.perf_counter() - t0
    finally:
        server.close()
    assert elapsed < 15
    _assert_one_line(proc, "dump", contains=("no answer about bucket some-bucket within 3 s",))


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.2, 0.8, 1.5])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(after_s, dump_setup, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from dump_helpers import dump_args

    out = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "logit_distill.cli",
                             *dump_args(dump_setup["teacher"], dump_setup["data"], str(out), **LEASE_DUMP)],
                            env=dump_setup["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:  # finished before the signal came (or it came during teardown): the store is whole
        from logit_distill.verify import verify_store

        assert verify_store(VerifyConfig(store=str(out), progress=False)).passed
        return
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("logit-distill dump: interrupted"), err
    assert sum("interrupted" in line for line in lines) == 1, err
    assert not (out / "lease.json").exists()


def test_ctrl_c_during_teardown_keeps_the_exit_code():
    """A Ctrl-C that lands after the command's outcome is known (here: from an atexit hook, as JAX's and
    gcsfs's clean-up would see it) leaves the exit code alone instead of killing the process by SIGINT."""
    import subprocess
    import sys

    code = ("import atexit, os, signal, sys, time\n"
            "from logit_distill.cli.main import keep_exit_code_on_interrupt as _keep_exit_code_on_interrupt\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))\n"
            "_keep_exit_code_on_interrupt()\n"
            "sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr


def test_dump_into_a_read_only_folder_is_one_line(small_fs, tmp_path, capsys):
    small_fs.mount()
    (small_fs.path / "keep.txt").write_text("keep")
    small_fs.read_only()
    (tmp_path / "data.jsonl").write_text('{"text": "alpha beta"}\n')
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "dump", "--teacher", "preset:tiny-qwen3", "--data", tmp_path / "data.jsonl",
                           "--output", small_fs.path / "s", "--quiet")
    assert_one_line_error(code, err, command="dump", contains=("not writable",))
    assert snapshot(tmp_path) == before


def test_verify_report_on_a_read_only_folder_is_one_line(small_fs, small_store, tmp_path, capsys):
    small_fs.mount()
    small_fs.read_only()
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, "verify", "--store", small_store, "--no-progress",
                             "--report-json", small_fs.path / "r.json")
    assert_one_line_error(code, err, command="verify", contains=("--report-json", "not writable"))
    assert out == ""  # refused before any check ran
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_disk_full_during_the_dump_is_one_line(small_fs, dump_setup, tmp_path):
    """A real ENOSPC: the store lives on a 160 KiB tmpfs; the chunks do not fit."""
    from dump_helpers import dump_args

    small_fs.mount("160k")
    (small_fs.path / "keep.bin").write_bytes(os.urandom(1000))
    before = snapshot(small_fs.path)
    out = small_fs.path / "s"
    proc = _cli_subprocess(*dump_args(dump_setup["teacher"], dump_setup["data"], str(out),
                                      **{**LEASE_DUMP, "num_steps": 8, "seq_len": 32, "top_k": 16, "codec": "exact"}),
                           env=dump_setup["env"])
    _assert_one_line(proc, "dump", contains=("No space left on device",))
    after = snapshot(small_fs.path)
    assert after["keep.bin"] == before["keep.bin"]
    assert not (out / "lease.json").exists()
    # no temporary left behind (a run that committed no chunk leaves no folder at all)
    assert not out.exists() or not [n for n in os.listdir(out) if n.startswith(".tmp-")]


def test_a_dump_that_fails_before_its_first_chunk_leaves_no_manifest(small_fs, dump_setup, capsys):
    """Disk full at the first chunk: the manifest written by this run goes again, so the corrected
    command (here: the same one with room) is not refused as another configuration."""
    from dump_helpers import dump_args

    small_fs.mount("16k")
    out = small_fs.path / "s"
    args = dump_args(dump_setup["teacher"], dump_setup["data"], str(out),
                     **{**LEASE_DUMP, "seq_len": 32, "top_k": 16, "codec": "exact"})
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, command="dump", contains=("No space left on device",))
    assert not out.exists()  # no manifest, no lease, no temporary, no folder


# =====================================================================================
# Non-finite values, tokenizer identity, caches: NaN never passes silently.
# =====================================================================================

import json  # noqa: E402

import numpy as np  # noqa: E402

from dump_helpers import dump_args, store_files, teacher_dir, write_corpus  # noqa: E402


def run_cli_err(capsys, *args) -> tuple[int, str]:
    """``logit-distill ARGS`` in this process; (exit code, stderr), argparse's exits included."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def one_line_error(err: str, command: str) -> str:
    """The last line of stderr is the error; no traceback anywhere."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"logit-distill {command}: error: "), err
    return lines[-1]



@pytest.fixture(scope="module")
def values_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("values")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGIT_DISTILL_CACHE", str(root / "cache"))
        teacher = teacher_dir(root)
    return {"root": root, "teacher": teacher, "data": write_corpus(root / "corpus.jsonl", num_docs=40)}


def _nan_teacher(src: str, dst: str) -> str:
    """A copy of the checkpoint ``src`` with one NaN weight."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    name = next(n for n in sorted(weights) if n.endswith("mlp.down_proj.weight"))
    weights[name] = weights[name].copy()
    weights[name].flat[7] = np.nan
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"sharding": "fsdp+tensor", "selection": "sampled", "samples": 4}],
                         ids=["topk", "fsdp+tensor-sampled"])
def test_nan_teacher_writes_no_chunk(values_setup, tmp_path, capsys, options):
    teacher = _nan_teacher(values_setup["teacher"], str(tmp_path / "nan-teacher"))
    out = tmp_path / "store"
    rc, err = run_cli_err(capsys, *dump_args(teacher, values_setup["data"], out, num_steps=4, **options))
    line = one_line_error(err, "dump")
    assert rc == 3, err
    assert "not finite" in line and "step 0, example 0, position" in line, line
    names = set(store_files(str(out))) if os.path.exists(out) else set()
    assert not any(n.startswith("chunk-") for n in names), names


@pytest.fixture(scope="module")
def train_setup(tmp_path_factory):
    """A tiny student (the preset tokenizer, vocabulary 258) and a sound synthetic store."""
    from test_train_helpers import make_model_dir

    root = tmp_path_factory.mktemp("train-values")
    student = make_model_dir(str(root / "student"), seed=2)
    return {"root": root, "student": student, "store": _synthetic_store(str(root / "store"))}


def _synthetic_store(uri, num_steps=2, codec="exact"):
    from logit_distill import store as store_mod
    from logit_distill.store.synthetic import synthetic_step

    m = store_mod.build_manifest(seq_len=16, top_k=8, vocab_size=258, codec=codec, num_steps=num_steps,
                                 examples_per_step=4, steps_per_file=1, content={"teacher": "synthetic"})
    store_mod.init_store(uri, m)
    store_mod.write_examples(uri, m, 0, {s: synthetic_step(m, s, 0) for s in range(num_steps)})
    return uri


def _rewrite_record(uri, record, edit):
    """Replace one record of the last chunk with ``edit(bytes) -> bytes`` and rename the chunk to the
    checksum of its new content: the damage passes every checksum."""
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    from logit_distill.store import chunks as chunks_mod

    name = sorted(n for n in os.listdir(uri) if n.startswith("chunk-"))[-1]
    info = chunks_mod.parse_chunk_name(name)
    reader = ArrayRecordReader(os.path.join(uri, name))
    records = reader.read_all()
    reader.close()
    records[record] = edit(bytes(records[record]))
    tmp = os.path.join(uri, "rewritten.tmp")
    writer = ArrayRecordWriter(tmp, "group_size:1,uncompressed")
    for r in records:
        writer.write(r)
    writer.close()
    digest, _ = paths.sha256_file(tmp)
    os.remove(os.path.join(uri, name))
    os.rename(tmp, os.path.join(uri, chunks_mod.chunk_name(info.tag, info.process, info.start, info.end, digest)))


def _train_args(train_setup, out, *extra, store=None):
    return ["train", "--store", store or train_setup["store"], "--student", train_setup["student"],
            "--output", out, "--num-steps", "2", "--batch-size", "4", "--no-progress", *extra]


@pytest.mark.parametrize("flag,value,match", [
    ("--temperature", "inf", "--temperature: must be a finite number"),
    ("--temperature", "0", "--temperature: must be > 0"),
    ("--max-grad-norm", "0", "--max-grad-norm: must be > 0"),
    ("--max-grad-norm", "-1", "--max-grad-norm: must be > 0"),
    ("--max-grad-norm", "nan", "--max-grad-norm: must be a finite number"),
    ("--weight-decay", "-0.1", "--weight-decay: must be >= 0"),
    ("--learning-rate", "nan", "--learning-rate: must be a finite number"),
    ("--alpha", "-inf", "--alpha: must be a finite number"),
])
def test_train_refuses_bad_float_flags(train_setup, tmp_path, capsys, flag, value, match):
    out = tmp_path / "out"
    rc, err = run_cli_err(capsys, *_train_args(train_setup, out, f"{flag}={value}"))
    assert rc == 2 and match in one_line_error(err, "train"), err
    assert len(err.strip().splitlines()) == 1, err  # no usage block either
    assert not out.exists()


@pytest.mark.parametrize("args,command", [(("dump", "--bogus"), "dump"), (("verify",), "verify"),
                                          (("train", "--num-steps", "x"), "train"), ((), None)])
def test_argument_errors_are_one_line_without_the_usage_block(capsys, args, command):
    rc, err = run_cli_err(capsys, *args)
    prefix = f"logit-distill {command}" if command else "logit-distill"
    assert rc == 2 and err.startswith(f"{prefix}: error: ") and err.count("\n") == 1, err
    assert f"see '{prefix} --help'" in err


def test_train_library_refuses_bad_floats(train_setup, tmp_path):
    from logit_distill.errors import InputError
    from logit_distill.train import train_student

    for kw in ({"temperature": float("inf")}, {"max_grad_norm": 0.0}, {"max_grad_norm": -1.0},
               {"weight_decay": float("nan")}, {"alpha": float("nan")}):
        with pytest.raises(InputError, match="must be a finite number"):
            train_student(TrainConfig(store=train_setup["store"], student=train_setup["student"],
                          output=str(tmp_path / "o"), num_steps=1, batch_size=4, progress=False, **kw))
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_train_stops_at_first_nonfinite_loss(train_setup, tmp_path, capsys):
    """A learning rate of 1e30 without clipping: step 1 is finite, step 2 overflows. Exit 3 names the
    step; the checkpoint of step 1 is the latest; no HF export."""
    out = tmp_path / "out"
    rc, err = run_cli_err(capsys, *_train_args(train_setup, out, "--learning-rate", "1e30", "--max-grad-norm", "none",
                                           "--warmup-steps", "0", "--checkpoint-every", "1", "--num-steps", "3"))
    line = one_line_error(err, "train")
    assert rc == 3, err
    assert "non-finite loss or gradient norm at step 2" in line and "step 1, is kept" in line, line
    assert sorted(os.listdir(out / "checkpoints")) == ["1"]
    assert not (out / "hf").exists()
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]


@pytest.mark.parametrize("damage", ["nan", "garbage"])
def test_train_refuses_damaged_records_with_valid_checksums(tmp_path, train_setup, capsys, damage):
    import shutil

    from logit_distill import codec

    uri = str(tmp_path / "store")
    shutil.copytree(train_setup["store"], uri)

    def edit(raw: bytes) -> bytes:
        h = codec.decode_header(raw)
        off = codec.HEADER.size + codec.RUN_DTYPE.itemsize * h["num_runs"] + 4 * h["seq_len"] \
            + 4 * h["seq_len"] * h["top_k"]  # exact codec: the top-k log-probs start here
        lp = np.frombuffer(raw, "<f4", h["seq_len"] * h["top_k"], off).copy()
        if damage == "nan":
            lp[5 * h["top_k"] + 2] = np.nan
        else:
            lp[:] = np.random.default_rng(0).uniform(-3, 0, lp.size)
        return raw[:off] + lp.astype("<f4").tobytes() + raw[off + lp.nbytes:]

    _rewrite_record(uri, 2, edit)
    before = snapshot(uri)
    out = tmp_path / "out"
    rc, err = run_cli_err(capsys, *_train_args(train_setup, out, store=uri))
    line = one_line_error(err, "train")
    if damage == "nan":
        assert rc == 3 and "holds a NaN or infinite log-prob at position 5" in line, err
    else:
        assert rc != 0 and "not sorted descending" in line, err
    assert "example 6" in line, line  # record 2 of the chunk of step 1
    assert snapshot(uri) == before
    assert not (out / "hf").exists()


def test_data_edited_in_place_with_size_and_mtime_kept_is_seen(values_setup, tmp_path, capsys):
    """`touch -r` puts the old mtime back after an in-place edit of the same size: the hash and token
    caches must not serve the old text, and `verify --data` re-derives everything."""
    import shutil
    import subprocess

    from logit_distill.data import ExampleSource

    data = str(tmp_path / "corpus.jsonl")
    shutil.copy(values_setup["data"], data)
    out = str(tmp_path / "store")
    rc, err = run_cli_err(capsys, *dump_args(values_setup["teacher"], data, out, num_steps=2))
    assert rc == 0, err
    tok = os.path.join(values_setup["teacher"], "tokenizer.json")
    rc, err = run_cli_err(capsys, "verify", "--store", out, "--data", data, "--tokenizer", tok)
    assert rc == 0, err
    old = np.array(ExampleSource.open(data, tok, seq_len=32)._cache.tokens)

    text = open(data).read()
    word = next(w for w in ("alpha", "gamma", "delta") if w in text.split("\n", 1)[0])
    new_word = {"alpha": "omega", "gamma": "kappa", "delta": "theta"}[word]
    subprocess.run(["cp", "-p", data, str(tmp_path / "ref")], check=True)  # keeps the old mtime
    with open(data, "r+") as f:  # same size, edited in place (same inode)
        f.write(text.replace(word, new_word, 1))
    subprocess.run(["touch", "-r", str(tmp_path / "ref"), data], check=True)
    assert os.path.getsize(data) == len(text.encode())

    new = np.array(ExampleSource.open(data, tok, seq_len=32)._cache.tokens)
    assert not np.array_equal(old, new), "the stale token cache was used"
    before = snapshot(out)
    rc, err = run_cli_err(capsys, "verify", "--store", out, "--data", data, "--tokenizer", tok)
    assert rc != 0 and "data_sha256" in err, err
    rc, err = run_cli_err(capsys, *dump_args(values_setup["teacher"], data, out, num_steps=2))
    assert rc != 0 and "content.data.data_sha256" in err, err  # the store is of the old text
    assert snapshot(out) == before


def test_verify_data_trusts_no_cache(values_setup):
    """A token cache damaged behind the tool's back (same key) does not fool a fresh source, the one
    `verify --data` uses."""
    from logit_distill.data import ExampleSource

    tok = os.path.join(values_setup["teacher"], "tokenizer.json")
    truth = ExampleSource.open(values_setup["data"], tok, seq_len=32)[0]["tokens"].copy()
    cached = np.memmap(os.path.join(ExampleSource.open(values_setup["data"], tok, seq_len=32)._cache.dir,
                                    "tokens.i32"), dtype="<i4", mode="r+")
    cached[:] = (cached + 1) % 256  # damage the cache in place
    cached.flush()
    assert not np.array_equal(ExampleSource.open(values_setup["data"], tok, seq_len=32)[0]["tokens"], truth)
    fresh = ExampleSource.open(values_setup["data"], tok, seq_len=32, fresh=True)
    assert not fresh._cache.dir.startswith(os.environ["LOGIT_DISTILL_CACHE"])
    np.testing.assert_array_equal(fresh[0]["tokens"], truth)


@pytest.fixture(scope="module")
def tokenizer_setup(tmp_path_factory):
    """A teacher and its dumped store; a student whose tokenizer.json has the same size but two ids
    swapped (a different tokenizer of the same vocabulary size)."""
    from test_train_helpers import make_model_dir, swap_tokenizer_ids, write_teacher_store

    root = tmp_path_factory.mktemp("tokenizer")
    teacher = make_model_dir(str(root / "teacher"), seed=1)
    student = swap_tokenizer_ids(make_model_dir(str(root / "student"), seed=2))
    data = write_corpus(root / "corpus.jsonl", num_docs=40)
    store = str(root / "store")
    write_teacher_store(store, teacher, data, seq_len=16, top_k=8, examples_per_step=4)
    return {"teacher": teacher, "student": student, "store": store, "data": data}


@pytest.mark.slow
def test_student_with_another_tokenizer_of_the_same_size_is_refused(tokenizer_setup, tmp_path, capsys):
    s = tokenizer_setup
    assert os.path.exists(os.path.join(s["store"], "tokenizer.json"))  # the store keeps its tokenizer
    before = snapshot(s["store"])
    out = tmp_path / "out"
    args = ["--student", s["student"], "--output", out, "--num-steps", "1", "--batch-size", "4", "--no-progress"]
    rc, err = run_cli_err(capsys, "train", "--store", s["store"], *args)
    line = one_line_error(err, "train")
    assert rc == 2 and "another tokenizer" in line, err
    assert "2 ids differ, the first: 97 ('a' vs 'b'), 98 ('b' vs 'a')" in line, line
    assert "--allow-tokenizer-mismatch" in line
    assert not out.exists() and snapshot(s["store"]) == before
    # online: the same check against the teacher's tokenizer
    rc, err = run_cli_err(capsys, "train", "--teacher", s["teacher"], "--data", s["data"], "--top-k", "8",
                      "--seq-len", "16", *args)
    assert rc == 2 and "another tokenizer than the teacher" in one_line_error(err, "train"), err
    # allowed: trains, warns, and the export ships the student's tokenizer
    rc, err = run_cli_err(capsys, "train", "--store", s["store"], *args, "--allow-tokenizer-mismatch")
    assert rc == 0, err
    assert "warning:" in err and "ships the student's tokenizer" in err
    with open(out / "hf" / "tokenizer.json", "rb") as a, open(os.path.join(s["student"], "tokenizer.json"), "rb") as b:
        assert a.read() == b.read()

