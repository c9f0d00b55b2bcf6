"""Mixtral-Offloading baseline: a per-layer LRU expert cache plus speculative loading of the next layer's
experts (Eliseev & Mazur 2023, "Fast Inference of Mixture-of-Experts Language Models with Offloading",
arXiv:2312.17238, section 3; code: dvmazur/mixtral-offloading, `src/expert_cache.py`).

Built by `make_policy` from `OffloadConfig(policy=MixtralOffload(...))`; the engine and the trace-replay
simulator drive it through the `Policy` hooks. No threads: the same events give the same hits.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import numpy as np

from ..cache import CacheView, Entry, Key
from ..events import IterationStart, LayerRouted
from .base import Policy, PolicyContext


def layer_quotas(capacity: int, num_layers: int) -> list[int]:
    """Slots per MoE layer: an even share of the budget, the remainder to the first layers (which the
    speculation never reaches: layer 0 has no layer before it to guess from)."""
    share, extra = divmod(capacity, num_layers)
    return [share + (1 if layer < extra else 0) for layer in range(num_layers)]


class MixtralOffload(Policy):
    """Per-layer LRU cache and next-layer speculative prefetch, as in Mixtral-Offloading.

    Cache. The original gives every layer a fixed number of device slots (one `EvictionGroupInfo` per
    layer in `ExpertCache`: `offload_per_layer` experts of each layer stay on the host), with LRU inside a
    layer. Our cache has one budget of C slots, so each MoE layer gets a quota (`layer_quotas`: C // L,
    the remainder to the first layers) and an expert arriving for layer m evicts the least recently used
    ready expert of the layer that most exceeds its quota once the newcomer is counted. When every layer
    holds its quota (the steady state) that is layer m's own LRU expert, exactly the original; while the
    cache warms up a layer may borrow slots another layer has not used yet and gives them back, LRU first,
    when that layer needs them (the original starts with every slot filled). With C < L some layers get no
    quota and borrow a slot for their compute. The book's tie-break (least recently used) orders experts
    of equal excess, so `keep_score` is minus the excess of the expert's layer.

    Speculation. After MoE layer l routes, the next MoE layer's router kernel is applied to layer l's
    router input: Mixtral-Offloading applies the next layer's gating function to the current layer's
    hidden states, relying on the residual stream changing little from one layer to the next. The top-k
    of those logits per valid token (the router's own choice for softmax top-k and for sparsemixer at
    inference) are prefetched for layer l + 1, replacing any waiting prefetch. A batch's guesses are
    merged and ranked by summed gate probability, and at most the next layer's quota (at least one) is
    requested: more would evict each other within the layer. The public code implements the cache only
    (its README lists speculative prefetching as future work); the speculation follows the report.

    Args:
      speculate: prefetch the next layer's guessed experts (off: the per-layer LRU cache alone).
      speculative_k: experts guessed per token (default: the model's top-k).
    """

    name = "mixtral_offload"

    @property
    def needs_hidden(self) -> bool:
        """Speculation reads each layer's router input; the cache rule alone reads nothing."""
        return self.speculate

    def __init__(self, *, speculate: bool = True, speculative_k: int | None = None):
        if speculative_k is not None and speculative_k < 1:
            raise ValueError(f"speculative_k must be >= 1 (experts guessed per token), got {speculative_k}")
        self.speculate = speculate
        self.speculative_k = speculative_k
        self.timers = {"speculation": 0.0}
        self.counts: collections.Counter[str] = collections.Counter()
        self._incoming = 0  # the layer whose experts are arriving now (for the quota rule)
        self._guessed: dict[int, set[int]] = {}  # layer -> experts speculated for it this iteration
        self._held: list[int] = []
        self._held_at: tuple[int, int] | None = None

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        super().bind(ctx, cache)
        if self.speculate and len(ctx.router_weights) != ctx.num_layers:
            raise ValueError(
                f"mixtral_offload speculation needs the router kernel of each of the {ctx.num_layers} MoE "
                f"layers (PolicyContext.router_weights), got {len(ctx.router_weights)}; the engine gives "
                "them to policies with needs_hidden=True, or pass speculate=False"
            )
        k = self.speculative_k or ctx.top_k
        if k > ctx.num_experts:
            raise ValueError(f"speculative_k={k} exceeds the {ctx.num_experts} experts of a layer")
        self.quota = layer_quotas(ctx.capacity, ctx.num_layers)

    # -- events ------------------------------------------------------------------------------------------
    def on_iteration_start(self, event: IterationStart) -> None:
        self._guessed.clear()
        self._incoming = 0

    def on_layer_routed(self, event: LayerRouted) -> None:
        layer, rows, hidden = event.layer, event.token_valid, event.hidden  # rows: [N]
        guessed = self._guessed.pop(layer, None)
        if guessed is not None:
            needed = set(event.needed)
            self.counts["needed"] += len(needed)
            self.counts["guessed_needed"] += len(needed & guessed)
            self.counts["guessed"] += len(guessed)
        self._incoming = layer
        target = layer + 1
        if not self.speculate or target >= self.ctx.num_layers or not rows.any():
            return
        if hidden is None:
            raise ValueError(
                "mixtral_offload got no router input (hidden) for layer "
                f"{layer}; the engine passes it to policies with needs_hidden=True"
            )
        start = time.perf_counter()
        logits = hidden[rows] @ self.ctx.router_weights[target]  # [n, J]
        k = self.speculative_k or self.ctx.top_k
        top = np.argsort(-logits, axis=1, kind="stable")[:, :k]  # [n, k]
        gate = np.exp(logits - logits.max(axis=1, keepdims=True))
        gate /= gate.sum(axis=1, keepdims=True)  # softmax [n, J]
        weight = np.zeros(self.ctx.num_experts)
        np.add.at(weight, top, np.take_along_axis(gate, top, axis=1))
        chosen = sorted(np.flatnonzero(weight), key=lambda e: (-weight[e], e))[: max(1, self.quota[target])]
        self._guessed[target] = {int(e) for e in chosen}
        self.timers["speculation"] += time.perf_counter() - start
        self._incoming = target
        try:
            self.cache.request_prefetch([((target, int(e)), float(weight[e])) for e in chosen], replace=True)
        finally:
            self._incoming = layer  # `ensure` of this layer follows: its misses arrive for `layer`

    # -- eviction ----------------------------------------------------------------------------------------
    def _held_per_layer(self) -> list[int]:
        """Experts held (resident or arriving) per layer. Recounted when the cache's contents change:
        every add counts a load and every remove frees a slot, so (loads, free slots) never repeats."""
        stamp = (self.cache.stats.loads, self.cache.free_slots())
        if stamp != self._held_at:
            held = [0] * self.ctx.num_layers
            for (layer, _), _ in self.cache.entries():
                held[layer] += 1
            self._held, self._held_at = held, stamp
        return self._held

    def _excess(self, layer: int, incoming: int) -> int:
        return self._held_per_layer()[layer] + (layer == incoming) - self.quota[layer]

    def keep_score(self, key: Key, entry: Entry) -> float:
        """Minus the excess over quota of the expert's layer (the newcomer counted); ties: LRU."""
        return -float(self._excess(key[0], self._incoming))

    def keep_scores(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """`keep_score` of many experts at once: the same floats, from one count of the layers' holdings."""
        excess = np.asarray(self._held_per_layer()) - np.asarray(self.quota)
        excess[self._incoming] += 1
        return -excess[layers].astype(np.float64)

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        """A speculative expert replaces one of its own layer or of a layer over its quota (a prefetch
        started late, while another layer's experts arrive, must not take a slot of a layer at quota)."""
        return victim[0] == key[0] or self._excess(victim[0], key[0]) > 0

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counts)
        if self.counts["needed"]:
            out["speculation_recall"] = self.counts["guessed_needed"] / self.counts["needed"]
        return out
