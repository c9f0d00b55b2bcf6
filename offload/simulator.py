"""Trace-replay simulator: replays recorded routing traces through any policy and cache budget on a
simulated clock with a hardware cost model. Called by benchmarks and tests (`simulate`).

It runs every iteration through the same iteration driver as the live engine (`offload/driver.py`), with
the same `DeviceExpertCache`, and copies going over a `SimulatedLink` instead of `jax.device_put`. So with
synchronous transfers its hit and miss counts equal the live engine's on the same requests; with
asynchronous ones, prefetches overlap the modelled compute.

Routing comes from the trace (layer, expert and top-k counts included); byte and FLOP sizes come from a
`ModelPreset` (e.g. `MIXTRAL_8X7B`), so a trace of a small model replays at a real model's size.

Hybrid execution (`OffloadConfig(execution="hybrid")`, with a `HostPreset`): the same planner as the live
engine (`offload/hybrid.py`) picks the misses the host computes; the host's call for a layer starts when the
layer has routed and runs concurrently with the device's experts (and with the link's copies), and the layer
finishes when both have (the device waits for the host's result: `host_wait_s`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from .cache import DeviceExpertCache, Key
from .config import OffloadConfig
from .cost_model import CostModel, HardwarePreset, HostPreset, ModelPreset
from .driver import Driver, Functions, Routed
from .engine_model import EngineModel
from .hybrid import HybridPlanner, ModelledHostCost
from .policies import Policy, PolicyContext
from .projection import fit_layers
from .replay_steps import Counted, layout
from .resources import Copy, SimulatedHost, SimulatedLink  # noqa: F401  (Copy: part of this module's API)
from .trace import RoutingTrace


@dataclasses.dataclass
class SimResult:
    """What a replay measured. Counts follow `offload/cache.py` (hit, miss, late and wasted prefetch); times
    are simulated seconds. Per-request lists are in trace order, requests of each trace in their order."""

    hits: int
    misses: int
    late_prefetches: int
    prefetches: int
    wasted_prefetches: int
    dropped_prefetches: int
    bytes_to_device: int
    layer_hits: list[int]  # [L]
    layer_needed: list[int]  # [L]
    stall_s: float  # compute waiting for experts (on-demand loads, late prefetches, synchronous copies)
    compute_s: float  # the device's
    total_s: float  # compute_s + stall_s + host_wait_s
    link_busy_s: float  # time the link spent copying (transfers overlapping compute included)
    ttft_s: list[float]  # per request: its batch's prefill iteration, LM head included
    tpot_s: list[float]  # per request: mean decode iteration while it was active (nan without decode)
    capacity: int  # cache slots
    expert_bytes: int
    device_bytes: int  # cache budget + resident weights (no KV cache, no activations)
    fits_device: bool  # device_bytes within the hardware's memory
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # the policy's `stats()`
    host_computed: int = 0  # experts the host computed (hybrid: misses, and hits given it to balance a layer)
    host_compute_s: float = 0.0  # the host's busy time (calls overlap the device's compute)
    host_wait_s: float = 0.0  # the device waiting for the host's results
    launches: int = 0  # the engine's step-program launches and host syncs (hardware with engine costs)
    syncs: int = 0

    @property
    def link_busy_share(self) -> float:
        """Fraction of the replay's time the link spent copying experts."""
        return self.link_busy_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0

    @property
    def layer_hit_rate(self) -> list[float]:
        return [h / n if n else 1.0 for h, n in zip(self.layer_hits, self.layer_needed, strict=True)]

    @property
    def mean_ttft_s(self) -> float:
        return float(np.mean(self.ttft_s)) if self.ttft_s else float("nan")

    @property
    def median_ttft_s(self) -> float:
        return float(np.median(self.ttft_s)) if self.ttft_s else float("nan")

    @property
    def mean_tpot_s(self) -> float:
        decoded = [t for t in self.tpot_s if not np.isnan(t)]
        return float(np.mean(decoded)) if decoded else float("nan")

    @property
    def median_tpot_s(self) -> float:
        decoded = [t for t in self.tpot_s if not np.isnan(t)]
        return float(statistics.median(decoded)) if decoded else float("nan")

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in (
            "hit_rate",
            "link_busy_share",
            "layer_hit_rate",
            "mean_ttft_s",
            "median_ttft_s",
            "mean_tpot_s",
            "median_tpot_s",
        ):
            out[name] = getattr(self, name)
        return out


