"""The student training loop: KD beats CE, HF export, resume after SIGKILL, offline == online,
schedules and accumulation, and bad input rejected before any step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from logit_distill import store as store_mod
from logit_distill.data import write_pretokenized
from logit_distill.errors import InputError, StoreError
from logit_distill.models import load_model
from logit_distill.store.synthetic import synthetic_step
from logit_distill.cli import main as cli_main
from logit_distill.cli.main import build_parser
from logit_distill.train import sample_from_teacher, train_student
from logit_distill.train import TrainConfig
from logit_distill.train.losses import training_mask

from test_train_helpers import VOCAB, make_model_dir, max_weight_diff, write_teacher_store
from cpu_devices import env_with_cpu_devices

SEQ_LEN = 32
TOP_K = 16
KD_STEPS = 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A bigram-like teacher, a random student, data sampled from the teacher, and its exact store."""
    root = tmp_path_factory.mktemp("train")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGIT_DISTILL_CACHE", str(root / "cache"))
        teacher = make_model_dir(str(root / "teacher"), seed=1, init_range=0.3, bigram=True)
        student = make_model_dir(str(root / "student"), seed=2)
        docs = sample_from_teacher(load_model(teacher), 96, SEQ_LEN - 1, seed=0, eos_id=256)
        train_data = write_pretokenized(str(root / "train.array_record"), docs[:64])
        eval_data = write_pretokenized(str(root / "eval.array_record"), docs[64:])
        store = str(root / "store")
        write_teacher_store(store, teacher, train_data, seq_len=SEQ_LEN, top_k=TOP_K, examples_per_step=4)
    return {"root": root, "teacher": teacher, "student": student, "train_data": train_data,
            "eval_data": eval_data, "store": store}


@pytest.fixture(scope="module")
def kd_run(setup, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("kd") / "out")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGIT_DISTILL_CACHE", str(setup["root"] / "cache"))
        result = train_student(TrainConfig(store=setup["store"], student=setup["student"], output=out, num_steps=KD_STEPS,
                               batch_size=8, learning_rate=1e-2, loss="topk_kl", alpha=0.5,
                               eval_data=setup["eval_data"], eval_teacher=setup["teacher"], checkpoint_every=20,
                               log_every=1, progress=False))
    return result


