"""Flax NNX students (``flax:MODULE:FACTORY``): the examples learn more from KD than from CE alone,
the export reloads, a SIGKILLed run resumes exactly, offline == online, fsdp honours the
annotations, the KFP train component takes the spec, and bad factories fail before any step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from logit_distill import store as store_mod
from logit_distill.data import write_pretokenized
from logit_distill.errors import InputError
from logit_distill.models import load_model, load_student
from logit_distill.models.flax_student import TokensAndMask, parse_spec
from logit_distill.train import sample_from_teacher, train_student
from logit_distill.cli import main as cli_main
from logit_distill.train import TrainConfig

from test_train_helpers import VOCAB, make_model_dir, write_teacher_store
from cpu_devices import env_with_cpu_devices

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ_LEN = 32
TOP_K = 16
TRANSFORMER = "flax:examples.students.tiny_transformer:make"
RECURRENT = "flax:examples.students.gated_recurrence:make"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A bigram-like teacher, data sampled from it, and its exact store (as in test_train)."""
    root = tmp_path_factory.mktemp("flax")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGIT_DISTILL_CACHE", str(root / "cache"))
        teacher = make_model_dir(str(root / "teacher"), seed=1, init_range=0.3, bigram=True)
        docs = sample_from_teacher(load_model(teacher), 96, SEQ_LEN - 1, seed=0, eos_id=256)
        train_data = write_pretokenized(str(root / "train.array_record"), docs[:64])
        eval_data = write_pretokenized(str(root / "eval.array_record"), docs[64:])
        store = str(root / "store")
        write_teacher_store(store, teacher, train_data, seq_len=SEQ_LEN, top_k=TOP_K, examples_per_step=4)
    return {"root": root, "teacher": teacher, "train_data": train_data, "eval_data": eval_data, "store": store}


def _weights(export_dir):
    from safetensors.numpy import load_file

    return load_file(os.path.join(export_dir, "model.safetensors"))


def _max_diff(a_dir, b_dir):
    a, b = _weights(a_dir), _weights(b_dir)
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)


