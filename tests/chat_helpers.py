"""Tiny tokenizers and chat templates for the conversation tests, and transformers as the reference.

The tokenizer is byte-level BPE (ids 0..255 are bytes) with a few merges, so tokens do not fall on
character boundaries everywhere, plus the special tokens of the test templates (``special=True``,
as real checkpoints mark them) and the reasoning / tool tags as ordinary added tokens (as Qwen3 has
them). The templates in ``chat_templates/`` are written for these tests.
"""

from __future__ import annotations

import json
import os

from logit_distill.models.presets import _bytes_to_unicode  # the GPT-2 byte symbols, in byte order

TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ċ", "Ċ"), ("i", "n"), ("e", "r"), ("o", "n"), ("Ġ", "a"),
          ("a", "s"), ("Ġ", "i"), ("Ġi", "s"), ("r", "e")]
# The special tokens each template family's tokenizer_config.json names.
FAMILIES = {
    "chatml_think_tools": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "chatml_generation": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3_header": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "gemma_fold_system": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<|endoftext|>"},
}


def template_text(name: str) -> str:
    with open(os.path.join(TEMPLATES_DIR, f"{name}.jinja")) as f:
        return f.read()


def write_chat_tokenizer(directory, family: str = "chatml_think_tools", *, where: str = "config",
                         template: str | None = None, extra_config: dict | None = None) -> str:
    """A tokenizer directory for `family`; its template (default: the family's) goes into
    tokenizer_config.json (`where="config"`), chat_template.jinja (`"jinja"`) or nowhere (`"none"`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {sym: i for i, sym in enumerate(_bytes_to_unicode())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(ADDED)
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **FAMILIES[family], **(extra_config or {})}
    text = template if template is not None else template_text(family)
    if where == "config":
        config["chat_template"] = text
    elif where == "jinja":
        with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
            f.write(text)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return directory


def hf_tokenizer(directory):
    """The reference: transformers' fast tokenizer loaded from the directory (template included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CONVERSATIONS = {
    "simple": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi to the team."},
        {"role": "assistant", "content": "Hi there, team!"},
    ],
    "multi": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And times 3?"},
        {"role": "assistant", "content": "12, the answer."},
    ],
    "reasoning": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "Yes.", "reasoning_content": "7 has no divisor but 1 and 7."},
    ],
    "multi_reasoning": [
        {"role": "user", "content": "Is 9 prime?"},
        {"role": "assistant", "content": "No.", "reasoning_content": "9 is 3 times 3."},
        {"role": "user", "content": "Is 11?"},
        {"role": "assistant", "content": "Yes, 11 is.", "reasoning_content": "No divisor up to 3."},
    ],
    "tools": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": "It is 21 °C in Paris."},
    ],
    "unicode": [
        {"role": "user", "content": "Grüße aus Köln ✓"},
        {"role": "assistant", "content": "Ça va — très bien ✓ 日本"},
    ],
}
