"""Expert-parallel placement: which device holds each routed expert, and one cache per device behind one face.

The engine builds a `CacheGroup` when `OffloadConfig(devices=...)` names several devices; policies keep
seeing `(layer, expert)` keys and one cache (`request_prefetch`, `book.freq`, `book.entries`), and the
group routes every call to the cache of the device the placement assigns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .cache import CacheStats, Entry, Key
from .transfer import DeviceExpertCache

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


class _Routed(Mapping):
    """A read-only mapping over the per-device books' dicts (`freq` or `entries`), routed by placement."""

    def __init__(self, group: CacheGroup, attr: str):
        self.group, self.attr = group, attr

    def _owner(self, key: Key) -> dict:
        cache = self.group.caches[self.group.placement(key)]
        return {} if cache is None else getattr(cache.book, self.attr)

    def __getitem__(self, key: Key) -> Any:
        return self._owner(key)[key]

    def get(self, key: Key, default: Any = None) -> Any:
        return self._owner(key).get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._owner(key)  # type: ignore[arg-type]

    def __iter__(self):
        for cache in self.group.local:
            yield from getattr(cache.book, self.attr)

    def __len__(self) -> int:
        return sum(len(getattr(c.book, self.attr)) for c in self.group.local)


class _GroupBook:
    """The part of `CacheBook` policies and the engine read, over all devices."""

    def __init__(self, group: CacheGroup):
        self.group = group
        self.freq = _Routed(group, "freq")
        self.entries = _Routed(group, "entries")

    @property
    def capacity(self) -> int:
        return sum(c.book.capacity for c in self.group.local)

    @property
    def expert_bytes(self) -> int:
        return self.group.local[0].book.expert_bytes

    @property
    def free_slots(self) -> int:
        return sum(c.book.free_slots for c in self.group.local)

    def __contains__(self, key: Key) -> bool:
        cache = self.group.cache_of(key)
        return cache is not None and key in cache.book

    def __len__(self) -> int:
        return sum(len(c.book) for c in self.group.local)

    @property
    def stats(self) -> CacheStats:
        """Totals over devices (peak bytes: the sum of each device's peak)."""
        total = CacheStats()
        for cache in self.group.local:
            s = cache.book.stats
            for field in (
                "hits",
                "misses",
                "late_prefetches",
                "prefetches",
                "wasted_prefetches",
                "dropped_prefetches",
                "loads",
                "bytes_to_device",
                "peak_bytes",
            ):
                setattr(total, field, getattr(total, field) + getattr(s, field))
            for layer, value in s.layer_hits.items():
                total.layer_hits[layer] = total.layer_hits.get(layer, 0) + value
            for layer, value in s.layer_needed.items():
                total.layer_needed[layer] = total.layer_needed.get(layer, 0) + value
        return total


class CacheGroup:
    """One `DeviceExpertCache` per device, addressed by `(layer, expert)` through `placement`.

    With several processes (multi-host), `caches[i]` is None for another process's device: requests for
    its experts are dropped here (that process serves them), and statistics cover this process's devices.
    """

    def __init__(self, caches: Sequence[DeviceExpertCache | None], placement: Placement):
        self.caches = list(caches)
        self.placement = placement
        self.book = _GroupBook(self)

    @property
    def local(self) -> list[DeviceExpertCache]:
        return [c for c in self.caches if c is not None]

    def cache_of(self, key: Key) -> DeviceExpertCache | None:
        device = self.placement(key)
        if not 0 <= device < len(self.caches):
            raise ValueError(f"placement put expert {key} on device {device}; there are {len(self.caches)}")
        return self.caches[device]

    def split(self, keys: Iterable[Key]) -> list[list[Key]]:
        """Keys grouped by device index."""
        out: list[list[Key]] = [[] for _ in self.caches]
        for key in keys:
            out[self.placement(key)].append(key)
        return out

    def request_prefetch(
        self, items: Iterable[tuple[Key, float]], *, replace: Any = True, stale_before: int | None = None
    ) -> None:
        items = list(items)
        by_device: list[list[tuple[Key, float]]] = [[] for _ in self.caches]
        for key, priority in items:
            by_device[self.placement(key)].append((key, priority))
        for cache, wanted in zip(self.caches, by_device, strict=True):
            if cache is not None:
                cache.request_prefetch(wanted, replace=replace, stale_before=stale_before)

    def protect(self, keys: Iterable[Key], layer: int | None = None) -> None:
        for cache, own in zip(self.caches, self.split(keys), strict=True):
            if cache is not None:
                cache.protect(own, layer)

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
