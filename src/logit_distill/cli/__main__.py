"""``python -m logit_distill.cli COMMAND ...``: the same as ``logit-distill COMMAND ...``."""

import sys

from .main import main

sys.exit(main())
