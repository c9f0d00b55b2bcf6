"""The device expert cache: the cached experts' device arrays and their `CacheBook`, and the copies.

Prefetches wait in a priority queue and start while fewer than `max_inflight` copies are in flight;
on-demand loads start at once, ahead of every queued prefetch, and pause prefetching until they land. The
iteration driver calls `ensure` and `release`; policies read it through the `CacheView` methods and call
`request_prefetch` and `drop_prefetches` (from any thread: one lock guards the state). Copies go through a
`Mover`: `offload/transfer.py`'s (`OffloadConfig.transfer`), or the simulator's link
(`offload/resources.py`).
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .book import CacheBook, Entry, KeepScores, Key
from .view import BookView

if TYPE_CHECKING:
    from fmoe_jax.models.moe import ExpertWeights


NOTHING: frozenset[Key] = frozenset()  # no experts protected


class EvictionPolicy(Protocol):
    """What the cache asks its policy (`offload.policies.Policy` declares all three)."""

    def keep_score(self, key: Key, entry: Entry) -> float:
        """Higher is kept longer; the lowest-scoring ready, unpinned expert is evicted first."""

    # `keep_score` of many resident experts at once, `keep_scores(layers, experts)`, or None: the cache then
    # calls `keep_score` per entry.
    keep_scores: KeepScores | None
    # `keep_score` is the entry's last use: the cache evicts the least recently used without scoring.
    evicts_least_recent: bool

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        """Whether a prefetch of `key` may evict `victim` to make room."""


class Mover:
    """Copies experts to one device for a `DeviceExpertCache`. A handle stands for one copy in flight.

    Subclasses implement `start`, `is_ready` and `wait`; the rest are optional capabilities with their
    defaults here: a copy cannot be stopped, its handle is the expert's device arrays, no thread to stop,
    and no estimate of copy times (the hybrid planner needs one: wrap the mover in `TimedMover`)."""

    # `result` returns the handle itself, so the cache hands out handles without calling it: True here and
    # for a subclass that keeps this `result`, False for one that defines its own unless it says otherwise.
    handle_is_result = True

    # `load_now` lands copies at once (a mover on a clock of its own: the simulator's link). False here; a
    # subclass of such a mover that redefines `start` or `wait` is False unless it says otherwise.
    loads_now = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        if "result" in own and "handle_is_result" not in own:
            cls.handle_is_result = False
        if ("start" in own or "wait" in own) and "load_now" not in own and "loads_now" not in own:
            cls.loads_now = False

    def start(self, key: Key, *, urgent: bool = False) -> Any:
        """Begins copying expert `key` to the device; returns a handle. An urgent copy (an on-demand load)
        goes ahead of every prefetch chunk the link has not started."""
        raise NotImplementedError

    def is_ready(self, handle: Any) -> bool:
        raise NotImplementedError

    def wait(self, handles: Sequence[Any]) -> None:
        raise NotImplementedError

    def load_now(self, keys: Sequence[Key]) -> list[Any]:
        """Urgent copies of `keys` started in order and waited for, as `start(key, urgent=True)` of each and
        one `wait` of them all: their handles, landed. Called only when `loads_now` (the cache holds its lock
        throughout, which a real copy must not block)."""
        handles = [self.start(key, urgent=True) for key in keys]
        self.wait(handles)
        return handles

    def cancel(self, handle: Any) -> float | None:
        """Stops a copy between chunks: the fraction of its bytes not sent, or None if it cannot be stopped
        (it has landed, its last chunk is under way, or this mover cannot cancel)."""
        return None

    def result(self, handle: Any) -> Any:
        """The expert's device arrays once the copy has landed."""
        return handle

    def close(self) -> None:
        """Stops the mover's threads."""

    def landing_in(self, handle: Any, ahead: int = 0) -> float:
        """Seconds until the copy `handle` lands, when `ahead` on-demand loads are issued now."""
        raise NotImplementedError(f"{type(self).__name__} does not time its copies (wrap it in TimedMover)")

    def load_in(self, ahead: int = 0) -> float:
        """Seconds an on-demand load issued now would take, behind `ahead` others."""
        raise NotImplementedError(f"{type(self).__name__} does not time its copies (wrap it in TimedMover)")