def _metrics(output):
    with open(os.path.join(output, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _no_step_taken(output):
    ckpts = os.path.join(output, "checkpoints")
    assert not os.path.exists(ckpts) or not any(n.isdigit() for n in os.listdir(ckpts))
    assert not os.path.exists(os.path.join(output, "metrics.jsonl"))


# ----------------------------------------------------------------------------- distillation works


@pytest.mark.slow
def test_kd_student_beats_ce_student(setup, kd_run, tmp_path):
    ce = train_student(TrainConfig(store=setup["store"], student=setup["student"], output=str(tmp_path / "ce"),
                       num_steps=KD_STEPS, batch_size=8, learning_rate=1e-2, alpha=0.0,
                       eval_data=setup["eval_data"], checkpoint_every=20, progress=False))
    kd_ce, ce_ce = kd_run.eval["cross_entropy"], ce.eval["cross_entropy"]
    assert kd_ce < ce_ce - 0.3, (kd_ce, ce_ce)
    assert kd_run.eval["perplexity"] == pytest.approx(np.exp(kd_ce))
    with open(os.path.join(kd_run.output, "eval.json")) as f:
        assert json.load(f) == kd_run.eval
    # the CE-only run still reports the KD loss (as a metric), and alpha 0
    assert np.isfinite(ce.metrics["kd_loss"]) and ce.metrics["alpha"] == 0.0
    assert ce.metrics["loss"] == pytest.approx(ce.metrics["ce_loss"])


def test_loss_falls_and_metrics_are_written(kd_run):
    rows = _metrics(kd_run.output)
    assert [r["step"] for r in rows] == list(range(1, KD_STEPS + 1))
    for key in ("step", "loss", "kd_loss", "ce_loss", "learning_rate", "tokens_per_s", "alpha"):
        assert key in rows[0]
    first = np.mean([r["loss"] for r in rows[:5]])
    last = np.mean([r["loss"] for r in rows[-5:]])
    assert last < 0.5 * first, (first, last)
    assert kd_run.metrics == rows[-1]
    assert kd_run.resumed_from_step is None and kd_run.final_step == KD_STEPS


@pytest.mark.slow
def test_hf_export_loads_in_transformers_with_same_logits(setup, kd_run):
    import torch
    import transformers

    hf = kd_run.hf_dir
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(hf))
    ours = load_model(hf)
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(2, SEQ_LEN)).astype(np.int32)
    positions = np.tile(np.arange(SEQ_LEN, dtype=np.int32), (2, 1))
    segment_ids = np.ones_like(tokens)
    mine = np.asarray(jax.jit(ours.apply)(ours.params, tokens, positions, segment_ids))
    with torch.no_grad():
        theirs = ref(input_ids=torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    assert np.max(np.abs(mine - theirs)) <= 1e-4
    # and the export is the trained student, not the initial one
    assert max_weight_diff(hf, setup["student"]) > 1e-3


# ----------------------------------------------------------------------------- resume


def _cli_cmd(setup, output, num_steps):
    return [sys.executable, "-m", "logit_distill.cli", "train", "--store", setup["store"],
            "--student", setup["student"], "--output", output, "--num-steps", str(num_steps),
            "--batch-size", "4", "--checkpoint-every", "10", "--log-every", "10", "--no-progress", "--json"]


@pytest.mark.slow
def test_sigkill_and_rerun_gives_the_same_weights(setup, tmp_path):
    steps = 150
    killed = str(tmp_path / "killed")
    proc = subprocess.Popen(_cli_cmd(setup, killed, steps), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ckpts = os.path.join(killed, "checkpoints")
    deadline = time.time() + 120
    try:
        while True:
            if os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)):
                break
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(killed, "hf")), "the run finished before it was killed"

    rerun = subprocess.run(_cli_cmd(setup, killed, steps), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout)
    assert summary["resumed_from_step"] is not None and 10 <= summary["resumed_from_step"] < steps
    assert summary["final_step"] == steps
    rows = _metrics(killed)
    assert [r["step"] for r in rows] == list(range(10, steps + 1, 10))  # each logged step once

    whole = train_student(TrainConfig(store=setup["store"], student=setup["student"], output=str(tmp_path / "whole"),
                          num_steps=steps, batch_size=4, checkpoint_every=1000, log_every=10, progress=False))
    assert max_weight_diff(os.path.join(killed, "hf"), whole.hf_dir) <= 1e-6
    assert _metrics(killed)[-1]["loss"] == pytest.approx(whole.metrics["loss"], abs=1e-6)

    # a finished run re-run is a no-op that returns the same result
    again = train_student(TrainConfig(store=setup["store"], student=setup["student"], output=killed, num_steps=steps,
                          batch_size=4, checkpoint_every=10, log_every=10, progress=False))
    assert again.resumed_from_step == steps and again.metrics["step"] == steps


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_nonzero(setup, tmp_path):
    steps = 150
    out = str(tmp_path / "term")
    proc = subprocess.Popen(_cli_cmd(setup, out, steps), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpts = os.path.join(out, "checkpoints")
    deadline = time.time() + 120
    while not (os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts))):
        assert proc.poll() is None and time.time() < deadline, "no checkpoint in time"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    at = int(err.split("at step ")[-1].split(";")[0])
    assert 10 <= at < steps and "checkpoint saved" in err
    assert str(at) in os.listdir(ckpts)
    rerun = subprocess.run(_cli_cmd(setup, out, steps), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads(rerun.stdout)["resumed_from_step"] == at


@pytest.mark.slow
def test_rerun_with_other_settings_is_refused(setup, tmp_path):
    out = str(tmp_path / "o")
    kw = dict(store=setup["store"], student=setup["student"], output=out, batch_size=4, progress=False)
    train_student(TrainConfig(num_steps=2, **kw))
    with pytest.raises(InputError, match="learning_rate"):
        train_student(TrainConfig(num_steps=2, learning_rate=1e-3, **kw))


# ----------------------------------------------------------------------------- online == offline


@pytest.mark.slow
def test_offline_exact_store_and_online_teacher_give_the_same_weights(setup, tmp_path):
    common = dict(student=setup["student"], num_steps=6, batch_size=4, learning_rate=1e-2, seed=3,
                  loss="topk_tail_kl", alpha=0.7, checkpoint_every=100, progress=False)
    off = train_student(TrainConfig(store=setup["store"], output=str(tmp_path / "off"), **common))
    n = len(store_mod.open_store(setup["store"]))
    on = train_student(TrainConfig(teacher=setup["teacher"], data=setup["train_data"], top_k=TOP_K, seq_len=SEQ_LEN,
                       num_examples=n, output=str(tmp_path / "on"), **common))
    # Adam divides by the gradient's running RMS, so float32 rounding in a near-zero gradient (the teacher
    # runs in another program online) can move a weight by a fraction of the learning rate (1e-2); the
    # loss is the tight check
    assert max_weight_diff(off.hf_dir, on.hf_dir) <= 1e-3
    assert on.metrics["kd_loss"] == pytest.approx(off.metrics["kd_loss"], abs=1e-4)


# ----------------------------------------------------------------------------- schedules, accumulation


@pytest.mark.slow
def test_alpha_schedule_lr_and_grad_accum(setup, tmp_path):
    from logit_distill.train.schedules import learning_rate_schedule

    out = str(tmp_path / "acc")
    r = train_student(TrainConfig(store=setup["store"], student=setup["student"], output=out, num_steps=4, batch_size=4,
                      grad_accum=2, alpha=0.8, alpha_end=0.2, alpha_schedule="linear", warmup_steps=1,
                      learning_rate=1e-3, checkpoint_every=2, progress=False))
    rows = _metrics(out)
    assert [r["alpha"] for r in rows] == pytest.approx([0.8, 0.65, 0.5, 0.35])
    lr = learning_rate_schedule(1e-3, 1, 4)
    assert [r["learning_rate"] for r in rows] == pytest.approx([float(lr(s)) for s in range(4)])
    with open(os.path.join(out, "checkpoints", "4", "data", "process_0-of-1.json")) as f:
        assert json.load(f)["next_index"] == 8  # 4 optimizer steps x 2 micro-batches
    assert rows[0]["num_tokens"] > 0 and r.final_step == 4


# ----------------------------------------------------------------------------- bad input


def _synthetic_store(uri, *, vocab_size=VOCAB, top_k=8, codec="exact", tail=None, steps=None, num_steps=4):
    m = store_mod.build_manifest(seq_len=16, top_k=top_k, vocab_size=vocab_size, codec=codec,
                                 num_steps=num_steps, examples_per_step=4, steps_per_file=2,
                                 content={"teacher": "synthetic"})
    store_mod.init_store(uri, m)
    by_step = {}
    for s in (range(num_steps) if steps is None else steps):
        rec = synthetic_step(m, s, 0)
        if tail is not None:
            rec["tail_logprob"] = np.full_like(rec["tail_logprob"], tail)
        by_step[s] = rec
    store_mod.write_examples(uri, m, 0, by_step)
    return uri


def test_vocab_mismatch_is_refused_before_any_step(setup, tmp_path):
    s = _synthetic_store(str(tmp_path / "s"), vocab_size=300)
    out = str(tmp_path / "o")
    with pytest.raises(InputError, match="vocabulary of 258.*has 300"):
        train_student(TrainConfig(store=s, student=setup["student"], output=out, num_steps=2, batch_size=4, progress=False))
    _no_step_taken(out)


def test_corrupt_chunk_is_refused_before_any_step(setup, tmp_path):
    s = _synthetic_store(str(tmp_path / "s"))
    chunk = sorted(n for n in os.listdir(s) if n.startswith("chunk-"))[-1]  # not the first one read
    path = os.path.join(s, chunk)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3] ^= 0x40
    open(path, "wb").write(bytes(data))
    out = str(tmp_path / "o")
    with pytest.raises(StoreError, match="checksum mismatch"):
        train_student(TrainConfig(store=s, student=setup["student"], output=out, num_steps=2, batch_size=4, progress=False))
    _no_step_taken(out)


