"""A llama.cpp-style static split as a policy of this runtime: the experts of whole layers live on the device,
every other layer's experts on the host, where hybrid execution computes them. Source: llama.cpp's
`--n-cpu-moe N` and `--override-tensor` options (ggml-org/llama.cpp, `common/arg.cpp`), which place each
layer's expert tensors on the CPU or the GPU before serving.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from ..cache import CacheView, Entry, Key
from ..events import LayerRouted
from .base import Policy, PolicyContext
from .fiddler import restore_placement


class StaticSplit(Policy):
    """N = capacity // J whole MoE layers' experts are placed on the device before serving and never move;
    nothing is prefetched, and an expert the host computes is not copied afterwards (`host_fill` off).

    Whole layers, as llama.cpp places them (a layer's experts are one tensor there). Which layers: the first N
    (`device_layers="first"`, as DESIGN.md describes the baseline) or the last N (`"last"`: llama.cpp's
    `--n-cpu-moe N` keeps the experts of the *first* N layers on the CPU, which with N filling the budget
    leaves the last ones on the GPU). Slots left over take the copies the hybrid planner chooses (prefill;
    llama.cpp likewise copies CPU-resident expert weights to the GPU for large batches) and are evicted before
    any placed expert; a placed expert evicted all the same (no slot left over) is copied back in the
    background. With `execution="copy"` every other expert loads on demand into those slots.

    Args:
      device_layers: "first" or "last" (see above).
    """

    name = "static_split"
    host_fill = False
    fill_free_slots = False

    def __init__(self, device_layers: Literal["first", "last"] = "first"):
        if device_layers not in ("first", "last"):
            raise ValueError(f"device_layers must be 'first' or 'last', got {device_layers!r}")
        self.device_layers = device_layers
        self.placed: list[Key] = []

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        super().bind(ctx, cache)
        n = min(ctx.capacity // ctx.num_experts, ctx.num_layers)
        layers = range(n) if self.device_layers == "first" else range(ctx.num_layers - n, ctx.num_layers)
        self.placed = [(m, e) for m in layers for e in range(ctx.num_experts)]
        self._placed = set(self.placed)

    def initial_experts(self) -> list[Key]:
        return list(self.placed)

    def on_layer_routed(self, event: LayerRouted) -> None:
        restore_placement(self, self.placed)

    def keep_score(self, key: Key, entry: Entry) -> float:
        return float(entry.last_use) if key in self._placed else -math.inf

    def stats(self) -> dict[str, Any]:
        return {"placed_experts": len(self.placed), "device_layers": len(self.placed) // self.ctx.num_experts}
