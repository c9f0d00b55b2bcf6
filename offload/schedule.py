"""How one MoE layer is served from the expert cache: which experts it needs, in which chunks, and the
ensure / compute / release sequence around each chunk.

Shared by the live engine (`fmoe_jax/engine.py`, whose `compute` runs the jitted expert step) and the
trace-replay simulator (whose `compute` advances a simulated clock), so both make the same cache calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .cache import Key


def needed_experts(ids: np.ndarray, valid: np.ndarray) -> list[int]:
    """Distinct experts chosen by the valid tokens: ids `[N, k]`, valid `[N]` -> sorted expert ids."""
    return sorted({int(e) for e in ids[valid].ravel()})


def announce(cache: Any, layer: int, needed: list[int]) -> None:
    """Call before telling the policy that `layer` has routed: its needed experts cannot be evicted by a
    prefetch the policy issues before `serve_layer` pins them."""
    cache.protect([(layer, e) for e in needed], layer)


def plan_chunks(
    layer: int, needed: list[int], capacity: int, resident: Callable[[Key], bool]
) -> list[list[Key]]:
    """Splits a layer's needed experts into chunks of at most `capacity`. When it takes more than one,
    resident experts go first: they are hits now, and loading the others would evict them."""
    keys = [(layer, e) for e in needed]
    if len(keys) > capacity:
        keys.sort(key=lambda k: not resident(k))
    return [keys[i : i + capacity] for i in range(0, len(keys), capacity)]


def serve_layer(
    cache: Any, layer: int, needed: list[int], compute: Callable[[list[Key], dict[Key, Any], bool], Any]
) -> Any:
    """For each chunk: `cache.ensure` it, `compute(chunk, arrays, is_last)`, release it.

    Returns what the last `compute` returned (None when nothing is needed; the caller then computes the
    layer's always-resident part alone).
    """
    out = None
    chunks = plan_chunks(layer, needed, cache.book.capacity, lambda k: k in cache.book)
    try:
        for i, chunk in enumerate(chunks):
            arrays = cache.ensure(layer, chunk)
            try:
                out = compute(chunk, arrays, i == len(chunks) - 1)
            finally:
                cache.release(chunk)
    finally:
        cache.protect(())
    return out
