"""The oracle policy: knows every future routing of the requests it serves, evicts by Belady's rule and
prefetches the next layer's experts; the upper bound every comparison chart shows (DESIGN.md, "Policies").

Built from the routing trace of an earlier run of the very same generation (e.g. the resident model with the
same prompts, batch and greedy sampling): `OffloadConfig(policy=Oracle(trace))`. The engine and the
trace-replay simulator drive it through the `Policy` hooks; it follows their event stream and refuses to go
on when the stream leaves the trace.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..cache import CacheView, Entry, Key
from ..events import IterationStart, LayerRouted, RequestStart
from .base import Policy, PolicyContext


class Oracle(Policy):
    """Belady eviction (Belady 1966, "MIN": evict what is needed farthest in the future) and perfect
    prefetch, driven by the recorded future.

    Timeline. The traces (one per `generate` call, in call order) become a sequence of steps, one per
    (call, iteration, MoE layer), each with its set of needed experts (the union over the batch's active
    rows). The policy keeps its position from the events: `on_request_start` opens the next call (an
    iteration with nothing open, or after the open call's last iteration, opens it implicitly), every
    `on_iteration_start` checks each row's token count against the trace, and every `on_layer_routed`
    checks the layer's needed experts; any difference raises, since the future would be wrong from there.

    Eviction. `keep_score` is minus the step of the expert's next use (never again: minus infinity), so the
    cache evicts the expert needed farthest ahead. An expert the current layer needs and has not served
    yet counts as needed now (it is served once the engine has used it since the layer routed).

    Prefetch. At iteration start and after each layer routes, the oracle requests the experts needed next,
    soonest first (priority = minus the step of use), in the next `prefetch_ahead` layers only (default 1):
    as many as fit beside the current layer's experts (`capacity` at iteration start, and when the layer
    runs in chunks). One layer ahead issues the loads Belady's on-demand schedule would make at the next
    layer, early, evicting what it would evict then (only the current layer is used in between); reaching
    further brings experts in before Belady would, and at tight budgets their victims come back as extra
    copies. Simulated at Mixtral-8x7B sizes on fmoe-tiny-mixtral's routing at 12.5 % of the experts (RTX
    3090), prefetching as far as fits cost 192.9 ms per token against LFU's 171.5 (no bound), one layer
    ahead 153.2, on the store split's prompts; at 50 % as far as fits was faster (15.6 against 18.3 ms),
    both below every baseline. `admit_prefetch` lets one in only by
    evicting an expert needed strictly later, and only if the current layer's experts still to load will
    find experts needed later still to evict; so a prefetch never costs a hit and is not evicted unused
    (short of ties). It never requests the experts of the layer that has just routed: that is the current
    demand, served on demand, not a prediction (with synchronous transfers such a "prefetch" would land
    before the layer counts its hits and turn every miss into a hit).

    Upper bound. With `OffloadConfig(synchronous_transfers=True)` every copy lands as it is issued, so the
    hit rate measures prediction and eviction alone: among policies that, like every policy here, prefetch
    only layers after the one just routed, none gets more hits than the oracle on the same requests and
    budget (and with `prefetch=False`, Belady's miss count is the optimum of on-demand loading). With
    asynchronous transfers over a finite link the oracle issues the same requests, but a copy still in
    flight when its layer asks counts as a miss (a late prefetch), and the cache's in-flight limit and queue
    order decide what lands in time: the result bounds what perfect knowledge buys under this transfer
    engine, not the best schedule the link allows (that would also plan issue times against bandwidth).
    Nor is it a bound when a layer's experts outnumber the slots (the layer runs in chunks): admission holds
    its prefetches back until the layer's last chunk has loaded, and they start only with the next layer's
    loads, after that layer has routed; a policy that lets prefetches evict freely can then get more hits
    (on a tiny Qwen1.5-MoE at one layer's top-k in slots, batch 3: MoE-Infinity 20, the oracle 16).

    Args:
      traces: the `RoutingTrace` of the generation to serve, or one per `generate` call in order.
      prefetch: prefetch the future (off: Belady eviction with on-demand loading only).
      horizon: foresight in iterations (tokens of a decode): the oracle sees the rest of the current
        iteration and the next `horizon` iterations of the current call, and nothing beyond (an expert
        next needed later counts as never needed again; ties go to the least recently used). None: the
        whole future. With `prefetch=False` this is Belady limited to that foresight, which measures how
        far ahead an eviction rule must see to approach the optimum.
      prefetch_ahead: layers ahead whose experts are prefetched (None: as many as fit, whatever the layer).
    """

    name = "oracle"

    def __init__(
        self,
        traces: Any,
        *,
        prefetch: bool = True,
        horizon: int | None = None,
        prefetch_ahead: int | None = 1,
    ):
        traces = list(traces) if isinstance(traces, Sequence) else [traces]
        if not traces:
            raise ValueError("Oracle needs the RoutingTrace of the generation it serves, got none")
        meta = traces[0].meta
        self.num_layers, self.num_experts = int(meta["num_layers"]), int(meta["num_experts"])
        if horizon is not None and horizon < 0:
            raise ValueError(f"horizon must be >= 0 iterations (or None: the whole future), got {horizon}")
        if prefetch_ahead is not None and prefetch_ahead < 1:
            raise ValueError(
                f"prefetch_ahead must be >= 1 layer (or None: as far as fits), got {prefetch_ahead}"
            )
        self.prefetch = prefetch
        self.horizon = horizon
        self.prefetch_ahead = prefetch_ahead
        self._until = math.inf  # the last step the oracle may see (its horizon)
        self.calls: list[_Call] = []
        self.needs: list[frozenset[Key]] = []  # per step: experts needed
        self.uses: dict[Key, list[int]] = {}  # per expert: the steps that need it, ascending
        for c, trace in enumerate(traces):
            if (int(trace.meta["num_layers"]), int(trace.meta["num_experts"])) != (
                self.num_layers,
                self.num_experts,
            ):
                raise ValueError(
                    f"trace {c} has L={trace.meta['num_layers']}, J={trace.meta['num_experts']}; "
                    f"trace 0 has L={self.num_layers}, J={self.num_experts}"
                )
            self._add_call(trace)
        # Each expert's first use after step `_synced` (inf: none), for `keep_scores`; `_cursor`: its index
        # in `uses`. Brought forward to `_now` when read (`_sync`).
        self._next = np.full((self.num_layers, self.num_experts), np.inf)
        self._cursor: dict[Key, int] = {}
        self._synced = math.inf  # not yet set up
        self._call = -1  # the open call
        self._iteration = -1  # within it
        self._layer = -1  # last routed MoE layer of the iteration
        self._now = -1  # current step (layer just routed; iteration start: the step before layer 0)
        # The current layer's experts -> their last_use when it routed (empty at iteration start).
        self._at_routing: dict[Key, int | None] = {}

    def _add_call(self, trace: Any) -> None:
        iterations = max((len(r.iterations) for r in trace.requests), default=0)
        tokens = np.zeros((iterations, len(trace.requests)), np.int64)  # [I, B] valid tokens per row
        offset = len(self.needs)
        for i in range(iterations):
            needed: list[set[int]] = [set() for _ in range(self.num_layers)]
            for b, request in enumerate(trace.requests):
                if i < len(request.iterations):
                    ids = np.asarray(request.iterations[i].ids)  # [t, L, k]
                    tokens[i, b] = ids.shape[0]
                    for layer in range(self.num_layers):
                        needed[layer].update(int(e) for e in ids[:, layer].ravel())
            for layer in range(self.num_layers):
                step = len(self.needs)
                self.needs.append(frozenset((layer, e) for e in needed[layer]))
                for e in sorted(needed[layer]):
                    self.uses.setdefault((layer, e), []).append(step)
        self.calls.append(_Call(offset, tokens))

    def bind(self, ctx: PolicyContext, cache: CacheView) -> None:
        super().bind(ctx, cache)
        if (ctx.num_layers, ctx.num_experts) != (self.num_layers, self.num_experts):
            raise ValueError(
                f"the oracle's trace has L={self.num_layers} MoE layers and J={self.num_experts} experts; "
                f"the model has L={ctx.num_layers}, J={ctx.num_experts}: record the trace with this model"
            )

    # -- following the event stream ----------------------------------------------------------------------
    def _diverged(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"the event stream diverges from the oracle's trace at call {self._call}, iteration "
            f"{self._iteration}: {what}. The oracle must serve the very generation it was recorded from "
            "(same prompts, batch, sampling, max_new_tokens and stop rule), one trace per generate call"
        )

    def _open_call(self, batch: int) -> None:
        if self._call >= 0:
            done, recorded = self._iteration + 1, self.calls[self._call].iterations
            if done != recorded:
                raise self._diverged(f"a new call starts after {done} iterations, the trace has {recorded}")
        if self._call + 1 >= len(self.calls):
            raise RuntimeError(
                f"generate call {self._call + 2} started but the oracle has traces of {len(self.calls)} "
                "calls; give Oracle one trace per generate call, in order"
            )
        self._call += 1
        self._iteration = -1
        rows = self.calls[self._call].tokens.shape[1]
        if batch != rows:
            raise self._diverged(f"the batch has {batch} requests, the trace {rows}")

    def on_request_start(self, event: RequestStart) -> None:
        self._open_call(event.batch)

    def on_iteration_start(self, event: IterationStart) -> None:
        valid = event.valid
        if self._call < 0 or self._iteration + 1 >= self.calls[self._call].iterations:
            self._open_call(valid.shape[0])
        if self._layer not in (-1, self.num_layers - 1):
            raise self._diverged(f"an iteration starts after MoE layer {self._layer} of {self.num_layers}")
        self._iteration += 1
        self._layer = -1
        call = self.calls[self._call]
        expected = call.tokens[self._iteration]  # [B]
        got = valid.sum(axis=1)
        if valid.shape[0] != expected.shape[0] or not np.array_equal(got, expected):
            raise self._diverged(f"valid tokens per row {got.tolist()}, the trace has {expected.tolist()}")
        self._now = call.offset + self._iteration * self.num_layers - 1
        if self.horizon is not None:
            last = min(self._iteration + self.horizon, call.iterations - 1)  # not past the call
            self._until = call.offset + (last + 1) * self.num_layers - 1
        self._at_routing = {}
        if self.prefetch:
            self._request(exclude=frozenset())

    def on_layer_routed(self, event: LayerRouted) -> None:
        layer = event.layer
        if layer != self._layer + 1:
            raise self._diverged(f"MoE layer {layer} routed after layer {self._layer}")
        self._layer = layer
        self._now += 1
        needs = self.needs[self._now]
        if len(event.needed) != len(needs) or any((layer, e) not in needs for e in event.needed):
            raise self._diverged(
                f"MoE layer {layer} needs experts {sorted(event.needed)}, the trace "
                f"{sorted(e for _, e in needs)}"
            )
        entry_of = self.cache.entry
        self._at_routing = {
            key: None if (entry := entry_of(key)) is None else entry.last_use for key in needs
        }
        if self.prefetch:
            self._request(exclude=needs)

    def _request(self, exclude: frozenset[Key]) -> None:
        """Requests the experts needed soonest after now (not those of the current layer, `exclude`): as
        many as fit beside the current layer's, or `capacity` when the layer runs in chunks (admission then
        holds them back until the last chunk's experts are in)."""
        chunked = len(exclude) > self.ctx.capacity
        room = self.ctx.capacity if chunked else self.ctx.capacity - len(exclude)
        if self.prefetch_ahead is None:
            upcoming = []
            for key, steps in self.uses.items():
                i = bisect.bisect_right(steps, self._now)
                if i < len(steps) and key not in exclude:
                    upcoming.append((steps[i], key))
            soonest = heapq.nsmallest(room, upcoming)
        else:  # the steps up to `prefetch_ahead` ahead hold all there is: no pass over every expert
            soonest, seen = [], set(exclude)
            for step in range(self._now + 1, min(self._now + self.prefetch_ahead + 1, len(self.needs))):
                for key in sorted(self.needs[step] - seen):  # (step, key) order, as nsmallest's
                    soonest.append((step, key))
                    seen.add(key)
            soonest = soonest[: max(room, 0)]
        self.cache.request_prefetch([(key, -float(step)) for step, key in soonest], replace=True)

    # -- the future ------------------------------------------------------------------------------------
    def next_use(self, key: Key) -> float:
        """The step at which `key` is next needed (now, if the current layer still needs it); inf: never."""
        steps = self.uses.get(key)
        if not steps:
            return math.inf
        if key in self._at_routing and not self._served(key):
            return float(self._now)
        i = bisect.bisect_right(steps, self._now)
        return float(steps[i]) if i < len(steps) and steps[i] <= self._until else math.inf

    def _served(self, key: Key) -> bool:
        """The current layer has used `key` since it routed (its last use moved on)."""
        entry = self.cache.entry(key)
        return entry is not None and entry.used and entry.last_use != self._at_routing[key]

    def keep_score(self, key: Key, entry: Entry) -> float:
        return -self.next_use(key)

    def keep_scores(self, layers: np.ndarray, experts: np.ndarray) -> np.ndarray:
        """`keep_score` of many experts at once: the same floats, from the next uses kept per expert."""
        if self._synced != self._now:
            self._sync()
        upcoming = self._next  # beyond the horizon, never again
        if self._until != math.inf:
            upcoming = np.where(upcoming <= self._until, upcoming, np.inf)
        entry_of, now = self.cache.entry, []
        for key, last_use in self._at_routing.items():  # not `_served` yet
            entry = entry_of(key)
            if entry is None or not entry.used or entry.last_use == last_use:
                now.append(key)
        if now:
            upcoming = upcoming.copy() if upcoming is self._next else upcoming
            for key in now:
                upcoming[key] = float(self._now)
        return -upcoming[layers, experts]

    def _sync(self) -> None:
        """Brings `_next` to `_now`: the experts needed at each step passed move on to their next use."""
        if self._synced > self._now:  # set up (or, were the stream to step back, start over)
            self._next.fill(np.inf)
            for key, steps in self.uses.items():
                self._next[key] = steps[0]
                self._cursor[key] = 0
            self._synced = -1
        for step in range(self._synced + 1, self._now + 1):
            for key in self.needs[step]:
                i = self._cursor[key] = self._cursor[key] + 1
                steps = self.uses[key]
                self._next[key] = steps[i] if i < len(steps) else np.inf
        self._synced = self._now

    def admit_prefetch(self, key: Key, priority: float, victim: Key) -> bool:
        """Only by evicting an expert needed later, and only if the current layer's experts still to load
        will find experts needed later still than `key` to evict (else they would evict `key`, unused)."""
        when = self.next_use(key)
        if self.next_use(victim) <= when:
            return False
        to_load = sum(1 for k in self._at_routing if self.cache.entry(k) is None)
        if not to_load:
            return True
        later = sum(
            1
            for k, e in self.cache.entries()
            if k != victim
            and k not in self._at_routing
            and e.ready
            and not e.pins
            and self.next_use(k) > when
        )
        return later >= to_load

    def stats(self) -> dict[str, Any]:
        return {"oracle_steps": self._now + 1, "oracle_trace_steps": len(self.needs)}


class _Call:
    """One generate call of the timeline: its first step and valid tokens per iteration and row."""

    def __init__(self, offset: int, tokens: np.ndarray):
        self.offset = offset
        self.tokens = tokens  # [I, B]

    @property
    def iterations(self) -> int:
        return self.tokens.shape[0]
