"""Imports flow one way: the conversion CLI (`fmoe_jax.convert`) builds on the package's loading code, which
never imports it back."""

from __future__ import annotations

import json
import subprocess
import sys


def test_importing_fmoe_jax_does_not_import_convert():
    """In a fresh interpreter (this one's modules are whatever earlier tests imported)."""
    code = (
        "import json, sys; import fmoe_jax, fmoe_jax.loading, fmoe_jax.checkpoint.orbax_io; "
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('fmoe_jax'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "fmoe_jax.checkpoint.orbax_io" in modules  # the check looks where it should
    assert not [m for m in modules if m == "fmoe_jax.convert" or m.startswith("fmoe_jax.convert.")]
