"""Policies without prediction: every miss loads on demand (DeepSpeed-Inference-like), plus `resident`.

`on_demand_lru` evicts the least recently used expert, `on_demand_lfu` the least frequently used one;
`resident` keeps every expert on the device (the no-offload reference served by the same engine).
"""

from __future__ import annotations

import numpy as np

from ..cache import Entry, Key
from .base import Policy


class OnDemandLRU(Policy):
    """No prefetch; evicts the least recently used expert. With hybrid execution, an expert the host computed
    is copied in the background (`host_fill`), so that the cache still holds the most recently used."""

    name = "on_demand_lru"
    host_fill = True


class OnDemandLFU(Policy):
    """No prefetch; evicts the expert with the fewest uses so far (ties: least recently used)."""

    name = "on_demand_lfu"

    def keep_score(self, key: Key, entry: Entry) -> float:
        return float(self.cache.freq(key))

    def keep_scores(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """`keep_score` of many experts at once (the same floats)."""
        freq = self.cache.freq
        pairs = zip(layers.tolist(), experts.tolist(), strict=True)
        return np.fromiter((freq(key) for key in pairs), np.float64, len(layers))


class Resident(Policy):
    """Every expert on the device from the start; nothing is ever loaded or evicted."""

    name = "resident"
    preload_all = True
