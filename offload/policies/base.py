"""The policy interface every offloading policy implements, driven by the engine's event stream.

Events (same order in the live engine and the simulator): request start, iteration start (semantic
context), layer routed (trajectory context), iteration end. A policy answers with prefetch requests
(`self.cache.request_prefetch`) and with the eviction order (`keep_score`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..cache import Entry, Key


@dataclasses.dataclass(frozen=True)
class PolicyContext:
    """What a policy learns about the model and the cache when the engine starts it."""

    num_layers: int  # MoE layers (an expert map has this many rows); "layer" in policies means MoE layer
    num_experts: int  # J
    top_k: int
    embed_dim: int  # H, width of the semantic context
    prefetch_distance: int  # d
    capacity: int  # cache slots (all devices together)
    model_id: str = ""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Router kernels `[D, J]` float32 of each MoE layer, for policies that `needs_hidden` (speculation).
    router_weights: tuple[np.ndarray, ...] = ()
    # Cost hints for a policy that weighs a prefetch against the link time it takes (fmoe's admission):
    # seconds to copy one expert to the device, and to compute one MoE layer of a decode step. The
    # simulator passes its cost model's; the live engine leaves them None (such a policy measures them).
    copy_s: float | None = None
    layer_s: float | None = None


class Policy:
    """Base policy: on-demand loading only, least-recently-used eviction.

    Subclasses override the hooks they need. Hooks run on the engine thread, so anything slow belongs on
    a thread of the policy's own (see `fmoe`). Arrays passed to hooks are host NumPy arrays the policy may
    keep.
    """

    name = "base"
    needs_semantic = False  # the engine copies the embeddings to the host only for policies that use them
    needs_probs = False  # likewise for the full router probabilities (ids are always given)
    needs_hidden = False  # likewise for each MoE layer's router input (speculative / learned predictors)
    preload_all = False  # the cache starts with every expert (the resident policy)

    def bind(self, ctx: PolicyContext, cache: Any) -> None:
        self.ctx = ctx
        self.cache = cache
        if "timers" not in vars(self):  # seconds by stage ("matching", ...), added to out.stats.overhead_s
            self.timers: dict[str, float] = {}

    def on_request_start(self, batch: int) -> None:
        """A new batch of requests begins (a `generate` call)."""

    def on_iteration_start(self, embeds: np.ndarray | None, valid: np.ndarray) -> None:
        """An iteration over N = B * T new tokens starts: embeds `[N, H]` float32 (the semantic context;
        None unless `needs_semantic`), valid `[B, T]` (False for padding and finished rows)."""

    def on_layer_routed(
        self,
        layer: int,
        probs: np.ndarray | None,
        ids: np.ndarray,
        valid: np.ndarray,
        *,
        hidden: np.ndarray | None = None,
    ) -> None:
        """MoE layer `layer` has routed (the trajectory context): probs `[N, J]` float32 (None unless
        `needs_probs`), ids `[N, k]`, valid `[B, T]`, hidden `[N, D]` float32, the router's input (None
        unless `needs_hidden`)."""

    def on_iteration_end(self) -> None:
        """Every layer of the iteration has run."""

    def keep_score(self, key: Key, entry: Entry) -> float:
        """Eviction order: the lowest score is evicted first."""
        return float(entry.last_use)

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        """Policy-specific statistics merged into `out.stats.extra`."""
        return {}

    def close(self) -> None:
        """Stops threads and saves state; the engine calls it once."""
