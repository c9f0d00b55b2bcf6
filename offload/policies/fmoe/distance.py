"""Eviction by expected next-use distance (`FMoEOptions.reuse_distance`): the victim is the resident expert
whose next use lies furthest ahead in layer steps, as Belady's rule would pick had it to guess.

Why: the reuse forecast scores "used again within h iterations", which ranks an expert of the layer about
to route (needed, if at all, in one layer step) like one of a layer that has just routed (a whole iteration
away), and scores a long-run favourite of the request that skipped a few tokens like a stranger. Here each
expert's chance p of being used at its layer's next routing is the larger of a table's (counts over the
request's own history of it: iterations since its last use, uses in the last 8 and 32 iterations, share of
the request so far; fit on recorded routing by `FMoE.from_traces` and learned on as requests are served)
and the reuse forecast's per iteration (which knows the store's reuse hint), combined with the guides' need
for that routing; its next use is then expected d + L (1 - p) / p layer steps ahead (d: steps until its
layer routes; then a use every 1 / p iterations). Only the victim's choice changes: admission still prices
a prefetch against the victim's reuse score, on the scale it was tuned for.
Decision "next-use distance".

Letters: T iterations, L MoE layers, J experts per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .forecast import ReuseForecast
from .next_use import gaps_since_use

# Features of an expert at the start of an iteration: iterations since the request last used it (0 = the
# previous one; held at _CAP, or _NEVER while unused), uses in the last 8 iterations (0-8), uses in the last
# 32 (binned by W32_EDGES) and the share of the request's iterations so far (SHARE_EDGES).
GAP_EDGES = np.array([1, 2, 3, 4, 5, 7, 10, 16, 32])
W32_EDGES = np.array([1, 2, 3, 5, 9, 17])
SHARE_EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.35])
_CAP, _NEVER = 32, 33
_GAP_BIN = np.append(np.searchsorted(GAP_EDGES, np.arange(_CAP + 1), side="right"), len(GAP_EDGES) + 1)
_SIZES = (len(GAP_EDGES) + 2, 9, len(W32_EDGES) + 1, len(SHARE_EDGES) + 1)
CELLS = int(np.prod(_SIZES))
PRIOR = 4.0  # pseudo-observations of the base rate (top_k / J) in every cell
_FLOOR = 1e-3  # the least chance of use: an expected distance stays finite


_W32_BIN = np.searchsorted(W32_EDGES, np.arange(33), side="right")


def cells(gap: np.ndarray | int, last8: np.ndarray, last32: np.ndarray, share: np.ndarray) -> np.ndarray:
    """Each expert's table cell from its features (arrays of one shape; `gap` may be a number)."""
    share_bin = np.searchsorted(SHARE_EDGES, share, side="right")
    return ((_GAP_BIN.take(gap) * _SIZES[1] + last8) * _SIZES[2] + _W32_BIN.take(last32)) * _SIZES[
        3
    ] + share_bin


def request_cells(used: np.ndarray) -> np.ndarray:
    """`[T, L, J]` each expert's cell as each iteration of a recorded request starts (`used` `[T, L, J]`)."""
    steps = used.shape[0]
    cumulative = np.concatenate([np.zeros((1, *used.shape[1:]), np.int64), np.cumsum(used, axis=0)])
    t = np.arange(steps)
    last8 = cumulative[t] - cumulative[np.maximum(t - 8, 0)]
    last32 = cumulative[t] - cumulative[np.maximum(t - 32, 0)]
    share = cumulative[t] / np.maximum(t, 1)[:, None, None]
    gap = gaps_since_use(used)
    return cells(gap, last8, last32, share)


def fit_counts(requests: Sequence[np.ndarray]) -> np.ndarray:
    """`[2, CELLS]` uses and observations per cell over recorded requests' `used_sets` `[T, L, J]`."""
    counts = np.zeros((2, CELLS))
    for used in requests:
        index = request_cells(used).ravel()
        counts[0] += np.bincount(index, used.ravel().astype(np.float64), minlength=CELLS)
        counts[1] += np.bincount(index, minlength=CELLS)
    return counts