def test_incomplete_store_is_refused(setup, tmp_path):
    s = _synthetic_store(str(tmp_path / "s"), steps=[0, 1])
    out = str(tmp_path / "o")
    with pytest.raises(StoreError, match="incomplete"):
        train_student(TrainConfig(store=s, student=setup["student"], output=out, num_steps=2, batch_size=4, progress=False))
    _no_step_taken(out)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["top_k_is_vocab", "tail_at_floor", "tail_minus_inf"])
def test_tail_loss_without_tail_mass_is_refused(setup, tmp_path, case):
    if case == "top_k_is_vocab":
        s = _synthetic_store(str(tmp_path / "s"), top_k=VOCAB, num_steps=2)
    elif case == "tail_at_floor":
        from logit_distill.codec import LOGPROB_FLOOR

        s = _synthetic_store(str(tmp_path / "s"), codec="default", tail=LOGPROB_FLOOR, num_steps=2)
    else:
        s = _synthetic_store(str(tmp_path / "s"), tail=-np.inf, num_steps=2)
    out = str(tmp_path / "o")
    with pytest.raises(InputError, match="topk_tail_kl needs tail mass"):
        train_student(TrainConfig(store=s, student=setup["student"], output=out, num_steps=2, batch_size=4,
                      loss="topk_tail_kl", progress=False))
    _no_step_taken(out)
    if case == "tail_minus_inf":  # topk_kl on the same store is fine
        train_student(TrainConfig(store=s, student=setup["student"], output=out, num_steps=1, batch_size=4, loss="topk_kl",
                      alpha=0.5, progress=False))


