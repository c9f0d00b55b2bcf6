"""`python -m fmoe_jax.convert`: the same command as the `fmoe-convert` console script (see `cli.py`)."""

import sys

from .cli import main

sys.exit(main())
