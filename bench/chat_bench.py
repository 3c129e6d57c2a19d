"""Chat figures: chat_prepare_over_plain_tokenize and chat_store_bytes_ratio.

Checking, rendering, masking and tokenizing conversations (``ChatPreparer.prepare``, what the token
cache runs on chat data) over plain ``encode_batch`` of the already rendered texts (what text data
costs), side by side in one process. The tokenizer is a byte-level BPE of 8192 tokens trained here
on the bench's own text (real merges, so tokenizing costs what a real vocabulary costs); the
templates are the ChatML ones of tests/chat_templates: in the manner of Qwen3 without markers
(prefix method) and with {% generation %} markers.

chat_store_bytes_ratio: the bytes of a store of conversations (the teacher's values at the
assistant's tokens only) over those of a full store of the same tokens (the rendered conversations as
text: values at every next token), both dumped by the same teacher with the default codec and top-k
64; the assistant's tokens are a fraction f of the tokens, measured on the data (goal: ratio <= f + 0.02).

    python -m bench.chat_bench [--conversations N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

import numpy as np

from . import common

TEMPLATES = os.path.join(common.ROOT, "tests", "chat_templates")
WORDS = ("the of and to in is that for it as with was on be by this are or at from but not have an they which one "
         "you were all we her she there been if more when will would who so no prime number sum answer proof step "
         "check value result because therefore consider first second next finally compute").split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def conversations(n: int, seed: int = 0, turns=(1, 1, 2, 3)) -> list[list[dict]]:
    """Instruction and reasoning conversations: `turns` user/assistant exchanges (one drawn per
    conversation), a system prompt in some, reasoning in half of the replies."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": _sentence(rng, 12)}] if rng.random() < 0.3 else []
        for _ in range(rng.choice(turns)):
            msgs.append({"role": "user", "content": " ".join(_sentence(rng, 14) for _ in range(rng.randint(1, 4)))})
            reply = {"role": "assistant", "content": " ".join(_sentence(rng, 16) for _ in range(rng.randint(2, 8)))}
            if rng.random() < 0.5:
                reply["reasoning_content"] = " ".join(_sentence(rng, 16) for _ in range(rng.randint(4, 16)))
            msgs.append(reply)
        out.append(msgs)
    return out


def _tokenizer_dir(texts: list[str], template: str, out_dir: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}, f)
    return out_dir


def prepare(size: dict) -> dict:
    from logit_distill.data import ChatOptions, load_tokenizer
    from logit_distill.data.chat_template import load_chat_template
    from logit_distill.data.conversations import MESSAGES, parse_record
    from logit_distill.data.supervision import ChatPreparer

    mixed = conversations(size["chat_conversations"])
    corpus = [m["content"] + " " + m.get("reasoning_content", "") for c in mixed for m in c]
    options = ChatOptions()
    figures = {}
    runs = {"chatml_think_tools": ("chatml_think_tools", mixed), "chatml_generation": ("chatml_generation", mixed),
            "chatml_think_tools_single_turn": ("chatml_think_tools",
                                               conversations(size["chat_conversations"], turns=(1,)))}
    with tempfile.TemporaryDirectory() as tmp:
        for run, (name, convs) in runs.items():
            with open(os.path.join(TEMPLATES, f"{name}.jinja")) as f:
                template_text = f.read()
            d = _tokenizer_dir(corpus, template_text, os.path.join(tmp, run))
            tokenizer = load_tokenizer(d)
            template = load_chat_template(d, template_file=None, template_kwargs={}, now=options.now)
            preparer = ChatPreparer(tokenizer, template, options)
            records = [{"messages": c} for c in convs]
            texts = [template.render(c) for c in convs]
            batch = 1024  # as the token cache batches

            def chat():
                for a in range(0, len(records), batch):
                    items = [parse_record(r, MESSAGES, None, options, "text", f"row {a + i}")
                             for i, r in enumerate(records[a: a + batch])]
                    preparer.prepare(items)

            def plain():
                for a in range(0, len(texts), batch):
                    [np.asarray(e.ids, np.int32) for e in tokenizer.hf.encode_batch(texts[a: a + batch],
                                                                                    add_special_tokens=False)]

            chat(), plain()  # warm up
            times = common.interleave({"chat": chat, "plain": plain}, size["chat_repeats"])
            tokens = sum(len(e.ids) for e in tokenizer.hf.encode_batch(texts, add_special_tokens=False))
            figures[run] = {
                "mask_method": preparer.method,
                "assistant_turns_per_conversation": sum(m["role"] == "assistant" for c in convs for m in c) / len(convs),
                "ratio": common.ratio(times, "chat", "plain"),
                "chat": common.summary(times["chat"]), "plain": common.summary(times["plain"]),
                "tokens": tokens, "tokens_per_s_plain": tokens / common.median(times["plain"]),
            }
            common.log(f"chat_prepare {run} ({preparer.method}): {figures[run]['ratio']:.3f}")
    return {
        "chat_prepare_over_plain_tokenize": {
            "value": figures["chatml_think_tools"]["ratio"],
            "details": {
                "what": "check + render + mask + tokenize over encode_batch of the rendered texts",
                "conversations": len(mixed), "tokenizer": "byte-level BPE, 8192 tokens, trained on the bench text",
                "prefix_method": figures["chatml_think_tools"], "generation_method": figures["chatml_generation"],
                "prefix_method_single_turn": figures["chatml_think_tools_single_turn"],
            },
        }
    }


