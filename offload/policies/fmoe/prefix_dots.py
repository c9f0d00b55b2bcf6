"""An iteration's trajectory searches of the expert-map store, layer after layer, summing only the layers new
since the last search (`PrefixDots`). Used by `ExpertMapStore.match_traj` and the fmoe policy's matcher.
"""

from __future__ import annotations

import math

import numpy as np

from .store import _NORM_FLOOR, ExpertMapStore, _scores


class PrefixDots:
    """One iteration's trajectory searches, layer after layer: the dot products of a batch's map prefixes with
    every stored map's prefix and the prefixes' squared norms are carried from one search to the next, so
    that a search after layer l adds layer l's products alone (n x J multiply-adds) and validates only the
    new layers.

    It starts over by itself whenever the earlier layers it summed are not the query's (another iteration,
    other rows) or the store has changed since (`ExpertMapStore.version`); sums in another order than one
    matrix product over the whole prefix, so scores may differ from a fresh search in the last float32 bits.
    """

    def __init__(self) -> None:
        self._key: tuple[int, int, int] | None = None  # (store id, store version, rows) the sums belong to
        self._query: np.ndarray | None = None  # [B, L, J] the prefix summed so far (first `_done` layers)
        self._done = 0
        self._dots: np.ndarray | None = None  # [B, n]
        self._squares: np.ndarray | None = None  # [B] float64, squared norm of the summed prefix

    def full_dots(self, store: ExpertMapStore, maps: np.ndarray) -> np.ndarray | None:
        """The dot products of whole maps `[B, L, J]` with every stored map `[B, n]` (float32), by finishing
        the sums of this iteration's searches, when those were of the same store and of `maps`' first layers
        (the layers after the last search are added: n x J multiply-adds each); None otherwise. `add` takes
        them for its redundancy rule (`dots`): decode's map update needs no pass of its own over the store."""
        rows = len(maps)
        if self._key != (id(store), store.version, rows) or not self._done:
            return None
        done = self._done
        if maps.shape[1:] != self._query.shape[1:] or not np.array_equal(
            maps[:, :done], self._query[:, :done]
        ):
            return None
        rest = np.ascontiguousarray(maps[:, done:], dtype=np.float32)
        if not np.isfinite(rest).all():
            return None
        self._sum(store, rest, done)
        return self._dots

    def _sum(self, store: ExpertMapStore, new: np.ndarray, done: int) -> None:
        """Adds layers `done`, `done + 1`, ... of the query (`new` [B, m, J], float32) to the sums."""
        n, by_layer = store._size, store._by_layer
        if len(new) == 1:  # decode at batch 1: each layer's gemv (one batched call), added in place in order
            dots = self._dots[0]
            for part in np.matmul(by_layer[done : done + new.shape[1], :n], new[0, :, :, None])[..., 0]:
                dots += part
        else:
            for i in range(new.shape[1]):
                self._dots += _scores(by_layer[done + i, :n], new[:, i])
        self._squares += np.square(new, dtype=np.float64).sum(axis=(1, 2))
        self._query[:, done : done + new.shape[1]] = new
        self._done = done + new.shape[1]

    def search(self, store: ExpertMapStore, trajs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`store.match_traj(trajs, self)`: `trajs` [B, l, J] already shape-checked by the store."""
        rows, observed = trajs.shape[:2]
        key = (id(store), store.version, rows)
        done = self._done if self._key == key else 0
        if done > observed or (done and not (trajs[:, :done] == self._query[:, :done]).all()):
            done = 0
        new = np.ascontiguousarray(trajs[:, done:], dtype=np.float32)  # [B, l - done, J]
        if not np.isfinite(new).all():
            raise ValueError("trajs holds NaN or inf; the store only takes finite values.")
        n, layers, experts = store._size, store.num_layers, store.num_experts
        if done == 0:
            self._dots = np.zeros((rows, n), np.float32)
            self._squares = np.zeros(rows, np.float64)
            self._query = np.empty((rows, layers, experts), np.float32)
        self._key = key
        self._sum(store, new, done)
        if rows == 1:  # decode at batch 1: the same float32 numbers, with Python scalars around them
            inv_query = np.float32(1.0 / max(math.sqrt(self._squares[0]), _NORM_FLOOR))
            sims = self._dots[0] * store._inv_prefix_norm[observed - 1, :n] * inv_query
            best = int(sims.argmax())
            score = np.array([min(max(float(sims[best]), -1.0), 1.0)], np.float32)  # as `_answer` clips
            return score, store._maps[best : best + 1].reshape(1, layers, experts).copy()
        inv_query = (1.0 / np.maximum(np.sqrt(self._squares), _NORM_FLOOR)).astype(np.float32)
        sims = self._dots * store._inv_prefix_norm[observed - 1, :n] * inv_query[:, None]
        best = np.argmax(sims, axis=1)  # [B]
        return store._answer(sims[np.arange(rows), best], best)
