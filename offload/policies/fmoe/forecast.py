"""What fMoE's predictions are worth, learned online from outcomes: calibrated need probabilities for
prefetching, and forecasts of reuse a few tokens ahead for eviction. Used by the fmoe policy's guides and
eviction (`guides.py`, `eviction.py`).

Why: a matched expert map's probability is not the probability that the expert will be needed (a map
matched with similarity 0.7 is not a forecast), and what eviction must know is reuse two to four tokens
ahead, which the current token's map does not say. Both are estimated here the cheap way, as tables of
counts over a few binned features, updated from what each layer and iteration turned out to need.

Letters: L MoE layers, J experts per layer, H the reuse horizon in iterations.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import numpy as np

# Bin edges. Map probability p and match similarity s in [0, 1]; distance in layers (1, 2, 3, 4+).
P_EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8])
S_EDGES = np.array([0.5, 0.7, 0.85, 0.95])
MAX_DISTANCE = 4
# Reuse features: iterations since the request last used the expert (0 = the previous one) and the share
# of the request's iterations that used it (decayed).
GAP_EDGES = np.array([1, 2, 3, 5, 9])  # gap 0, 1, 2, 3-4, 5-8, 9+ ; "never" is its own bin
SHARE_EDGES = np.array([0.05, 0.15, 0.3, 0.5, 0.75])
RECENCY_BINS = len(GAP_EDGES) + 2  # the gap bins and "never"
# `ReuseForecast`'s gap counter: iterations since the last use, held at the last edge (9: "9 or more") or
# at `_NEVER` (not used yet by the request); `_GAP_BIN` maps it to its gap bin.
_NEVER = GAP_EDGES[-1] + 1
_GAP_BIN = np.append(np.searchsorted(GAP_EDGES, np.arange(_NEVER), side="right"), RECENCY_BINS - 1)
# The sticky feature's decay (`ReuseForecast(sticky=True)`): the request's long-run share of iterations that
# used the expert, over about 1 / (1 - decay) iterations (its recent share forgets within about five).
STICKY_DECAY = 0.97


class Calibration:
    """P(needed | map probability, match similarity, distance in layers, recency) from counts.

    Recency is the expert's gap bin in the request (iterations since it last used the expert, `GAP_EDGES`;
    `RECENCY_BINS - 1`: never): a matched map that gives an expert little weight says less when the request
    used the expert a token ago. `predict` and `observe` take arrays of equal shape (recency may be left
    out: bin 0). An empty bin answers the pooled rate of its (probability, similarity, distance) bin over
    every recency, and an empty pooled bin the raw map probability itself (`prior_strength`
    pseudo-observations each), so calibration starts as the paper's rule and moves as outcomes arrive.
    """

    def __init__(self, prior_strength: float = 4.0):
        shape = (len(P_EDGES) + 1, len(S_EDGES) + 1, MAX_DISTANCE, RECENCY_BINS)
        # needed, seen and the sum of raw p (the prior's mean) per bin, stacked so that one `np.add.at`
        # updates all three; and the same summed over recency (`predict_binned`'s prior).
        self._counts = np.zeros((3, *shape))
        self._pooled = np.zeros((3, *shape[:-1]))
        self.prior_strength = prior_strength
        self._table: np.ndarray | None = None  # `predict_binned`'s answer per bin, from the counts (NaN: p)

    needed = property(lambda self: self._counts[0])
    seen = property(lambda self: self._counts[1])
    p_sum = property(lambda self: self._counts[2])

    @staticmethod
    def bins(
        p: np.ndarray, score: np.ndarray, distance: np.ndarray, recency: np.ndarray | int = 0
    ) -> np.ndarray:
        """Each observation's bin, as an index into the flattened tables (`np.add.at` and `np.take` on one
        index are several times faster than on four: the matcher calls these after every layer). The
        fmoe policy keeps the bins of its guides, for `observe_binned` when their layer has routed."""
        d = np.minimum(np.maximum(np.asarray(distance, np.int64), 1), MAX_DISTANCE) - 1
        p_bin, s_bin = P_EDGES.searchsorted(p), S_EDGES.searchsorted(score)
        # ((p_bin * S + s_bin) * D + d) * R + recency, S = len(S_EDGES) + 1, with the terms that do not
        # depend on p summed first: `distance` is usually a column [n, 1] and `score` a scalar, so three
        # operations over the whole [n, J] instead of six (the same integers).
        rest = (s_bin * MAX_DISTANCE + d) * RECENCY_BINS
        return p_bin * ((len(S_EDGES) + 1) * MAX_DISTANCE * RECENCY_BINS) + rest + recency

    def observe(
        self,
        p: np.ndarray,
        score: np.ndarray,
        distance: np.ndarray,
        needed: np.ndarray,
        recency: np.ndarray | int = 0,
    ) -> None:
        self.observe_binned(p, self.bins(p, score, distance, recency), needed)

    def observe_binned(self, p: np.ndarray, bins: np.ndarray, needed: np.ndarray) -> None:
        bins = np.asarray(bins, np.int64).ravel()
        size = self._counts[0].size
        # A bincount per table, each observation weighing 1 if needed (else 0), 1 and its p: exact for the
        # counts (sums of whole numbers); each bin of p sums its observations in their order.
        counts = np.empty((3, size))
        counts[0] = np.bincount(bins, np.asarray(needed, np.float64).ravel(), minlength=size)
        counts[1] = np.bincount(bins, minlength=size)
        counts[2] = np.bincount(bins, np.ravel(p), minlength=size)
        counts = counts.reshape(self._counts.shape)
        self._counts += counts
        self._pooled += counts.sum(axis=-1)
        self._table = None

    def predict(
        self, p: np.ndarray, score: np.ndarray, distance: np.ndarray, recency: np.ndarray | int = 0
    ) -> np.ndarray:
        return self.predict_binned(p, self.bins(p, score, distance, recency))

    def predict_binned(self, p: np.ndarray, bins: np.ndarray) -> np.ndarray:
        """The need probability of each observation from its raw map probability `p` and its bin. Every bin
        whose pooled bin has counts answers a number of its own (`_prepare`, once after each `observe`); the
        rest answer `p` itself (no counts anywhere near: the prior alone)."""
        if self._table is None:
            self._prepare()
        known = self._table.take(bins)  # a new array: the bins with no counts take p in place
        np.copyto(known, p, where=np.isnan(known))
        return known

    def _prepare(self) -> None:
        k = self.prior_strength
        needed_pool, seen_pool, p_pool = self._pooled.reshape(3, -1, 1)
        # NaN where the pooled bin is empty (no observation: its p sum is 0 too): `predict_binned` answers p
        raw = np.divide(p_pool, seen_pool, out=np.full_like(p_pool, np.nan), where=seen_pool > 0)
        prior = (needed_pool + k * raw) / (seen_pool + k)  # [pooled bins, 1]: each recency bin's prior
        needed, seen = self._counts.reshape(3, -1, RECENCY_BINS)[:2]
        self._table = ((needed + k * prior) / (seen + k)).ravel()

    def state(self) -> dict[str, np.ndarray]:
        return {"needed": self.needed, "seen": self.seen, "p_sum": self.p_sum}

    def load(self, state: dict[str, Any]) -> None:
        """Restores `state()`; tables of another shape (an older layout) are ignored: learning starts over."""
        names = ("needed", "seen", "p_sum")
        if all(np.shape(state.get(name)) == self._counts.shape[1:] for name in names):
            self._counts = np.stack([np.asarray(state[name], np.float64) for name in names])
            self._pooled = self._counts.sum(axis=-1)
            self._table = None


class ReuseForecast:
    """P(an expert is needed within the next `horizon` iterations of the request), per expert `[L, J]`.

    Features per expert, from the request's own routing so far: iterations since its last use (temporal
    locality) and the decayed share of iterations that used it (with `sticky`, also its long-run share:
    the experts a request keeps returning to), plus, when given, the probability a
    matched expert map gives it for the current token (`hint`). A table of counts over the binned
    features is updated each iteration with the outcomes `horizon` iterations later; two more tables count
    the same outcomes split by whether the snapshot's own iteration used the expert. Once an expert's layer
    has routed in the current iteration it scores from the table its outcome there picks (`mark_used`),
    for the same window of iterations as every other expert (decision "forecast after a layer routes").
    """

    def __init__(
        self, num_layers: int, num_experts: int, *, horizon: int = 2, decay: float = 0.8, sticky: bool = False
    ):
        if horizon < 1:
            raise ValueError(f"the reuse horizon must be >= 1 iteration, got {horizon}")
        self.shape = (num_layers, num_experts)
        self.horizon, self.decay, self.sticky = horizon, decay, sticky
        sticky_bins = len(SHARE_EDGES) + 1 if sticky else 1
        table = (len(GAP_EDGES) + 2, len(SHARE_EDGES) + 1, sticky_bins, len(P_EDGES) + 1)
        # The prior per bin (flat, gap-major): 0.6 for experts used at the last iteration (gap 0), 0.2 else.
        gap_size = int(np.prod(table[1:]))
        self._prior = np.where(np.arange(int(np.prod(table))) < gap_size, 0.6, 0.2)
        self.reused = np.zeros(table)
        self.seen = np.zeros(table)
        # The same counts for the experts the snapshot's own iteration did not use and did use: what a layer
        # that has routed says about each of its experts (`mark_used`).
        self.reused_missed = np.zeros(table)
        self.seen_missed = np.zeros(table)
        self.reused_hit = np.zeros(table)
        self.seen_hit = np.zeros(table)
        self.start_request()

    def start_request(self) -> None:
        self.iteration = 0
        self._since = np.full(self.shape, _NEVER, np.int64)  # iterations since the request used it (capped)
        self.share = np.zeros(self.shape)
        self.long_share = np.zeros(self.shape)  # decayed by STICKY_DECAY, not yet bias-corrected
        self.pending: collections.deque[tuple[np.ndarray, list[np.ndarray]]] = collections.deque()
        self._prepare()
        self._score(None)

    def _prepare(self) -> None:
        """What stays fixed until `end_iteration`: each bin's probability (`_table`, flat; `_table_missed`
        given the iteration did not use the expert, falling back to `_table` while it has few counts) and
        each expert's bin without the hint (`_base` `[L, J]`: gap and share). A new hint then costs a search
        and a few takes: the reuse predictor refreshes the hint after every layer, on the engine thread."""
        # Laplace-smoothed; an unseen bin falls back to a weak prior of "recently used is likely reused".
        self._table = (self.reused.ravel() + self._prior) / (self.seen.ravel() + 1.0)
        self._table_missed = (self.reused_missed.ravel() + self._table) / (self.seen_missed.ravel() + 1.0)
        gap = _GAP_BIN.take(self._since)
        share = np.searchsorted(SHARE_EDGES, self.share)
        self.recency = gap  # [L, J] each expert's gap bin this iteration (`Calibration`'s recency)
        sticky, sticky_used = self._sticky_bins()
        _, shares, stickies, hints = self.seen.shape
        self._base = ((gap * shares + share) * stickies + sticky) * hints  # hint bin 0
        # The bins the experts would have next iteration once used in this one (gap 0, the share counting
        # it): `_if_used`'s prior while the table of used experts has few counts.
        share_used = np.searchsorted(SHARE_EDGES, self.decay * self.share + (1 - self.decay))
        self._base_used = (share_used * stickies + sticky_used) * hints
        # `_if_used`'s counts, flat, its denominator's + 1 added once here rather than at every `_score`.
        self._reused_hit, self._seen_hit_1 = self.reused_hit.ravel(), self.seen_hit.ravel() + 1.0

    def _sticky_bins(self) -> tuple[np.ndarray | int, np.ndarray | int]:
        """Each expert's sticky bin now, and once used in this iteration (0 and 0 without the feature): its
        long-run share of the request's iterations, bias-corrected for a short request."""
        if not self.sticky:
            return 0, 0
        seen = 1.0 - STICKY_DECAY**self.iteration
        now = self.long_share / seen if self.iteration else self.long_share
        used = (STICKY_DECAY * self.long_share + (1 - STICKY_DECAY)) / (
            1.0 - STICKY_DECAY ** (self.iteration + 1)
        )
        return np.searchsorted(SHARE_EDGES, now), np.searchsorted(SHARE_EDGES, used)

    def bins(self, hint: np.ndarray | None = None) -> np.ndarray:
        """Each expert's bin `[L, J]` (gap, share, hint probability): an index into the flattened tables."""
        return self._base if hint is None else self._base + np.searchsorted(P_EDGES, hint)

    def _score(self, hint: np.ndarray | None) -> np.ndarray:
        """`scores` for the iteration, and each expert's score once its layer has routed with it
        (`_if_used`) or without it (`_if_missed`), which `mark_used` copies in. Returns each expert's bin."""
        hint_bins = 0 if hint is None else np.searchsorted(P_EDGES, hint)
        bins = self._base + hint_bins
        self.scores = self._table.take(bins)
        prior = self._table.take(self._base_used + hint_bins)
        self._if_used = (self._reused_hit.take(bins) + prior) / self._seen_hit_1.take(bins)
        self._if_missed = self._table_missed.take(bins)
        return bins

    def begin_iteration(self, hint: np.ndarray | None = None) -> None:
        """A new iteration of the request: scores for it from the routing so far (and the map's `hint`
        `[L, J]` for this token, if any)."""
        self.pending.append((self._score(hint), []))

    def refresh(self, hint: np.ndarray, used: np.ndarray, routed: int = -1) -> None:
        """A newer `hint` `[L, J]` for the current iteration (the learned reuse predictor's, after a layer has
        routed): scores from it, the experts the iteration has used so far (`used` `[L, J]` bool) scoring as
        used and the other experts of the layers that have routed (`routed` and those before) as missed
        (`mark_used`), and the iteration learns its outcome under the newest hint."""
        bins = self._score(hint)
        if routed >= 0:
            self.scores[: routed + 1] = self._if_missed[: routed + 1]
        self.scores = np.where(used, self._if_used, self.scores)
        if self.pending:
            self.pending[-1] = (bins, self.pending[-1][1])

    def mark_used(self, layer: int, experts: np.ndarray) -> None:
        """`layer` has routed, needing `experts`: from now on its experts score as experts this iteration
        used or did not use."""
        row = self.scores[layer]  # a view: the same elements written as by 2-D indexing, at less cost
        row[:] = self._if_missed[layer]
        row[experts] = self._if_used[layer].take(experts)

    def end_iteration(self, used: np.ndarray) -> None:
        """The iteration's experts `[L, J]` bool: features update, and the snapshot `horizon` iterations back
        learns what followed it. (`used` is copied: the caller may refill the same array next iteration.)"""
        used = np.array(used, bool)
        for _, later in self.pending:
            later.append(used)
        if len(self.pending) > self.horizon:  # the oldest snapshot has seen its whole horizon
            bins, later = self.pending.popleft()
            outcome = functools.reduce(np.logical_or, later[1 : self.horizon + 1])  # the iterations after it
            # Counts of whole numbers, split by whether the snapshot's own iteration used the expert: two
            # bincounts over (used, bin) add them exactly, as np.add.at one by one would.
            size = self.seen.size
            split = bins.ravel() + size * later[0].ravel()  # [0, size): missed; [size, 2 size): used
            seen = np.bincount(split, minlength=2 * size).reshape(2, *self.seen.shape)
            reused = np.bincount(split, outcome.ravel(), minlength=2 * size).reshape(2, *self.seen.shape)
            self.seen += seen[0] + seen[1]
            self.reused += reused[0] + reused[1]
            self.seen_missed += seen[0]
            self.reused_missed += reused[0]
            self.seen_hit += seen[1]
            self.reused_hit += reused[1]
        self._since += self._since < GAP_EDGES[-1]  # one more iteration; "9 or more" and never stay
        self._since[used] = 0
        self.share *= self.decay
        self.share += (1 - self.decay) * used
        if self.sticky:
            self.long_share *= STICKY_DECAY
            self.long_share += (1 - STICKY_DECAY) * used
        self.iteration += 1
        self._prepare()

    def state(self) -> dict[str, np.ndarray]:
        return {
            "reuse_horizon": np.array(self.horizon),
            "reused": self.reused,
            "reuse_seen": self.seen,
            "reused_missed": self.reused_missed,
            "reuse_seen_missed": self.seen_missed,
            "reused_hit": self.reused_hit,
            "reuse_seen_hit": self.seen_hit,
        }

    def load(self, state: dict[str, Any]) -> None:
        """Restores `state()`; tables of another shape (an older layout) or counted over another horizon (a
        store saved beside a cache of another size, `reuse_horizon="auto"`) are ignored: their outcomes
        answer another question. A state saved before the horizon was recorded counted over 2 iterations."""
        if int(np.asarray(state.get("reuse_horizon", 2))) != self.horizon:
            return
        if np.shape(state.get("reused")) == self.reused.shape:
            self.reused = np.array(state["reused"], np.float64)  # contiguous copies
            self.seen = np.array(state["reuse_seen"], np.float64)
        for outcome in ("missed", "hit"):
            if np.shape(state.get(f"reused_{outcome}")) == self.reused.shape:
                setattr(self, f"reused_{outcome}", np.array(state[f"reused_{outcome}"], np.float64))
                setattr(self, f"seen_{outcome}", np.array(state[f"reuse_seen_{outcome}"], np.float64))
        self._prepare()