def test_online_tail_loss_with_full_top_k_is_refused(setup, tmp_path):
    with pytest.raises(InputError, match="no tail"):
        train_student(TrainConfig(teacher=setup["teacher"], data=setup["train_data"], top_k=VOCAB, seq_len=SEQ_LEN,
                      student=setup["student"], output=str(tmp_path / "o"), num_steps=1, batch_size=4,
                      loss="topk_tail_kl", progress=False))


def test_argument_errors(setup, tmp_path):
    out = str(tmp_path / "o")
    with pytest.raises(InputError, match="either --store"):
        train_student(TrainConfig(student=setup["student"], output=out, num_steps=1, batch_size=4))
    with pytest.raises(InputError, match="excludes"):
        train_student(TrainConfig(store=setup["store"], teacher=setup["teacher"], student=setup["student"], output=out,
                      num_steps=1, batch_size=4))
    with pytest.raises(InputError, match="alpha-end"):
        train_student(TrainConfig(store=setup["store"], student=setup["student"], output=out, num_steps=1, batch_size=4,
                      alpha_end=0.1))
    with pytest.raises(InputError, match="--loss .mse. is not one of"):
        train_student(TrainConfig(store=setup["store"], student=setup["student"], output=out, num_steps=1, batch_size=4,
                      loss="mse"))
    _no_step_taken(out)


