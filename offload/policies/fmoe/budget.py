"""fMoE's search budget (`pay_for_matching`): prediction pays for its own host time. Each routed layer adds to
a credit what that layer's misses could have cost (their link time), and, where the engine stops for a miss,
the stops prediction removed (`Admission.stop_credit_s`, decision "relaunch price"); each search, store
update, reuse prediction, next-token guess or live decode iteration of bookkeeping (the policy's event
handlers) spends its measured host time from it, and work the credit cannot pay is left out (counted as
`unpaid_<kind>`). Where misses are nearly free (a CPU, and an engine that does not stop for them) the
matcher and then the bookkeeping rest, and fmoe serves as LRU; where a copy costs more than a search, every
search is paid. Decisions "pay for matching" and "pay for bookkeeping". In the simulator the prices are the
context's (`PolicyContext.matcher_s`, `.bookkeeping_s`), and a decode iteration's bookkeeping, once paid,
is owed to its clock layer by layer (`charged`), as live time follows the decision.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import TYPE_CHECKING, Any

from ...cache import CacheStats
from ..base import PolicyContext

if TYPE_CHECKING:
    from .admission import Admission

# Work is priced at the median host time of the last `COST_SAMPLES` of its kind, once `COST_WARMUP` are
# measured (the first of each kind, cold, is not): an average from the first kept the cold contexts' times
# and priced every later context out. Decision "matcher pricing".
COST_SAMPLES, COST_WARMUP = 15, 5

CONTEXT_KINDS = ("semantic", "trajectory", "update")  # the matcher's work
# The engine thread's: the reuse predictor, the next-token guess, and a decode iteration's event handlers
# (fmoe's bookkeeping: guides, forecast, admission; left out, fmoe rests through the iteration).
ENGINE_KINDS = ("reuse", "next_token", "bookkeeping")


class SearchBudget:
    """The credit, and the host time of each kind of work.

    Args:
      enabled: `pay_for_matching`; off, every piece of work goes.
      counts: the policy's counters (`unpaid_<kind>` are added here).
      admission: what a miss costs: the link time of one expert, hinted or measured (`Admission.link_s`),
        None until known (work is priced only once it is), and per needed expert the stops prediction
        removes (`Admission.stop_credit_s`; 0 where the engine does not stop for misses).
      ctx: the policy's context; the simulator's prices are its `matcher_s` (host time per context) and
        `bookkeeping_s` (per layer of a decode iteration's bookkeeping); None: measured live (`matcher_s`),
        free in the simulator (`bookkeeping_s`, so never left out).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        counts: collections.Counter,
        admission: Admission,
        ctx: PolicyContext,
    ):
        self.enabled, self.counts = enabled, counts
        self.copy_s, self.stop_s = admission.link_s, admission.stop_credit_s
        simulated_s = ctx.matcher_s
        self.simulated = simulated_s is not None
        self.credit = 0.0  # link seconds the work may still spend (engine thread)
        # Host seconds per piece of work of each kind: the simulator's, else the median measured.
        self.prices: dict[str, float | None] = dict.fromkeys(CONTEXT_KINDS, simulated_s)
        # The engine thread's work is measured live. In the simulator it is free unless the context prices
        # the bookkeeping: a decode iteration's is then `layers` times its per-layer price (the reuse
        # prediction and the next-token guess run inside the handlers that price times live: free).
        self.prices |= dict.fromkeys(ENGINE_KINDS)
        self._layer_s, self._layers = ctx.bookkeeping_s, ctx.num_layers
        if self._layer_s is not None:
            self.prices["bookkeeping"] = self._layer_s * self._layers
        self._owed = 0  # layers of paid bookkeeping the simulator has not charged yet (`charged`)
        self._spent = {kind: collections.deque(maxlen=COST_SAMPLES) for kind in self.prices}
        self._timed = collections.Counter()  # contexts timed, by kind

    def priced(self) -> bool:
        """Whether work is weighed against the credit at all."""
        return self.enabled and self.copy_s() is not None

    def deposit(self, needed: int, stats: CacheStats, most: int) -> None:
        """A layer routed `needed` experts, each of which would have cost a copy with the chance `at_stake`
        reads in the cache's `stats`, and its share of the stops prediction removes (`stop_s`); the credit
        holds `most` experts' worth at most (a decode iteration's)."""
        copy_s = self.copy_s()
        if self.enabled and copy_s is not None:
            at_stake = self.at_stake(stats)
            stop_s = self.stop_s(at_stake)  # (+ 0.0 where no stop is priced: the copies alone, exactly)
            banked = self.credit + needed * copy_s * at_stake + needed * stop_s
            self.credit = min(banked, most * copy_s + most * stop_s)

    @staticmethod
    def at_stake(stats: CacheStats) -> float:
        """The share of needed experts that would miss without prediction, as far as the cache can tell:
        its misses and the hits prefetches made (prefetched, not evicted unused) per access; 1 before any."""
        accesses = stats.hits + stats.misses
        if not accesses:
            return 1.0
        return min(1.0, (stats.misses + max(0, stats.prefetches - stats.wasted_prefetches)) / accesses)

    def pay(self, kind: str) -> bool:
        """Spends the price of work of `kind` from the credit, if it covers it (or the work is not priced
        yet); counts the work left out otherwise."""
        cost = self.prices[kind]
        if cost is not None and self.priced():
            if self.credit < cost:
                self.counts[f"unpaid_{kind}"] += 1
                return False
            self.credit -= cost
        if kind == "bookkeeping" and self._layer_s is not None:  # simulated: done, so owed to the clock
            self._owed = self._layers
        return True

    def affords(self, kind: str, recorded: bool) -> bool:
        """`pay`, for a context whose inputs the engine gave (`recorded`); one it did not give them for (the
        credit covered no context when the iteration began, `wants_maps`) is unpaid work too."""
        if not recorded:
            self.counts[f"unpaid_{kind}"] += 1
            return False
        return self.pay(kind)

    def covers(self, kind: str) -> bool:
        """Whether the credit would cover work of `kind` now, without paying (unpriced work always)."""
        cost = self.prices[kind]
        return cost is None or not self.priced() or self.credit >= cost

    @property
    def measures_contexts(self) -> bool:
        """Whether the matcher's host time per context is measured (live); the simulator gives it instead,
        and nothing then needs the time taken (reading a thread's CPU clock is a system call)."""
        return not self.simulated

    def record_context(self, kind: str, seconds: float) -> None:
        """The matcher thread's CPU time on one context (what the work takes from the engine's)."""
        self._timed[kind] += 1
        if not self.simulated and self._timed[kind] > 1:
            self._record(kind, seconds)

    def record_engine(self, kind: str, start: float) -> None:
        """Engine-thread work of `kind` that began at `start` (perf_counter) and just ended; live only."""
        if not self.simulated:
            self._record(kind, time.perf_counter() - start)

    def record_spent(self, kind: str, seconds: float) -> None:
        """Engine-thread work of `kind` that took `seconds`; live only."""
        if not self.simulated:
            self._record(kind, seconds)

    def _record(self, kind: str, seconds: float) -> None:
        spent = self._spent[kind]
        spent.append(seconds)
        if len(spent) >= COST_WARMUP:
            self.prices[kind] = statistics.median(spent)  # 0.4 us; np.median 14

    def charged(self) -> float:
        """Simulated host seconds of paid bookkeeping since the simulator last asked (`Policy.charged_s`): a
        layer's price after each layer of a paid decode iteration, nothing in one fmoe rested through."""
        if not self._owed:
            return 0.0
        self._owed -= 1
        return self._layer_s

    def wants_maps(self, kinds: list[str]) -> bool | None:
        """Live, whether the next iteration's embeddings and router probabilities are worth copying out of
        the device: only when the credit already covers one of the contexts of `kinds` they feed (a search
        the credit could pay later in an iteration without them waits for the next one). None where every
        iteration's come: in the simulator (copies are free) and while work is unpriced; True in a simulator
        that prices the bookkeeping (the copies are free, but an iteration fmoe rests through, and the first
        it pays for after, records nothing, as live). Decision "pay for matching"."""
        if not self.priced() or (self.simulated and self._layer_s is None):
            return None
        if self.simulated:
            return True
        costs = [self.prices[kind] for kind in kinds]
        return bool(costs) and (None in costs or self.credit >= min(costs))  # None: not priced yet

    def stats(self) -> dict[str, Any]:
        out = {}
        for kind in ENGINE_KINDS:  # host time per piece of work
            name = "reuse_predictor_ms" if kind == "reuse" else f"{kind}_ms"
            if self.prices[kind] is not None:
                out[name] = 1e3 * self.prices[kind]
        for kind in CONTEXT_KINDS:  # host time per context
            if self.prices[kind] is not None:
                out[f"{kind}_host_ms"] = 1e3 * self.prices[kind]
        return out
