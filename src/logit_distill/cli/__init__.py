"""``logit-distill COMMAND``: the command line. The library never imports this package.

  main      ``main(argv)``: the entry point; parsing, logging, the one-line failure (docs/ERRORS.md)
  parser    ``OneLineParser``: argument errors as one line, no abbreviations
  flags     argument types (finite floats, ranges)
  dump, verify, train, preset
            one module per command: ``add_arguments(parser)``, ``config_from_args(args)`` (explicit,
            flag by flag) and ``run(args) -> exit status``
"""

try:
    from .main import main
except KeyboardInterrupt:  # Ctrl-C while the command line itself loads, before main() can catch it
    import sys

    _command = next((a for a in sys.argv[1:] if a in ("dump", "verify", "train", "preset")), None)
    print(f"logit-distill{' ' + _command if _command else ''}: interrupted (Ctrl-C) while starting; "
          "nothing was written", file=sys.stderr, flush=True)
    raise SystemExit(130) from None

__all__ = ["main"]
