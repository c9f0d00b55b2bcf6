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

import array
import collections
import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np

Key = tuple[int, int]  # (moe layer, expert)
# A policy's keep scores of many experts at once: (layers, experts) [n] int64 -> [n] (`Policy.keep_scores`).
KeepScores = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclasses.dataclass(slots=True)
class Entry:
    ready: bool = False  # the copy has completed
    prefetched: bool = False  # brought in by a prefetch (not on demand)
    used: bool = False  # served a layer since it arrived
    pins: int = 0  # > 0 while a layer computes with it, or waits for it
    last_use: int = 0  # logical clock of the last use (LRU)
    arrived: int = 0  # logical clock of arrival
    slot: int = -1  # where the book's per-slot arrays describe it (the book's own bookkeeping)


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

    Besides the entries it keeps what choosing a victim reads, up to date at every transition, so that a
    victim costs no pass over every resident expert: the held experts in order of last use (`recency`:
    the least recently used first, and so the tie order), and per slot the expert, its last use and
    whether it could be evicted (ready, unpinned), for a policy that scores arrays (`keep_scores`).
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
        self.recency: collections.OrderedDict[Key, Entry] = collections.OrderedDict()  # by last use
        self.freq: collections.defaultdict[Key, int] = collections.defaultdict(int)  # read it with `get`
        self.clock = 0
        self.stats = CacheStats()
        self._free = list(range(capacity - 1, -1, -1))  # slots not held (a stack)
        # Per slot, written one element at a time through Python buffers (cheaper than NumPy scalar
        # stores) and read as arrays through NumPy views of the same memory.
        self._layer_of = array.array("q", bytes(8 * capacity))
        self._expert_of = array.array("q", bytes(8 * capacity))
        self._slot_layer = np.frombuffer(self._layer_of, np.int64)
        self._slot_expert = np.frombuffer(self._expert_of, np.int64)
        self._slot_use = [0] * capacity  # its entry's last_use
        self._can_evict = bytearray(capacity)  # held, ready and unpinned: 1
        self.grown = 0  # counts the times an expert became evictable (a refused prefetch may then go)
        self._evictable = np.frombuffer(self._can_evict, np.bool_)

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
    def add(self, key: Key, *, prefetched: bool, pinned: bool = False) -> Entry:
        """Holds a slot for `key`, whose copy has started (`pinned`: the caller waits for it, as `pin`)."""
        self.add_all((key,), prefetched=prefetched, pinned=pinned)
        return self.entries[key]

    def add_all(self, keys: Sequence[Key], *, prefetched: bool, pinned: bool = False) -> None:
        """`add` of each of `keys` in order (an iteration's on-demand loads at once)."""
        entries, capacity = self.entries, self.capacity
        arriving, recency, free = self.arriving, self.recency, self._free
        layer_of, expert_of, uses = self._layer_of, self._expert_of, self._slot_use
        now, pins, added = self.clock, 1 if pinned else 0, 0
        try:
            for key in keys:
                if key in entries:
                    raise KeyError(f"expert {key} is already cached")
                if len(entries) >= capacity:
                    raise RuntimeError(f"cache full ({capacity} slots): evict before adding {key}")
                self.clock = now = now + 1
                slot = free.pop()
                entry = Entry(False, prefetched, False, pins, now, now, slot)  # arrival counts as a use (LRU)
                entries[key] = arriving[key] = recency[key] = entry
                layer_of[slot], expert_of[slot] = key
                uses[slot] = now
                added += 1
        finally:  # those added counted, should one fail (the peak: the last, as held only grows here)
            s, expert_bytes = self.stats, self.expert_bytes
            s.loads += added
            s.bytes_to_device += added * expert_bytes
            if prefetched:
                s.prefetches += added
            held = len(entries) * expert_bytes
            if held > s.peak_bytes:
                s.peak_bytes = held

    def mark_ready(self, key: Key) -> None:
        self.mark_all_ready((key,))

    def mark_all_ready(self, keys: Iterable[Key]) -> None:
        """The copies of `keys` (held) have landed."""
        entries, arriving, evictable = self.entries, self.arriving, self._can_evict
        for key in keys:
            entry = entries[key]
            entry.ready = True
            arriving.pop(key, None)
            if not entry.pins:
                evictable[entry.slot] = True
                self.grown += 1

    def _drop(self, key: Key) -> None:
        """Forgets a held expert's entry and frees its slot."""
        slot = self.entries.pop(key).slot
        self.arriving.pop(key, None)
        del self.recency[key]
        self._can_evict[slot] = False
        self._free.append(slot)

    def remove(self, key: Key) -> None:
        self.remove_all((key,))

    def remove_all(self, keys: Iterable[Key]) -> None:
        """Evicts each of `keys` (held, unpinned) in order."""
        entries, arriving, recency = self.entries, self.arriving, self.recency
        can_evict, free, stats = self._can_evict, self._free, self.stats
        for key in keys:
            entry = entries[key]
            if entry.pins:
                raise RuntimeError(f"expert {key} is pinned and cannot be evicted")
            del entries[key]  # as `_drop`, inline: an eviction per miss
            arriving.pop(key, None)
            del recency[key]
            slot = entry.slot
            can_evict[slot] = False
            free.append(slot)
            if entry.prefetched and not entry.used:
                stats.wasted_prefetches += 1

    def cancel(self, key: Key, unsent_bytes: int) -> None:
        """A prefetch stopped before it landed: its slot is free again and its unsent bytes uncounted."""
        entry = self.entries[key]
        if entry.pins or entry.ready:
            raise RuntimeError(f"expert {key} is pinned or has landed and cannot be cancelled")
        self._drop(key)
        self.stats.cancelled_prefetches += 1
        self.stats.bytes_to_device -= unsent_bytes

    def pin(self, keys: Iterable[Key]) -> None:
        entries, evictable = self.entries, self._can_evict
        for key in keys:
            entry = entries[key]
            entry.pins += 1
            evictable[entry.slot] = False

    def unpin(self, keys: Iterable[Key]) -> None:
        evictable, entries = self._can_evict, self.entries
        for key in keys:
            entry = entries[key]
            entry.pins -= 1
            if not entry.pins and entry.ready:
                evictable[entry.slot] = True
                self.grown += 1

    def record_use(self, key: Key) -> None:
        self.record_uses((key,))

    def record_uses(self, keys: Iterable[Key]) -> None:
        """A use of each of `keys` (held), in order: each the most recent so far."""
        entries, recency, freq = self.entries, self.recency, self.freq
        uses, now = self._slot_use, self.clock
        for key in keys:
            entry = entries[key]
            entry.used = True
            now += 1
            entry.last_use = now
            recency.move_to_end(key)
            uses[entry.slot] = now
            freq[key] += 1
        self.clock = now

    def classify(
        self, layer: int, needed: Iterable[Key], *, pin: bool = False
    ) -> tuple[list[Key], list[Key], list[Key]]:
        """Splits a layer's needed experts into (hits, late prefetches, misses) and counts them; `pin`: pins
        the hits and late prefetches too (as `pin`)."""
        hits, late, misses = [], [], []
        get, evictable = self.entries.get, self._can_evict
        for key in needed:
            entry = get(key)
            if entry is None:
                misses.append(key)
                continue
            if entry.ready:
                hits.append(key)
            else:
                late.append(key)
            if pin:
                entry.pins += 1
                evictable[entry.slot] = False
        s, n_hits, n_late = self.stats, len(hits), len(late)
        n_missed = n_late + len(misses)
        s.hits += n_hits
        s.misses += n_missed
        if n_late:
            s.late_prefetches += n_late
        layer_hits, layer_needed = s.layer_hits, s.layer_needed
        layer_hits[layer] = layer_hits.get(layer, 0) + n_hits
        layer_needed[layer] = layer_needed.get(layer, 0) + n_hits + n_missed
        return hits, late, misses

    def use_least_recent(
        self, layer: int, needed: Sequence[Key], load: Callable[[list[Key]], list]
    ) -> tuple[list[Key], list[Key], list] | None:
        """A layer's use of `needed` in one pass, while nothing is arriving, for a policy that evicts the
        least recently used: what `classify(pin=True)`, evicting `least_recent` victims outside `needed`
        for the misses (`remove_all`, reversed), `add_all` of the misses (pinned; `load(misses)`: their
        copies, started and landed) and `record_uses(needed)` do one after another, with each key looked up
        once: the same entries, slots, recency order, clock and counts. Returns (victims, misses, the
        misses' handles), or None, having changed nothing, when too few experts can be evicted."""
        entries, evictable = self.entries, self._can_evict
        found = [entries.get(key) for key in needed]
        misses: list[Key] = []
        for key, entry in zip(needed, found, strict=True):  # the hits pinned first: victims are then the
            if entry is None:  # unpinned, outside `needed` too
                misses.append(key)
            else:
                entry.pins += 1
                evictable[entry.slot] = False
        victims: list[tuple[Key, Entry]] = []
        n_missed, free = len(misses), self._free
        if n_missed and n_missed > len(free):
            short = n_missed - len(free)
            for key, entry in self.recency.items():  # the least recently used first
                if entry.ready and not entry.pins:
                    victims.append((key, entry))
                    if len(victims) == short:
                        break
            else:
                self.unpin([key for key, entry in zip(needed, found, strict=True) if entry is not None])
                return None
        handles = load(misses) if misses else []
        s, recency = self.stats, self.recency
        n_hits = len(needed) - n_missed
        s.hits += n_hits
        s.misses += n_missed
        layer_hits, layer_needed = s.layer_hits, s.layer_needed
        layer_hits[layer] = layer_hits.get(layer, 0) + n_hits
        layer_needed[layer] = layer_needed.get(layer, 0) + n_hits + n_missed
        for key, entry in reversed(victims):  # `remove_all`: the misses take the slots in victims' order
            del entries[key]
            del recency[key]
            slot = entry.slot
            evictable[slot] = False
            free.append(slot)
            if entry.prefetched and not entry.used:
                s.wasted_prefetches += 1
        # Arrivals take the clock's next `n_missed` ticks, in order; then one use each of `needed`, in order
        # (to the end of `recency`, where an arrival goes too).
        arrived, now = self.clock, self.clock + n_missed
        uses, freq, layer_of, expert_of = self._slot_use, self.freq, self._layer_of, self._expert_of
        for key, entry in zip(needed, found, strict=True):
            now += 1
            if entry is None:
                arrived += 1
                slot = free.pop()
                entries[key] = recency[key] = Entry(True, False, True, 1, now, arrived, slot)
                layer_of[slot], expert_of[slot] = key
            else:
                entry.used = True
                entry.last_use = now
                recency.move_to_end(key)
                slot = entry.slot
            uses[slot] = now
            freq[key] += 1
        self.clock = now
        if n_missed:
            s.loads += n_missed
            s.bytes_to_device += n_missed * self.expert_bytes
            held = len(entries) * self.expert_bytes
            if held > s.peak_bytes:
                s.peak_bytes = held
        return [key for key, _ in victims], misses, handles

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
        keep_scores: KeepScores | None = None,
        least_recent: bool = False,
    ) -> Key | None:
        """The ready, unpinned expert with the lowest keep score (NaN counts as infinite; ties: the least
        recently used), or None.

        Three ways to the same choice: `least_recent` (the policy declares `keep_score` to be the last use,
        `Policy.evicts_least_recent`) takes the first candidate in `recency` order; `keep_scores(layers,
        experts)` (a policy's vectorised `keep_score`, `Policy.keep_scores`) scores every candidate slot in
        one array expression; else `keep_score` is called per candidate, in `recency` order."""
        protected = protect if isinstance(protect, (set, frozenset)) else set(protect)
        if keep_scores is not None and not least_recent:
            return self._victim_of_arrays(keep_scores, protected)
        best: Key | None = None
        low = math.inf
        for key, entry in self.recency.items():  # least recently used first: the first lowest wins ties
            if not entry.ready or entry.pins or key in protected:
                continue
            if least_recent:
                return key
            score = keep_score(key, entry)
            if best is None or score < low:
                best, low = key, (math.inf if score != score else score)
        return best

    def least_recent(self, n: int, protect: set[Key]) -> list[Key]:
        """Up to `n` ready, unpinned experts outside `protect`, the least recently used first: the victims
        `victim(least_recent=True)` would choose one after another while nothing else becomes evictable."""
        out: list[Key] = []
        if n > 0:
            for key, entry in self.recency.items():
                if entry.ready and not entry.pins and key not in protect:
                    out.append(key)
                    if len(out) == n:
                        break
        return out

    def _victim_of_arrays(self, keep_scores: KeepScores, protected: set[Key]) -> Key | None:
        can_evict, get = self._can_evict, self.entries.get
        hidden = [e.slot for key in protected if (e := get(key)) is not None and can_evict[e.slot]]
        for slot in hidden:  # protected experts that could otherwise go: left out of this choice only
            can_evict[slot] = False
        candidates = self._evictable.nonzero()[0]
        for slot in hidden:
            can_evict[slot] = True
        if not candidates.size:
            return None
        scores = keep_scores(self._slot_layer[candidates], self._slot_expert[candidates])
        if not isinstance(scores, np.ndarray) or scores.dtype != np.float64:
            scores = np.asarray(scores, np.float64)
        first = int(scores.argmin())  # the first lowest, or the first NaN
        low = scores[first]
        if low != low:  # a NaN: never below a number
            scores = np.where(np.isnan(scores), np.inf, scores)
            first = int(scores.argmin())
            low = scores[first]
        ties = scores == low
        if np.count_nonzero(ties) == 1:
            slot = int(candidates[first])
        else:  # ties: the least recently used
            slot = min(candidates[ties].tolist(), key=self._slot_use.__getitem__)
        return self._layer_of[slot], self._expert_of[slot]
