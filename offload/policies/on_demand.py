"""Policies without prediction: every miss loads on demand (DeepSpeed-Inference-like), plus `resident`.

`on_demand_lru` evicts the least recently used expert, `on_demand_lfu` the least frequently used one;
`resident` keeps every expert on the device (the no-offload reference served by the same engine).
"""

from __future__ import annotations

from ..cache import Entry, Key
from .base import Policy


class OnDemandLRU(Policy):
    """No prefetch; evicts the least recently used expert."""

    name = "on_demand_lru"


class OnDemandLFU(Policy):
    """No prefetch; evicts the expert with the fewest uses so far (ties: least recently used)."""

    name = "on_demand_lfu"

    def keep_score(self, key: Key, entry: Entry) -> float:
        return float(self.cache.freq(key))


class Resident(Policy):
    """Every expert on the device from the start; nothing is ever loaded or evicted."""

    name = "resident"
    preload_all = True