def simulate(
    traces: RoutingTrace | Sequence[RoutingTrace],
    offload: OffloadConfig | None = None,
    *,
    model: ModelPreset | Any,
    hardware: HardwarePreset,
    host: HostPreset | None = None,
    router_weights: Sequence[np.ndarray] | None = None,
    warmup: Sequence[RoutingTrace] = (),
    chunks: int | None = None,
    finish_started: bool = True,
    matcher_s: float = 0.0,
    policy_s: float = 0.0,
    bookkeeping_s: float | None = None,
    layers: str = "trace",
) -> SimResult:
    """Replays routing traces through an offload policy and expert cache on a simulated clock.

    Each `RoutingTrace` is one batch, as one `generate` call records it: the batch starts with
    `on_request_start(B)`; its first iteration is the prefill (every request's first iteration, left padded
    to the longest), each later one decodes one token of the requests that have that many iterations
    (the others finished and are invalid rows). Invalid rows of the arrays handed to the policy are zeros.
    Batches run one after another on one cache and one policy, as consecutive `generate` calls on a model.
    Time advances only by the cost model's compute and by waits for copies: the policy's own host work
    (matching, predictors) takes no simulated time on the engine's path unless priced (`policy_s`,
    `bookkeeping_s`, `matcher_s`). With `matcher_s` > 0, fmoe's
    matcher (a thread beside the engine live) takes that long per search or update on the simulated clock,
    so its prefetches are requested that much later, behind its earlier work.

    Args:
      traces: one trace or a list, replayed in order; all of the same layer, expert and top-k counts.
      offload: the policy and budget exactly as the live engine takes them (`policy`, `policy_options`,
        `cache_experts` / `cache_bytes` (bytes of `model`'s experts) / neither for 25 %, `prefetch_distance`,
        `max_inflight`, `transfer="synchronous"`, `store_capacity`, `store_path`). A policy that matches on
        a thread of its own must run inline here (fmoe: `policy_options={"asynchronous": False}`).
      model: byte and FLOP sizes: a `ModelPreset` (`MIXTRAL_8X7B`, ...) or a model config (`model.config`).
      hardware: a `HardwarePreset` (`H100_SXM`, `H100_PCIE`, `A100_SXM`, `RTX_3090`, or your own).
      host: the host CPU beside it, a `HostPreset` (`cost_model.HOSTS`); needed for `execution="hybrid"`.
      router_weights: per MoE layer the router kernel `[D, J]` float32, for policies that `needs_hidden`
        (the trace must then hold hidden states: `generate(..., record_trace=True, record_hidden=True)`).
      warmup: traces replayed first through the same policy and cache, left out of the result (cache and
        policy state carry over into `traces`, as `generate` calls before a measurement do).
      chunks: pieces each expert's copy goes over the link in (`SimulatedLink`); 1: whole experts; None:
        `hardware.copy_chunks(model.expert_bytes)`, one per matrix where the per-copy fixed cost is small
        beside a matrix's bytes (the RTX 3090 preset), whole otherwise (the Hopper presets).
      finish_started: a prefetch no longer wanted is cancelled only before its first piece (the default,
        as the live `ChunkedJaxMover`); False: also between pieces.
      matcher_s: host seconds a predicting policy's matcher spends per context (fmoe: a search or a map
        update; `PolicyContext.matcher_s` and `.clock`); 0: free and instantaneous (the default).
      policy_s: host seconds the policy's events take per MoE layer on the engine's path (measured live,
        `GenerationStats.overhead_s["policy_events"]`), charged with the hardware's engine costs
        (`offload/engine_model.py`; `hardware.without_engine()` replays without any).
      bookkeeping_s: host seconds per MoE layer of a policy's own bookkeeping beyond `policy_s`
        (`PolicyContext.bookkeeping_s`): a policy that weighs its host work prices it so, and the clock is
        charged it after each layer the policy did the work for (`Policy.charged_s`), nothing for an
        iteration it left the work out of (fmoe resting). None: free and never left out (the default).
      layers: a trace of fewer MoE layers than `model`: "project", "refuse" or "trace" (`projection.py`).

    Returns:
      a `SimResult` of `traces`. The policy is bound to a fresh cache and closed at the end.
    """
    traces = [traces] if isinstance(traces, RoutingTrace) else list(traces)
    if not traces:
        raise ValueError("simulate needs at least one routing trace")
    model = model if isinstance(model, ModelPreset) else ModelPreset.from_config(model)
    everything = fit_layers([*warmup, *traces], model.num_layers, layers)
    costs = dict(model=model, hardware=hardware, host=host, matcher_s=matcher_s, policy_s=policy_s)
    costs["bookkeeping_s"] = bookkeeping_s
    replay = Replay(
        offload,
        meta=common_meta(everything),
        router_weights=router_weights,
        check=everything,
        chunks=chunks,
        finish_started=finish_started,
        **costs,
    )
    split = len(everything) - len(traces)  # the warm-up's projected traces come first
    try:
        for trace in everything[:split]:
            replay.run(trace)
        replay.reset_statistics()
        for trace in everything[split:]:
            replay.run(trace)
    finally:
        result = replay.close()
    return result


