"""`python -m fmoe_jax.serve MODEL ...`: the same as `fmoe-serve` (see `fmoe_jax.serve.cli`)."""

from .cli import main

main()