def _metrics(output):
    with open(os.path.join(output, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _no_step_taken(output):
    ckpts = os.path.join(output, "checkpoints")
    assert not os.path.exists(ckpts) or not any(n.isdigit() for n in os.listdir(ckpts))
    assert not os.path.exists(os.path.join(output, "metrics.jsonl"))


# ----------------------------------------------------------------------------- KD beats CE, export


@pytest.mark.slow
@pytest.mark.parametrize("spec", [TRANSFORMER, RECURRENT], ids=["transformer", "recurrence"])
def test_example_student_learns_more_from_kd_than_ce_and_reloads(setup, tmp_path, spec):
    common = dict(store=setup["store"], student=spec, num_steps=30, batch_size=8, learning_rate=1e-2, loss="topk_kl",
                  eval_data=setup["eval_data"], checkpoint_every=100, log_every=5, progress=False)
    kd = train_student(TrainConfig(output=str(tmp_path / "kd"), alpha=0.5, **common))
    ce = train_student(TrainConfig(output=str(tmp_path / "ce"), alpha=0.0, **common))
    assert kd.eval["cross_entropy"] < ce.eval["cross_entropy"] - 0.3, (kd.eval, ce.eval)

    # the export: safetensors by flat parameter name + student.json; load_student rebuilds the module
    assert kd.hf_dir is None and kd.export_dir == str(tmp_path / "kd" / "student")
    with open(os.path.join(kd.export_dir, "student.json")) as f:
        meta = json.load(f)
    assert meta["student"] == spec and meta["vocab_size"] == VOCAB and meta["kwargs"] == {}
    assert os.path.exists(os.path.join(kd.export_dir, "tokenizer.json"))  # the store's teacher's
    module = load_student(kd.export_dir)
    assert isinstance(module, nnx.Module)
    from logit_distill.data import ExampleSource
    from logit_distill.train.evaluate import evaluate

    examples = ExampleSource.open(setup["eval_data"], None, seq_len=SEQ_LEN, packing=True, seed=0)
    again = evaluate(lambda _, t, p, s: module(t, p, s), None, examples, batch_size=8)
    assert again["cross_entropy"] == pytest.approx(kd.eval["cross_entropy"], abs=1e-5)


# ----------------------------------------------------------------------------- resume, online


SMALL_RECURRENT = RECURRENT + "?width=16&num_layers=1"
SMALL_TRANSFORMER = TRANSFORMER + "?num_layers=1&width=32"
SMALL_RUN = dict(student=SMALL_TRANSFORMER, num_steps=4, batch_size=4, learning_rate=1e-2, seed=3,
                 loss="topk_tail_kl", alpha=0.7, checkpoint_every=100, progress=False)


@pytest.fixture(scope="module")
def small_offline_run(setup, tmp_path_factory):
    """A few steps of a small transformer on the store, on one device (the reference of two tests)."""
    return train_student(TrainConfig(store=setup["store"], output=str(tmp_path_factory.mktemp("small") / "off"), **SMALL_RUN))


def _cli_cmd(setup, output, num_steps):
    return [sys.executable, "-m", "logit_distill.cli", "train", "--store", setup["store"],
            "--student", SMALL_RECURRENT, "--output", output, "--num-steps", str(num_steps),
            "--batch-size", "4", "--checkpoint-every", "10", "--log-every", "10", "--no-progress", "--json"]


@pytest.mark.slow
def test_sigkill_and_rerun_gives_the_same_weights(setup, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    steps = 100
    killed = str(tmp_path / "killed")
    proc = subprocess.Popen(_cli_cmd(setup, killed, steps), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    ckpts = os.path.join(killed, "checkpoints")
    deadline = time.time() + 120
    try:
        while not (os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts))):
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(os.path.join(killed, "student")), "the run finished before it was killed"

    rerun = subprocess.run(_cli_cmd(setup, killed, steps), capture_output=True, text=True, timeout=300, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout)
    assert summary["resumed_from_step"] is not None and 10 <= summary["resumed_from_step"] < steps
    assert summary["export_dir"].endswith("student") and summary["hf_dir"] is None
    assert [r["step"] for r in _metrics(killed)] == list(range(10, steps + 1, 10))

    whole = train_student(TrainConfig(store=setup["store"], student=SMALL_RECURRENT, output=str(tmp_path / "whole"),
                          num_steps=steps, batch_size=4, checkpoint_every=1000, log_every=10, progress=False))
    assert _max_diff(os.path.join(killed, "student"), whole.export_dir) <= 1e-6
    assert _metrics(killed)[-1]["loss"] == pytest.approx(whole.metrics["loss"], abs=1e-6)


@pytest.mark.slow
def test_offline_exact_store_and_online_teacher_give_the_same_weights(setup, small_offline_run, tmp_path):
    off = small_offline_run
    n = len(store_mod.open_store(setup["store"]))
    on = train_student(TrainConfig(teacher=setup["teacher"], data=setup["train_data"], top_k=TOP_K, seq_len=SEQ_LEN,
                       num_examples=n, output=str(tmp_path / "on"), **SMALL_RUN))
    assert _max_diff(off.export_dir, on.export_dir) <= 1e-4
    assert on.metrics["kd_loss"] == pytest.approx(off.metrics["kd_loss"], abs=1e-4)


# ----------------------------------------------------------------------------- sharding, component


@pytest.mark.slow
def test_fsdp_on_two_devices_follows_the_annotations_and_matches_one_device(setup, small_offline_run, tmp_path):
    spec = SMALL_TRANSFORMER
    common = dict(SMALL_RUN, store=setup["store"])
    one = small_offline_run
    script = (
        "import sys, json, jax\n"
        "from logit_distill.errors import InputError\n"
        "from logit_distill.models.sharding import make_mesh\n"
        "from logit_distill.train.student import describe_student, open_student\n"
        "from logit_distill.train import TrainConfig, train_student\n"
        "assert jax.device_count() == 2, jax.devices()\n"
        f"s = open_student(describe_student({spec!r}, vocab_size={VOCAB}, seq_len={SEQ_LEN}, where='test'), "
        f"seq_len={SEQ_LEN})\n"
        "state = s.place({'params': s.params, 'opt_state': {'mu': s.params}}, make_mesh(jax.devices()), 'fsdp')\n"
        "specs = {k: [str(a) for a in v.sharding.spec] for k, v in state['params'].items()}\n"
        "mu = {k: [str(a) for a in v.sharding.spec] for k, v in state['opt_state']['mu'].items()}\n"
        "assert specs == mu, (specs, mu)\n"
        f"odd = open_student(describe_student({RECURRENT + '?width=15'!r}, vocab_size={VOCAB}, seq_len={SEQ_LEN}, "
        f"where='test'), seq_len={SEQ_LEN})\n"
        "try:\n"
        "    odd.place({'params': odd.params}, make_mesh(jax.devices()), 'fsdp')\n"
        "    raise SystemExit('an annotation the devices do not divide was placed')\n"
        "except InputError as e:\n"
        "    assert 'which do not divide 15' in str(e), e\n"
        "print(json.dumps(specs))\n"
        f"train_student(TrainConfig(output=sys.argv[1], param_sharding='fsdp', **{common!r}))\n"
    )
    env = env_with_cpu_devices(2,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "fsdp")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    specs = json.loads(run.stdout.strip().splitlines()[-1])
    assert specs["embed.embedding"] == ["None", "data"]  # annotated (None, "fsdp")
    assert specs["blocks.0.qkv.kernel"] == ["data", "None"]  # ("fsdp", "model"): no model axis here
    assert specs["blocks.0.out.kernel"] == ["None", "data"]  # ("model", "fsdp")
    assert specs["norm.scale"] == []  # unannotated and small: replicated
    ref, rows = _metrics(one.output), _metrics(str(tmp_path / "fsdp"))
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref], abs=1e-5)