class Replay:
    """One policy and expert cache on a simulated clock, fed one batch (`RoutingTrace`) at a time.

    `simulate` runs one over a list of traces; a serving experiment that forms batches as requests arrive
    feeds them as it goes and reads `clock` between batches. Statistics count from construction or from
    the last `reset_statistics()`. Arguments as `simulate`'s; `meta` is a trace's `meta` (layer, expert and
    top-k counts, embedding width, model identity) that every replayed trace must match; `check`: traces
    whose fields are checked against the policy's needs before it starts (`run` checks each trace anyway).
    """

    def __init__(
        self,
        offload: OffloadConfig | None,
        *,
        meta: dict[str, Any],
        model: ModelPreset | Any,
        hardware: HardwarePreset,
        host: HostPreset | None = None,
        router_weights: Sequence[np.ndarray] | None = None,
        check: Sequence[RoutingTrace] = (),
        chunks: int | None = None,
        finish_started: bool = True,
        matcher_s: float = 0.0,
        policy_s: float = 0.0,
        bookkeeping_s: float | None = None,
    ):
        offload = offload or OffloadConfig()
        _check_setting(offload, host, matcher_s, bookkeeping_s)
        if not isinstance(model, ModelPreset):
            model = ModelPreset.from_config(model)
        if chunks is None:  # the cost model's choice; `SimulatedLink` refuses fewer than one
            chunks = hardware.copy_chunks(model.expert_bytes)
        for key in ("num_layers", "num_experts", "top_k"):
            if not meta.get(key):
                raise ValueError(f"routing trace meta[{key!r}] is missing or zero; the simulator needs it")
        self.meta, self.model, self.hardware = meta, model, hardware
        self.num_layers, num_experts = meta["num_layers"], meta["num_experts"]
        self.router_weights = router_weights
        self.policy = offload.make_policy()
        _check_policy(self.policy, list(check), router_weights, self.num_layers)

        total = self.num_layers * num_experts
        self.capacity = total if self.policy.preload_all else offload.slots(model.expert_bytes, total)
        self.link = SimulatedLink(
            model.expert_bytes,
            hardware.link_effective,
            chunks=chunks,
            finish_started=finish_started,
            chunk_latency_s=hardware.copy_latency_s,
        )
        self.cache = DeviceExpertCache(
            self.link,
            self.capacity,
            model.expert_bytes,
            self.policy,
            max_inflight=offload.max_inflight,
            synchronous=offload.transfer == "synchronous",
        )
        self.costs = CostModel(model, hardware, num_experts)
        self.policy.bind(self._context(offload, chunks, matcher_s, bookkeeping_s), self.cache)
        self.host: SimulatedHost | None = None
        planner = None
        if offload.execution == "hybrid":
            cost = ModelledHostCost(model, host, hardware.link_effective)
            self.host = SimulatedHost(cost)
            planner = HybridPlanner(cost, self.costs)
        self.driver = Driver(self.policy, self.cache, planner)
        arguments = model.launch_arguments(self.num_layers, num_experts)
        self.engine = EngineModel(hardware, arguments, self.cache, policy_s)
        self.charges = _Charges(self.costs, self.engine, bills=bookkeeping_s is not None)
        self._closed = False
        try:
            if self.policy.preload_all:
                self.cache.preload([(m, e) for m in range(self.num_layers) for e in range(num_experts)])
            elif self.policy.initial_experts():
                self.cache.preload(self.policy.initial_experts())
        except BaseException:
            self.close()
            raise
        self.reset_statistics()

    def _context(
        self, offload: OffloadConfig, chunks: int, matcher_s: float, bookkeeping_s: float | None
    ) -> PolicyContext:
        """What the policy learns of the model, the cache and the simulated costs."""
        meta, model, hardware, router_weights = self.meta, self.model, self.hardware, self.router_weights
        one = np.ones(1)
        decode_layer_s = (
            self.costs.attention_s(one, one)
            + self.costs.experts_s([1] * int(meta["top_k"]))
            + self.costs.shared_s(1)
        )
        return PolicyContext(
            num_layers=self.num_layers,
            num_experts=meta["num_experts"],
            top_k=meta["top_k"],
            embed_dim=meta["embed_dim"],
            prefetch_distance=offload.prefetch_distance,
            capacity=self.capacity,
            model_id=str(meta.get("model_id", "")),
            router_weights=tuple(np.asarray(w, np.float32) for w in router_weights)
            if self.policy.needs_hidden
            else (),
            copy_s=hardware.copy_s(model.expert_bytes, chunks),
            layer_s=decode_layer_s,
            matcher_s=matcher_s,
            clock=(lambda: self.link.clock) if matcher_s > 0 else None,
            copy_chunks=chunks,
            execution=offload.execution,
            bookkeeping_s=bookkeeping_s,
        )

    @property
    def clock(self) -> float:
        """Simulated seconds since the replay began."""
        return self.link.clock

    def reset_statistics(self) -> None:
        """Counts hits, times and requests from here on (after a warm-up); cache and policy keep state."""
        link, host = self.link, self.host or SimulatedHost(None)
        self.driver.reset()
        self._start = (link.clock, link.stall_s, link.compute_s, link.busy_s, host.busy_s, host.wait_s)
        self._engine_start = (self.engine.launches, self.engine.syncs)
        self.ttft_s: list[float] = []
        self.tpot_s: list[float] = []

    def run(self, trace: RoutingTrace) -> tuple[list[float], list[float]]:
        """Replays one batch; returns its requests' TTFT and mean decode-iteration time (simulated s)."""
        for key in ("num_layers", "num_experts", "top_k", "embed_dim"):
            if trace.meta.get(key) != self.meta.get(key):
                raise ValueError(
                    f"routing trace has {key}={trace.meta.get(key)} but the replay was built for "
                    f"{self.meta.get(key)}; replay traces of one model together"
                )
        _check_policy(self.policy, [trace], self.router_weights, self.num_layers)
        ttft, tpot = _replay_batch(trace, self.driver, self.link, self.charges, self.host)
        self.ttft_s += ttft
        self.tpot_s += tpot
        return ttft, tpot

    def close(self) -> SimResult:
        """Closes the policy (once) and returns what was measured since the last `reset_statistics()`."""
        if not self._closed:
            self._closed = True
            self.policy.close()
        clock, stall, compute, busy, host_busy, host_wait = self._start
        s, link, layers = self.driver.measure().cache, self.link, range(self.num_layers)
        host = self.host or SimulatedHost(None)
        num_experts = self.meta["num_experts"]
        device_bytes = self.capacity * self.model.expert_bytes + self.model.resident_bytes(
            self.num_layers, num_experts
        )
        return SimResult(
            hits=s.hits,
            misses=s.misses,
            late_prefetches=s.late_prefetches,
            prefetches=s.prefetches,
            wasted_prefetches=s.wasted_prefetches,
            dropped_prefetches=s.dropped_prefetches,
            bytes_to_device=s.bytes_to_device,
            layer_hits=[s.layer_hits.get(m, 0) for m in layers],
            layer_needed=[s.layer_needed.get(m, 0) for m in layers],
            stall_s=link.stall_s - stall,
            compute_s=link.compute_s - compute,
            total_s=link.clock - clock,
            link_busy_s=link.busy_s - busy,
            ttft_s=list(self.ttft_s),
            tpot_s=list(self.tpot_s),
            capacity=self.capacity,
            expert_bytes=self.model.expert_bytes,
            device_bytes=device_bytes,
            fits_device=device_bytes <= self.hardware.memory_bytes,
            extra=self.policy.stats(),
            host_computed=s.host_computed,
            host_compute_s=host.busy_s - host_busy,
            host_wait_s=host.wait_s - host_wait,
            launches=self.engine.launches - self._engine_start[0],
            syncs=self.engine.syncs - self._engine_start[1],
        )


