"""``logit-distill dump``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from ..codec import MAX_HYBRID_K
from ..dump.config import DEFAULT_SAMPLES, DEFAULT_SELECTION, DEFAULT_TOP_K
from ..store.lease import DEFAULT_TIMEOUT_S as DEFAULT_LEASE_TIMEOUT_S
from ..store.manifest import DEFAULT_ARRAY_RECORD_OPTIONS
from .chat_flags import add_chat_arguments, chat_options
from .flags import add_output_arguments, positive_float

HELP = "run a teacher over the data and store its top-k log-probs and draws from the rest (resumable)"
DESCRIPTION = ("Run the teacher once over the data; store each supervised position's top-k log-probs, ids and "
               "tail mass, plus tokens drawn from the rest (--selection hybrid, the default), or the top-k alone, "
               "or tokens sampled from it, in a chunked logit store: every next-token position of "
               "text, the assistant's tokens of conversations. Re-running the same command resumes. "
               "Exit status: 0 complete, 1 stopped before the last chunk, 2 bad input, 3 non-finite teacher "
               "outputs, 4 store damaged, 130 interrupted (docs/ERRORS.md).")
FORMATTER = argparse.HelpFormatter


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", required=True,
                   help="HF checkpoint directory or gs:// URI (config.json, *.safetensors, tokenizer.json), "
                        "or preset:NAME[@SEED] for a tiny random teacher")
    p.add_argument("--data", required=True,
                   help="JSONL or Parquet file, glob or directory (text, conversations as messages, or "
                        "prompt/completion pairs), or pre-tokenized *.array_record files")
    p.add_argument("--output", required=True, help="store location: local path, file:// or gs:// URI")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"log-probs kept per position: the exact head of --selection hybrid, <= {MAX_HYBRID_K} "
                        f"(default {DEFAULT_TOP_K['hybrid']}), or the ids of --selection topk (default "
                        f"{DEFAULT_TOP_K['topk']}); not used by --selection sampled (its N is --samples)")
    p.add_argument("--selection", choices=["topk", "sampled", "hybrid"], default=DEFAULT_SELECTION,
                   help="hybrid (default): the exact top-k head + tail mass plus --samples N systematic draws from "
                        "the rest of the distribution (unbiased, noise in the tail only); its defaults matched "
                        "top-64 + tail in held-out KL at 36.5 bytes per position against 213 "
                        "(docs/BENCHMARKS.md, fidelity); topk: the k most likely ids + tail mass; sampled: "
                        "--samples N draws per position from the teacher, stored as distinct ids + counts + "
                        "log-probs (unbiased)")
    p.add_argument("--samples", type=int, default=None,
                   help=f"--selection hybrid: draws from the tail per position (default "
                        f"{DEFAULT_SAMPLES['hybrid']}); --selection sampled: draws per position, with replacement, "
                        "required (e.g. 32: no sampled setting has a measured default)")
    p.add_argument("--proposal-temperature", type=positive_float, default=1.0,
                   help="--selection sampled or hybrid: draw from softmax(logits / t) (default 1: the teacher "
                        "itself); a store drawn at t trains at --temperature t")
    p.add_argument("--tail-temperatures", type=temperatures, default=(),
                   help="--selection topk: comma-separated temperatures T1,T2 at which the tail mass of the "
                        "tempered teacher is also stored, for topk_tail_kl at T != 1 (e.g. 2,4)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per example (default 512)")
    p.add_argument("--batch-size", type=int, default=8, help="examples per step across all processes (default 8)")
    p.add_argument("--num-steps", type=int, default=None, help="steps to dump (default: every full batch of the data)")
    p.add_argument("--steps-per-file", type=int, default=50,
                   help="steps per chunk file: the most work a kill can lose (default 50)")
    p.add_argument("--codec", choices=["default", "exact"], default="default",
                   help="default: bit-packed ids + 16-bit fixed-point log-probs (error <= 4.9e-4); "
                        "exact: float32 + int32")
    p.add_argument("--seed", type=int, default=0, help="seed of the document order (default 0)")
    p.add_argument("--no-packing", dest="packing", action="store_false",
                   help="one document per example, padded, instead of packing documents to --seq-len")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="teacher weights and compute dtype (selection is always float32)")
    p.add_argument("--text-field", default="text", help="field holding the text of text records (default text)")
    p.add_argument("--tokenizer", default=None, help="directory or file of tokenizer.json (default: the teacher's)")
    p.add_argument("--sharding", choices=["replicate", "fsdp", "tensor", "fsdp+tensor", "expert", "fsdp+expert"],
                   default="replicate",
                   help="teacher parameters: replicated on every device; fsdp (split over the data axis); "
                        "tensor (heads and MLP columns split over a model axis, a mixture's experts too); "
                        "fsdp+tensor (both); expert (a mixture's experts split over the model axis, the rest "
                        "replicated); fsdp+expert (experts over the model axis, the rest fsdp)")
    p.add_argument("--model-parallel", type=int, default=None,
                   help="devices of the model axis with --sharding tensor/fsdp+tensor/expert/fsdp+expert "
                        "(default: all the devices of one host); the rest of the devices split the batch")
    p.add_argument("--attention", choices=["auto", "dense", "blocked", "pallas_gpu", "pallas_tpu"], default="auto",
                   help="attention implementation (default auto: the Pallas flash kernel on GPU, splash "
                        "attention on TPU (both with --sharding replicate), blocked for sequences over 256 "
                        "tokens, dense otherwise); all agree to float rounding")
    p.add_argument("--device-batch", type=int, default=None,
                   help="examples per kernel on each device with --sharding replicate (default: 1 on CPU, "
                        "8 on accelerators, lowered to divide the device's rows); fix it for identical "
                        "bytes across device counts")
    p.add_argument("--vocab-chunk", type=int, default=None,
                   help="vocabulary entries per chunk of the output head and selection, top-k, sampled or hybrid "
                        "(default 32768): memory of one chunk instead of the whole vocabulary")
    p.add_argument("--array-record-options", default=DEFAULT_ARRAY_RECORD_OPTIONS,
                   help="ArrayRecord writer options, e.g. 'group_size:1,zstd:3' (default uncompressed)")
    p.add_argument("--force-takeover", action="store_true",
                   help="take over the store's lease when it is stale (its dump stopped refreshing it for "
                        "longer than its timeout, e.g. on a machine that is gone)")
    p.add_argument("--lease-timeout", type=positive_float, default=DEFAULT_LEASE_TIMEOUT_S,
                   help="seconds without a refresh after which this dump's lease counts as stale; it is "
                        f"refreshed every quarter of it (default {DEFAULT_LEASE_TIMEOUT_S:.0f})")
    add_chat_arguments(p, applies_to="--data")
    add_output_arguments(p)


def temperatures(text: str) -> tuple:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"temperatures must be finite and > 0, got {text!r}")
    return values


def config_from_args(args: argparse.Namespace):
    from ..data import ChatOptions
    from ..dump import DumpConfig

    return DumpConfig(
        teacher=args.teacher, data=args.data, output=args.output, top_k=args.top_k, seq_len=args.seq_len,
        batch_size=args.batch_size, num_steps=args.num_steps, steps_per_file=args.steps_per_file, codec=args.codec,
        seed=args.seed, packing=args.packing, dtype=args.dtype, text_field=args.text_field,
        chat=chat_options(args) or ChatOptions(), tokenizer=args.tokenizer,
        selection=args.selection, samples=args.samples, proposal_temperature=args.proposal_temperature,
        tail_temperatures=args.tail_temperatures, array_record_options=args.array_record_options,
        sharding=args.sharding, model_parallel=args.model_parallel, attention=args.attention,
        device_batch=args.device_batch, vocab_chunk=args.vocab_chunk, progress=args.progress,
        force_takeover=args.force_takeover, lease_timeout_s=args.lease_timeout,
    )


def run(args: argparse.Namespace) -> int:
    import jax

    from ..dump import run_dump

    result = run_dump(config_from_args(args).check())
    if jax.process_index() == 0:
        print(f"logit-distill dump: {result.summary()}", file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(dataclasses.asdict(result), indent=2, sort_keys=True))
    return 0 if result.complete else 1
