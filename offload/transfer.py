"""The device expert cache's storage and its transfer engine: asynchronous host-to-device copies.

`DeviceExpertCache` owns the cached experts' device arrays and the `CacheBook`; prefetches wait in a
priority queue and start while fewer than `max_inflight` copies are in flight; on-demand loads start
at once, ahead of every queued prefetch, and pause prefetching until they land. The iteration
driver calls `ensure` and `release`; policies read it through the `CacheView` methods and call
`request_prefetch` (from any thread: one lock guards the state). Copies go through a `Mover`:
`JaxMover` issues each expert's `jax.device_put` at once (the runtime orders the copies);
`ChunkedJaxMover` sends them from a transfer thread one matrix at a time, on-demand loads first, and can
stop a prefetch between matrices; the simulator plugs in a simulated link (`offload/resources.py`).
"""

from __future__ import annotations

import collections
import heapq
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import jax
from fmoe_jax.models.moe import ExpertWeights

from .cache import BookView, CacheBook, Entry, Key


class EvictionPolicy(Protocol):
    def keep_score(self, key: Key, entry: Entry) -> float:
        """Higher is kept longer; the lowest-scoring ready, unpinned expert is evicted first."""

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        """Whether a prefetch of `key` may evict `victim` to make room."""


class Mover(Protocol):
    def start(self, key: Key, *, urgent: bool = False) -> Any:
        """Begins copying expert `key` to the device; returns a handle (the device arrays). An urgent copy
        (an on-demand load) goes ahead of every prefetch chunk the link has not started."""

    def is_ready(self, handle: Any) -> bool: ...

    def wait(self, handles: Sequence[Any]) -> None: ...

    def cancel(self, handle: Any) -> float | None:
        """Stops a copy between chunks: the fraction of its bytes not sent, or None if it cannot be stopped
        (it has landed, its last chunk is under way, or this mover cannot cancel)."""

    # Optional: `result(handle)`, the expert's device arrays once the copy has landed (without it, the
    # handle is the arrays), and `close()`, which stops the mover's threads.


class JaxMover:
    """Asynchronous `jax.device_put` of an expert's host arrays to a device sharding."""

    def __init__(self, host: Callable[[Key], ExpertWeights], device: jax.sharding.Sharding):
        self.host = host
        self.device = device

    def start(self, key: Key, *, urgent: bool = False) -> ExpertWeights:
        return jax.device_put(self.host(key), self.device)

    def is_ready(self, handle: ExpertWeights) -> bool:
        return all(a.is_ready() for a in jax.tree.leaves(handle))  # quantized matrices hold two arrays

    def wait(self, handles: Sequence[ExpertWeights]) -> None:
        jax.block_until_ready(list(handles))

    def cancel(self, handle: ExpertWeights) -> None:
        return None  # an issued device_put runs to its end


class _Transfer:
    """One expert's copy by `ChunkedJaxMover`: its host arrays (the chunks), sent in order."""

    def __init__(self, key: Key, leaves: list[Any], treedef: Any):  # treedef None: one chunk, the whole
        self.key, self.leaves, self.treedef = key, leaves, treedef
        self.sent: list[jax.Array] = []  # the device arrays of the chunks that have landed
        self.sending = False  # a chunk is on the link
        self.cancelled = False
        self.done = threading.Event()  # landed, failed or cancelled
        self.error: BaseException | None = None
        self.arrays: Any = None  # the expert's device arrays, once landed

    def unsent_share(self) -> float:
        """The share of the expert's bytes not sent and not under way."""

        def nbytes(chunk: Any) -> int:
            return sum(leaf.nbytes for leaf in jax.tree.leaves(chunk))

        total = sum(nbytes(leaf) for leaf in self.leaves)
        later = self.leaves[len(self.sent) + self.sending :]
        return sum(nbytes(leaf) for leaf in later) / max(total, 1)

    def landed(self) -> Any:
        """The expert's device arrays from its landed chunks."""
        if self.treedef is None:  # sent whole
            return self.sent[0]
        return jax.tree.unflatten(self.treedef, self.sent)


