"""The teacher dump: parity with HF transformers, resume after kills, config mismatch, bad input."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dump_helpers import chunk_bytes, cli, dump_args, store_files, teacher_dir, write_corpus
from logit_distill import codec, paths, store
from logit_distill.dump import DumpConfig, run_dump
from logit_distill.errors import ConfigMismatchError, InputError
from logit_distill.store.chunks import parse_chunk_name

from cpu_devices import env_with_cpu_devices


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dump")
    return {
        "teacher": teacher_dir(root),
        "data": write_corpus(root / "corpus.jsonl"),
        "root": root,
    }


def _config(setup, output, **kw):
    base = dict(teacher=setup["teacher"], data=setup["data"], output=output, selection="topk", top_k=8, seq_len=32,
                batch_size=4, num_steps=6, steps_per_file=2, progress=False)
    base.update(kw)
    return DumpConfig(**base)


@pytest.mark.slow
@pytest.mark.parametrize("codec_name,packing", [("exact", True), ("default", True), ("exact", False)])
def test_stored_topk_equals_hf_transformers(setup, tmp_path, codec_name, packing):
    import torch
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "s")
    run_dump(_config(setup, out, codec=codec_name, packing=packing))
    hf = AutoModelForCausalLM.from_pretrained(setup["teacher"], torch_dtype=torch.float32,
                                              attn_implementation="eager").eval()
    s = store.open_store(out)
    tol = 1e-4 if codec_name == "exact" else codec.LOGPROB_MAX_ERROR + 1e-4
    k = s.manifest["shapes"]["top_k"]
    checked = 0
    assert s.manifest["shapes"]["masked"]
    for i in range(len(s)):
        rec = s.read(i)
        assert not rec["topk_logprobs"][~rec["loss_mask"]].any()  # no values at padding or a document's end
        for seg in np.unique(rec["segment_ids"]):
            if seg == 0:
                continue
            where = np.flatnonzero(rec["segment_ids"] == seg)
            assert (rec["positions"][where] == np.arange(len(where))).all()
            with torch.no_grad():
                logits = hf(torch.tensor(rec["tokens"][where][None].astype(np.int64))).logits[0]
            ref = torch.log_softmax(logits.double(), -1).numpy()
            # The store holds every next-token position of the document (not its last token): nothing else.
            held = rec["loss_mask"][where]
            np.testing.assert_array_equal(held, np.arange(len(where)) < len(where) - 1)
            ref = ref[held]
            where = where[held]
            ref_ids = np.argsort(-ref, axis=-1, kind="stable")[:, :k]
            got_ids = rec["topk_ids"][where]
            got_lp = rec["topk_logprobs"][where]
            # Log-probs of our ids under HF, and the sorted values, both within the bound.
            np.testing.assert_allclose(np.take_along_axis(ref, got_ids, -1), got_lp, atol=tol)
            np.testing.assert_allclose(np.take_along_axis(ref, ref_ids, -1), got_lp, atol=tol)
            # Ids equal up to exact ties.
            differs = got_ids != ref_ids
            if differs.any():
                a = np.take_along_axis(ref, got_ids, -1)[differs]
                b = np.take_along_axis(ref, ref_ids, -1)[differs]
                np.testing.assert_allclose(a, b, atol=1e-6)
            # Tail mass: log of what the top-k leave out.
            rest = np.log1p(-np.exp(np.take_along_axis(ref, ref_ids, -1)).sum(-1))
            np.testing.assert_allclose(rec["tail_logprob"][where], rest, atol=max(tol, 1e-4))
            checked += len(where)
    assert checked > 100


@pytest.mark.slow
def test_the_default_dump_is_a_hybrid_store_that_trains_with_hybrid_kl(setup, tmp_path):
    """No --selection, --top-k or --samples: a hybrid store of the top-4 head + 16 tail draws, the same bytes as
    those flags given; `train` picks hybrid_kl for it. --top-k alone sets the head and --selection topk alone
    the top-64 store."""
    out, explicit = str(tmp_path / "default"), str(tmp_path / "explicit")
    r = cli(*dump_args(setup["teacher"], setup["data"], out, selection=None, top_k=None, num_steps=4))
    assert r.returncode == 0, r.stderr
    assert "hybrid selection: top-4 + tail mass and 16 tail draws per position" in r.stderr, r.stderr
    shapes = store.open_store(out).manifest["shapes"]
    assert (shapes["selection"], shapes["top_k"], shapes["num_samples"]) == ("hybrid", 4, 16)
    assert store.open_store(out).read(0)["topk_ids"].shape == (32, 4)
    r = cli(*dump_args(setup["teacher"], setup["data"], explicit, selection="hybrid", top_k=4, samples=16,
                       num_steps=4))
    assert r.returncode == 0, r.stderr
    assert chunk_bytes(out) == chunk_bytes(explicit)
    t = cli("train", "--store", out, "--student", "preset:tiny-qwen3@1", "--output", str(tmp_path / "t"),
            "--num-steps", "2", "--batch-size", "4", "--no-progress")
    assert t.returncode == 0, t.stderr
    with open(tmp_path / "t" / "train_config.json") as f:
        assert json.load(f)["loss"] == "hybrid_kl"
    # --top-k alone: the hybrid head; --selection topk alone: top-64 (planned only: nothing is written)
    from logit_distill.dump import plan_dump

    for flags, want in ((dict(top_k=8), ("hybrid", 8, 16)), (dict(selection="topk"), ("topk", 64, None))):
        config = DumpConfig(teacher=setup["teacher"], data=setup["data"], output="", seq_len=32, batch_size=4,
                            num_steps=4, **flags)
        got = plan_dump(config).manifest["shapes"]
        assert (got.get("selection", "topk"), got["top_k"], got.get("num_samples")) == want


@pytest.mark.slow
def test_rerun_is_a_noop_and_bytes_are_deterministic(setup, tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ra = run_dump(_config(setup, a))
    assert ra.complete and ra.chunks_written == 3 and ra.resumed_from_step == 0
    run_dump(_config(setup, b))
    assert chunk_bytes(a) == chunk_bytes(b)
    capsys.readouterr()
    again = run_dump(_config(setup, a))
    assert again.steps_run == 0 and again.chunks_written == 0 and again.resumed_from_step == 6
    assert "the teacher was not loaded" in capsys.readouterr().err  # a complete store: a scan of names only


@pytest.mark.slow
def test_deleted_middle_chunk_is_filled(setup, tmp_path):
    out = str(tmp_path / "s")
    run_dump(_config(setup, out))
    before = chunk_bytes(out)
    middle = sorted(before)[1]
    os.remove(os.path.join(out, middle))
    (tmp_path / "s" / ".tmp-leftover-p00000.array_record").write_bytes(b"partial")
    r = run_dump(_config(setup, out))
    assert r.resumed_from_step == 2 and r.steps_run == 2 and r.chunks_written == 1
    assert chunk_bytes(out) == before
    assert not any(n.startswith(".tmp-") for n in os.listdir(out))


@pytest.mark.parametrize("change,field", [
    ({"top_k": 4}, "shapes.top_k"),
    ({"seq_len": 16}, "shapes.seq_len"),
    ({"seed": 3}, "content.data.seed"),
    ({"teacher_seed": 1}, "content.teacher"),
    ({"other_data": True}, "content.data.data_sha256"),
])
def test_other_config_is_refused_and_store_untouched(setup, tmp_path, change, field):
    out = str(tmp_path / "s")
    run_dump(_config(setup, out))
    before = store_files(out)
    kw = dict(change)
    if kw.pop("teacher_seed", None):
        kw["teacher"] = teacher_dir(setup["root"], seed=1)
    if kw.pop("other_data", None):
        kw["data"] = write_corpus(tmp_path / "other.jsonl", seed=7)
    with pytest.raises(ConfigMismatchError) as e:
        run_dump(_config(setup, out, **kw))
    assert field in str(e.value) and "nothing was changed" in str(e.value)
    assert store_files(out) == before


def test_bad_input_errors(setup, tmp_path, gcs_emulator):
    # Unsupported architecture.
    bad = tmp_path / "bad-model"
    bad.mkdir()
    cfg = json.loads(open(os.path.join(setup["teacher"], "config.json")).read())
    cfg["architectures"] = ["MambaForCausalLM"]
    cfg["model_type"] = "mamba"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="MambaForCausalLM"):
        run_dump(_config(setup, str(tmp_path / "o1"), teacher=str(bad)))
    # Empty data.
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InputError):
        run_dump(_config(setup, str(tmp_path / "o2"), data=str(empty)))
    # seq_len beyond the model's maximum.
    with pytest.raises(InputError, match="exceeds the teacher's maximum"):
        run_dump(_config(setup, str(tmp_path / "o3"), seq_len=100_000))
    # Tokenizer vocabulary larger than the model's.
    small = tmp_path / "small-vocab"
    small.mkdir()
    for name in os.listdir(setup["teacher"]):
        (small / name).write_bytes(open(os.path.join(setup["teacher"], name), "rb").read())
    cfg = json.loads((small / "config.json").read_text())
    cfg["vocab_size"] = 64
    (small / "config.json").write_text(json.dumps(cfg))
    from logit_distill.models import init_params, save_hf_checkpoint, build_model

    params = init_params(cfg, 0, "float32")
    save_hf_checkpoint(build_model(cfg, params), params, str(small))
    with pytest.raises(InputError, match="vocab"):
        run_dump(_config(setup, str(tmp_path / "o4"), teacher=str(small), top_k=4))
    # Too many steps for the data.
    with pytest.raises(InputError, match="--num-steps"):
        run_dump(_config(setup, str(tmp_path / "o5"), num_steps=10_000))
    # Unreachable output.
    with pytest.raises(InputError, match="not reachable"):
        run_dump(_config(setup, "gs://no-such-bucket-x/s", ))
    # Nothing was written for any of these.
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 6))


def _kill_and_rerun(args, rng, kills, uri):
    """Run the CLI, SIGKILL it at random moments, then let it finish; return chunks after each kill."""
    counts = []
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, "-m", "logit_distill.cli", *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Wait until the run has committed something new, then kill after a random delay.
        deadline = time.time() + 120
        before = len(chunk_bytes(uri)) if paths.exists(uri) else 0
        while time.time() < deadline and proc.poll() is None:
            try:
                now = len(chunk_bytes(uri))
            except Exception:  # noqa: BLE001 - the store may not exist yet
                now = 0
            if now > before:
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        counts.append(len(chunk_bytes(uri)))
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    return done, counts


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "gcs"])
def test_sigkill_at_random_moments_then_rerun_equals_uninterrupted(setup, tmp_path, backend, request):
    root = str(tmp_path) if backend == "local" else request.getfixturevalue("gcs_bucket")
    ref = str(tmp_path / "ref")
    data = write_corpus(tmp_path / "big.jsonl", num_docs=900, seed=3)
    opts = dict(num_steps=300, steps_per_file=5, batch_size=4, seq_len=32)
    r = cli(*dump_args(setup["teacher"], data, ref, **opts))
    assert r.returncode == 0, r.stderr
    uri = root + "/killed"
    done, counts = _kill_and_rerun(dump_args(setup["teacher"], data, uri, **opts), random.Random(7), 3, uri)
    assert any(0 < n < 60 for n in counts), counts  # killed mid-stream, not before or after
    assert "resuming at step" in done.stderr or "nothing to do" in done.stderr
    assert chunk_bytes(uri) == chunk_bytes(ref)


@pytest.mark.slow
def test_sigterm_commits_what_is_complete_and_exits_nonzero(setup, tmp_path):
    out = str(tmp_path / "s")
    args = dump_args(setup["teacher"], setup["data"], out, num_steps=60, steps_per_file=1)
    proc = subprocess.Popen([sys.executable, "-m", "logit_distill.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.isdir(out) and any(n.startswith("chunk-") for n in os.listdir(out))):
        time.sleep(0.05)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert time.time() - t0 < 30
    assert "re-run the same command to resume" in err
    s = store.open_store(out)
    assert 0 < s.scan.num_present < s.scan.num_expected
    for chunk in s.scan.chunks.values():  # everything committed reads back
        s.read_chunk(chunk)
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert "resuming at step" in again.stderr


def _records(uri):
    s = store.open_store(uri)
    return [s.read(i) for i in range(len(s))]


def _assert_same_records(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for key in ("tokens", "segment_ids", "positions", "topk_ids", "topk_logprobs", "tail_logprob"):
            np.testing.assert_array_equal(x[key], y[key])


@pytest.mark.slow
@pytest.mark.parametrize("device_batch", [None, 2])
def test_same_bytes_on_one_and_four_devices(setup, tmp_path, device_batch):
    outs = {}
    for n in (1, 4):
        out = str(tmp_path / f"d{n}")
        env = env_with_cpu_devices(n)
        r = cli(*dump_args(setup["teacher"], setup["data"], out, batch_size=8, num_steps=4, codec="exact",
                           device_batch=device_batch), env=env)
        assert r.returncode == 0, r.stderr
        outs[n] = chunk_bytes(out)
    assert outs[1] == outs[4]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_multihost(teacher, data, out, logs, num_steps=6, **settings):
    """Start the 2 processes of a CPU dump; their stdout and stderr go to files under ``logs``."""
    script = os.path.join(os.path.dirname(__file__), "multihost_dump.py")
    port = str(_free_port())
    procs = []
    for i in range(2):
        args = [sys.executable, script, port, str(i), "2", teacher, data, out, str(num_steps), json.dumps(settings)]
        with open(logs / f"p{i}.out", "w") as so, open(logs / f"p{i}.err", "w") as se:
            procs.append(subprocess.Popen(args, stdout=so, stderr=se, text=True))
    return procs


def _wait_multihost(procs, logs, timeout):
    """Wait for both processes at most ``timeout`` s (then kill them); (exit codes, stdouts, stderrs)."""
    deadline = time.time() + timeout
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    read = lambda name: [(logs / f"p{i}.{name}").read_text() for i in range(len(procs))]  # noqa: E731
    return [p.returncode for p in procs], read("out"), read("err")


def _multihost(setup, out):
    logs = out + "-logs"
    os.makedirs(logs, exist_ok=True)
    from pathlib import Path

    procs = _start_multihost(setup["teacher"], setup["data"], out, Path(logs))
    codes, outs, errs = _wait_multihost(procs, Path(logs), 300)
    assert codes == [0, 0], (outs, errs)
    return outs


@pytest.mark.slow
def test_two_processes_write_their_own_chunks_and_resume_together(setup, tmp_path):
    single = str(tmp_path / "single")
    run_dump(_config(setup, single, codec="exact"))
    out = str(tmp_path / "multi")
    _multihost(setup, out)
    names = sorted(n for n in os.listdir(out) if n.startswith("chunk-"))
    assert sum("-p00000-" in n for n in names) == 3 and sum("-p00001-" in n for n in names) == 3
    _assert_same_records(_records(single), _records(out))
    # Lose one chunk of process 1 only: both processes run those steps again, only process 1 writes.
    before = chunk_bytes(out)
    os.remove(os.path.join(out, [n for n in names if "-p00001-s000000002" in n][0]))
    logs = _multihost(setup, out)
    assert "process 0: complete=True written=0" in logs[0]
    assert "process 1: complete=True written=1" in logs[1]
    assert chunk_bytes(out) == before


def _marked_corpus(path):
    """60 short documents (under 32 tokens), each starting with a character of its own (one token, in
    no word): with --no-packing, one document per example, each example holds a token no other has."""
    import string

    from dump_helpers import WORDS

    rng = random.Random(0)
    markers = string.ascii_uppercase + string.digits + "!#$%&*+,-./:;<=>?@[]^_{|}~"
    path.write_text("".join(json.dumps({"text": " ".join([m] + [rng.choice(WORDS) for _ in range(3)])}) + "\n"
                            for m in markers[:60]))
    return str(path)


def _token_of_one_example(teacher, data, owner, steps=(2, 3), B=4, num_processes=2, num_steps=6):
    """(token id, global example index): a token that appears in one example of the dump only, an
    example of process ``owner`` at one of ``steps`` (--no-packing)."""
    from logit_distill.data import ExampleSource

    source = ExampleSource.open(data, teacher, seq_len=32, packing=False, seed=0)
    tokens = source.batch(range(num_steps * B))["tokens"]
    b = B // num_processes
    for token in np.unique(tokens):
        rows = np.flatnonzero((tokens == token).any(-1))
        if len(rows) == 1 and rows[0] // B in steps and rows[0] % B // b == owner:
            return int(token), int(rows[0])
    raise AssertionError(f"no token of one example of process {owner} at steps {steps}")


def _nan_embedding_teacher(src, dst, token):
    """A copy of the (untied) checkpoint ``src`` whose embedding of ``token`` is NaN: only the
    examples holding ``token`` get NaN log-probs."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"].copy()
    weights["model.embed_tokens.weight"][token] = np.nan
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("owner,settings", [
    (1, {}),
    (0, {"sharding": "fsdp+tensor", "selection": "sampled", "samples": 4}),
], ids=["process1-topk", "process0-fsdp+tensor-sampled"])
def test_two_processes_stop_together_on_a_nan_of_either(setup, tmp_path, owner, settings):
    """A NaN in an example of one process stops both at that step: exit 3, the same one line."""
    data = _marked_corpus(tmp_path / "marked.jsonl")
    clean = teacher_dir(setup["root"], preset="tiny-llama3")
    token, example = _token_of_one_example(clean, data, owner)
    teacher = _nan_embedding_teacher(clean, str(tmp_path / "nan-teacher"), token)
    out = str(tmp_path / "multi")
    t0 = time.time()
    procs = _start_multihost(teacher, data, out, tmp_path, packing=False, **settings)
    codes, outs, errs = _wait_multihost(procs, tmp_path, 120)
    assert time.time() - t0 < 120 and codes == [3, 3], (codes, outs, errs)
    lines = [[line for line in err.splitlines() if line.startswith("logit-distill dump: error: ")] for err in errs]
    assert all(len(found) == 1 for found in lines) and lines[0] == lines[1], errs
    assert "Traceback" not in errs[0] + errs[1]
    step = example // 4
    assert f"not finite (NaN or inf) at step {step}, example {example}, position " in lines[0][0], lines
    # The chunks of steps 0-1 committed before the bad step stay; nothing of its chunk was written.
    chunks = [parse_chunk_name(n) for n in os.listdir(out) if n.startswith("chunk-")]
    assert sorted((c.process, c.start, c.end) for c in chunks) == [(0, 0, 2), (1, 0, 2)], chunks
