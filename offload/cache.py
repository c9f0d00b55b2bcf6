"""Bookkeeping of the device expert cache: which experts are held, loading or pinned, and the statistics.

Plain Python (no JAX), so it is testable on its own; `offload/transfer.py` moves the weights and the engine
(`fmoe_jax/engine.py`) asks it for hits. Keys are `(layer, expert)` with `layer` the MoE-layer index.

Definitions (also in the README):
- hit: a needed expert that was fully resident when its layer asked for it;
- miss: any other needed expert, loaded on demand; a *late prefetch* is a miss whose prefetch was already
  in flight (the layer waits for it) and is counted in both `misses` and `late_prefetches`;
- wasted prefetch: an expert fetched by a prefetch and evicted without ever being used.
Each (iteration, layer, expert) counts once, however many tokens route to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

Key = tuple[int, int]  # (moe layer, expert)


@dataclasses.dataclass
class Entry:
    ready: bool = False  # the copy has completed
    prefetched: bool = False  # brought in by a prefetch (not on demand)
    used: bool = False  # served a layer since it arrived
    pins: int = 0  # > 0 while a layer computes with it, or waits for it
    last_use: int = 0  # logical clock of the last use (LRU)
    arrived: int = 0  # logical clock of arrival


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    late_prefetches: int = 0
    prefetches: int = 0
    wasted_prefetches: int = 0
    dropped_prefetches: int = 0  # requested, never started (no longer wanted, or no room)
    loads: int = 0
    bytes_to_device: int = 0
    peak_bytes: int = 0
    layer_hits: dict[int, int] = dataclasses.field(default_factory=dict)
    layer_needed: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


class CacheBook:
    """Slots, pins, eviction choice and statistics for one device's expert cache.

    `capacity` counts experts that are resident *or* arriving (an in-flight copy already holds its memory).
    Frequencies (`freq`) count uses over the cache's whole lifetime, as LFU and fMoE's eviction need.
    """

    def __init__(self, capacity: int, expert_bytes: int):
        if capacity < 1:
            raise ValueError(f"the expert cache needs at least one slot, got capacity={capacity}")
        self.capacity = capacity
        self.expert_bytes = expert_bytes
        self.entries: dict[Key, Entry] = {}
        self.freq: dict[Key, int] = {}
        self.clock = 0
        self.stats = CacheStats()

    # -- state -----------------------------------------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def free_slots(self) -> int:
        return self.capacity - len(self.entries)

    @property
    def held_bytes(self) -> int:
        return len(self.entries) * self.expert_bytes

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # -- transitions -----------------------------------------------------------------------------------
    def add(self, key: Key, *, prefetched: bool) -> Entry:
        if key in self.entries:
            raise KeyError(f"expert {key} is already cached")
        if self.free_slots <= 0:
            raise RuntimeError(f"cache full ({self.capacity} slots): evict before adding {key}")
        now = self.tick()
        entry = Entry(prefetched=prefetched, last_use=now, arrived=now)  # arrival counts as a use for LRU
        self.entries[key] = entry
        self.stats.loads += 1
        self.stats.bytes_to_device += self.expert_bytes
        self.stats.prefetches += int(prefetched)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.held_bytes)
        return entry

    def mark_ready(self, key: Key) -> None:
        self.entries[key].ready = True

    def remove(self, key: Key) -> None:
        entry = self.entries.pop(key)
        if entry.pins:
            raise RuntimeError(f"expert {key} is pinned and cannot be evicted")
        if entry.prefetched and not entry.used:
            self.stats.wasted_prefetches += 1

    def pin(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self.entries[key].pins += 1

    def unpin(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self.entries[key].pins -= 1

    def record_use(self, key: Key) -> None:
        entry = self.entries[key]
        entry.used = True
        entry.last_use = self.tick()
        self.freq[key] = self.freq.get(key, 0) + 1

    def classify(self, layer: int, needed: Iterable[Key]) -> tuple[list[Key], list[Key], list[Key]]:
        """Splits a layer's needed experts into (hits, late prefetches, misses) and counts them."""
        hits, late, misses = [], [], []
        for key in needed:
            entry = self.entries.get(key)
            if entry is None:
                misses.append(key)
            elif entry.ready:
                hits.append(key)
            else:
                late.append(key)
        s = self.stats
        s.hits += len(hits)
        s.misses += len(late) + len(misses)
        s.late_prefetches += len(late)
        s.layer_hits[layer] = s.layer_hits.get(layer, 0) + len(hits)
        s.layer_needed[layer] = s.layer_needed.get(layer, 0) + len(hits) + len(late) + len(misses)
        return hits, late, misses

    def victim(self, keep_score: Callable[[Key, Entry], float], *, protect: Iterable[Key] = ()) -> Key | None:
        """The ready, unpinned expert with the lowest keep score (ties: least recently used), or None."""
        protected = set(protect)
        best, best_score = None, None
        for key, entry in self.entries.items():
            if not entry.ready or entry.pins or key in protected:
                continue
            score = (keep_score(key, entry), entry.last_use, entry.arrived)
            if best_score is None or score < best_score:
                best, best_score = key, score
        return best
