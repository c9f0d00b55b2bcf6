"""fMoE's per-expert decisions as pure functions: similarity-aware selection and the two priorities.

Called by the fmoe policy's guides (`guides.py`) after a match from the expert-map store (`store.py`); no
JAX, no state.

Paper section 4.3 (selection) and 4.5 (priorities: `prefetch_priority`, `keep_priority`). Notation: J experts
per layer, K = top_k experts activated per layer, p the probability of an expert in the matched expert map.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

# Cumulative sums of float32 router probabilities stop short of 1.0 by a few ulp. Without slack, a
# threshold delta = 1 would drag in every zero-probability expert; 1e-6 is ~8 float32 ulp at 1.0.
MASS_TOLERANCE = 1e-6


def selection_threshold(score: float | np.ndarray) -> np.ndarray:
    """delta = Clip(1 - score, 0, 1) (section 4.3): low match confidence asks for more probability mass.

    Args:
      score: cosine similarity of the match, in [-1, 1]; scalar or [B].

    Returns:
      delta, float64 of the same shape, in [0, 1].
    """
    score = np.asarray(score, dtype=np.float64)
    if not np.all(np.isfinite(score)):
        raise ValueError(f"match score must be finite, got {score}; an empty store reports 0, not NaN.")
    return np.minimum(np.maximum(1.0 - score, 0.0), 1.0)  # np.clip's, at a third of its overhead


def select_experts(
    probs: np.ndarray,  # [J] or [B, J]
    score: float | np.ndarray,  # scalar or [B]
    top_k: int,
) -> np.ndarray | list[np.ndarray]:
    """Experts to prefetch for one layer of a matched map: equations 6-8 of the paper.

    The smallest set E with sum_{j in E} p_j >= delta (eq. 7) and |E| >= top_k (eq. 8), where
    delta = Clip(1 - score, 0, 1). Taking experts by descending probability gives the smallest such
    set. Ties in probability go to the lower expert id, so the result is deterministic.

    Mass is compared with a slack of `MASS_TOLERANCE`, so score <= 0 (delta = 1) takes the experts
    that carry all of the mass, not every zero-probability expert behind them.

    A row that is all zeros carries no information (an empty store answers with zero maps): it
    selects nothing, not `top_k` arbitrary experts. The authors' code does the same
    (`ExpertMapMatcher._select_by_cumsum`, `has_pos`).

    Where the paper and the authors' code differ: the code keeps the experts whose cumulative sum
    stays at or below delta (`k = (csum <= th).sum()`), one short of reaching delta; this follows
    the paper's constraint 7 (the selected mass reaches delta).

    Args:
      probs: router probabilities of one layer [J], or of several layers or rows [B, J]; >= 0.
      score: similarity of the match that produced `probs`; one per row, or one for all rows.
      top_k: experts the model activates per layer (K); 1 <= top_k <= J.

    Returns:
      For [J] input, int64 expert ids [n] in selection order (descending probability).
      For [B, J] input, a list of B such arrays.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim not in (1, 2):
        raise ValueError(f"probs must be [J] or [B, J], got shape {probs.shape}.")
    rows = probs.reshape(-1, probs.shape[-1])  # [B, J]
    order, count = _selection(rows, score, top_k)
    ids = [order[b, : count[b]].astype(np.int64) for b in range(rows.shape[0])]
    return ids[0] if probs.ndim == 1 else ids


def select_mask(probs: np.ndarray, score: float | np.ndarray, top_k: int) -> np.ndarray:
    """`select_experts` of every row `[B, J]` as a mask `[B, J]` bool (True: selected), with no Python loop
    over the rows."""
    rows = np.asarray(probs, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"probs must be [B, J], got shape {rows.shape}.")
    order, count = _selection(rows, score, top_k)
    return _mask(order, count)


def _recent(table: dict, key: Any, capacity: int, make: Callable[..., Any], *args: Any) -> Any:
    """`table[key]`, `make(*args)` if absent, kept as the most recently used of at most `capacity`: the
    `SortedMaps` caches."""
    found = table.pop(key, None)
    if found is None:
        found = make(*args)
        if len(table) >= capacity:
            del table[next(iter(table))]  # the least recently used
    table[key] = found
    return found


