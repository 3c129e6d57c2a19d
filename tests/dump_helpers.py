"""Shared set-up of the dump tests: a tiny teacher checkpoint and a JSONL corpus."""

import json
import os
import subprocess
import sys

from logit_distill.models import materialize_preset

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma tau upsilon phi chi psi omega").split()


def write_corpus(path, num_docs=120, seed=0):
    import random

    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(num_docs):
            n = rng.randint(3, 40)
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(n))}) + "\n")
    return str(path)


def teacher_dir(root, preset="tiny-qwen3", seed=0):
    out = os.path.join(str(root), f"{preset}-{seed}")
    if not os.path.exists(os.path.join(out, "config.json")):
        materialize_preset(preset, out, seed=seed)
    return out


def cli(*args, env=None, timeout=600):
    """Run ``logit-distill`` in a subprocess; return the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "logit_distill.cli", *args], capture_output=True,
                          text=True, env=env or os.environ.copy(), timeout=timeout)


def dump_args(teacher, data, output, **overrides):
    opts = {"selection": "topk", "top-k": 8, "seq-len": 32, "batch-size": 4, "num-steps": 12, "steps-per-file": 2}
    opts.update({k.replace("_", "-"): v for k, v in overrides.items()})
    args = ["dump", "--teacher", teacher, "--data", data, "--output", output, "--quiet"]
    for key, value in opts.items():
        if value is True:
            args.append(f"--{key}")
        elif value is not None and value is not False:
            args += [f"--{key}", str(value)]
    return args


def store_files(uri):
    from logit_distill import paths

    return {f["name"]: paths.read_bytes(paths.join(uri, f["name"])) for f in paths.list_files(uri)}


def chunk_bytes(uri):
    return {k: v for k, v in store_files(uri).items() if k.startswith("chunk-")}
