"""fMoE's prefetch admission (ours, not in the paper): a selected expert is prefetched only when its need
probability q pays for the link time T it takes, and at priority q / (layers until it is needed).

With `link="free"` (the default, decision "admission link rule") a prefetch is admitted when
q >= T / (T + min(T, W)), as if the link were free when asked: a right copy saves its layer up to min(T, W) of
waiting (W: the compute before that layer), a wrong one holds the link for T. `link="queue"` prices the same
after the copies and misses queued ahead (`after_queue`). `link="stalls"` prices the misses a prefetch
delays: the link serves on-demand loads first, between the pieces of a copy, so the piece under way when
the next layer's misses come delays them; a prefetch is admitted when q covers the share of its link time
taken from on-demand loads and it lands before its layer (`_stall_share`). Under hybrid execution misses go
to the host, and every selected expert goes (decision "hybrid admission").

Where the engine stops its step program at a layer that misses and launches it again (`CacheView.stops`,
`.stop_s`: live, the optimistic engine; simulated, a preset with engine costs), a right prefetch also saves
its share of that relaunch, S (one stop's price times the stops per miss so far), so a prefetch is admitted
when q >= T / (T + min(T, W) + S) ("free" and "queue"), and a miss costs T + S (`miss_s`, the credit's
price). S counts the stops and misses of the last `STOP_WINDOW` decode iterations. The credit banks, beside T
per expert at stake, the stops prediction removes (`StopSavings`). Decision "relaunch price": with
`price_stops` (off by default); hybrid execution leaves S out.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any

import numpy as np

from ...cache import CacheView, Key
from ..base import PolicyContext
from .options import FMoEOptions

# S counts the stops and misses of the last `STOP_WINDOW` decode iterations (cumulative counts keep a
# warm-up's cold stops). The credit's stop rates: stops per needed expert over the last `RATE_SAMPLES`
# counted decode iterations fmoe paid for, and rested through; a rested probe of `PROBE_RUN` iterations
# follows `PROBE_EVERY` paid ones in a row (the first only once the store has learned a while: what prediction
# removes early, from a store still empty, says little of later); a paid rate older than `STALE_AFTER` decode
# iterations is forgotten (the prior returns, and with it paid iterations). Decision "relaunch price".
STOP_WINDOW, RATE_SAMPLES, MIN_SAMPLES, STALE_AFTER = 64, 16, 2, 256
PROBE_RUN, PROBE_EVERY = 3, 32


class Admission:
    """Thresholds and priorities of the selected experts, from T (`copy_s`) and one decode layer's compute
    (`layer_s`): the options' values, else the context's hints (the simulator's cost model), else measured as
    the engine runs (`measure`). Until they are known every selected expert goes."""

    def __init__(
        self, options: FMoEOptions, ctx: PolicyContext, cache: CacheView, counts: collections.Counter
    ):
        self.rule, self.link = options.admission, options.link
        self.ctx, self.cache, self.counts = ctx, cache, counts
        self.copy_s = options.copy_s if options.copy_s is not None else ctx.copy_s
        self.layer_s = options.layer_s if options.layer_s is not None else ctx.layer_s
        # Hybrid execution: a miss is computed on the host rather than waiting for the link, so a wasted
        # prefetch only delays other prefetches, and "cost" admission lets every selected expert go.
        self.free_link = ctx.execution == "hybrid"
        self.price_stops = options.price_stops and not self.free_link
        self.measuring = (
            self.rule == "cost" and not self.free_link and (self.copy_s is None or self.layer_s is None)
        )
        self._clock: tuple[float, float, int] | None = None  # (time, on-demand wait, misses), last layer
        self.savings = StopSavings(cache, counts)

    def begin_iteration(self, decoding: bool, paid: bool = True) -> None:
        """An iteration begins, one fmoe pays its bookkeeping for (`paid`) or rests through."""
        self._clock = None
        if self.price_stops:
            self.savings.begin(decoding, paid)

    def probes(self) -> bool:
        """Whether the decode iteration about to begin rests to measure the stops without prediction
        (`StopSavings.probes`); never without `price_stops`, or where the engine reports no stop."""
        return self.price_stops and self.savings.probes()

    def measure(self, decoding: bool) -> None:
        """Live estimates of T and of one layer's compute (exponential averages), from the cache's on-demand
        wait and miss count at consecutive layers of a decode step: between two routed layers the engine
        computed one layer and waited for that layer's misses. Called at each routed layer while
        `measuring`."""
        now = (time.perf_counter(), self.cache.on_demand_wait_s, self.cache.stats.misses)
        if self._clock is not None and decoding:
            (t0, w0, m0), (t1, w1, m1) = self._clock, now
            elapsed, waited, misses = t1 - t0, w1 - w0, m1 - m0
            compute = max(elapsed - waited, 0.0)
            self.layer_s = compute if self.layer_s is None else 0.9 * self.layer_s + 0.1 * compute
            if misses > 0:
                per_copy = waited / misses
                self.copy_s = per_copy if self.copy_s is None else 0.9 * self.copy_s + 0.1 * per_copy
        self._clock = now

    def stop_share_s(self) -> float:
        """S: a miss's share of the engine's stops, one stop's price times the stops per miss of the last
        `STOP_WINDOW` decode iterations; 0 where the engine reports none, or with `price_stops` off
        (decision "relaunch price")."""
        cache = self.cache
        if not (self.price_stops and cache.stops):
            return 0.0
        stops, misses = self.savings.since_window()
        return cache.stop_s * stops / misses if misses else 0.0

    def miss_s(self) -> float | None:
        """What a miss costs: T and S; None until T is known."""
        copy_s = self.copy_s
        if copy_s is None:
            return None
        return copy_s + self.stop_share_s()  # (+ 0.0 where no stop is priced: the copy alone, exactly)

    def link_s(self) -> float | None:
        """T, None until known: what the credit banks per expert at stake (`SearchBudget`)."""
        return self.copy_s

    def stop_credit_s(self, at_stake: float) -> float:
        """What the credit banks per needed expert for the stops prediction removes: one stop's price times
        the stops per needed expert it removed (`StopSavings.removed`); until both rates are measured, S per
        expert at stake (`at_stake`: as if every covered miss removed its share). 0 where no stop is priced.
        Decision "relaunch price"."""
        cache = self.cache
        if not (self.price_stops and cache.stops):
            return 0.0
        removed = self.savings.removed
        return self.stop_share_s() * at_stake if removed is None else cache.stop_s * removed

    def threshold(self, layer: int | np.ndarray, current: int) -> float | np.ndarray:
        """The probability a selected expert of `layer` (or of each of several layers) needs to be
        prefetched, deciding after `current`: the share of its link time taken from on-demand loads, or inf
        where it cannot land before its layer (`link="stalls"`); T / (T + min(T, W) + S) with the other
        rules; 0 under hybrid execution."""
        if not isinstance(layer, np.ndarray):
            return self._threshold(int(layer), current)
        if self.rule == "all" or (self.rule == "cost" and self.free_link):
            return np.zeros(np.shape(layer)) if np.ndim(layer) else 0.0
        if self.rule != "cost":
            return np.full(np.shape(layer), float(self.rule)) if np.ndim(layer) else float(self.rule)
        if self.copy_s is None or self.layer_s is None or self.copy_s <= 0:
            return np.zeros(np.shape(layer)) if np.ndim(layer) else 0.0  # nothing measured yet
        ahead = np.asarray(layer) - current  # layers of compute before it routes (a layer routed already:
        ahead = np.where(ahead > 0, ahead, ahead + self.ctx.num_layers)  # its routing at the next iteration)
        if self.link == "stalls":
            share, per_layer = self._stall_share()
            out = np.where(ahead * per_layer >= self.copy_s, share, np.inf)  # inf: cannot land in time
        else:
            saved = np.minimum(self.copy_s, ahead * self.layer_s)
            out = self.copy_s / (self.copy_s + saved + self.stop_share_s())
        return out if np.ndim(layer) else float(out)

    def _threshold(self, layer: int, current: int) -> float:
        """`threshold` of one layer, in Python floats (the same operations, one at a time: the same
        doubles): each prefetch that asks to evict is priced by it."""
        if self.rule == "all" or (self.rule == "cost" and self.free_link):
            return 0.0
        if self.rule != "cost":
            return float(self.rule)
        copy_s = self.copy_s
        if copy_s is None or self.layer_s is None or copy_s <= 0:
            return 0.0
        ahead = layer - current
        if ahead <= 0:
            ahead += self.ctx.num_layers
        if self.link == "stalls":
            share, per_layer = self._stall_share()
            return float(share) if ahead * per_layer >= copy_s else math.inf
        window = ahead * self.layer_s
        saved = window if window < copy_s else copy_s  # np.minimum(copy_s, window)
        return copy_s / (copy_s + saved + self.stop_share_s())

    def price(self, layer: int, current: int) -> float:
        """`threshold` of a prefetch for `layer` decided now, 0 where it is infinite (a prefetch already
        admitted no longer asks whether it lands in time) or not priced: what a wrong copy costs, in need
        probability, when a prefetch asks to evict."""
        price = self._threshold(int(layer), current) if self.rule == "cost" else 0.0  # (`threshold`'s)
        return price if math.isfinite(price) else 0.0

    def prefetches(
        self, layers: np.ndarray, picked: np.ndarray, need: np.ndarray, current: int
    ) -> list[tuple[Key, float]]:
        """The admitted prefetches `(key, q / (layer - current))` among the `picked` experts `[n, J]` of
        consecutive `layers` `[n]`, q their need probability `[n, J]`."""
        q = np.where(picked, need, 0.0)
        thresholds = self.threshold(layers, current)  # [n]
        admitted = (q > 0) & (q >= thresholds[:, None])
        pos, experts = np.nonzero(admitted)
        self.counts["not_admitted"] += int(np.count_nonzero(picked)) - len(pos)  # admitted ones are picked
        priority = q[pos, experts] / (layers[pos] - current)  # `prefetch_priority`, checks left out
        if self.link == "queue" and self.rule == "cost" and len(pos) and thresholds.max() > 0:
            keep = self.after_queue(q[pos, experts], layers[pos], current, priority)
            self.counts["not_admitted"] += int(len(keep) - keep.sum())
            pos, experts, priority = pos[keep], experts[keep], priority[keep]
        keys = zip(layers[pos].tolist(), experts.tolist(), strict=True)
        return list(zip(keys, priority.tolist(), strict=True))

    def after_queue(
        self, q: np.ndarray, layers: np.ndarray, current: int, priority: np.ndarray
    ) -> np.ndarray:  # [m] bool
        """Which admitted prefetches still pay once the link's queue is counted: the copies arriving now,
        the on-demand loads the layers before the target will make (the measured miss rate), and the
        prefetches of higher priority admitted before it. A prefetch starting at `start` lands at `start +
        T`, so a right guess saves min(T, W - start) of the wait at its layer, nothing if the link is still
        busy when the layer comes; a wrong one costs T of link time. Kept where q >= T / (T + saved + S) and
        saved > 0."""
        copy_s, layer_s = self.copy_s, self.layer_s
        stats = self.cache.stats
        misses = self.ctx.top_k * stats.misses / max(1, stats.hits + stats.misses)  # loads per layer
        arriving = sum(1 for _, entry in self.cache.entries() if not entry.ready)
        keep = np.zeros(len(q), bool)
        ahead = float(arriving)
        stop = self.stop_share_s()
        for i in np.argsort(-priority, kind="stable"):
            start = (ahead + misses * (layers[i] - current - 1)) * copy_s
            saved = min(copy_s, (layers[i] - current) * layer_s - start)
            if saved > 0 and q[i] >= copy_s / (copy_s + saved + stop):
                keep[i] = True
                ahead += 1
        return keep

    def _stall_share(self) -> tuple[float, float]:
        """(f, c + s): the share of a prefetch's link time taken from on-demand loads, and how far it
        advances per decode layer (c: one layer's compute; s = m * r). The piece under way when a layer's
        misses come delays them by r = max(piece - c, piece / 2) (a piece longer than a layer's compute,
        started as it began, runs piece - c past it; a shorter one is caught on average halfway), in a share
        m of the layers, m = 1 - (1 - miss rate) ** top_k."""
        stats = self.cache.stats
        miss_rate = stats.misses / max(1, stats.hits + stats.misses)
        m = 1.0 - (1.0 - miss_rate) ** self.ctx.top_k
        piece = self.copy_s / max(1, self.ctx.copy_chunks)
        stalls = m * max(piece - self.layer_s, piece / 2)
        per_layer = self.layer_s + stalls
        return stalls / per_layer, per_layer

    def stats(self) -> dict[str, Any]:
        if self.rule == "cost" and self.copy_s is not None and self.layer_s is not None:
            out = {"copy_ms": 1e3 * self.copy_s, "layer_ms": 1e3 * self.layer_s}
            if self.price_stops and self.cache.stops:
                out["stop_share_ms"] = 1e3 * self.stop_share_s()
                out |= self.savings.stats()
            return out
        return {}


class StopSavings:
    """The stops fmoe's prediction removes, measured where the engine stops for misses (decision "relaunch
    price"): stops per needed expert in the decode iterations fmoe paid its bookkeeping for, against those
    it rested through. The first iteration of each run of either kind is not counted (it starts from the
    other kind's cache: the first paid one after rest records nothing to search with). Where fmoe would
    never rest, a probe rests `PROBE_RUN` iterations now and then, so both rates stay known; a resting
    fmoe pays when the credit can (the last paid rate holds meanwhile, for `STALE_AFTER` iterations at most:
    then the prior credit returns and pays a few). Also the window S is taken over."""

    def __init__(self, cache: CacheView, counts: collections.Counter):
        self.cache, self.counts = cache, counts
        # (stops, misses) as each of the last `STOP_WINDOW` decode iterations (this one too) began.
        self._starts: collections.deque[tuple[int, int]] = collections.deque([(0, 0)], maxlen=STOP_WINDOW)
        # (stops, accesses) of each counted decode iteration, paid (True) and rested (False).
        self.samples = {paid: collections.deque(maxlen=RATE_SAMPLES) for paid in (True, False)}
        self.removed: float | None = None  # stops per needed expert prediction removed (`rates`)
        self._decode = self._paid_at = 0  # decode iterations begun; the last counted paid one
        self._open: tuple[bool, int, int] | None = None  # the decode iteration under way: paid, its start's
        # stops and accesses
        self._run = 0  # its place in the run of its kind (1: the first)
        self._paid_run = 0  # paid decode iterations since fmoe last rested
        self._probe = 0  # iterations of the probe under way still to rest

    def begin(self, decoding: bool, paid: bool) -> None:
        """An iteration begins: the decode iteration before it, if any, closes (and counts, if not the first
        of its run)."""
        cache, stats = self.cache, self.cache.stats
        stops, accesses = cache.stops, stats.hits + stats.misses
        last = self._open
        if last is not None and self._run > 1:
            self.samples[last[0]].append((stops - last[1], accesses - last[2]))
            self._paid_at = self._decode if last[0] else self._paid_at
        if self._decode - self._paid_at > STALE_AFTER:
            self.samples[True].clear()
        self.removed = self.rates()
        if not decoding:
            self._open, self._run = None, 0
            return
        self._decode += 1
        self._starts.append((stops, stats.misses))
        self._run = self._run + 1 if last is not None and last[0] == paid else 1
        self._open = (paid, stops, accesses)
        if paid:
            self._paid_run += 1
        else:
            self._paid_run, self._probe = 0, max(0, self._probe - 1)

    def probes(self) -> bool:
        """Whether the decode iteration about to begin rests to measure the stops without prediction: the
        probe under way, or a new one after `PROBE_EVERY` paid iterations in a row; never where the engine
        reports no stop."""
        if self._probe:
            return True
        if self.cache.stops and self._paid_run >= PROBE_EVERY:
            self._probe = PROBE_RUN
            self.counts["stop_probes"] += 1
            return True
        return False

    def rates(self) -> float | None:
        """Stops per needed expert rested less paid (0 at least), None until each has `MIN_SAMPLES`."""
        per = []
        for paid in (False, True):
            samples = self.samples[paid]
            accesses = sum(a for _, a in samples)
            if len(samples) < MIN_SAMPLES or not accesses:
                return None
            per.append(sum(s for s, _ in samples) / accesses)
        return max(0.0, per[0] - per[1])

    def since_window(self) -> tuple[int, int]:
        """Stops and misses since the oldest decode iteration of the window began."""
        stops, misses = self._starts[0]
        return self.cache.stops - stops, self.cache.stats.misses - misses

    def stats(self) -> dict[str, float]:
        return {} if self.removed is None else {"stops_removed_per_expert": self.removed}
