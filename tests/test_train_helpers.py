"""Builders shared by the training tests (no tests here): model checkpoints with the preset
tokenizer, a store written by the dump, weight comparisons."""

from __future__ import annotations

import os
import tempfile

import numpy as np

from logit_distill import store as store_mod
from logit_distill.models import PRESETS, build_model, init_params, save_hf_checkpoint
from logit_distill.models.presets import write_tokenizer

VOCAB = 258  # the preset byte-level tokenizer's size: 256 bytes + <|endoftext|> + <|pad|>


def make_model_dir(out_dir: str, *, seed: int, init_range: float = 0.02, vocab_size: int = VOCAB,
                   base: str = "tiny-qwen3", bigram: bool = False) -> str:
    """An HF checkpoint of a tiny Qwen3 with random weights (N(0, init_range)) and the preset tokenizer.

    ``bigram``: the attention and MLP outputs are zeroed, so the next-token distribution depends
    on the current token only (a random rank-64 bigram table): a teacher a small student can learn
    in a few dozen steps, which makes the KD-vs-CE comparison quick and clear.
    """
    cfg = dict(PRESETS[base])
    cfg["vocab_size"] = vocab_size
    cfg["initializer_range"] = init_range
    params = init_params(cfg, seed, "float32")
    if bigram:
        for layer in params["model"]["layers"]:
            layer["self_attn"]["o_proj"]["weight"] = layer["self_attn"]["o_proj"]["weight"] * 0
            layer["mlp"]["down_proj"]["weight"] = layer["mlp"]["down_proj"]["weight"] * 0
    loaded = build_model(cfg, params)
    with tempfile.TemporaryDirectory() as tok_dir:  # the preset tokenizer, sized to this vocabulary
        write_tokenizer(tok_dir, cfg["max_position_embeddings"], vocab_size)
        save_hf_checkpoint(loaded, params, out_dir, tokenizer_path=os.path.join(tok_dir, "tokenizer.json"))
    return out_dir


def swap_tokenizer_ids(model_dir: str, a: str = "a", b: str = "b") -> str:
    """Swap two ids of ``model_dir``'s tokenizer.json: another tokenizer of the same vocabulary size."""
    import json

    path = os.path.join(model_dir, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    with open(path, "w") as f:
        json.dump(tok, f)
    return model_dir


def write_teacher_store(uri: str, teacher_dir: str, data_path: str, *, seq_len: int, top_k: int,
                        examples_per_step: int, codec: str = "exact", steps_per_file: int = 2) -> dict:
    """A complete store of the teacher over the data, written by the real dump; return its manifest."""
    from logit_distill.dump import DumpConfig, run_dump

    run_dump(DumpConfig(teacher=teacher_dir, data=data_path, output=uri, selection="topk", top_k=top_k, seq_len=seq_len,
                        batch_size=examples_per_step, steps_per_file=steps_per_file, codec=codec,
                        progress=False))
    return store_mod.open_store(uri).manifest


def read_weights(hf_dir: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


def max_weight_diff(a_dir: str, b_dir: str) -> float:
    a, b = read_weights(a_dir), read_weights(b_dir)
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)