@pytest.mark.slow
def test_train_component_takes_a_flax_spec(setup, tmp_path):
    import components
    from kfp.dsl import HTML, Dataset, Metrics, Model

    model = Model(uri=str(tmp_path / "model"))
    metrics, report = Metrics(uri=str(tmp_path / "m")), HTML(uri=str(tmp_path / "report.html"))
    out = components.train_offline_student.train_offline_student(
        store=Dataset(uri=setup["store"]), student=SMALL_RECURRENT, num_steps=2,
        batch_size=4, model=model, metrics=metrics, report=report, log_every=1, checkpoint_every=2)
    assert os.path.exists(os.path.join(model.uri, "student", "student.json"))
    assert model.metadata["export_dir"].endswith("student") and "flax" in model.metadata["format"]
    assert model.metadata["num_steps"] == 2 and np.isfinite(metrics.metadata["final_loss"])
    assert out.hf_dir == model.metadata["export_dir"]  # the folder the pipeline registers


# ----------------------------------------------------------------------------- bad input


class _Echo(nnx.Module):
    """Logits from an embedding only (a tokens-and-mask module for the adapter test)."""

    def __init__(self, vocab_size, width=8):
        self.embed = nnx.Embed(vocab_size, width, rngs=nnx.Rngs(0))
        self.head = nnx.Linear(width, vocab_size, rngs=nnx.Rngs(1))

    def __call__(self, tokens, mask):
        assert mask.shape == (tokens.shape[0], 1, tokens.shape[1], tokens.shape[1])
        return self.head(self.embed(tokens))


def masked(vocab_size):
    return TokensAndMask(_Echo(vocab_size))


def not_a_module(vocab_size):
    return {"vocab_size": vocab_size}


def wrong_vocab(vocab_size):
    return TokensAndMask(_Echo(vocab_size + 1))


def no_params(vocab_size):
    return TokensAndMask(nnx.Dropout(0.0))


def needs_width(vocab_size, *, width):
    return TokensAndMask(_Echo(vocab_size, width))


def test_spec_values_are_json_literals_else_strings():
    fs = parse_spec("flax:pkg.mod:make?layers=3&rate=0.5&tied=true&name=abc&quoted=%22x%22&none=null")
    assert (fs.module, fs.factory) == ("pkg.mod", "make")
    assert fs.kwargs == {"layers": 3, "rate": 0.5, "tied": True, "name": "abc", "quoted": "x", "none": None}


def test_adapter_for_tokens_and_mask_modules_gives_logits_and_gradients():
    import jax

    from logit_distill.train.student import describe_student, open_student

    s = open_student(describe_student("flax:test_flax_student:masked", vocab_size=VOCAB, seq_len=8, where="test"),
                     seq_len=8)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    positions = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    segment_ids = jnp.asarray([[1] * 4 + [2] * 4, [1] * 6 + [0] * 2], jnp.int32)
    assert s.apply(s.params, tokens, positions, segment_ids).shape == (2, 8, VOCAB)
    grads = jax.grad(lambda p: s.apply(p, tokens, positions, segment_ids).sum())(s.params)
    assert grads.keys() == s.params.keys() and all(np.all(np.isfinite(g)) for g in grads.values())


@pytest.mark.parametrize("spec, message", [
    ("flax:no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
    ("flax:test_flax_student:no_such_factory", "has no callable 'no_such_factory'"),
    ("flax:test_flax_student:not_a_module", "returned a dict, not a flax.nnx.Module"),
    ("flax:test_flax_student:wrong_vocab", f"logits over a vocabulary of {VOCAB + 1}, not the store's {VOCAB}"),
    ("flax:test_flax_student:no_params", "has no nnx.Param"),
    ("flax:test_flax_student:needs_width?depth=2", "failed: TypeError"),
    ("flax:test_flax_student:needs_width?width", "'width' is not key=value"),
    ("flax:test_flax_student", "expected MODULE:FACTORY"),
    ("flax:test_flax_student:masked?vocab_size=3", "vocab_size comes from the store"),
], ids=["import", "factory", "not-module", "vocab", "no-params", "kwargs", "syntax", "no-factory", "vocab-kwarg"])
def test_bad_factory_fails_before_any_step_with_one_line(setup, tmp_path, capsys, spec, message):
    out = str(tmp_path / "o")
    rc = cli_main(["train", "--store", setup["store"], "--student", spec, "--output", out, "--num-steps", "1",
                   "--batch-size", "4", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err, err
    assert err.startswith("logit-distill train: error: student ") and message in err, err
    _no_step_taken(out)
    assert not os.path.exists(out)  # nothing written


def test_load_student_of_a_directory_without_student_json_is_refused(tmp_path):
    with pytest.raises(InputError, match="no student.json"):
        load_student(str(tmp_path))


def test_causal_segment_mask_keeps_documents_apart():
    from logit_distill.models.flax_student import causal_segment_mask

    m = np.asarray(causal_segment_mask(jnp.asarray([[1, 1, 2, 2, 0]])))[0, 0]
    want = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(m, want)
