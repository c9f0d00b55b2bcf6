"""fMoE's guides: what the matches of the current iteration say each layer still to route will need, and
the next token's guess. A search selects experts from its matched maps (similarity-aware selection) and
turns their map probabilities into need probabilities (calibrated, learned from what each layer then
needed); admission, priority and eviction read those. The next token's first d layers, which no search of
that token guides in time, are guessed from the reuse hint (decision "next-token guess").

Letters: L MoE layers, J experts, D distance bins (`MAX_DISTANCE`), B rows of a batch, n target layers.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from .forecast import MAX_DISTANCE, Calibration, ReuseForecast
from .select import SortedMaps

Threshold = Callable[[np.ndarray, int], np.ndarray]


class Guides:
    """The guides of the current iteration, per distance bin and expert `[D, L, J]` (a guide made 1, 2, 3
    or 4+ layers ahead of its layer): the raw map probability (`p`) and its calibration bin (map
    probability, the match's similarity, distance in layers), and per `[D, L]` whether a match has guided the
    layer from that far. The latest guide of each layer gives its need probability (`need` `[L, J]`,
    calibrated p) and its raw probability (`latest_p`). The matcher writes them (a search guides every
    expert of its target layers); when the layer routes, the calibration learns from the latest guide of
    every distance: admission decides up to L - 1 layers ahead, while the guide a layer has when it routes
    is always the one made d layers before, and a bin never learned from answers the raw map probability."""

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        *,
        dynamic_delta: bool,
        calibrate: bool,
        calibration: Calibration,
        next_calibration: Calibration,
        forecast: ReuseForecast,
        sorted_maps: SortedMaps,
    ):
        shape = (num_layers, num_experts)
        self.num_layers, self.top_k = num_layers, top_k
        self.dynamic_delta, self.calibrate = dynamic_delta, calibrate
        self.calibration, self.next_calibration = calibration, next_calibration
        self.forecast, self.sorted_maps = forecast, sorted_maps
        depth = MAX_DISTANCE
        self.p, self.bin = np.zeros((depth, *shape)), np.zeros((depth, *shape), np.int64)
        self.guided = np.zeros((depth, num_layers), bool)
        self.latest_p = np.zeros(shape)
        self.latest = np.zeros(num_layers, bool)  # [L] whether any match has guided the layer
        self.need = np.zeros(shape)
        self.used = np.zeros(shape, bool)  # the experts this iteration has needed so far
        self.current = -1  # the MoE layer that routed last in this iteration
        # The next token's guesses: (iteration, p, bins, (layers, experts) admitted), their p and bins [d, J].
        self.next_guesses: list = []

    # -- the engine thread's events --------------------------------------------------------------------
    def start_request(self) -> None:
        self.need[:] = 0.0  # a guess of the last request's next token says nothing of this prompt
        self.next_guesses = []

    def begin_iteration(self) -> None:
        self.guided[:] = False
        self.latest[:] = False
        self.used[:] = False
        self.current = -1  # (`need` holds what `guess_next` guessed of this iteration's first layers)

    def route(self, layer: int, needed: np.ndarray) -> None:
        self.current = layer  # from now on no guide of this layer is written (`guide`)
        self.need[layer] = 0.0  # its next routing is the next iteration's: unknown until `guess_next`
        self.used[layer][needed] = True  # (a row view, then its elements: cheaper than one 2-D index)

    def observe(self) -> None:
        """What the iteration's guides were worth: the calibration learns, for every layer and distance bin a
        match guided, whether each expert was needed. Once per iteration (the guides of a layer are final
        when it routes), so predictions within an iteration use the counts of those before."""
        if not self.guided.any():  # no match guided this iteration (most live ones: searches unpaid)
            return
        guided = self.guided.copy()  # [D, L]; the matcher thread may still add guides of later layers
        guided[:, self.current + 1 :] = False
        if not guided.any():
            return
        p, bins = self.p[guided], self.bin[guided]  # [count, J]
        outcome = self.used[np.nonzero(guided)[1]]  # each guide's layer's outcome, in the same order
        self.calibration.observe_binned(p.ravel(), bins.ravel(), outcome.ravel())

    # -- the matcher's -------------------------------------------------------------------------------------
    def guide(
        self, scores: np.ndarray, maps: np.ndarray, targets: range, current: int, *, fresh: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Similarity-aware selection per matched map `[B, L, J]` (scores `[B]`) and target layer; a batch's
        wishes are merged, each expert keeping its highest probability. Writes the guides of the target
        layers still to route when `fresh` (the match is of the current iteration). Returns the target
        layers `[n]`, the selected experts `[n, J]` and their need probabilities `[n, J]`."""
        span = slice(targets.start, targets.stop)  # targets are consecutive layers: slices read views
        layers = np.arange(targets.start, targets.stop)
        dist = (layers - current)[:, None]  # [n, 1]
        probs = maps[:, span]  # [B, n, J]
        score = scores if self.dynamic_delta else np.ones_like(scores)  # [B]
        chosen = self.sorted_maps.select_mask(maps, span, score, self.top_k)  # [B, n, J]
        if len(probs) == 1:  # decode at batch 1: one map, nothing to merge
            guide = probs[0]
            picked = chosen[0] & (guide > 0)  # selected, with a probability above 0
        else:
            picked = np.where(chosen, probs, 0.0).max(axis=0) > 0  # [n, J] selected from any map
            guide = probs.max(axis=0)  # [n, J] every expert's best probability in the matched maps
        match = float(scores.max()) if len(scores) else 0.0  # the guides' similarity
        bins = self.calibration.bins(guide, match, dist, self.forecast.recency[span])  # [n, J]
        need = self.calibration.predict_binned(guide, bins) if self.calibrate else guide  # [n, J]
        if fresh:  # guides of the layers still to route (from a late match, a routed layer's guide is moot)
            first = max(targets.start, self.current + 1)  # `layers` ascend one by one
            ahead, rows = slice(first - targets.start, None), slice(first, targets.stop)  # rows: `at`'s
            at, depth = layers[ahead], np.minimum(dist[ahead, 0], MAX_DISTANCE) - 1  # distance bin
            self.p[depth, at], self.bin[depth, at] = guide[ahead], bins[ahead]
            self.guided[depth, at] = True
            self.latest_p[rows], self.latest[rows] = guide[ahead], True  # (slices: views, cheaper)
            self.need[rows] = need[ahead]
        return layers, picked, need

    # -- the next token ------------------------------------------------------------------------------------
    def guessed(self, iteration: int) -> bool:
        """Whether the last iteration guessed this one's first layers (`guess_next`)."""
        return any(made == iteration - 1 for made, *_ in self.next_guesses)

    def guess_next(
        self,
        hint: np.ndarray,
        *,
        iteration: int,
        first: int,
        rows: int,
        threshold: Threshold,
        counts: collections.Counter,
    ) -> list[tuple[tuple[int, int], float]]:
        """Prefetches for the next token's layers [0, `first`), from the reuse hint `[L, J]` (the learned
        predictor's chance of reuse, or what followed the stored maps most like the last token's),
        calibrated into the chance each expert is needed at the next token's layer j (`next_calibration`,
        learned from the outcomes of the earlier guesses; bins: the hint, the layers until j routes, the
        expert's recency as of the next token). The likeliest top_k x `rows` experts of each layer, where
        their chance pays for the copy (`threshold`); eviction keeps them by that chance (`need`) until
        the next token's own searches guide their layers."""
        current, num_layers = self.current, self.num_layers
        for made, p, bins, (layers, experts) in self.next_guesses:
            # What the last iteration's guesses of this one's first layers were worth (they have routed).
            if made == iteration - 1:
                self.next_calibration.observe_binned(p.ravel(), bins.ravel(), self.used[: len(p)].ravel())
                counts["next_token_guesses"] += len(layers)  # admitted (resident ones not copied)
                counts["next_token_right"] += int(self.used[layers, experts].sum())
        self.next_guesses = [g for g in self.next_guesses if g[0] == iteration]
        p = np.asarray(hint[:first], np.float64)
        ahead = np.arange(first) + num_layers - current  # layers of compute until each one routes
        recency = np.where(self.used[:first], 0, self.forecast.recency[:first])  # gap 0: used this token
        bins = Calibration.bins(p, 1.0, ahead[:, None], recency)
        q = self.next_calibration.predict_binned(p, bins) if self.calibrate else p
        self.need[:first] = q  # routed this iteration: `need` is their next routing's (eviction's "now")
        likeliest = np.zeros(q.shape, bool)
        count = min(self.top_k * max(1, rows), q.shape[1])
        likeliest[np.arange(first)[:, None], np.argpartition(-q, count - 1, axis=1)[:, :count]] = True
        admitted = likeliest & (q > 0) & (q >= threshold(np.arange(first), current)[:, None])
        layers, experts = np.nonzero(admitted)
        self.next_guesses.append((iteration, p, bins, (layers, experts)))
        priority = q[layers, experts] / ahead[layers]
        return list(zip(zip(layers.tolist(), experts.tolist(), strict=True), priority.tolist(), strict=True))
