"""Chat preparation figure: chat_prepare_over_plain_tokenize.

Checking, rendering, masking and tokenizing conversations (``ChatPreparer.prepare``, what the token
cache runs on chat data) over plain ``encode_batch`` of the already rendered texts (what text data
costs), side by side in one process. The tokenizer is a byte-level BPE of 8192 tokens trained here
on the bench's own text (real merges, so tokenizing costs what a real vocabulary costs); the
templates are the ChatML ones of tests/chat_templates: in the manner of Qwen3 without markers
(prefix method) and with {% generation %} markers.

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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    common.setup_environment()
    result = prepare({"chat_conversations": args.conversations, "chat_repeats": args.repeats})
    print(json.dumps(result, indent=1, default=float))
