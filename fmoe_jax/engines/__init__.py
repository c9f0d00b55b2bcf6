"""Engines: what runs a model's steps for `generate` and `forward`.

`ResidentEngine` (`engines/resident.py`) keeps every weight on the device and runs each step as one
program; `OffloadEngine` (`engines/offload.py`) keeps routed experts in host memory and runs the layers one
by one through the iteration driver. Both implement `Engine`; their compiled programs belong to them
(`engines/programs.py`), and `engines/devices.py` holds what one device and several differ in.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from fmoe_jax.models import ForcedRouting, LayerKV, Layout, Routing

from ..sampling import Sampling
from .programs import Programs, Recorded


class StepOutput:
    """What one engine step returns to the generation loop."""

    __slots__ = ("tokens", "logits", "recorded")

    def __init__(self, tokens: Any, logits: Any, recorded: Recorded | None = None):
        self.tokens = tokens  # [B] int32, sampled next tokens
        self.logits = logits  # [B, V] float32, logits of the last position
        self.recorded = recorded  # the step's routing, when asked to record it


class ForcedStep(NamedTuple):
    """One step's recorded routing that the engine uses instead of its routers' choices (`generate(...,
    forced_routing=trace)`), and the semantic context an offload policy hears instead of the step's own
    embedding (None: the step's own), so that it hears what the simulator gives it for the same trace."""

    routing: ForcedRouting  # [N, L, k] ids and weights, [N, L, J] probs or None (host arrays)
    embeds: np.ndarray | None  # [N, D] float32


class Engine(Protocol):
    """The interface `fmoe_jax.generate` and `fmoe_jax.forward` drive."""

    programs: Programs  # the engine's compiled programs, their compilations and compile time

    def init_cache(self, batch: int, length: int) -> list[LayerKV]:
        """A fresh per-request cache: per layer a KV cache `[B, S, ...]`, or a linear-attention layer's state
        (`models.init_kv_cache`)."""

    def begin(self, batch: int) -> None:
        """A `generate` call over `batch` rows starts (statistics count from here)."""

    def step(
        self,
        tokens: Any,
        kv: list[LayerKV],
        layout: Layout,
        key: Any,
        sampling: Sampling,
        record: bool = False,
        record_hidden: bool = False,
        requests: Any = None,
        forced: ForcedStep | None = None,
    ) -> tuple[StepOutput, list[LayerKV]]:
        """Prefill (T > 1) or one decode step (T = 1) of tokens `[B, T]`. `requests`: each row's request id,
        stable across steps, when rows change requests between `begin`s (continuous batching). `forced`:
        routing every MoE layer takes instead of its router's choice (`generate(..., forced_routing=...)`)."""

    def finish(self, stats: Any) -> None:
        """The call is over: fill the engine's statistics into `stats` (a `GenerationStats`)."""

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, list[Routing]]:
        """Full-sequence logits `[B, T, V]` float32 and each MoE layer's routing, no sampling or cache."""

    def close(self) -> None:
        """Stops background work and saves state (once)."""

    def paused_learning(self) -> contextlib.AbstractContextManager[None]:
        """While it is entered, requests teach the engine's expert policy nothing it keeps (a warm-up's
        random tokens); `Policy.paused_learning`."""


__all__ = ["Engine", "ForcedStep", "Programs", "Recorded", "StepOutput"]
