"""Mixture-of-experts teachers through ``logit-distill dump`` end to end: the stored top-k equals HF
transformers', a deleted chunk is filled with the same bytes, ``verify --spot-check`` passes, a dense
student trains from the store; the same bytes on 1 and 4 data-parallel devices; experts split over 8
devices agree with one device."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dump_helpers import chunk_bytes, cli, dump_args, teacher_dir, write_corpus
from logit_distill import codec, store
from logit_distill.cli import main

from cpu_devices import env_with_cpu_devices

MOE_PRESETS = ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-deepseek-v3", "tiny-glm4-moe"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-dump")
    return {"root": root, "data": write_corpus(root / "corpus.jsonl")}


def _hf_logprobs(model, tokens):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor(tokens[None].astype(np.int64))).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_dump_resume_verify_and_train_a_dense_student(setup, tmp_path, capsys, preset):
    import torch
    from transformers import AutoModelForCausalLM

    teacher = teacher_dir(setup["root"], preset)
    out = str(tmp_path / "store")
    args = dump_args(teacher, setup["data"], out, codec="exact", num_steps=4)
    assert main(args) == 0, capsys.readouterr().err
    before = chunk_bytes(out)

    # every stored position against transformers on its own document
    hf = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32, attn_implementation="eager").eval()
    s = store.open_store(out)
    k = s.manifest["shapes"]["top_k"]
    checked = 0
    for i in range(len(s)):
        rec = s.read(i)
        for seg in np.unique(rec["segment_ids"]):
            if seg == 0:
                continue
            where = np.flatnonzero(rec["segment_ids"] == seg)
            ref = _hf_logprobs(hf, rec["tokens"][where])
            held = rec["loss_mask"][where]  # a document's last position predicts nothing: no values there
            assert held.sum() == len(where) - 1
            where, ref = where[held], ref[held]
            np.testing.assert_array_equal(rec["topk_ids"][where], np.argsort(-ref, -1, kind="stable")[:, :k])
            np.testing.assert_allclose(rec["topk_logprobs"][where], np.take_along_axis(ref, rec["topk_ids"][where], -1),
                                       atol=1e-4)
            checked += len(where)
    assert checked > 100

    # a deleted middle chunk is computed again, to the same bytes
    middle = sorted(before)[1]
    os.remove(os.path.join(out, middle))
    assert main(args) == 0
    assert chunk_bytes(out) == before

    # the teacher spot check recomputes it
    assert main(["verify", "--store", out, "--teacher", teacher, "--spot-check", "3", "--no-progress"]) == 0, \
        capsys.readouterr().err

    # a dense student trains from the store
    student = str(tmp_path / "student")
    assert main(["train", "--store", out, "--student", "preset:tiny-qwen3", "--output", student, "--num-steps", "2",
                 "--batch-size", "4", "--no-progress"]) == 0, capsys.readouterr().err
    metrics = [json.loads(line) for line in open(os.path.join(student, "metrics.jsonl"))]
    assert metrics and all(np.isfinite(m["loss"]) for m in metrics if "loss" in m)


@pytest.mark.slow
def test_same_bytes_on_one_and_four_devices(setup, tmp_path):
    teacher = teacher_dir(setup["root"], "tiny-deepseek-v3")
    outs = {}
    for n in (1, 4):
        out = str(tmp_path / f"d{n}")
        env = env_with_cpu_devices(n)
        r = cli(*dump_args(teacher, setup["data"], out, batch_size=8, num_steps=2, codec="exact"), env=env)
        assert r.returncode == 0, r.stderr
        outs[n] = chunk_bytes(out)
    assert outs[1] == outs[4]


_EP_SCRIPT = textwrap.dedent(
    """
    import json, sys, numpy as np, jax
    from logit_distill.dump import DumpConfig, TeacherStep
    from logit_distill.dump.teacher_step import dump_mesh
    from logit_distill.models import load_model, safetensors_io
    from logit_distill.selection import select_topk
    assert jax.device_count() == 8
    rng = np.random.default_rng(0)
    B, L = 4, 32
    tokens = rng.integers(0, 512, (B, L)).astype(np.int32)
    positions = np.tile(np.arange(L, dtype=np.int32), (B, 1))
    seg = np.ones((B, L), np.int32)
    positions[1, 20:] = np.arange(12)
    seg[1, 20:] = 2  # two documents in a row
    out = {}
    read = {"bytes": 0}
    orig = safetensors_io.read_rows
    def counting(*a, **k):
        arr = orig(*a, **k)
        read["bytes"] += arr.nbytes
        return arr
    safetensors_io.read_rows = counting
    for teacher, modes in json.loads(sys.argv[1]).items():
        m = load_model(teacher)
        ref = {k: np.asarray(v) for k, v in jax.jit(
            lambda p: select_topk(m.apply(p, tokens, positions, seg), 8))(m.params).items()}
        total = sum(a.nbytes for a in jax.tree.leaves(m.params))
        for mode, mp in modes:
            config = DumpConfig(teacher="", data="", output="", selection="topk", top_k=8, seq_len=L, batch_size=B,
                                sharding=mode,
                                model_parallel=mp)
            read["bytes"] = 0
            sharded = load_model(teacher, mesh=dump_mesh(config), shard_mode=mode)  # experts read onto their devices
            c = TeacherStep(sharded, config, dump_mesh(config))
            sel = c.fetch(c.dispatch({"tokens": tokens, "positions": positions, "segment_ids": seg}, np.arange(B)))
            spec = str(sharded.params["model"]["layers"][-1]["mlp"]["experts"]["down_proj"].sharding.spec)
            out[f"{teacher} {mode}"] = {
                "ids_equal": bool((sel["topk_ids"] == ref["topk_ids"]).all()),
                "max_logprob_diff": float(np.abs(sel["topk_logprobs"] - ref["topk_logprobs"]).max()),
                "read_over_total": read["bytes"] / total, "experts_spec": spec, "mesh": dict(c.mesh.shape)}
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_experts_over_eight_devices_match_one_device(setup):
    """Experts split over the model axis give the single-device top-k ids, log-probs within the codec's
    bound (the k experts' contributions are summed in another order: last bits may differ)."""
    modes = {
        "tiny-qwen3-moe": [["expert", 8], ["fsdp+expert", 4], ["tensor", 4]],
        "tiny-gpt-oss": [["expert", 8], ["fsdp+tensor", 2]],
        "tiny-deepseek-v3": [["expert", 8], ["fsdp+expert", 4], ["tensor", 4]],
        "tiny-glm4-moe": [["fsdp+expert", 4]],
    }
    teachers = {teacher_dir(setup["root"], name): m for name, m in modes.items()}
    env = env_with_cpu_devices(8)
    proc = subprocess.run([sys.executable, "-c", _EP_SCRIPT, json.dumps(teachers)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1][len("RESULT"):])
    assert len(res) == 9
    for key, r in res.items():
        assert r["ids_equal"] and r["max_logprob_diff"] <= codec.LOGPROB_MAX_ERROR, (key, r)
        assert r["experts_spec"].startswith("P('model'"), (key, r)
        if " expert" in key:  # the experts split by expert: each read once by the device holding it
            assert r["read_over_total"] == pytest.approx(1.0), (key, r)
    assert res[f"{teacher_dir(setup['root'], 'tiny-qwen3-moe')} expert"]["mesh"] == {"data": 1, "model": 8}
