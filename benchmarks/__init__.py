"""Benchmarks and the paper's experiments (see README.md here).

fmoe_jax is imported first so that its XLA settings (bit-exact bfloat16 rounding, see `fmoe_jax/__init__.py`)
are in place before any script starts a JAX backend.
"""

import fmoe_jax  # noqa: F401
