"""The iteration driver: the one place that orders the events of a decode iteration and keeps their
statistics. The live engine (`fmoe_jax/engines/step_loop.py`, one `LayerLoop` per step) and
the trace-replay simulator (`offload/simulator.py`) both run every iteration through `Driver.iteration`, so
what the policy and the cache see cannot differ between them.

A caller supplies a `LayerLoop`: `route(layer)` (compute attention and the router of one MoE layer, or
read them from a trace, and return the routing), `compute(layer, chunk, arrays, is_last)` (run some of the
layer's experts, or advance a simulated clock) and, for hybrid execution, `host(layer, keys)` (start the
host's share of the layer: the engine dispatches it to the CPU, the simulator books the host's time; called
only with a `HybridPlanner`, `offload/hybrid.py`, given at construction). The driver does the rest, in this
order (DESIGN.md, "One decode iteration"):

    RequestStart                                    once per generate call / replayed batch (`begin`);
                                                    a cache with room for every expert queues those it
                                                    lacks behind every prefetch (`fill_free_slots`)
    IterationStart(valid, semantic context)
    for each MoE layer l:
        route(l)                                    attention and router; the caller's one host read
        protect l's needed experts                  from here on no prefetch may evict them
        LayerRouted(l, trajectory context)          the policy may request prefetches now
        hybrid: plan -> host(l, keys)               misses the host finishes before their copy would land
                                                    (and hits, to balance l, given a device cost);
                                                    counted as `host_computed`
        for each chunk of l's other needed experts: one chunk unless l needs more than the cache holds
            ensure -> compute -> release            hits counted, misses loaded, weights pinned meanwhile
                                                    (per device, with several devices); the last `compute`
                                                    of the layer adds the host's share
        hybrid: background copies of the host's     when the policy wants them (`Policy.host_fill`), behind
        experts                                     every prefetch
    on_iteration_end
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

from .cache import CacheStats, Key, ServingCache
from .events import IterationStart, LayerRouted, RequestStart, needed_experts
from .hybrid import FILL_PRIORITY, HybridPlanner
from .policies.base import Policy


class Routed(NamedTuple):
    """One MoE layer's routing on the host, as `route` returns it."""

    ids: np.ndarray  # [N, k] int32
    probs: np.ndarray | None = None  # [N, J] float32, when the policy needs it (or the caller records it)
    hidden: np.ndarray | None = None  # [N, D] float32 router input, likewise
    # The distinct experts the valid tokens chose, ascending, when the caller has them at hand (the
    # simulator works them out for every layer of an iteration at once); None: the driver does.
    needed: tuple[int, ...] | None = None


class LayerLoop(Protocol):
    """What `Driver.iteration` runs one iteration's MoE layers through, in the module docstring's order: the
    live engine's step (`fmoe_jax/engines/step_loop.py`) or the simulator's replay (`offload/simulator.py`).
    """

    # False: `compute` books a chunk without its experts' weights (the simulator's replay), so `ensure` hands
    # over none.
    wants_arrays: bool

    def route(self, layer: int) -> Routed:
        """MoE layer `layer`'s routing on the host (computed, or read from a trace); once a layer."""

    def compute(self, layer: int, chunk: list[Key], arrays: dict[Key, Any], is_last: bool) -> None:
        """Runs (or books) the experts `chunk` of `layer` with their device arrays; `is_last`: the layer's
        last chunk over all devices (`chunk` empty when the device has none)."""

    def host(self, layer: int, keys: list[Key]) -> None:
        """Starts the host's share `keys` of `layer` before its first `compute` (hybrid execution: called
        only when the driver has a planner)."""


Compute = Callable[[int, list[Key], dict[Key, Any], bool], Any]


def _no_host(layer: int, keys: list[Key]) -> None:
    raise RuntimeError(f"MoE layer {layer}: experts {keys} were planned for the host, which this loop lacks")


@dataclasses.dataclass(frozen=True)
class Functions:
    """A `LayerLoop` made of functions, for callers that keep nothing between layers (the simulator's
    replay, tests)."""

    route: Callable[[int], Routed]
    compute: Compute
    host: Callable[[int, list[Key]], Any] = _no_host
    wants_arrays: bool = True


@dataclasses.dataclass
class Measured:
    """What the requests since `Driver.reset` cost."""

    cache: CacheStats  # counts of the call (peak bytes: the cache's peak so far)
    overhead_s: dict[str, float]  # host seconds by stage (the driver's, the cache's and the policy's)


