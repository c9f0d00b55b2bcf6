"""The resident engine: every weight on the device, one jitted program per prefill and per decode step.

`fmoe_jax.generate` drives it through `step` (prefill when T > 1, decode when T = 1), as it drives the
offload engine (`engines/offload.py`); the programs are the model's own (`engines/programs.py`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import jax

from fmoe_jax.models import LayerKV, Layout, MoECausalLM, init_kv_cache
from fmoe_jax.models.moe import Kernel

from ..sampling import Sampling
from . import StepOutput
from .programs import Programs, forward_inputs, full_forward, split, whole_step


class ResidentEngine:
    """Runs the whole model in one jitted program per call."""

    def __init__(self, module: MoECausalLM, *, kernel: Kernel = "auto", programs: Programs | None = None):
        self.module = module
        self.config = module.config
        self.kernel = kernel
        self.programs = programs if programs is not None else Programs()
        self.graph, self.params = split(module)
        self._step = whole_step(self.programs, self.graph, kernel)
        self._forward = full_forward(self.programs, self.graph, kernel)
        self._host_s: list[float] = []  # per step since `begin`: seconds to launch it

    def init_cache(self, batch: int, length: int) -> list[LayerKV]:
        return init_kv_cache(self.config, batch, length, self.module.dtype)

    def begin(self, batch: int) -> None:
        """A resident model has no expert cache: only its steps are counted."""
        self._host_s = []

    def finish(self, stats: Any) -> None:
        """Each step was one launch and one read of its tokens (by the generation loop); the offload
        statistics keep their resident values (hit rate 1, no copies)."""
        stats.step_launches = [1] * len(self._host_s)
        stats.step_syncs = [1] * len(self._host_s)
        stats.step_host_s = list(self._host_s)

    def close(self) -> None:
        """Nothing runs in the background."""

    def paused_learning(self) -> contextlib.AbstractContextManager[None]:
        """Nothing learns from requests here."""
        return contextlib.nullcontext()

    def step(
        self,
        tokens: Any,
        cache: list[LayerKV],
        layout: Layout,
        key: Any,
        sampling: Sampling,
        record: bool = False,
        record_hidden: bool = False,
        requests: Any = None,
    ) -> tuple[StepOutput, list[LayerKV]]:
        """Runs prefill (T > 1) or one decode step (T = 1) and samples the next token of each row (`requests`
        is for the offload engine's policy)."""
        start = time.perf_counter()
        next_tokens, logits, cache, recorded = self._step(
            self.params, tokens, cache, layout, key, sampling, record, record and record_hidden
        )
        self._host_s.append(time.perf_counter() - start)
        return StepOutput(next_tokens, logits, recorded), cache

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, list]:
        """Full-sequence logits `[B, T, V]` and routings of unpadded tokens `[B, T]`, no sampling or cache."""
        cache, layout = forward_inputs(self.config, tokens, self.module.dtype)
        logits, routings, _ = self._forward(self.params, tokens, cache, layout)
        return logits, routings
