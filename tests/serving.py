"""A loaded model's weights and compiled programs behind a fresh offload engine: the tests that serve many
policies and budgets load a model once and compile each of its programs once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fmoe_jax.offload.config import OffloadConfig

import fmoe_jax as fj
from fmoe_jax.engines.offload import OffloadEngine


def served(base: fj.Model, offload: OffloadConfig, **engine_options: Any) -> fj.Model:
    """`base` (loaded with any offload config, and closed or not) served by a new offload engine for
    `offload` (`engine_options`: `OffloadEngine`'s others, e.g. `host_cost`) over its weights and the
    programs its engine compiled: no reload, nothing compiled twice."""
    engine = OffloadEngine(base.module, offload, programs=base.engine.programs, **engine_options)
    return dataclasses.replace(base, engine=engine, offload=offload)


def loaded_once(load: Callable[[str], fj.Model]) -> Callable[..., fj.Model]:
    """`serve(name, offload=None)`: `load(name)`'s weights and programs, loaded and closed once per name,
    behind a fresh engine for `offload` (`served`); with no `offload`, the closed model (for its config)."""
    bases: dict[str, fj.Model] = {}

    def serve(name: str, offload: OffloadConfig | None = None) -> fj.Model:
        if name not in bases:
            bases[name] = load(name)
            bases[name].close()  # its weights and programs serve on; its own engine does not
        return bases[name] if offload is None else served(bases[name], offload)

    return serve