@pytest.mark.parametrize("kw, match", [
    (dict(loss="full_kl"), "whole distribution, which no store holds"),
    (dict(loss="sampled_jsd"), "does not fit"),  # a top-k store
    (dict(loss="sampled_reverse_kl"), "is not one of"),
    (dict(loss="topk_tail_jsd", jsd_beta=1.0), "--jsd-beta must be a finite number in"),
    (dict(loss="topk_tail_kl", allow_biased_temperature=True), "applies to the sampled_"),
    (dict(eval_teacher="x"), "--eval-teacher runs the teacher on --eval-data"),
    (dict(eval_store="x", eval_data="y"), "--eval-store holds its own"),
    (dict(online=True, loss="full_kl", top_k=TOP_K), "drop --top-k"),
    (dict(online=True, loss="topk_tail_kl", samples=4), "--samples applies to the sampled_"),
])
def test_loss_and_evaluation_refusals(setup, tmp_path, kw, match):
    out = str(tmp_path / "o")
    data = (dict(teacher=setup["teacher"], data=setup["train_data"], seq_len=SEQ_LEN) if kw.pop("online", False)
            else dict(store=setup["store"]))
    with pytest.raises(InputError, match=match):
        train_student(TrainConfig(student=setup["student"], output=out, num_steps=1, batch_size=4, **data, **kw))
    assert not os.path.exists(out)


def test_teacher_relative_evaluation_equals_teacher_metrics(setup, kd_run):
    """eval.json's measures against --eval-teacher are teacher_metrics' over the held-out positions."""
    from logit_distill.data import ExampleSource
    from logit_distill.train import teacher_metrics

    got = kd_run.eval["teacher"]
    assert got["against"] == f"teacher {setup['teacher']}" and got["k"] == TOP_K
    teacher, student = load_model(setup["teacher"]), load_model(kd_run.hf_dir)
    ex = ExampleSource.open(setup["eval_data"], None, seq_len=SEQ_LEN, packing=True, seed=0)
    rows = ex.batch(list(range(len(ex))))
    args = [rows[k] for k in ("tokens", "positions", "segment_ids")]
    values = teacher_metrics.per_position(jax.jit(student.apply)(student.params, *args),
                                          {"teacher_logits": jax.jit(teacher.apply)(teacher.params, *args)}, k=TOP_K)
    want = teacher_metrics.means(jax.device_get(teacher_metrics.sums(values, training_mask(rows))))
    assert set(want) == {"kl", "top1_agreement", "topk_mass", "tail_shape_kl", "count"}
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert got["count"] == kd_run.eval["num_tokens"]
    report = open(os.path.join(kd_run.output, "report.md")).read()
    assert f"top-1 agreement {got['top1_agreement']:.1%}" in report and "tail-shape KL" in report


@pytest.mark.slow  # an online run with the teacher's whole vocabulary: its own compile (about 30 s here)
def test_online_full_vocabulary_divergence_and_eval_store(setup, tmp_path):
    """An online full_* loss trains; --eval-store measures against a store's k + 1 bins."""
    from logit_distill.train import teacher_metrics

    r = train_student(TrainConfig(teacher=setup["teacher"], data=setup["train_data"], seq_len=SEQ_LEN,
                                  loss="full_jsd", jsd_beta=0.3, student=setup["student"], output=str(tmp_path / "o"),
                                  num_steps=1, batch_size=4, eval_store=setup["store"], max_eval_examples=8,
                                  progress=False))
    assert np.isfinite(r.metrics["kd_loss"]) and r.metrics["kd_loss"] > 0
    settings = json.load(open(os.path.join(r.output, "train_config.json")))
    assert settings["loss"] == "full_jsd" and settings["jsd_beta"] == 0.3
    got = r.eval["teacher"]
    st = store_mod.open_store(setup["store"])
    recs = [st.read(i) for i in range(8)]
    b = {k: np.stack([rec[k] for rec in recs]) for k in ("tokens", "positions", "segment_ids", "loss_mask", "topk_ids",
                                                         "topk_logprobs", "tail_logprob")}
    student = load_model(r.hf_dir)
    logits = jax.jit(student.apply)(student.params, b["tokens"], b["positions"], b["segment_ids"])
    want = teacher_metrics.means(jax.device_get(teacher_metrics.sums(teacher_metrics.per_position(logits, b),
                                                                     training_mask(b))))
    assert set(want) == {"kl_bins", "top1_agreement", "topk_mass", "count"} and got["k"] == TOP_K
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


