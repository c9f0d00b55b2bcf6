"""Imports flow one way (DESIGN.md, "Layout"): `models` <- `offload` <- `fmoe_jax` (the public layer) ->
`convert` (the conversion CLI builds on the loading code, which never imports it back), and nothing that
serves imports `research/`.

Each serving module is imported in a fresh interpreter, one after another, and what each import adds to
`sys.modules` is checked; models and offload are imported under a bare `fmoe_jax` package (its public
`__init__` not run), so that what they pull in is their own doing. Imports inside functions (lazy ones) do
not show at import time: the source's import statements are checked too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Serving folders and the package each one is: the public layer and its subpackages.
FOLDERS = {
    "fmoe_jax": "fmoe_jax",
    "models": "fmoe_jax.models",
    "offload": "fmoe_jax.offload",
    "convert": "fmoe_jax.convert",
}
# What each layer may import of the project (`fmoe_jax` and its subpackages; `research` never).
ALLOWED = {
    "fmoe_jax.models": ("fmoe_jax.models",),
    "fmoe_jax.offload": ("fmoe_jax.models", "fmoe_jax.offload"),
}


def serving_modules() -> dict[str, Path]:
    """Module name -> file, for every module of the serving folders (CLI entry points left out: importing
    one runs it)."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__main__":
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def layer_of(module: str) -> str:
    """The layer a project module belongs to: `fmoe_jax.models`, `fmoe_jax.offload`, `fmoe_jax.convert`,
    `fmoe_jax.research`, or the public layer `fmoe_jax`."""
    for package in (*FOLDERS.values(), "fmoe_jax.research"):
        if package != "fmoe_jax" and (module == package or module.startswith(package + ".")):
            return package
    return "fmoe_jax"


def breaks_layering(importer: str, imported: str) -> bool:
    """Whether `importer` may not import `imported` (both project modules)."""
    source, target = layer_of(importer), layer_of(imported)
    if target == "fmoe_jax.research":
        return True
    allowed = ALLOWED.get(source)
    return allowed is not None and target not in allowed


# Imports each module given on argv in turn and prints, per module, the project modules its import added.
_PROBE = r"""
import importlib, importlib.util, json, sys, types
bare = sys.argv[1] == "bare"
if bare:  # the package without its public __init__: subpackages alone
    spec = importlib.util.find_spec("fmoe_jax")
    package = types.ModuleType("fmoe_jax")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["fmoe_jax"] = package
out = {}
for name in sys.argv[2:]:
    before = set(sys.modules)
    importlib.import_module(name)
    out[name] = sorted(m for m in set(sys.modules) - before if m == "fmoe_jax" or m.startswith("fmoe_jax."))
print(json.dumps(out))
"""


def imported_at_import_time(bare: bool, names: list[str]) -> dict[str, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, "bare" if bare else "full", *names],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bare", [True, False], ids=["models and offload", "public layer and convert"])
def test_each_serving_module_imports_only_the_layers_below_it(bare):
    modules = serving_modules()
    lower = ("fmoe_jax.models", "fmoe_jax.offload")
    names = [name for name in modules if (layer_of(name) in lower) == bare]
    added = imported_at_import_time(bare, names)
    assert set(added) == set(names)
    wrong = {
        name: [m for m in new if breaks_layering(name, m) or (bare and layer_of(m) not in lower)]
        for name, new in added.items()
    }
    assert not {name: bad for name, bad in wrong.items() if bad}
    assert not any(m.startswith("fmoe_jax.research") for new in added.values() for m in new)


def imports_in(source: str, module: str, *, package: bool = False) -> list[str]:
    """Every module an import statement of `module`'s `source` names (inside functions too), relative
    imports resolved (`package`: the source is a package's `__init__`)."""
    anchor = module if package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = anchor.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return found


def test_no_serving_source_imports_research_or_reaches_up():
    """Lazy imports included: `research/` never, and `models` and `offload` nothing above them."""
    wrong = []
    for module, path in serving_modules().items():
        for name in imports_in(path.read_text(), module, package=path.name == "__init__.py"):
            if name.split(".")[0] == "fmoe_jax" and breaks_layering(module, name):
                wrong.append(f"{module} imports {name}")
    assert not wrong


def test_the_layering_check_can_fail():
    assert breaks_layering("fmoe_jax.offload.simulator", "fmoe_jax.trace")
    assert breaks_layering("fmoe_jax.offload.policies.fmoe.policy", "fmoe_jax.research.predictor_training")
    assert breaks_layering("fmoe_jax.generation", "fmoe_jax.research")
    assert breaks_layering("fmoe_jax.models.mixtral", "fmoe_jax.offload.cache")
    assert not breaks_layering("fmoe_jax.offload.trace", "fmoe_jax.models")
    assert not breaks_layering("fmoe_jax.engines.offload", "fmoe_jax.offload.cache")
    source = "from ...predictor_training import train_reuse\ndef f():\n    from fmoe_jax import research\n"
    found = imports_in(source, "fmoe_jax.offload.policies.fmoe.policy")
    assert "fmoe_jax.offload.predictor_training" in found and "fmoe_jax.research" in found
    assert "fmoe_jax.offload.cache" in imports_in("from .cache import Key", "fmoe_jax.offload", package=True)


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
