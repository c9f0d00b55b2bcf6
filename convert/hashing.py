"""What fmoe-convert shows and hashes while it writes: progress bars, and the sha256 of every file on one
background thread (the manifest's records), overlapping the conversion."""

from __future__ import annotations

import concurrent.futures as cf
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from fmoe_jax.checkpoint.manifest import FileRecord, hash_file


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        smoothing=0.1,
    )


class Hasher:
    """sha256 of files on one background thread, overlapping the conversion (hashlib releases the GIL)."""

    def __init__(self) -> None:
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fmoe-hash")
        self._stop = threading.Event()
        self._futures: dict[str, tuple[Path, cf.Future]] = {}
        self._done_bytes = 0
        self._lock = threading.Lock()

    def _count(self, n: int) -> None:
        with self._lock:
            self._done_bytes += n

    def __contains__(self, name: str) -> bool:
        return name in self._futures

    def add(self, name: str, path: Path) -> None:
        self._futures[name] = (
            path,
            self._pool.submit(hash_file, path, on_bytes=self._count, stop=self._stop),
        )

    def results(self, names: Sequence[str], bar: tqdm, poll: Callable[[], None]) -> dict[str, FileRecord]:
        """Waits for the given files' hashes, advancing `bar` by the bytes hashed meanwhile."""
        out = {}
        with self._lock:
            seen = self._done_bytes
        for name in names:
            future = self._futures[name][1]
            while not cf.wait([future], timeout=0.2).done:
                poll()
                with self._lock:
                    bar.update(self._done_bytes - seen)
                    seen = self._done_bytes
            out[name] = future.result()
        with self._lock:
            bar.update(self._done_bytes - seen)
        return out

    def pending_bytes(self) -> int:
        with self._lock:
            done = self._done_bytes
        return sum(path.stat().st_size for path, _ in self._futures.values()) - done

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
