"""``logit-distill COMMAND``: the command line. The library never imports this package.

  main      ``main(argv)``: the entry point; parsing, logging, the one-line failure (docs/ERRORS.md)
  parser    ``OneLineParser``: argument errors as one line, no abbreviations
  flags     argument types (finite floats, ranges)
  dump, verify, train, preset
            one module per command: ``add_arguments(parser)``, ``config_from_args(args)`` (explicit,
            flag by flag) and ``run(args) -> exit status``
"""

from .main import main

__all__ = ["main"]