class _Link:
    """`ChunkedJaxMover`'s queues and its transfer thread's loop. The thread holds only this (not the mover,
    whose host-array source keeps the model alive), and stops once the mover is closed or collected."""

    def __init__(self, device: jax.sharding.Sharding):
        self.device = device
        self.cv = threading.Condition()
        self.urgent: collections.deque[_Transfer] = collections.deque()  # on-demand loads, in order
        self.queued: collections.deque[_Transfer] = collections.deque()  # prefetches, in the order started
        self.closed = False

    def send(self, leaf: Any) -> jax.Array:
        """One chunk to the device, waiting until it has landed."""
        return jax.block_until_ready(jax.device_put(leaf, self.device))

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def run(self) -> None:
        while True:
            with self.cv:
                while not (self.urgent or self.queued or self.closed):
                    self.cv.wait()
                if self.closed:
                    for transfer in (*self.urgent, *self.queued):
                        transfer.error = RuntimeError("the expert transfer thread was closed")
                        transfer.done.set()
                    return
                line = self.urgent if self.urgent else self.queued
                transfer = line[0]
                leaf = transfer.leaves[len(transfer.sent)]
                transfer.sending = True
            try:  # one chunk on the link at a time: what comes next is decided between chunks
                chunk, error = self.send(leaf), None
            except Exception as err:  # noqa: BLE001 - handed to whoever waits for this copy
                chunk, error = None, err
            with self.cv:
                transfer.sending = False
                if transfer.cancelled:  # it left its line when cancelled
                    continue
                if error is None:
                    transfer.sent.append(chunk)
                if error is not None or len(transfer.sent) == len(transfer.leaves):
                    line.remove(transfer)
                    transfer.error = error
                    if error is None:
                        transfer.arrays = transfer.landed()
                    transfer.done.set()


class ChunkedJaxMover:
    """Copies experts from a transfer thread of its own, one chunk (one of the expert's arrays: a matrix, or
    a quantized matrix's values or scales) at a time: on-demand loads (`urgent`) before every prefetch, and
    prefetches in the order they were started. So an on-demand load waits behind at most one chunk of a
    prefetch, and `cancel` stops a prefetch that is no longer wanted before its first chunk, or between
    chunks with `finish_started=False`, freeing the link (the simulator's `SimulatedLink` models the same).
    `OffloadConfig(chunked_copies=True)`.

    A started copy finishes by default: in the simulator, on the validation split of experiments 4 and 8,
    cancelling between chunks was slower than letting what had started land (hybrid, Mixtral-8x7B sizes:
    1-5 %; copy-only with fmoe's admission of session 13: 4-10 %): a cancelled copy's sent chunks are
    wasted link time, and the prediction it served was often right after all.

    The cost: a chunk waits for the previous one to land before it is issued (the link is never given two
    at once, so that the order stays ours), and each chunk is a thread hand-off; on a GPU each chunk also
    pays the copy's fixed cost (~0.3 ms on an H200, `benchmarks/link_compute.py`). With `whole=True` an
    expert is one chunk (one `device_put` of all its arrays): copies still leave the caller's thread and
    on-demand loads still go first, but a miss may wait behind a whole prefetch.
    `OffloadConfig(transfer_thread=True)`.
    """

    def __init__(
        self,
        host: Callable[[Key], ExpertWeights],
        device: jax.sharding.Sharding,
        *,
        finish_started: bool = True,
        whole: bool = False,
    ):
        self.host = host
        self.finish_started = finish_started
        self.whole = whole
        self._link = _Link(device)
        thread = threading.Thread(target=self._link.run, name="fmoe-expert-transfers", daemon=True)
        thread.start()
        self._closer = weakref.finalize(self, self._link.close)

    def start(self, key: Key, *, urgent: bool = False) -> _Transfer:
        expert = self.host(key)
        if self.whole:  # one chunk: the whole pytree in one device_put
            transfer = _Transfer(key, [expert], None)
        else:
            transfer = _Transfer(key, *jax.tree.flatten(expert))
        with self._link.cv:
            if self._link.closed:
                raise RuntimeError("the expert transfer thread was closed")
            (self._link.urgent if urgent else self._link.queued).append(transfer)
            self._link.cv.notify()
        return transfer

    def is_ready(self, handle: _Transfer) -> bool:
        return handle.done.is_set()

    def wait(self, handles: Sequence[_Transfer]) -> None:
        for handle in handles:
            handle.done.wait()
            if handle.error is not None:
                raise handle.error

    def result(self, handle: _Transfer) -> ExpertWeights:
        if handle.error is not None:
            raise handle.error
        return handle.arrays

    def cancel(self, handle: _Transfer) -> float | None:
        with self._link.cv:
            if handle.done.is_set() or handle.cancelled:
                return None
            unsent = handle.unsent_share()
            if handle.sending and unsent == 0.0:  # its last chunk is under way
                return None
            if self.finish_started and (handle.sent or handle.sending):
                return None
            for line in (self._link.urgent, self._link.queued):
                if handle in line:
                    line.remove(handle)
            handle.cancelled = True
            handle.error = RuntimeError(f"the copy of expert {handle.key} was cancelled")
            handle.done.set()
            return unsent

    def close(self) -> None:
        """Stops the transfer thread; copies not landed fail."""
        self._closer()


