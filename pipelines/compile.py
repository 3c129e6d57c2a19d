"""Compile the pipelines to ``compiled/*.yaml`` (``make compile``).

    python -m pipelines.compile [--image URI] [--dump-replicas N] [--train-replicas N] [--out-dir DIR]

The image is a compile option (pinned by tag or digest; default
``components.image.DEFAULT_IMAGE``, which ``pipelines.submit --image`` replaces).
With the defaults the output is byte-for-byte what is checked in.
"""

import argparse
import os
import sys

OUTPUTS = {"local": "logit_distill_pipeline.yaml", "vertex": "logit_distill_pipeline_vertex.yaml"}


def compile_all(out_dir: str, image: str | None = None, dump_replicas: int = 1, train_replicas: int = 1) -> dict:
    """Write both pipelines into ``out_dir``; return ``{variant: path}``."""
    from kfp import compiler

    from components.image import DEFAULT_IMAGE
    from pipelines.pipeline import build_pipelines

    pipes = build_pipelines(image or DEFAULT_IMAGE, dump_replicas=dump_replicas, train_replicas=train_replicas)
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    for variant, name in OUTPUTS.items():
        path = os.path.join(out_dir, name)
        compiler.Compiler().compile(pipes[variant], path)
        written[variant] = path
    return written


def main(argv=None) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(prog="python -m pipelines.compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=os.path.join(here, "compiled"))
    ap.add_argument("--image", default=None, help="component image, pinned (name:TAG or name@sha256:...)")
    ap.add_argument("--dump-replicas", type=int, default=1, help="hosts of the Vertex dump job (multi-host)")
    ap.add_argument("--train-replicas", type=int, default=1, help="hosts of the Vertex training job")
    args = ap.parse_args(argv)
    try:
        written = compile_all(args.out_dir, args.image, args.dump_replicas, args.train_replicas)
    except ValueError as e:
        print(f"compile: error: {e}", file=sys.stderr)
        return 2
    for path in written.values():
        print(f"wrote {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