class DistanceForecast(ReuseForecast):
    """`ReuseForecast` (whose scores admission and the guides still read) that also keeps each expert's
    chance of use at its layer's next routing (`chance`, `[L, J]`: this iteration's for a layer still to
    route, the next one's for a layer that has) from the table of `counts`, learning on as it goes; and
    ranks resident experts by expected next-use distance (`keep_scores`, from the larger of that chance and
    its own scores' per iteration)."""

    def __init__(
        self, num_layers: int, num_experts: int, top_k: int, counts: np.ndarray | None = None, **kw: object
    ):
        self.counts = np.zeros((2, CELLS)) if counts is None else np.array(counts, np.float64)
        if self.counts.shape != (2, CELLS):
            raise ValueError(f"next-use counts are {self.counts.shape}, expected {(2, CELLS)}")
        self.base_rate = top_k / num_experts
        super().__init__(num_layers, num_experts, **kw)

    def start_request(self) -> None:
        shape = self.shape
        self._gap = np.full(shape, _NEVER, np.int64)
        self._ring = np.zeros((32, *shape), np.int64)  # the last 32 iterations' uses
        self._last8 = np.zeros(shape, np.int64)
        self._last32 = np.zeros(shape, np.int64)
        self._uses = np.zeros(shape, np.int64)
        self._step = 0
        self._begin()
        super().start_request()

    def _rates(self) -> np.ndarray:
        return (self.counts[0] + PRIOR * self.base_rate) / (self.counts[1] + PRIOR)

    def _begin(self) -> None:
        """Each expert's cell and chance for the iteration about to start, and its chance at the next one
        if this one uses it or not (`mark_used` copies them in as its layer routes)."""
        step, gap = self._step, self._gap
        leaving8 = self._ring[(step - 8) % 32] if step >= 8 else 0  # the iteration leaving the window
        leaving32 = self._ring[step % 32] if step >= 32 else 0
        last8, last32 = self._last8 - leaving8, self._last32 - leaving32
        rate = self._rates()
        self._cells = cells(gap, self._last8, self._last32, self._uses / max(step, 1))
        self.chance = rate.take(self._cells)
        self._if_missed_chance = rate.take(
            cells(np.where(gap < _CAP, gap + 1, gap), last8, last32, self._uses / (step + 1))
        )
        self._if_used_chance = rate.take(cells(0, last8 + 1, last32 + 1, (self._uses + 1) / (step + 1)))

    def mark_used(self, layer: int, experts: np.ndarray) -> None:
        """Layer `layer` has routed: its experts' chance becomes the next iteration's."""
        super().mark_used(layer, experts)
        self.chance[layer] = self._if_missed_chance[layer]
        self.chance[layer, experts] = self._if_used_chance[layer, experts]

    def end_iteration(self, used: np.ndarray) -> None:
        used = np.asarray(used, bool)
        both = np.bincount((self._cells + CELLS * used).ravel(), minlength=2 * CELLS)  # missed, used
        self.counts[0] += both[CELLS:]
        self.counts[1] += both[:CELLS] + both[CELLS:]
        step, slot = self._step, self._step % 32
        if step >= 8:
            self._last8 -= self._ring[(step - 8) % 32]
        if step >= 32:
            self._last32 -= self._ring[slot]
        self._ring[slot] = used
        self._last8 += used
        self._last32 += used
        self._uses += used
        self._gap = np.where(self._gap < _CAP, self._gap + 1, self._gap)
        self._gap[used] = 0
        self._step += 1
        self._begin()
        super().end_iteration(used)

    def keep_scores(self, flat: np.ndarray, need: np.ndarray, current: int) -> np.ndarray:
        """Minus the expected next-use distance in layer steps of the experts at flat indices `flat`
        (layer * J + expert), after layer `current` of the iteration routed (-1: none yet); `need` `[L, J]`:
        the guides' need at each layer's next routing."""
        num_layers, num_experts = self.shape
        layers = flat // num_experts
        forecast = 1.0 - (1.0 - self.scores.take(flat)) ** (1.0 / self.horizon)  # within h -> per iteration
        p = 1.0 - (1.0 - need.take(flat)) * (1.0 - np.maximum(self.chance.take(flat), forecast))
        steps = layers - current + np.where(layers <= current, num_layers, 0)
        return -(steps + num_layers * (1.0 - p) / np.maximum(p, _FLOOR))