# -- replay ---------------------------------------------------------------------------------------------
class _Charges:
    """The cost model's seconds for the stages a replay charges again and again with the same arguments
    (a layer's attention at the batch's token counts, a chunk of experts and their token counts, the shared
    expert, the LM head), each worked out once: the cost model is a pure function of them, so the floats are
    the ones it gives."""

    def __init__(self, costs: CostModel, engine: EngineModel, bills: bool = False):
        self.costs, self.engine = costs, engine  # the engine's host costs (`offload/engine_model.py`)
        self.bills = bills  # the policy's bookkeeping is priced: charge what it did (`Policy.charged_s`)
        # Requests replayed one after another decode at the same (new, past) token counts, step for step.
        self._attention: dict[tuple[bytes, bytes], float] = {}
        self._experts: dict[tuple[int, ...], float] = {}
        self._shared: dict[int, float] = {}
        self._head: dict[int, float] = {}

    def attention_s(self, new_tokens: np.ndarray, past_tokens: np.ndarray) -> float:
        key = (new_tokens.tobytes(), past_tokens.tobytes())  # both int64 `[R]`: the bytes say the values
        seconds = self._attention.get(key)
        if seconds is None:
            seconds = self._attention[key] = self.costs.attention_s(new_tokens, past_tokens)
        return seconds

    def experts_s(self, tokens: tuple[int, ...]) -> float:
        seconds = self._experts.get(tokens)
        if seconds is None:
            seconds = self._experts[tokens] = self.costs.experts_s(list(tokens))
        return seconds

    def shared_s(self, tokens: int) -> float:
        seconds = self._shared.get(tokens)
        if seconds is None:
            seconds = self._shared[tokens] = self.costs.shared_s(tokens)
        return seconds

    def head_s(self, rows: int) -> float:
        seconds = self._head.get(rows)
        if seconds is None:
            seconds = self._head[rows] = self.costs.head_s(rows)
        return seconds