class Driver:
    """Feeds one policy and one expert cache (a `DeviceExpertCache` or a `CacheGroup`) the event stream;
    with a `planner` (hybrid execution), also decides which experts the host computes."""

    def __init__(self, policy: Policy, cache: ServingCache, planner: HybridPlanner | None = None):
        self.policy = policy
        self.cache = cache
        self.planner = planner
        # Host seconds by stage: "policy_events" (the policy's hooks on this thread) is the driver's own;
        # callers add theirs (the engine's "context_collection").
        self.timers: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._start: tuple[CacheStats, dict[str, float]] = (CacheStats(), {})
        self.requests: tuple[int, ...] | None = None  # the rows' requests of the step being run (engine)

    # -- statistics ---------------------------------------------------------------------------------------
    def _all_timers(self) -> dict[str, float]:
        out = dict(self.timers)
        for source in (self.cache.timers, self.policy.timers):
            for name, value in source.items():
                out[name] = out.get(name, 0.0) + value
        return out

    def reset(self) -> None:
        """Statistics count from here on."""
        self._start = (self.cache.stats.copy(), self._all_timers())

    def measure(self) -> Measured:
        """Counts and host times since the last `reset`."""
        before, timers = self._start
        now = self._all_timers()
        return Measured(self.cache.stats - before, {k: v - timers.get(k, 0.0) for k, v in now.items()})

    # -- events -------------------------------------------------------------------------------------------
    def _tell(self, hook: Callable, *args: Any) -> None:
        start = time.perf_counter()
        hook(*args)
        self.timers["policy_events"] += time.perf_counter() - start

    def begin(self, batch: int) -> None:
        """A batch of requests begins: the policy hears `RequestStart`; a cache that has room for every expert
        starts copying those it lacks (`fill_free_slots`)."""
        self._tell(self.policy.on_request_start, RequestStart(batch))
        self.fill_free_slots()

    def fill_free_slots(self) -> None:
        """A cache with room for every expert never evicts, so the experts it lacks (none of the requests so
        far needed them) cost only their copy: it is queued behind every prefetch. Once they land no step
        stops at a layer for a miss, where otherwise steps would until some routing happened to need the last
        of them. A smaller cache is left to the policy, and so is every cache of a policy that places experts
        itself (`Policy.fill_free_slots` off)."""
        ctx = self.policy.ctx
        keys = [(layer, e) for layer in range(ctx.num_layers) for e in range(ctx.num_experts)]
        if self.cache.capacity < len(keys) or not self.policy.fill_free_slots:
            return
        lacking = [(key, FILL_PRIORITY) for key in keys if self.cache.entry(key) is None]
        if lacking:
            self.cache.request_prefetch(lacking, replace=False)

    def iteration(
        self, valid: np.ndarray, embeds: np.ndarray | None, loop: LayerLoop, tokens: np.ndarray | None = None
    ) -> None:
        """Runs one iteration over the MoE layers (see the module docstring for the order).

        Args:
          valid: `[B, T]` bool, the iteration's valid tokens.
          embeds: `[N, H]` float32 semantic context, or None when the policy does not need it.
          loop: the layers' routing and compute (`LayerLoop`).
          tokens: `[N]` int64 token ids fed, or None (unknown, or the policy does not need them).
        """
        policy = self.policy
        token_valid = valid.reshape(-1)
        rows = None if token_valid.all() else token_valid  # the valid tokens' rows (None: every row)
        # Read once an iteration, as `Policy` documents: they hold until `on_iteration_end`.
        semantic, probs = policy.needs_semantic, policy.needs_probs
        tokens = tokens if policy.needs_tokens else None
        start = IterationStart(valid, embeds if semantic else None, self.requests, tokens)
        self._tell(policy.on_iteration_start, start)
        cache, hears, planner = self.cache, policy.hears_layers, self.planner
        # Protect a layer's experts before the policy hears of its routing: a prefetch requested before they
        # are pinned must not evict them. Without a hearing policy, a planner's fills or a policy's thread,
        # none is requested before `serve` (which protects them where it runs several chunks).
        guard = hears or planner is not None or policy.threaded
        for layer in range(policy.ctx.num_layers):
            routed = loop.route(layer)
            needed = needed_experts(routed.ids, rows) if routed.needed is None else routed.needed
            keys = [(layer, e) for e in needed]
            if guard:
                cache.protect(keys, layer)
            if hears:
                event = LayerRouted(
                    layer,
                    routed.ids,
                    valid,
                    needed,
                    probs=routed.probs if probs else None,
                    hidden=routed.hidden if policy.needs_hidden else None,
                )
                self._tell(policy.on_layer_routed, event)
            on_host = self._host_share(layer, needed, routed.ids, token_valid, loop) if planner else None
            served = [key for key in keys if key not in on_host] if on_host else keys
            self.serve(layer, served, loop.compute, protected=guard, arrays=loop.wants_arrays)
            if on_host and policy.host_fill:
                fill = [(key, FILL_PRIORITY) for key in on_host if self.cache.entry(key) is None]
                self.cache.request_prefetch(fill, replace=False, if_idle=policy.host_fill == "idle")
        self._tell(policy.on_iteration_end)

    def _host_share(
        self, layer: int, needed: tuple[int, ...], ids: np.ndarray, valid: np.ndarray, loop: LayerLoop
    ) -> list[Key]:
        """Plans the layer's host share (`plan`) and starts it (`LayerLoop.host`)."""
        try:
            on_host = self.plan(layer, needed, ids, valid)
            if on_host:
                loop.host(layer, on_host)
        except BaseException:
            self.cache.protect(())  # as `serve` would have: a failed call leaves the cache usable
            raise
        return on_host

    def plan(self, layer: int, needed: tuple[int, ...], ids: np.ndarray, valid: np.ndarray) -> list[Key]:
        """The needed experts the host computes (none without a planner), counted as `host_computed` in the
        statistics of the device that holds them: misses, or hits where the planner balanced the layer."""
        if self.planner is None or not needed:
            return []
        start = time.perf_counter()
        counts = collections.Counter(int(e) for e in ids[valid].ravel())
        on_host = self.planner.split(self.cache.parts([(layer, e) for e in needed]), counts, int(valid.sum()))
        for part, keys in self.cache.parts(on_host):
            part.book.count_host(layer, keys)
        self.timers["hybrid_planning"] += time.perf_counter() - start
        return on_host

    def serve(
        self, layer: int, keys: list[Key], compute: Compute, *, protected: bool = True, arrays: bool = True
    ) -> None:
        """For each device's share of the layer's needed experts `keys`, chunk by chunk: ensure, compute,
        release.

        `is_last` is True for the layer's last chunk over all devices (the engine finishes the layer
        there); a layer that needs nothing (or only host-computed experts) gets one `compute` with an empty
        chunk. `protected`: the caller has protected `keys` (`ServingCache.protect`); else they are
        protected here where the layer runs in several chunks or on several devices (one chunk is pinned
        before anything could evict its experts). `arrays=False`: `compute` gets no weights (an empty
        dict)."""
        cache = self.cache
        parts = cache.parts(keys)
        if len(parts) == 1 and parts[0][0] is cache and len(keys) <= cache.book.capacity:  # the usual
            try:  # one device, one chunk: its release ends the protection
                weights = cache.ensure(layer, keys, arrays=arrays)
            except BaseException:
                cache.protect(())
                raise
            try:
                compute(layer, keys, weights, True)
            finally:
                cache.release(keys, unprotect=True)
            return
        try:
            if not protected:
                cache.protect(keys, layer)
            if len(parts) == 1 and len(parts[0][1]) <= parts[0][0].book.capacity:  # one chunk on one device
                part, chunk = parts[0]
                weights = part.ensure(layer, chunk, arrays=arrays)
                try:
                    compute(layer, chunk, weights, True)
                finally:
                    part.release(chunk)
                return
            chunks = [
                (part, chunk)
                for part, share in parts
                for chunk in plan_chunks(share, part.book.capacity, part.book.__contains__)
            ]
            if not chunks:
                compute(layer, [], {}, True)
                return
            last = len(chunks) - 1
            for i, (part, chunk) in enumerate(chunks):
                weights = part.ensure(layer, chunk, arrays=arrays)
                try:
                    compute(layer, chunk, weights, i == last)
                finally:
                    part.release(chunk)
                if i < last:
                    # A chunk that has run needs no protection: prefetches for later layers may take its
                    # slots while the layer's remaining chunks load (DuoServe streams its prefill through
                    # them). After the last, `protect(())` below ends it.
                    self.cache.protect([key for _, later in chunks[i + 1 :] for key in later], layer)
        finally:
            self.cache.protect(())


def plan_chunks(keys: list[Key], capacity: int, held: Callable[[Key], bool]) -> list[list[Key]]:
    """Splits one device's share of a layer's needed experts into chunks of at most `capacity`. When it
    takes more than one, held experts go first: they are hits now, and loading the others would evict
    them."""
    if len(keys) > capacity:
        keys = sorted(keys, key=lambda k: not held(k))
    return [keys[i : i + capacity] for i in range(0, len(keys), capacity)]
