"""Fiddler as a policy of this runtime: the most popular experts stay on the device, every other expert is
computed on the host by hybrid execution. Kamahori et al. 2024, "Fiddler: CPU-GPU Orchestration for Fast
Inference of Mixture-of-Experts Models" (arXiv 2402.07033); code: efeslab/fiddler, `src/fiddler/mixtral.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cache import CacheView, Entry, Key
from ..events import LayerRouted
from .base import Policy, PolicyContext


def expert_usage(traces: Sequence[Any]) -> np.ndarray:
    """`[L, J]` float64: how many valid tokens each expert served in recorded `RoutingTrace`s (prefill and
    decode), the profile Fiddler ranks experts by."""
    traces = list(traces)
    meta = traces[0].meta
    counts = np.zeros((int(meta["num_layers"]), int(meta["num_experts"])), np.float64)
    for trace in traces:
        for request in trace.requests:
            for it in request.iterations:
                ids = np.asarray(it.ids)  # [t, L, k]
                for layer in range(counts.shape[0]):
                    np.add.at(counts[layer], ids[:, layer].ravel(), 1.0)
    return counts


def restore_placement(policy: Policy, placed: Sequence[Key]) -> None:
    """Asks for background copies of placed experts that a copy chosen by the hybrid planner (or a miss, with
    `execution="copy"`) evicted, so that a fixed placement comes back once the link is free."""
    missing = [key for key in placed if policy.cache.entry(key) is None]
    if missing:
        policy.cache.request_prefetch([(key, 0.0) for key in missing], replace=False)


class Fiddler(Policy):
    """The experts most used in a profile of earlier requests are placed on the device before serving; nothing
    is prefetched, and an expert the host computes is not copied afterwards (`host_fill` off).

    Fiddler decides per missed expert between the CPU (tokens x 7 ms) and a copy into a placeholder on the GPU
    (70 ms): the hybrid planner's comparison, with measured costs, so serve it with
    `OffloadConfig(execution="hybrid")`. With `execution="copy"` it is Fiddler's all-GPU baseline
    (`cpu_offload=0`): every miss loads into the placeholder.

    The placeholder (Fiddler's `expert_placeholder`): with more than one slot, one slot of the budget stays
    free for the copies the planner chooses (prefill); such a copy is evicted before any placed expert. A
    placed expert evicted all the same (a budget of one slot, a layer copying several) is copied back in the
    background.

    Args:
      popularity: `[L, J]` uses of each expert in earlier requests (`from_traces` counts the tokens routed to
        each in recorded traces, `expert_usage`); None: experts placed in (layer, expert) order.
    """

    name = "fiddler"
    host_fill = False
    fill_free_slots = False

    def __init__(self, popularity: Any = None):
        self.popularity = None if popularity is None else np.asarray(popularity, np.float64)
        if self.popularity is not None and self.popularity.ndim != 2:
            raise ValueError(f"popularity must be [L, J] counts, got shape {self.popularity.shape}")
        self.placed: list[Key] = []
        self.rank: dict[Key, float] = {}

    @classmethod
    def from_traces(
        cls, traces: Sequence[Any], *, prefetch_distance: int, store_capacity: int, **options: Any
    ) -> Fiddler:
        """Profiles the experts' popularity in recorded traces (those of other requests)."""
        traces = list(traces)
        if traces and "popularity" not in options:
            options["popularity"] = expert_usage(traces)
        return cls(**options)

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        super().bind(ctx, cache)
        shape = (ctx.num_layers, ctx.num_experts)
        popularity = self.popularity if self.popularity is not None else np.zeros(shape)
        if popularity.shape != shape:
            raise ValueError(
                f"fiddler's popularity profile is {popularity.shape} but the model has {shape} (MoE layers, "
                "experts): profile requests of this model"
            )
        order = sorted(np.ndindex(*shape), key=lambda key: (-popularity[key], key))
        self.placed = [(int(m), int(e)) for m, e in order[: ctx.capacity - 1 if ctx.capacity > 1 else 1]]
        self.rank = {key: float(len(self.placed) - i) for i, key in enumerate(self.placed)}

    def initial_experts(self) -> list[Key]:
        return list(self.placed)

    def on_layer_routed(self, event: LayerRouted) -> None:
        restore_placement(self, self.placed)

    def keep_score(self, key: Key, entry: Entry) -> float:
        """Placed experts by popularity (the least popular goes first if one must); anything else first."""
        return self.rank.get(key, -math.inf)

    def stats(self) -> dict[str, Any]:
        return {"placed_experts": len(self.placed)}