class DeviceExpertCache(BookView):
    """Expert weights on one device, within a budget of `capacity` experts.

    Args:
      mover: copies an expert to the device (`JaxMover`, or the simulator's).
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
        self._result = getattr(mover, "result", lambda handle: handle)  # handle -> device arrays
        self.book = CacheBook(capacity, expert_bytes)
        self.policy = policy
        self.max_inflight = max_inflight
        self.synchronous = synchronous
        self.arrays: dict[Key, Any] = {}
        self.lock = threading.RLock()
        self.queue: list[tuple[float, int, Key]] = []  # (-priority, order, key)
        self.queued: set[Key] = set()
        self.filling: set[Key] = set()  # background fills on the link (`request_prefetch`)
        self.order = 0
        self.paused = 0  # on-demand loads pending
        self.protected: set[Key] = set()  # the current layer's needs: prefetches must not evict them
        self.serving: int | None = None  # the layer between its routing and the end of its compute
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
    def _start_copy(self, key: Key, *, prefetched: bool) -> None:
        """Caller holds the lock and has made room. A copy that fails to start leaves the cache unchanged."""
        handle = self.mover.start(key, urgent=not prefetched)
        if self.synchronous:
            self.mover.wait([handle])
        self.book.add(key, prefetched=prefetched)
        self.arrays[key] = handle
        if self.synchronous:
            self.book.mark_ready(key)

    def _poll(self) -> None:
        """Marks finished copies ready."""
        for key, entry in self.book.entries.items():
            if not entry.ready and self.mover.is_ready(self.arrays[key]):
                entry.ready = True

    def _inflight(self) -> list[Key]:
        return [k for k, e in self.book.entries.items() if not e.ready]

    def _evict_one(self, protect: Iterable[Key] = ()) -> bool:
        victim = self.book.victim(
            self.policy.keep_score, protect=protect, keep_scores=getattr(self.policy, "keep_scores", None)
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
                self.book.stats.dropped_prefetches += len(self.queue) - len(kept)
                heapq.heapify(kept)
                self.queue = kept
                self.queued = {entry[2] for entry in kept}
                still = {key for key, _ in items}
                self._cancel_arriving(lambda key: unwanted(key) and key not in still)
            if if_idle and (self.queue or self._inflight()):
                items = []
            for key, priority in items:
                if key in self.book or key in self.queued or key[0] == self.serving:
                    continue
                self.order += 1
                heapq.heappush(self.queue, (-priority, self.order, key))
                self.queued.add(key)
            self._pump()
        self.timers["prefetch_issue"] += time.perf_counter() - start

    def _cancel_arriving(self, unwanted: Callable[[Key], bool]) -> None:
        """Stops prefetches still arriving that are no longer wanted (between chunks, where the mover can):
        their slots and the link's remaining time go to what is wanted now. Caller holds the lock."""
        for key, entry in list(self.book.entries.items()):
            if key in self.protected:  # the layer being served needs it: a late prefetch still beats a miss
                continue
            if key in self.filling:
                continue
            if entry.prefetched and not entry.ready and not entry.pins and unwanted(key):
                unsent = self.mover.cancel(self.arrays[key])
                if unsent is not None:
                    self.book.cancel(key, int(round(unsent * self.book.expert_bytes)))
                    del self.arrays[key]

    def _pump(self) -> None:
        """Starts queued prefetches while allowed. Caller holds the lock."""
        if self.paused:
            return
        self._poll()
        if self.filling:  # only those still arriving
            entries = self.book.entries
            self.filling = {k for k in self.filling if k in entries and not entries[k].ready}
        while self.queue and len(self._inflight()) < self.max_inflight:
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
        """Makes room for a prefetch if the policy lets it evict its lowest-ranked expert."""
        victim = self.book.victim(
            self.policy.keep_score,
            protect=self.protected,
            keep_scores=getattr(self.policy, "keep_scores", None),
        )
        if victim is None or not self.policy.admit_prefetch(key, priority, victim):
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
            self.protected = set(keys)
            self.serving = layer

    # -- the engine's side -----------------------------------------------------------------------------
    def ensure(self, layer: int, needed: Sequence[Key]) -> dict[Key, ExpertWeights]:
        """Makes `needed` (at most `capacity` experts of one layer) resident and pinned; returns their arrays.

        Hits are counted before anything is loaded; misses load on demand ahead of queued prefetches.
        The caller must `release` the keys after computing with them.
        """
        if len(needed) > self.book.capacity:
            raise ValueError(
                f"{len(needed)} experts requested at once but the cache holds {self.book.capacity}"
            )
        with self.lock:
            self._poll()
            hits, late, misses = self.book.classify(layer, needed)
            pinned = hits + late
            self.book.pin(pinned)
            self.paused += bool(misses)
            try:
                for key in misses:
                    self.queued.discard(key)
                    while self.book.free_slots <= 0 and not self._evict_one(protect=needed):
                        self._wait_for_any_inflight()
                    self._start_copy(key, prefetched=False)
                    self.book.pin([key])
                    pinned.append(key)
            except BaseException:
                self._give_back(pinned, bool(misses))
                raise
        start = time.perf_counter()
        try:
            if late or misses:
                self._wait_ready(late + misses)
        except BaseException:
            self._give_back(pinned, bool(misses))
            raise
        self.timers["on_demand_wait"] += time.perf_counter() - start
        with self.lock:
            self.paused -= bool(misses)
            for key in needed:
                self.book.record_use(key)
            out = {key: self._result(self.arrays[key]) for key in needed}
            self._pump()
        return out

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
            return {key: self._result(self.arrays[key]) for key, e in self.book.entries.items() if e.ready}

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
        load behind those. The hybrid planner's question (`offload/hybrid.py`); the mover must answer
        `landing_in(handle, ahead)` and `load_in(ahead)` (the simulator's link, or the live engine's
        `TimedMover`)."""
        with self.lock:
            self._poll()
            entry = self.book.entries.get(key)
            if entry is None:
                return self.mover.load_in(ahead)
            return 0.0 if entry.ready else self.mover.landing_in(self.arrays[key], ahead)

    def release(self, keys: Iterable[Key]) -> None:
        with self.lock:
            self.book.unpin(keys)

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
