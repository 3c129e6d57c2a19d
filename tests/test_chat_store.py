"""Chat stores end to end: a dump of conversations keeps the teacher's values at the assistant's tokens
only (top-k and sampled), resumes to the same bytes, verifies against the re-rendered data and trains
(offline and online) on the supervised positions; bad conversations fail from the command line."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from chat_helpers import CONVERSATIONS, write_chat_tokenizer
from dump_helpers import chunk_bytes, teacher_dir
from logit_distill import codec, store
from logit_distill.data import ChatOptions, ExampleSource
from logit_distill.dump import DumpConfig, run_dump
from logit_distill.store.manifest import selection_of

SEQ_LEN = 96


def _conversations(n: int) -> list[dict]:
    """Single and multi-turn conversations, some with a system prompt or reasoning."""
    names = ["simple", "multi", "reasoning", "multi_reasoning", "unicode"]
    return [{"messages": CONVERSATIONS[names[i % len(names)]]} for i in range(n)]


def _write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny teacher and student with a ChatML tokenizer and a Qwen3-style template, 20 conversations and their exact
    top-k store (unpacked, so every row is one conversation and padding)."""
    root = tmp_path_factory.mktemp("chat-store")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOGIT_DISTILL_CACHE", str(root / "cache"))
        # the teacher and the student read conversations with the ChatML tokenizer and its template
        teacher, student = teacher_dir(root), teacher_dir(root, seed=1)
        for model in (teacher, student):
            write_chat_tokenizer(model, "chatml_think_tools")
        setup = {"root": root, "teacher": teacher, "student": student, "tokenizer": teacher,
                 "data": _write_jsonl(root / "chat.jsonl", _conversations(20))}
        setup["store"] = str(root / "topk")
        run_dump(_config(setup, setup["store"]))
    return setup


def _config(setup, output, **kw):
    base = dict(teacher=setup["teacher"], tokenizer=setup["tokenizer"], data=setup["data"], output=output,
                selection="topk", top_k=8,
                seq_len=SEQ_LEN, batch_size=4, num_steps=4, steps_per_file=1, codec="exact", packing=False,
                progress=False)
    base.update(kw)
    return DumpConfig(**base)


def _examples(setup, packing=False):
    return ExampleSource.open(setup["data"], setup["tokenizer"], seq_len=SEQ_LEN, packing=packing, chat=ChatOptions())


def test_store_holds_values_at_the_assistant_tokens_only(chat):
    s = store.open_store(chat["store"])
    assert s.manifest["shapes"]["masked"]
    examples = _examples(chat)
    supervised = total = 0
    for g in range(len(s)):
        rec, want = s.read(g), examples[g]
        np.testing.assert_array_equal(rec["tokens"], want["tokens"])
        np.testing.assert_array_equal(rec["loss_mask"], want["loss_mask"])  # the assistant's tokens, nothing else
        mask = rec["loss_mask"]
        assert 0 < mask.sum() < (rec["segment_ids"] != 0).sum() - 1  # prompts hold tokens but no values
        for field in ("topk_ids", "topk_logprobs", "tail_logprob"):
            assert not rec[field][~mask].any(), field
        assert (rec["topk_logprobs"][mask] < 0).all() and (rec["topk_logprobs"][mask, 0] > -30).all()
        # The prompt costs no bytes: header, runs, tokens, the mask bits and one row per supervised position.
        runs = len(codec.encode_runs(rec["segment_ids"], rec["positions"]))
        assert len(s.read_raw(g)) == codec.record_size("exact", 512, SEQ_LEN, 8, runs, supervised=int(mask.sum()))
        supervised, total = supervised + int(mask.sum()), total + len(mask)
    assert supervised < total / 3


def test_the_dump_of_a_chat_store_resumes_to_the_same_bytes(chat, tmp_path):
    # the sampled store packs conversations (segment ids), the top-k one (the fixture's) does not
    for selection, extra in (("topk", {}), ("sampled", {"samples": 8, "packing": True})):
        out = str(tmp_path / selection)
        if selection == "topk":
            shutil.copytree(chat["store"], out)
        else:
            run_dump(_config(chat, out, selection=selection, **extra))
        before = chunk_bytes(out)
        for name in sorted(before)[1:3]:  # two middle chunks lost, a partial upload left behind
            os.remove(os.path.join(out, name))
        (tmp_path / selection / ".tmp-leftover-p00000.array_record").write_bytes(b"partial")
        r = run_dump(_config(chat, out, selection=selection, **extra))
        assert r.resumed_from_step == 1 and r.steps_run == 2 and r.chunks_written == 2
        assert chunk_bytes(out) == before
        s = store.open_store(out)
        assert s.manifest["shapes"]["masked"] and selection_of(s.manifest) == selection
        for g in range(len(s)):
            rec = s.read(g)
            mask = rec["loss_mask"]
            if selection == "sampled":
                assert not rec["sample_counts"][~mask].any() and (rec["sample_counts"][mask].sum(-1) == 8).all()
            else:
                assert not rec["topk_logprobs"][~mask].any() and (rec["topk_logprobs"][mask] < 0).all()


def test_verify_rerenders_the_conversations_and_recomputes_the_teacher(chat):
    from logit_distill.verify import VerifyConfig, verify_store

    report = verify_store(VerifyConfig(store=chat["store"], data=chat["data"], teacher=chat["teacher"], spot_check=2,
                                       progress=False))
    assert report.passed, report.failure_line()
    status = {c["name"]: c["status"] for c in report.checks}
    assert status["data_alignment"] == status["teacher_spot_check"] == "passed", status


@pytest.mark.slow  # two trainings, one with the teacher in the loop: about 30 s
def test_offline_chat_store_and_online_teacher_train_alike_on_the_assistant_tokens(chat, tmp_path):
    """The store holds no prompt values, the online teacher computes them all: the same weights show that
    neither trains on a prompt position; the held-out CE counts the assistant's tokens only."""
    from test_train_helpers import max_weight_diff

    from logit_distill.train import TrainConfig, train_student
    from logit_distill.train.losses import training_mask

    common = dict(student=chat["student"], num_steps=2, batch_size=4, learning_rate=1e-2, loss="topk_tail_kl",
                  alpha=0.7, checkpoint_every=100, progress=False, report=False)
    off = train_student(TrainConfig(store=chat["store"], output=str(tmp_path / "off"), eval_data=chat["data"],
                                    **common))
    on = train_student(TrainConfig(teacher=chat["teacher"], data=chat["data"], chat=ChatOptions(), top_k=8,
                                   seq_len=SEQ_LEN, packing=False, num_examples=len(store.open_store(chat["store"])),
                                   output=str(tmp_path / "on"), **common))
    assert max_weight_diff(off.hf_dir, on.hf_dir) <= 1e-4
    assert on.metrics["kd_loss"] == pytest.approx(off.metrics["kd_loss"], abs=1e-4)
    held_out = _examples(chat)
    batch = held_out.batch(list(range(len(held_out))))
    want = int(np.asarray(training_mask(batch)).sum())
    assert off.eval["num_tokens"] == want
    assert want < int(np.count_nonzero(batch["segment_ids"])) / 2
