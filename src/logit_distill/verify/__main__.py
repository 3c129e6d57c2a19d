"""``python -m logit_distill.verify --store URI ...`` (the same as ``logit-distill verify``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