def _replay_batch(
    trace: RoutingTrace, driver: Driver, link: SimulatedLink, charges: _Charges, host: SimulatedHost | None
) -> tuple[list[float], list[float]]:
    """Replays one batch (one `generate` call); returns per-request TTFT and mean decode-iteration time."""
    requests = trace.requests
    rows = len(requests)
    num_iterations = max((len(r.iterations) for r in requests), default=0)
    # Tokens each request has before each of its iterations (its KV cache), summed once.
    past = [np.cumsum([0] + [it.num_tokens for it in r.iterations]).tolist() for r in requests]
    # A batch of one request: its routing counted for every iteration at once.
    counted = Counted(requests[0], trace.meta) if rows == 1 and num_iterations else None
    start, engine = link.clock, charges.engine
    ttft = [float("nan")] * rows
    decode_times: list[list[float]] = [[] for _ in range(rows)]
    driver.begin(rows)
    policy = driver.policy
    # Charges that are 0.0 on this preset (no engine costs, no shared expert) are left out: adding 0.0 to the
    # clock changes no bit of it.
    engine_active, experts_s, bills = engine.active, charges.experts_s, charges.bills
    for i in range(num_iterations):
        step = layout(trace, i, policy, past) if counted is None else counted.layout(i, policy, past)
        began = link.clock
        tokens = int(step.valid.sum())
        route_s = charges.attention_s(step.new_tokens, step.past_tokens) + engine.layer_s
        link.compute(engine.step_started())
        shared_s = charges.shared_s(tokens)
        ids = step.ids.transpose(1, 0, 2)  # [L, N, k]: a layer's rows without a strided index each time

        def route(m: int, route_s=route_s, ids=ids, needed=step.needed, probs=step.probs, hidden=step.hidden):
            if engine_active:
                engine.routed()  # what it returns, `layer_s`, is in `route_s`
            link.compute(route_s)
            if probs is None and hidden is None:
                return Routed(ids[m], None, None, needed[m])
            return Routed(
                ids[m],
                None if probs is None else probs[:, m],
                None if hidden is None else hidden[:, m],
                needed[m],
            )

        def compute(
            m: int, chunk: list[Key], arrays: dict, last: bool, step=step, shared=shared_s, needed=step.needed
        ) -> None:
            if engine_active:
                engine.runs(chunk)
            # A chunk of all the layer's needed experts (the usual) is charged the counts worked out once.
            link.compute(experts_s(step.counts[m] if len(chunk) == len(needed[m]) else step.tokens(m, chunk)))
            if last:
                if engine_active:
                    link.compute(engine.layer_done())
                if bills:
                    link.compute(policy.charged_s())
                if host is not None:
                    host.join(link)
                if shared:
                    link.compute(shared)

        def on_host(m: int, keys: list[Key], step=step, tokens=tokens) -> None:
            engine.runs(keys)
            host.start(link.clock, tokens, list(step.tokens(m, keys)))

        loop = Functions(route, compute, on_host, wants_arrays=False)  # the clock needs no weights
        driver.iteration(step.valid, step.embeds, loop, step.fed)
        active = step.valid.any(axis=1)
        link.compute(charges.head_s(int(active.sum())))
        for b in np.flatnonzero(active):
            if i == 0:
                ttft[b] = link.clock - start
            else:
                decode_times[b].append(link.clock - began)
    tpot = [float(np.mean(t)) if t else float("nan") for t in decode_times]
    return ttft, tpot


