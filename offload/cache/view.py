"""What a policy sees of an expert cache (`CacheView`) and what the iteration driver uses of one
(`ServingCache`); `BookView`, the view read from one device's `CacheBook`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from .book import CacheBook, CacheStats, Entry, Key

if TYPE_CHECKING:
    from .device import DeviceExpertCache


class CacheView(Protocol):
    """What a policy may read of the expert cache it serves, and the requests it may make.

    Implemented by `DeviceExpertCache` (one device, `offload/transfer.py`) and `CacheGroup` (one cache per
    device, `offload/placement.py`); the simulator's cache is a `DeviceExpertCache` too. Entries are the
    cache's own records: read them, never change them.
    """

    @property
    def capacity(self) -> int:
        """Expert slots, all devices together."""

    @property
    def stats(self) -> CacheStats:
        """Counts since the cache was made (hits, misses, loads, bytes...)."""

    @property
    def on_demand_wait_s(self) -> float:
        """Seconds the engine has waited for on-demand loads and late prefetches."""

    @property
    def stops(self) -> int:
        """Layers at which the engine's step program stopped for an expert not ready at its launch (and was
        launched again after loading it); 0 where the engine does not stop for misses."""

    @property
    def stop_s(self) -> float:
        """Seconds one such stop costs the engine beyond the misses' own wait (the relaunch and its sync),
        as the engine last measured or modelled it; 0 where it does not stop for misses or not measured."""

    def entry(self, key: Key) -> Entry | None:
        """The record of a resident or arriving expert (`ready` tells which), or None."""

    def entries(self, near: Key | None = None) -> Iterable[tuple[Key, Entry]]:
        """Every held expert's record; with `near`, only those on the device that holds `near`."""

    def free_slots(self, near: Key | None = None) -> int:
        """Slots neither resident nor arriving; with `near`, on the device that holds `near`."""

    def freq(self, key: Key) -> int:
        """Uses of `key` over the cache's lifetime (LFU's and fMoE's frequency)."""

    def device_of(self, key: Key) -> int:
        """Index of the device whose cache holds (or would hold) `key`; 0 with one device."""

    def request_prefetch(
        self,
        items: Iterable[tuple[Key, float]],
        *,
        replace: bool | Iterable[int] = True,
        stale_before: int | None = None,
        if_idle: bool = False,
    ) -> None:
        """Queues prefetches `(key, priority)`, higher first (see `DeviceExpertCache.request_prefetch`)."""

    def drop_prefetches(self, *, before: int) -> None:
        """Drops the waiting (and, where the mover can stop them, arriving) prefetches of layers before
        `before`: a policy's "no new wishes, but these are stale"."""


class ServingCache(CacheView, Protocol):
    """What the iteration driver uses of an expert cache beyond a policy's view: one device's cache
    (`DeviceExpertCache`) or one per device (`CacheGroup`)."""

    @property
    def timers(self) -> dict[str, float]:
        """Host seconds by stage ("prefetch_issue", "on_demand_wait")."""

    def parts(self, keys: list[Key]) -> list[tuple[DeviceExpertCache, list[Key]]]:
        """Each device's cache with its share of `keys` (devices with none left out)."""

    def protect(self, keys: Iterable[Key], layer: int | None = None) -> None:
        """No prefetch may evict `keys`, which `layer` is about to use; `protect(())` ends it."""

    def record_stop(self, price: Callable[[], float]) -> None:
        """The engine stopped at a layer for a miss (`stops`); `price()` is what one stop costs (`stop_s`),
        asked only when read."""


class BookView:
    """The `CacheView` of one device's cache, read from its `CacheBook` (`self.book`) and its timers
    (`self.timers["on_demand_wait"]`); `DeviceExpertCache` and test stand-ins mix it in."""

    book: CacheBook
    timers: dict[str, float]
    stops: int = 0  # `CacheView.stops`, and the price behind `.stop_s`, once the engine reports a stop
    _stop_price: Callable[[], float] | None = None

    @property
    def capacity(self) -> int:
        return self.book.capacity

    @property
    def stats(self) -> CacheStats:
        return self.book.stats

    @property
    def on_demand_wait_s(self) -> float:
        return self.timers["on_demand_wait"]

    def entry(self, key: Key) -> Entry | None:
        return self.book.entries.get(key)

    def entries(self, near: Key | None = None) -> list[tuple[Key, Entry]]:
        return list(self.book.entries.items())

    def free_slots(self, near: Key | None = None) -> int:
        return self.book.free_slots

    def freq(self, key: Key) -> int:
        return self.book.freq.get(key, 0)

    def device_of(self, key: Key) -> int:
        return 0

    @property
    def stop_s(self) -> float:
        return 0.0 if self._stop_price is None else self._stop_price()

    def record_stop(self, price: Callable[[], float]) -> None:
        self.stops += 1
        self._stop_price = price
