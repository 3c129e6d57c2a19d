"""Training into gs:// (the GCS emulator): Orbax/tensorstore checkpoints, metrics, the HF export and
eval.json land in the bucket, and a run killed with SIGKILL and re-run ends with the weights of an
uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from test_train_helpers import make_model_dir, write_teacher_store
from dump_helpers import write_corpus
from logit_distill.train import TrainConfig

STEPS = 12


@pytest.fixture(scope="module")
def gcs_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-gcs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGIT_DISTILL_CACHE", str(root / "cache"))
        teacher = make_model_dir(str(root / "teacher"), seed=1, init_range=0.3)
        student = make_model_dir(str(root / "student"), seed=2)
        data = write_corpus(root / "corpus.jsonl", num_docs=40)
        store = str(root / "store")
        write_teacher_store(store, teacher, data, seq_len=16, top_k=8, examples_per_step=4)
    return {"root": root, "student": student, "store": store, "data": data}


def _cmd(s, output):
    return [sys.executable, "-m", "logit_distill.cli", "train", "--store", s["store"], "--student", s["student"],
            "--output", output, "--num-steps", str(STEPS), "--batch-size", "4", "--checkpoint-every", "6",
            "--log-every", "4", "--keep-checkpoints", "2", "--no-progress", "--eval-data", s["data"],
            "--max-eval-examples", "8", "--json"]


def _weights(fs, hf_dir: str) -> dict:
    from safetensors.numpy import load

    return load(fs.cat_file(hf_dir.removeprefix("gs://") + "/model.safetensors"))


@pytest.mark.slow
def test_sigkill_and_rerun_on_gcs_gives_the_weights_of_an_uninterrupted_run(gcs_setup, gcs_bucket, tmp_path):
    import gcsfs

    from logit_distill.train import train_student

    fs = gcsfs.GCSFileSystem(token="anon")
    out = f"{gcs_bucket}/run"
    ckpts = out.removeprefix("gs://") + "/checkpoints"
    proc = subprocess.Popen(_cmd(gcs_setup, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 180
    try:
        while True:  # kill once a checkpoint is committed (Orbax writes commit_success.txt last on GCS)
            fs.invalidate_cache()
            if fs.exists(ckpts) and any(fs.exists(f"{d}/commit_success.txt") for d in fs.ls(ckpts)
                                        if d.rsplit("/", 1)[-1].isdigit()):
                break
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
            assert time.time() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    fs.invalidate_cache()
    assert not fs.exists(out.removeprefix("gs://") + "/hf/model.safetensors"), "finished before the kill"

    rerun = subprocess.run(_cmd(gcs_setup, out), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads(rerun.stdout)
    # resumed from the checkpoint the kill followed (6), or from the last one (12) when the kill landed
    # between the final checkpoint and the export: either way from a committed checkpoint
    assert summary["resumed_from_step"] is not None and 6 <= summary["resumed_from_step"] <= STEPS
    fs.invalidate_cache()
    names = {p.removeprefix(out.removeprefix("gs://") + "/") for p in fs.find(out.removeprefix("gs://"))}
    assert {"metrics.jsonl", "train_config.json", "eval.json", "hf/model.safetensors", "hf/tokenizer.json",
            "hf/config.json"} <= names, sorted(names)
    metrics = [json.loads(x) for x in fs.cat_file(out.removeprefix("gs://") + "/metrics.jsonl").splitlines()]
    assert [m["step"] for m in metrics] == list(range(4, STEPS + 1, 4))  # each logged step once

    whole = train_student(TrainConfig(store=gcs_setup["store"], student=gcs_setup["student"], output=str(tmp_path / "whole"),
                          num_steps=STEPS, batch_size=4, checkpoint_every=1000, log_every=4, progress=False))
    from safetensors.numpy import load_file

    ref = load_file(os.path.join(whole.hf_dir, "model.safetensors"))
    got = _weights(fs, summary["hf_dir"])
    assert ref.keys() == got.keys()
    assert max(float(np.max(np.abs(ref[k].astype(np.float64) - got[k]))) for k in ref) <= 1e-6
    assert metrics[-1]["loss"] == pytest.approx(whole.metrics["loss"], abs=1e-6)
