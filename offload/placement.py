"""Expert-parallel placement: which device holds each routed expert, and one cache per device behind one face.

The engine builds a `CacheGroup` when `OffloadConfig(devices=...)` names several devices; policies keep
seeing `(layer, expert)` keys and one `CacheView`, and the group routes every call to the cache of the
device the placement assigns; the iteration driver serves each device's share of a layer (`parts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .cache import CacheStats, DeviceExpertCache, Entry, Key

Placement = Callable[[Key], int]


def round_robin(num_experts: int, num_devices: int) -> Placement:
    """Expert `(l, e)` on device `(l * J + e) % n`: each layer spreads its experts over every device, as
    the fMoE paper's implementation assigns them (section 5)."""
    return lambda key: (key[0] * num_experts + key[1]) % num_devices


def placement_from(spec: Any, num_experts: int, num_devices: int) -> Placement:
    """`None` (round robin), a mapping `{(layer, expert): device}`, or a callable `(layer, expert) -> int`."""
    if spec is None:
        return round_robin(num_experts, num_devices)
    if isinstance(spec, Mapping):
        table = dict(spec)

        def lookup(key: Key) -> int:
            if key not in table:
                raise KeyError(f"the placement map has no device for expert {key}")
            return table[key]

        return lookup
    if callable(spec):
        return spec
    raise TypeError(f"placement must be None, a mapping or a callable, got {type(spec).__name__}")


class CacheGroup:
    """One `DeviceExpertCache` per device, addressed by `(layer, expert)` through `placement`; policies see
    it through the same `CacheView` methods as one device's cache.

    With several processes (multi-host), `caches[i]` is None for another process's device: requests for
    its experts are dropped here (that process serves them), and statistics cover this process's devices.
    """

    def __init__(self, caches: Sequence[DeviceExpertCache | None], placement: Placement):
        self.caches = list(caches)
        self.placement = placement
        self.stops = 0  # `CacheView.stops`, `.stop_s`: the engine's, not one device's
        self._stop_price: Callable[[], float] | None = None

    @property
    def local(self) -> list[DeviceExpertCache]:
        return [c for c in self.caches if c is not None]

    def cache_of(self, key: Key) -> DeviceExpertCache | None:
        device = self.placement(key)
        if not 0 <= device < len(self.caches):
            raise ValueError(f"placement put expert {key} on device {device}; there are {len(self.caches)}")
        return self.caches[device]

    # -- CacheView ------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return sum(c.capacity for c in self.local)

    @property
    def stats(self) -> CacheStats:
        """Totals over this process's devices (peak bytes: the sum of each device's peak)."""
        return sum((c.stats for c in self.local), CacheStats())

    @property
    def on_demand_wait_s(self) -> float:
        return sum(c.on_demand_wait_s for c in self.local)

    def entry(self, key: Key) -> Entry | None:
        cache = self.cache_of(key)
        return None if cache is None else cache.entry(key)

    def entries(self, near: Key | None = None) -> list[tuple[Key, Entry]]:
        if near is not None:
            cache = self.cache_of(near)
            return [] if cache is None else cache.entries()
        return [item for cache in self.local for item in cache.entries()]

    def free_slots(self, near: Key | None = None) -> int:
        if near is not None:
            cache = self.cache_of(near)
            return 0 if cache is None else cache.free_slots()
        return sum(c.free_slots() for c in self.local)

    def freq(self, key: Key) -> int:
        cache = self.cache_of(key)
        return 0 if cache is None else cache.freq(key)

    def device_of(self, key: Key) -> int:
        return self.placement(key)

    # -- the driver's side --------------------------------------------------------------------------------
    def parts(self, keys: list[Key]) -> list[tuple[DeviceExpertCache, list[Key]]]:
        """Each local device's cache with its share of `keys` (devices with none left out)."""
        shares = zip(self.caches, self.split(keys), strict=True)
        return [(cache, own) for cache, own in shares if cache is not None and own]

    def split(self, keys: Iterable[Key]) -> list[list[Key]]:
        """Keys grouped by device index."""
        out: list[list[Key]] = [[] for _ in self.caches]
        for key in keys:
            out[self.placement(key)].append(key)
        return out

    def request_prefetch(
        self,
        items: Iterable[tuple[Key, float]],
        *,
        replace: Any = True,
        stale_before: int | None = None,
        if_idle: bool = False,
    ) -> None:
        items = list(items)
        by_device: list[list[tuple[Key, float]]] = [[] for _ in self.caches]
        for key, priority in items:
            by_device[self.placement(key)].append((key, priority))
        for cache, wanted in zip(self.caches, by_device, strict=True):
            if cache is not None:
                cache.request_prefetch(wanted, replace=replace, stale_before=stale_before, if_idle=if_idle)

    def drop_prefetches(self, *, before: int) -> None:
        for cache in self.local:
            cache.drop_prefetches(before=before)

    def protect(self, keys: Iterable[Key], layer: int | None = None) -> None:
        for cache, own in zip(self.caches, self.split(keys), strict=True):
            if cache is not None:
                cache.protect(own, layer)

    @property
    def stop_s(self) -> float:
        return 0.0 if self._stop_price is None else self._stop_price()

    def record_stop(self, price: Callable[[], float]) -> None:
        self.stops += 1
        self._stop_price = price

    def preload(self, keys: Iterable[Key]) -> None:
        for cache, own in zip(self.caches, self.split(keys), strict=True):
            if cache is not None:
                cache.preload(own)

    @property
    def timers(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for cache in self.local:
            for name, value in cache.timers.items():
                out[name] = out.get(name, 0.0) + value
        return out

    def device_stats(self) -> list[dict[str, Any]]:
        """Per local device."""
        return [
            dict(
                hits=c.book.stats.hits,
                misses=c.book.stats.misses,
                hit_rate=c.book.stats.hit_rate,
                bytes_to_device=c.book.stats.bytes_to_device,
                peak_bytes=c.book.stats.peak_bytes,
                capacity=c.book.capacity,
            )
            for c in self.local
        ]


__all__ = ["CacheGroup", "Entry", "Placement", "placement_from", "round_robin"]