def _subparser(name):
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sub.choices[name]


def test_cli_help_and_error_exit(setup, tmp_path, capsys):
    p = _subparser("train")
    help_text = p.format_help()
    for flag in ("--store", "--teacher", "--data", "--top-k", "--seq-len", "--student", "--output",
                 "--num-steps", "--batch-size", "--learning-rate", "--warmup-steps", "--seed", "--loss",
                 "--alpha", "--alpha-end", "--alpha-schedule", "--temperature", "--checkpoint-every",
                 "--eval-data", "--grad-accum", "--eval-teacher", "--eval-store", "--allow-biased-temperature",
                 "--jsd-beta", "--skew"):
        assert flag in help_text
    s = _synthetic_store(str(tmp_path / "s"), vocab_size=300)
    rc = cli_main(["train", "--store", s, "--student", setup["student"], "--output", str(tmp_path / "o"),
                   "--num-steps", "1", "--batch-size", "4", "--no-progress"])
    assert rc == 2
    assert "vocabulary" in capsys.readouterr().err



# ----------------------------------------------------------------------------- data parallel


@pytest.mark.slow
def test_two_devices_replicated_and_fsdp_match_one_device(setup, tmp_path):
    """The batch split over 2 (fake CPU) devices, params replicated or fsdp: same weights as 1 device."""
    common = dict(store=setup["store"], student=setup["student"], num_steps=4, batch_size=4,
                  learning_rate=1e-2, checkpoint_every=2, progress=False)
    one = train_student(TrainConfig(output=str(tmp_path / "one"), **common))
    script = (
        "import sys, jax; from logit_distill.train import TrainConfig, train_student\n"
        "assert jax.device_count() == 2, jax.devices()\n"
        f"kw = {common!r}\n"
        "for mode in ('replicate', 'fsdp'):\n"
        "    train_student(TrainConfig(output=sys.argv[1] + '/' + mode, param_sharding=mode, **kw))\n"
    )
    env = env_with_cpu_devices(2)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ref = _metrics(one.output)
    for mode in ("replicate", "fsdp"):
        rows = _metrics(str(tmp_path / mode))
        # same examples, same gradients up to float rounding of the cross-device reduction ...
        assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], abs=1e-5), mode
        assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-4), mode
        # ... which Adam amplifies where a gradient is ~0 (g / (sqrt(v) + eps) ~ +-1): up to ~lr per step
        assert max_weight_diff(one.hf_dir, str(tmp_path / mode / "hf")) <= 0.5 * common["learning_rate"], mode


@pytest.mark.slow
def test_two_processes_train_like_one(setup, tmp_path):
    """JAX multi-controller: 2 CPU processes through jax.distributed, each loading its share of the
    batch, give the losses of 1 process; checkpoints and the HF export are written once."""
    import socket

    common = dict(store=setup["store"], student=setup["student"], num_steps=4, batch_size=4,
                  learning_rate=1e-2, checkpoint_every=2, progress=False)
    one = train_student(TrainConfig(output=str(tmp_path / "one"), **common))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = os.path.join(os.path.dirname(__file__), "multihost_train.py")
    kwargs = json.dumps(dict(common, output=str(tmp_path / "multi")))
    procs = [subprocess.Popen([sys.executable, script, port, str(i), kwargs], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[-2000:] for o in outs]
    rows, ref = _metrics(str(tmp_path / "multi")), _metrics(one.output)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], abs=1e-5)
    assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == sorted(os.listdir(tmp_path / "one" / "checkpoints"))
    assert max_weight_diff(one.hf_dir, str(tmp_path / "multi" / "hf")) <= 0.5 * common["learning_rate"]