def _sorted_frozen(expert_map: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(_frozen(a) for a in _sorted_rows(np.asarray(expert_map)))


def _top_sets(order: np.ndarray, top_k: int) -> list[list[int]]:
    return np.sort(order[:, :top_k], axis=-1).tolist()


class SortedMaps:
    """Expert maps sorted once for selection, so that selecting from a map the matcher has met before is a
    comparison and a sum per layer (`select_mask` gives the same masks, sorting every time).

    The matcher meets the same few stored maps search after search (a store keeps a map unchanged until its
    slot is overwritten), so each map's experts by descending probability per layer, their running mass, each
    expert's rank in that order and which layers carry any mass are kept, keyed by the map's bytes, for the
    `capacity` maps used last.
    """

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._sorted: dict[bytes, tuple[np.ndarray, ...]] = {}
        self._tops: dict[tuple[bytes, int], list] = {}  # `top_sets`, for as many maps

    def top_sets(self, expert_map: np.ndarray, top_k: int) -> list[list[int]]:
        """Each layer's `top_k` likeliest experts of one map `[L, J]`, in ascending ids `[L][k]` (nested
        lists, shared between callers): the routing that confirms the map at that layer (`SearchSkips`)."""
        key = expert_map.tobytes()
        order = self.sorted(expert_map, key)[0]  # (the map's use counts as one, as a selection's would)
        return _recent(self._tops, (key, top_k), self.capacity, _top_sets, order, top_k)

    def sorted(self, expert_map: np.ndarray, key: bytes | None = None) -> tuple[np.ndarray, ...]:
        """`(order, mass, rank [L, J], nonzero [L])` of one map `[L, J]`: each layer's experts by descending
        probability (ties: lower id first), the cumulative probability in that order (float64), each expert's
        position in it, and whether the layer has any mass. Read-only arrays, shared between callers. `key`:
        the map's bytes, where the caller has them."""
        key = expert_map.tobytes() if key is None else key
        return _recent(self._sorted, key, self.capacity, _sorted_frozen, expert_map)

    def select_mask(
        self, maps: np.ndarray, layers: np.ndarray | slice, score: np.ndarray, top_k: int
    ) -> np.ndarray:  # [B, n, J] bool
        """`select_mask` of the rows `maps[b, layers]` with `score[b]` for every map `[B, L, J]` (`layers`:
        layer ids, or a slice of them)."""
        batch, _, num_experts = maps.shape
        _check_top_k(top_k, num_experts)
        masks = []
        scores = np.asarray(score, np.float64).reshape(-1).tolist()  # delta in Python floats: a map at a time
        if not all(map(math.isfinite, scores)):
            selection_threshold(score)  # raises, naming the score
        for b, delta in enumerate(min(max(1.0 - s, 0.0), 1.0) for s in scores):
            few = isinstance(layers, slice) and 2 * len(range(len(maps[b]))[layers]) < len(maps[b])
            key = maps[b].tobytes()
            if few and key not in self._sorted:  # a new map's first layers (the semantic search's): sorted
                # alone, not kept (row by row, the same numbers as the whole map's)
                _, mass, rank, nonzero = _sorted_rows(np.asarray(maps[b][layers]))
                layers_b = slice(None)
            else:
                _, mass, rank, nonzero = self.sorted(maps[b], key)
                layers_b = layers
            count = _count(mass[layers_b], nonzero[layers_b], delta, top_k)
            masks.append(rank[layers_b] < count[:, None])
        if len(masks) != batch:
            raise ValueError(f"select_mask needs one score per map, got {len(masks)} for {batch}.")
        return masks[0][None] if batch == 1 else np.stack(masks)


def _sorted_rows(rows: np.ndarray) -> tuple[np.ndarray, ...]:  # [n, J] -> `SortedMaps.sorted`'s four
    _check_rows(rows)  # float32 from the store: sorted as is, summed in float64
    layers = np.arange(rows.shape[0])[:, None]
    order = descending_order(rows)
    mass = np.cumsum(rows[layers, order], axis=1, dtype=np.float64)
    rank = np.empty_like(order)
    rank[layers, order] = np.arange(order.shape[1])
    return order, mass, rank, rows.any(axis=1)


def descending_order(rows: np.ndarray) -> np.ndarray:  # [..., J] -> [..., J] int64
    """Each row's positions by descending value, ties in ascending position: `np.argsort(-rows, axis=-1,
    kind="stable")` for finite non-negative rows. For float32 rows each value and its position are packed
    into one uint64 key (a non-negative float's bits ascend with its value) and the keys sorted unstably,
    which is several times faster for wide rows (48 x 128 at Qwen3-30B's shapes: ~25 us against ~180 on
    this CPU; stable sorting falls back to a merge sort there)."""
    if rows.dtype != np.float32:
        return np.argsort(-rows, axis=-1, kind="stable")
    bits = (rows + np.float32(0.0)).view(np.uint32)  # + 0.0: a -0.0 keys as 0.0, which it equals
    keys = (~bits).astype(np.uint64) << np.uint64(32)  # descending value in the high half
    keys |= np.arange(rows.shape[-1], dtype=np.uint64)  # ascending position in the low half
    keys.sort(axis=-1)
    return (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, J={num_experts}], got {top_k}.")


def _check_rows(rows: np.ndarray) -> None:
    if not (np.isfinite(rows).all() and rows.min(initial=0.0) >= 0):
        raise ValueError("probs must be finite and non-negative (router probabilities).")


def _selection(rows: np.ndarray, score: float | np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's experts by descending probability (ties: lower id first) `[B, J]`, and how many of them
    are selected `[B]`. (The matcher calls this after every layer: a few array operations, no more.)"""
    _check_top_k(top_k, rows.shape[1])
    _check_rows(rows)
    delta = selection_threshold(score)  # scalar or [B]
    order = np.argsort(-rows, axis=1, kind="stable")  # [B, J]; stable: ties keep the lower id first
    mass = np.cumsum(np.take_along_axis(rows, order, axis=1), axis=1)  # [B, J], non-decreasing
    return order, _count(mass, rows.any(axis=1), delta, top_k)


def _count(mass: np.ndarray, nonzero: np.ndarray, delta: float | np.ndarray, top_k: int) -> np.ndarray:
    """How many of each row's experts are selected `[B]`, from the cumulative mass in descending order
    `[B, J]`: the positions short of delta are a prefix, and the first to reach it is the next one (a row
    that never reaches it takes all J); at least top_k; none from a row with no mass."""
    bound = delta - MASS_TOLERANCE  # one for all rows (a float, the matcher's case), or one per row
    short = mass < (bound if isinstance(bound, float) else np.reshape(bound, (-1, 1)))
    count = np.minimum(np.maximum(short.sum(axis=1) + 1, top_k), mass.shape[1])
    return np.where(nonzero, count, 0)


def _mask(order: np.ndarray, count: np.ndarray) -> np.ndarray:  # [B, J], [B] -> [B, J] bool
    mask = np.empty(order.shape, bool)
    mask[np.arange(order.shape[0])[:, None], order] = np.arange(order.shape[1]) < count[:, None]
    return mask


def _frozen(x: np.ndarray) -> np.ndarray:
    x.flags.writeable = False
    return x


def prefetch_priority(
    p: float | np.ndarray,  # [...]
    layer: int | np.ndarray,  # broadcasts with p
    current_layer: int,
) -> np.ndarray:
    """PRI_prefetch = p / (layer - current_layer) (section 4.5); higher is prefetched first.

    Likely experts and experts of nearby layers go first. Only layers strictly ahead of the
    current one can be prefetched: the current layer's misses are loaded on demand, ahead of every
    prefetch, so `layer <= current_layer` is a caller error and raises.

    The authors' code orders prefetches by p times a linear decay over the target band of layers
    (`ExpertMapMatcher._layer_decay_weights`); this follows the paper's equation.

    Args:
      p: expert probabilities from the matched map, >= 0.
      layer: target layer of each expert (0-based, like `current_layer`).
      current_layer: layer the forward pass is at.

    Returns:
      float64 priorities, the broadcast shape of `p` and `layer`.
    """
    p = np.asarray(p, dtype=np.float64)
    distance = np.asarray(layer, dtype=np.int64) - current_layer
    if np.any(distance <= 0):
        raise ValueError(
            f"prefetch_priority needs target layers after current_layer={current_layer}, got layer(s) "
            f"{np.asarray(layer).ravel().tolist()}; experts of the current layer are loaded on demand."
        )
    if not np.all(p >= 0):
        raise ValueError("prefetch_priority needs probabilities >= 0, got NaN or < 0.")
    return p / distance


def keep_priority(
    p: float | np.ndarray,  # [...]
    uses: float | np.ndarray,  # broadcasts with p
) -> np.ndarray:
    """fMoE's eviction order (section 4.5) as a keep score: p * (uses + 1); the LOWEST is evicted first.

    The paper's PRI_evict = 1 / (p * freq) evicts the highest first, which is the same order as evicting
    the lowest p * freq; the authors' cache sorts by p * incache_visit_count ascending and evicts from the
    front (`ArcherTaskPool::RemoveCachedSparseNode`). freq here is uses + 1: the arrival counts as one
    visit, so that an expert prefetched and not yet used (uses = 0) is ranked by its p, not evicted first
    with every p. The fmoe policy's `keep_score` and `admit_prefetch` call this; so do its tests.

    Args:
      p: probability of the expert in the map guiding its layer, >= 0 (0 if no map names it).
      uses: times the expert served a layer since it entered the cache's history, >= 0.

    Returns:
      float64 scores >= 0, the broadcast shape of `p` and `uses`.
    """
    p = np.asarray(p, dtype=np.float64)
    uses = np.asarray(uses, dtype=np.float64)
    if not (np.all(p >= 0) and np.all(uses >= 0)):
        raise ValueError("keep_priority needs probabilities and use counts >= 0 (not NaN).")
    return p * (uses + 1.0)