# -- checks ---------------------------------------------------------------------------------------------
def common_meta(traces: list[RoutingTrace]) -> dict[str, Any]:
    """The first trace's `meta`, once every trace is checked to have its layer, expert and top-k counts."""
    meta = traces[0].meta
    for key in ("num_layers", "num_experts", "top_k"):
        if not meta.get(key):
            raise ValueError(f"routing trace 0: meta[{key!r}] is missing or zero; the simulator needs it")
    for t, trace in enumerate(traces[1:], 1):
        for key in ("num_layers", "num_experts", "top_k", "embed_dim"):
            if trace.meta.get(key) != meta.get(key):
                raise ValueError(
                    f"routing trace {t} has {key}={trace.meta.get(key)} but trace 0 has {meta.get(key)}; "
                    "replay traces of one model together"
                )
    return meta


def _check_setting(
    offload: OffloadConfig, host: HostPreset | None, matcher_s: float, bookkeeping_s: float | None = None
) -> None:
    """Refuses settings the simulator does not model, saying what to pass instead."""
    if not matcher_s >= 0:
        raise ValueError(f"matcher_s must be >= 0 seconds, got {matcher_s!r}")
    if bookkeeping_s is not None and not bookkeeping_s >= 0:
        raise ValueError(f"bookkeeping_s must be >= 0 seconds or None, got {bookkeeping_s!r}")
    if offload.execution == "hybrid" and host is None:
        raise ValueError(
            "execution='hybrid' computes misses on the host: pass host=, a HostPreset such as "
            "fmoe_jax.offload.cost_model.HOSTS['desktop_ddr5']"
        )
    if offload.devices not in (None, 1) or offload.placement is not None:
        raise ValueError(
            f"the simulator models one device behind one host link; got devices={offload.devices!r}, "
            f"placement={offload.placement!r}: replay with devices=None and placement=None"
        )


def _check_policy(
    policy: Policy, traces: list[RoutingTrace], router_weights: Sequence[np.ndarray] | None, num_layers: int
) -> None:
    """Refuses a policy the replay cannot drive faithfully, naming what is missing."""
    if policy.threaded:
        hint = policy.doing_without("thread")
        raise ValueError(
            f"policy {policy.name!r} works on a thread of its own, whose timing the simulated clock cannot "
            "follow" + (f"; {hint}" if hint else "")
        )
    if policy.needs_hidden and (router_weights is None or len(router_weights) != num_layers):
        got = "none" if router_weights is None else f"{len(router_weights)}"
        raise ValueError(
            f"policy {policy.name!r} needs each MoE layer's router weights [D, J]: pass router_weights with "
            f"{num_layers} arrays (got {got}), e.g. the router kernels of the model that recorded the trace"
        )
    wanted = {
        "embeds": (policy.needs_semantic, "semantic embeddings"),
        "probs": (policy.needs_probs, "router probabilities"),
        "hidden": (policy.needs_hidden, "hidden states (record with generate(..., record_hidden=True))"),
    }
    for name, (needed, what) in wanted.items():
        if not needed:
            continue
        for t, trace in enumerate(traces):
            for r, request in enumerate(trace.requests):
                for i, it in enumerate(request.iterations):
                    if getattr(it, name) is None:
                        hint = policy.doing_without(name)
                        raise ValueError(
                            f"policy {policy.name!r} needs {what}, but routing trace {t} request {r} "
                            f"iteration {i} has no {name!r}" + (f"; {hint}" if hint else "")
                        )


if __name__ == "__main__":  # pragma: no cover  (`python -m fmoe_jax.offload.simulator`: the fmoe-sim CLI)
    import sys

    from .sim_cli import main

    sys.exit(main())
