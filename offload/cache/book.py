"""Bookkeeping of the device expert cache: which experts are held, loading or pinned, and the statistics.

Plain Python (no JAX), so it is testable on its own; `DeviceExpertCache` (`device.py`) keeps one beside the
weights its mover copies, the iteration driver (`offload/driver.py`) asks it for hits, and policies read it
through `CacheView` (`view.py`). Keys are `(layer, expert)` with `layer` the MoE-layer index.

Definitions (also in the README):
- hit: a needed expert that was fully resident when its layer asked for it;
- miss: any other needed expert, loaded on demand; a *late prefetch* is a miss whose prefetch was already
  in flight (the layer waits for it) and is counted in both `misses` and `late_prefetches`;
- wasted prefetch: an expert fetched by a prefetch and evicted without ever being used;
- host computed (hybrid execution): a miss the host computed from its own copy instead of waiting for a copy
  (counted in `misses` too, and in `late_prefetches` when a prefetch of it was in flight).
Each (iteration, layer, expert) counts once, however many tokens route to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

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
    host_computed: int = 0
    prefetches: int = 0
    wasted_prefetches: int = 0
    dropped_prefetches: int = 0  # requested, never started (no longer wanted, or no room)
    cancelled_prefetches: int = 0  # started, stopped between chunks when no longer wanted
    loads: int = 0
    bytes_to_device: int = 0
    peak_bytes: int = 0
    layer_hits: dict[int, int] = dataclasses.field(default_factory=dict)
    layer_needed: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0

    def layer_hit_rate(self, num_layers: int) -> list[float]:
        rates = []
        for m in range(num_layers):
            needed = self.layer_needed.get(m, 0)
            rates.append(self.layer_hits.get(m, 0) / needed if needed else 1.0)
        return rates

    def copy(self) -> CacheStats:
        return self + CacheStats()

    def __sub__(self, before: CacheStats) -> CacheStats:
        """What was counted since `before` (peak bytes: the peak so far, not a difference)."""
        return self._combine(before, lambda a, b: a - b)

    def __add__(self, other: CacheStats) -> CacheStats:
        """Totals of two caches (several devices); peak bytes add up (each device's own peak)."""
        return self._combine(other, lambda a, b: a + b, add_peak=True)

    def _combine(self, other: CacheStats, op, *, add_peak: bool = False) -> CacheStats:
        out = CacheStats()
        for field in dataclasses.fields(self):
            a, b = getattr(self, field.name), getattr(other, field.name)
            if isinstance(a, dict):
                value = {k: op(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}
            elif field.name == "peak_bytes" and not add_peak:
                value = a
            else:
                value = op(a, b)
            setattr(out, field.name, value)
        return out


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
        # The entries whose copy has not landed, in the order they were added: polled, cancelled and
        # counted as in flight without visiting every resident expert.
        self.arriving: dict[Key, Entry] = {}
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
        self.arriving[key] = entry
        self.stats.loads += 1
        self.stats.bytes_to_device += self.expert_bytes
        self.stats.prefetches += int(prefetched)
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.held_bytes)
        return entry

    def mark_ready(self, key: Key) -> None:
        self.entries[key].ready = True
        self.arriving.pop(key, None)

    def remove(self, key: Key) -> None:
        entry = self.entries[key]
        if entry.pins:
            raise RuntimeError(f"expert {key} is pinned and cannot be evicted")
        del self.entries[key]
        self.arriving.pop(key, None)
        if entry.prefetched and not entry.used:
            self.stats.wasted_prefetches += 1

    def cancel(self, key: Key, unsent_bytes: int) -> None:
        """A prefetch stopped before it landed: its slot is free again and its unsent bytes uncounted."""
        entry = self.entries[key]
        if entry.pins or entry.ready:
            raise RuntimeError(f"expert {key} is pinned or has landed and cannot be cancelled")
        del self.entries[key]
        del self.arriving[key]
        self.stats.cancelled_prefetches += 1
        self.stats.bytes_to_device -= unsent_bytes

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

    def count_host(self, layer: int, keys: Iterable[Key]) -> None:
        """Counts needed experts the host computes (hybrid execution): misses, late prefetches when a copy of
        them is arriving, and a use each in `freq` (a use is a use, wherever it ran: LFU's and fMoE's
        eviction rank by it). A cached copy of one is not used, so its entry does not change; but a resident
        expert the planner gave the host to balance the layer (`HybridPlanner`'s device cost) is a hit and a
        use of its entry: it was on the device when needed."""
        keys = list(keys)
        resident = [key for key in keys if key in self.entries and self.entries[key].ready]
        late = sum(1 for key in keys if key in self.entries and not self.entries[key].ready)
        for key in resident:
            self.record_use(key)
        for key in keys:
            if key not in resident:
                self.freq[key] = self.freq.get(key, 0) + 1
        s = self.stats
        s.hits += len(resident)
        s.misses += len(keys) - len(resident)
        s.late_prefetches += late
        s.host_computed += len(keys)
        s.layer_hits[layer] = s.layer_hits.get(layer, 0) + len(resident)
        s.layer_needed[layer] = s.layer_needed.get(layer, 0) + len(keys)

    def victim(
        self,
        keep_score: Callable[[Key, Entry], float],
        *,
        protect: Iterable[Key] = (),
        keep_scores: Callable[[list[Key]], Sequence[float]] | None = None,
    ) -> Key | None:
        """The ready, unpinned expert with the lowest keep score (ties: least recently used), or None.
        `keep_scores(keys)`, when given, scores a list of keys at once (a policy's vectorised
        `keep_score`, `Policy.keep_scores`): the same scores, without a Python call per entry."""
        protected = set(protect)
        entries = self.entries
        keys = [k for k, e in entries.items() if e.ready and not e.pins and k not in protected]
        if not keys:
            return None
        if keep_scores is None:
            scores = np.array([keep_score(key, entries[key]) for key in keys], np.float64)
        else:
            scores = np.array(keep_scores(keys), np.float64)
        low = scores.min()
        if low != low:  # a NaN: as the tuple comparison this replaced, never below a number
            scores[np.isnan(scores)] = np.inf
            low = scores.min()
        lowest = np.flatnonzero(scores == low)
        if len(lowest) == 1:
            return keys[lowest[0]]
        return min((keys[i] for i in lowest), key=lambda k: (entries[k].last_use, entries[k].arrived))