def store_bytes(size: dict) -> dict:
    from logit_distill import paths
    from logit_distill.data import ChatOptions, ExampleSource
    from logit_distill.data.chat_template import load_chat_template
    from logit_distill.dump import DumpConfig, run_dump
    from logit_distill.store import open_store

    root = common.fresh_dir("chat_store")
    convs = conversations(size["chat_store_conversations"], seed=1)
    corpus = [m["content"] + " " + m.get("reasoning_content", "") for c in convs for m in c]
    with open(os.path.join(TEMPLATES, "chatml_think_tools.jinja")) as f:
        template_text = f.read()
    teacher = os.path.join(root, "teacher")
    common.save_checkpoint(common.qwen3_config(vocab_size=8192, hidden=64, intermediate=128, layers=2, heads=2,
                                               kv_heads=1, head_dim=32), 0, teacher)
    _tokenizer_dir(corpus, template_text, teacher)  # the teacher reads conversations with this template
    chat_data = os.path.join(root, "chat.jsonl")
    with open(chat_data, "w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}) + "\n")
    L, B = size["chat_store_seq_len"], 4
    rendered = ExampleSource.open(chat_data, teacher, seq_len=L, chat=ChatOptions())
    text_data = os.path.join(root, "text.jsonl")  # the same tokens as text: every next token is a target
    template = load_chat_template(teacher, template_file=None, template_kwargs={}, now=ChatOptions().now)
    with open(text_data, "w") as f:
        for c in convs:
            f.write(json.dumps({"text": template.render(c)}) + "\n")
    steps = len(rendered) // B
    figures = {}
    for name, data in (("chat", chat_data), ("full", text_data)):
        out = os.path.join(root, name)
        run_dump(DumpConfig(teacher=teacher, data=data, output=out, selection="topk", top_k=64, seq_len=L, batch_size=B,
                            num_steps=steps, steps_per_file=steps, progress=False))
        s = open_store(out)
        records = [s.read_raw(g) for g in range(len(s))]
        masks = [s.read(g)["loss_mask"] for g in range(len(s))]
        segs = [s.read(g)["segment_ids"] for g in range(len(s))]
        figures[name] = {"record_bytes": sum(len(r) for r in records),
                         "chunk_file_bytes": sum(f["size"] for f in paths.list_files(out) if f["name"].startswith("chunk-")),
                         "positions_with_values": int(sum(m.sum() for m in masks)),
                         "tokens": int(sum(np.count_nonzero(x) for x in segs))}
    f_assistant = figures["chat"]["positions_with_values"] / figures["full"]["tokens"]
    ratio = figures["chat"]["record_bytes"] / figures["full"]["record_bytes"]
    common.log(f"chat_store_bytes_ratio: {ratio:.4f} (f = {f_assistant:.4f})")
    return {
        "chat_store_bytes_ratio": {
            "value": {"ratio": ratio, "assistant_fraction": f_assistant},
            "details": {
                "what": "record bytes of the assistant-only store over the full store of the same tokens",
                "assistant_fraction_f": f_assistant, "goal": f"<= f + 0.02 = {f_assistant + 0.02:.4f}",
                "over_f": ratio - f_assistant, "conversations": len(convs), "seq_len": L, "top_k": 64,
                "vocab_size": 8192, "codec": "default", "stores": figures,
                "file_bytes_ratio": figures["chat"]["chunk_file_bytes"] / figures["full"]["chunk_file_bytes"],
            },
        }
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    common.setup_environment()
    result = prepare({"chat_conversations": args.conversations, "chat_repeats": args.repeats})
    result.update(store_bytes({"chat_store_conversations": 64, "chat_store_seq_len": 1024}))
    print(json.dumps(result, indent=1, default=float))
