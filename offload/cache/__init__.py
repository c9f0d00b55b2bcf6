"""The device expert cache: its bookkeeping (`book.py`: `CacheBook`, plain Python), what policies and the
driver see of it (`view.py`), and the cache of one device with its copies (`device.py`:
`DeviceExpertCache`, `Mover`)."""

from .book import CacheBook, CacheStats, Entry, Key
from .device import DeviceExpertCache, EvictionPolicy, Mover
from .view import BookView, CacheView, ServingCache

__all__ = [
    "BookView",
    "CacheBook",
    "CacheStats",
    "CacheView",
    "DeviceExpertCache",
    "Entry",
    "EvictionPolicy",
    "Key",
    "Mover",
    "ServingCache",
]