class DeviceExpertCache(BookView):
    """Expert weights on one device, within a budget of `capacity` experts.

    Args:
      mover: copies an expert to the device (`offload/transfer.py`'s, or the simulator's link).
      capacity: slots.
      expert_bytes: bytes of one expert.
      policy: eviction order and prefetch admission (the offload policy).
      max_inflight: copies in flight at once (prefetches; on-demand loads are never held back).
      synchronous: wait for every copy as it is issued.
    """

    def __init__(
        self,
        mover: Mover,
        capacity: int,
        expert_bytes: int,
        policy: EvictionPolicy,
        *,
        max_inflight: int = 4,
        synchronous: bool = False,
    ):
        self.mover = mover
        self.book = CacheBook(capacity, expert_bytes)
        self.policy = policy
        self.max_inflight = max_inflight
        self.synchronous = synchronous
        self._lands_now = mover.loads_now and not synchronous  # `ensure` may take `_ensure_now`
        self.arrays: dict[Key, Any] = {}
        self.lock = threading.RLock()
        self.queue: list[tuple[float, int, Key]] = []  # (-priority, order, key)
        self.queued: set[Key] = set()
        self.filling: set[Key] = set()  # background fills on the link (`request_prefetch`)
        self.order = 0
        self.paused = 0  # on-demand loads pending
        # The current layer's needs: prefetches must not evict them.
        self.protected: set[Key] | frozenset[Key] = NOTHING
        self.serving: int | None = None  # the layer between its routing and the end of its compute
        # (the policy's `refusal_stamp`, `book.grown`, `protected`) of the last prefetch refused a victim.
        self._refused: tuple | None = None
        self.timers = {"prefetch_issue": 0.0, "on_demand_wait": 0.0}

    # -- what policies read (`CacheView`; the rest comes from `BookView`) -------------------------------
    def entries(self, near: Key | None = None) -> list[tuple[Key, Entry]]:
        with self.lock:  # a snapshot: the matcher thread may read while the engine changes the cache
            return list(self.book.entries.items())

    # -- the driver's side ----------------------------------------------------------------------------
    def parts(self, keys: list[Key]) -> list[tuple[DeviceExpertCache, list[Key]]]:
        """The caches that hold `keys` and their share of them: this one (the driver's per-device view)."""
        return [(self, keys)] if keys else []

    # -- copies ----------------------------------------------------------------------------------------
    def _start_copy(self, key: Key, *, prefetched: bool, pinned: bool = False) -> None:
        """Caller holds the lock and has made room. A copy that fails to start leaves the cache unchanged.
        `pinned`: the entry starts pinned (an on-demand load the caller waits for)."""
        handle = self.mover.start(key, urgent=not prefetched)
        if self.synchronous:
            self.mover.wait([handle])
        self.book.add(key, prefetched=prefetched, pinned=pinned)
        self.arrays[key] = handle
        if self.synchronous:
            self.book.mark_ready(key)

    def _poll(self) -> None:
        """Marks finished copies ready."""
        if self.book.arriving:
            is_ready, arrays = self.mover.is_ready, self.arrays
            for key in [key for key in self.book.arriving if is_ready(arrays[key])]:
                self.book.mark_ready(key)

    def _inflight(self) -> list[Key]:
        return list(self.book.arriving)

    def _evict_one(self, protect: Iterable[Key] = ()) -> bool:
        policy = self.policy
        victim = self.book.victim(
            policy.keep_score,
            protect=protect,
            keep_scores=policy.keep_scores,
            least_recent=policy.evicts_least_recent,
        )
        if victim is None:
            return False
        self.book.remove(victim)
        del self.arrays[victim]
        return True

    def _wait_ready(self, keys: Sequence[Key]) -> None:
        """Blocks (without the lock) until the copies of `keys` have landed."""
        self.mover.wait([self.arrays[k] for k in keys])
        with self.lock:
            for key in keys:
                self.book.mark_ready(key)

    # -- prefetch --------------------------------------------------------------------------------------
    def request_prefetch(
        self,
        items: Iterable[tuple[Key, float]],
        *,
        replace: bool | Iterable[int] = True,
        stale_before: int | None = None,
        if_idle: bool = False,
    ) -> None:
        """Queues prefetches `(key, priority)` (higher first), dropping waiting requests that are no longer
        wanted first: all of them (`replace=True`), those of the given layers (`replace=layers`), and those
        of layers before `stale_before` (already computed). Background fills (priority -inf,
        `hybrid.FILL_PRIORITY`: an expert the host computed, a free slot's expert) are no prediction, and no
        prediction replaces them: they stay queued, and arriving, until they land. `if_idle`: queue the items
        only if the link is idle (nothing queued or arriving), else drop them."""
        start = time.perf_counter()
        with self.lock:
            if replace is not False or stale_before is not None:
                layers = None if replace is True or replace is False else set(replace)

                def unwanted(key: Key) -> bool:
                    return (
                        replace is True
                        or (layers is not None and key[0] in layers)
                        or (stale_before is not None and key[0] < stale_before)
                    )

                items = list(items)
                kept = [entry for entry in self.queue if entry[0] == math.inf or not unwanted(entry[2])]
                if len(kept) < len(self.queue):  # else the queue stands as it is (a heap already)
                    self.book.stats.dropped_prefetches += len(self.queue) - len(kept)
                    heapq.heapify(kept)
                    self.queue = kept
                    self.queued = {entry[2] for entry in kept}
                if self.book.arriving:
                    still = {key for key, _ in items}
                    self._cancel_arriving(lambda key: unwanted(key) and key not in still)
            if if_idle and (self.queue or self.book.arriving):
                items = []
            for key, priority in items:
                if key in self.book or key in self.queued or key[0] == self.serving:
                    continue
                self.order += 1
                heapq.heappush(self.queue, (-priority, self.order, key))
                self.queued.add(key)
            self._pump()
        self.timers["prefetch_issue"] += time.perf_counter() - start

    def drop_prefetches(self, *, before: int) -> None:
        """Drops the waiting prefetches of layers before `before` (computed already: no longer wanted), and
        stops those still arriving where the mover can; queues nothing."""
        self.request_prefetch((), replace=False, stale_before=before)

    def _cancel_arriving(self, unwanted: Callable[[Key], bool]) -> None:
        """Stops prefetches still arriving that are no longer wanted (between chunks, where the mover can):
        their slots and the link's remaining time go to what is wanted now. Caller holds the lock."""
        for key, entry in list(self.book.arriving.items()):
            if key in self.protected:  # the layer being served needs it: a late prefetch still beats a miss
                continue
            if key in self.filling:
                continue
            if entry.prefetched and not entry.pins and unwanted(key):
                unsent = self.mover.cancel(self.arrays[key])
                if unsent is not None:
                    self.book.cancel(key, int(round(unsent * self.book.expert_bytes)))
                    del self.arrays[key]

    def _pump(self) -> None:
        """Starts queued prefetches while allowed. Caller holds the lock."""
        if self.paused:
            return
        if self.book.arriving:
            self._poll()
        if self.filling:  # only those still arriving
            entries = self.book.entries
            self.filling = {k for k in self.filling if k in entries and not entries[k].ready}
        while self.queue and len(self.book.arriving) < self.max_inflight:
            neg_priority, _, key = self.queue[0]
            if key in self.book:
                heapq.heappop(self.queue)
                self.queued.discard(key)
                continue
            if self.book.free_slots <= 0 and not self._evict_for_prefetch(key, -neg_priority):
                break
            heapq.heappop(self.queue)
            self.queued.discard(key)
            self._start_copy(key, prefetched=True)
            if neg_priority == math.inf:
                self.filling.add(key)

    def _evict_for_prefetch(self, key: Key, priority: float) -> bool:
        """Makes room for a prefetch if the policy lets it evict its lowest-ranked expert. A refusal the
        policy stamps (`Policy.refusal_stamp`) stands, without a victim search, while the stamp is the same
        and no expert has become a candidate (none evictable since, the same protected)."""
        policy = self.policy
        stamp = policy.refusal_stamp(key, priority)
        if stamp is not None:
            state = (stamp, self.book.grown, self.protected)
            if state == self._refused:
                return False
        victim = self.book.victim(
            policy.keep_score,
            protect=self.protected,
            keep_scores=policy.keep_scores,
            least_recent=policy.evicts_least_recent,
        )
        if victim is None or not self.policy.admit_prefetch(key, priority, victim):
            self._refused = None if stamp is None else state
            return False
        self.book.remove(victim)
        del self.arrays[victim]
        return True

    def protect(self, keys: Iterable[Key], layer: int | None = None) -> None:
        """Marks the experts `layer` is about to use: between its routing (when the policy hears of it and
        may prefetch) and its compute, no prefetch may evict them, and prefetches of `layer` itself are
        dropped (its misses load on demand; a prefetch landing first would pass a miss off as a hit).
        Replaces the last set; `protect(())` ends it."""
        with self.lock:
            self.protected = set(keys) if keys else NOTHING
            self.serving = layer

    # -- the engine's side -----------------------------------------------------------------------------
    def ensure(self, layer: int, needed: Sequence[Key], *, arrays: bool = True) -> dict[Key, ExpertWeights]:
        """Makes `needed` (at most `capacity` experts of one layer) resident and pinned; returns their arrays
        (`arrays=False`: an empty dict, for a caller that books the compute without the weights).

        Hits are counted before anything is loaded; misses load on demand ahead of queued prefetches.
        The caller must `release` the keys after computing with them.
        """
        book = self.book
        if len(needed) > book.capacity:
            raise ValueError(f"{len(needed)} experts requested at once but the cache holds {book.capacity}")
        with self.lock:
            if book.arriving:
                self._poll()
            if self._lands_now and not book.arriving and self.policy.evicts_least_recent:
                out = self._ensure_now(layer, needed, arrays)
                if out is not None:
                    return out
            hits, late, misses = book.classify(layer, needed, pin=True)
            if not (late or misses):  # every one resident: nothing to wait for
                return self._used(needed, arrays)
            if misses:
                self.paused += 1
                try:
                    self._load(misses, needed)
                except BaseException:
                    self._give_back(hits + late + [key for key in misses if key in book], True)
                    raise
            waiting = late + misses if late else misses
            handles = [self.arrays[k] for k in waiting]
        start = time.perf_counter()
        try:
            self.mover.wait(handles)
        except BaseException:
            self._give_back(hits + waiting, bool(misses))
            raise
        self.timers["on_demand_wait"] += time.perf_counter() - start
        with self.lock:
            book.mark_all_ready(waiting)
            if misses:
                self.paused -= 1
            return self._used(needed, arrays)

    def _load(self, misses: list[Key], needed: Sequence[Key]) -> None:
        """Starts the on-demand loads of `misses` (pinned), evicting what it must but none of `needed`.
        Caller holds the lock and has paused prefetching."""
        book, queued, arrays = self.book, self.queued, self.arrays
        protect, entries, capacity = set(needed), book.entries, book.capacity
        if self.policy.evicts_least_recent:  # the victims the loop would take, at once (reversed: the loads
            # take their slots in the loop's order)
            victims = book.least_recent(len(misses) - (capacity - len(entries)), protect)
            book.remove_all(reversed(victims))
            for victim in victims:
                del arrays[victim]
        if queued:
            queued.difference_update(misses)
        if self.synchronous or len(entries) + len(misses) > capacity:
            for key in misses:
                while len(entries) >= capacity and not self._evict_one(protect=protect):
                    self._wait_for_any_inflight()
                self._start_copy(key, prefetched=False, pinned=True)
            return
        # Room for every miss: each copy starts, then the book holds them all (those started, should one
        # fail to start).
        start, handles = self.mover.start, []
        try:
            for key in misses:
                handles.append(start(key, urgent=True))
        finally:
            started = misses[: len(handles)]
            book.add_all(started, prefetched=False, pinned=True)
            arrays.update(zip(started, handles, strict=True))

    def _ensure_now(self, layer: int, needed: Sequence[Key], want: bool) -> dict[Key, ExpertWeights] | None:
        """`ensure` in one pass of the book (`CacheBook.use_least_recent`), for a mover that lands copies
        at once (`Mover.loads_now`) while nothing is arriving and a policy that evicts the least recently
        used: the same counts, victims, slots, copies and uses as the general path; their arrays where `want`
        (else an empty dict). None (nothing done) when it does not apply. Caller holds the lock."""
        start = time.perf_counter()
        done = self.book.use_least_recent(layer, needed, self.mover.load_now)
        if done is None:
            return None
        victims, misses, handles = done
        arrays = self.arrays
        if misses:
            self.timers["on_demand_wait"] += time.perf_counter() - start
            for victim in victims:
                del arrays[victim]
            if self.queued:
                self.queued.difference_update(misses)
            arrays.update(zip(misses, handles, strict=True))
        out = self._handed(needed, want)
        if self.queue or self.filling:
            self._pump()
        return out

    def _used(self, needed: Sequence[Key], want: bool) -> dict[Key, ExpertWeights]:
        """Counts a use of each of `needed` (resident, pinned) and returns their arrays (`want`: else an
        empty dict); starts what prefetches may start now. Caller holds the lock."""
        self.book.record_uses(needed)
        out = self._handed(needed, want)
        self._pump()
        return out

    def _handed(self, needed: Sequence[Key], want: bool) -> dict[Key, ExpertWeights]:
        """What `ensure` returns for `needed`: their arrays (the mover's results), or an empty dict where the
        caller does not `want` them."""
        if not want:
            return {}
        arrays = self.arrays
        if self.mover.handle_is_result:
            return {key: arrays[key] for key in needed}
        result = self.mover.result
        return {key: result(arrays[key]) for key in needed}

    def _give_back(self, pinned: list[Key], paused: bool) -> None:
        """Undoes a failed `ensure`'s pins and pause, so that the cache stays usable for the next call."""
        with self.lock:
            self.book.unpin(pinned)
            self.paused -= paused

    def ready_arrays(self) -> dict[Key, ExpertWeights]:
        """The device arrays of every resident expert whose copy has landed: what the engine's step may use
        without asking (`fmoe_jax/engines/step_loop.py`). Counts and pins nothing: the driver's `ensure`
        calls count, once each layer's routing is known."""
        with self.lock:
            self._poll()
            entries = self.book.entries.items()
            return {key: self.mover.result(self.arrays[key]) for key, e in entries if e.ready}

    def _wait_for_any_inflight(self) -> None:
        """No evictable expert: every slot is pinned or arriving. Waits (lock held) for an unpinned arriving
        copy so it can be evicted; the lock is re-entrant and the copy needs no other thread."""
        arriving = [k for k in self._inflight() if not self.book.entries[k].pins]
        if not arriving:
            raise RuntimeError("expert cache deadlock: every slot is pinned (engine bug: chunk too large)")
        key = min(arriving, key=lambda k: self.book.entries[k].arrived)
        self.mover.wait([self.arrays[key]])
        self.book.mark_ready(key)

    def copy_eta(self, key: Key, ahead: int = 0) -> float:
        """Seconds until `key` could be used on the device, as the mover estimates it, when `ahead` other
        on-demand loads are issued now: 0 when resident, the rest of its copy when arriving, else an on-demand
        load behind those. The hybrid planner's question (`offload/hybrid.py`), answered by a mover that
        times its copies (`Mover.landing_in`, `Mover.load_in`)."""
        with self.lock:
            self._poll()
            entry = self.book.entries.get(key)
            if entry is None:
                return self.mover.load_in(ahead)
            return 0.0 if entry.ready else self.mover.landing_in(self.arrays[key], ahead)

    def release(self, keys: Iterable[Key], *, unprotect: bool = False) -> None:
        """Unpins `keys` after their compute; `unprotect`: and ends the protection (as `protect(())`)."""
        with self.lock:
            self.book.unpin(keys)
            if unprotect:
                self.protected, self.serving = NOTHING, None

    def preload(self, keys: Iterable[Key]) -> None:
        """Loads experts without counting them as prefetches or misses (warm start, resident policy), in
        order, as many as the cache holds."""
        with self.lock:
            for key in list(keys)[: self.book.free_slots]:
                if key not in self.book:
                    self.book.add(key, prefetched=False)
                    self.arrays[key] = self.mover.start(key)
            self.book.stats.loads = 0
            self.book.stats.bytes_to_device = 0
        self._wait_ready(list(self.arrays))
