"""Hybrid execution: the planner's rule on stand-in caches, the host's cost (modelled and measured), the
fixed-placement baselines (fiddler, static_split), the simulator's host on hand-computed timelines, the
replay's counts against the live engine's, live serving with its statistics, and losslessness (every policy
on Mixtral, and the other families) with test_lossless.py's helpers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fakes import RecordingCache, layer_routed
from fmoe_jax.offload.cache import Entry
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.cost_model import (
    HARDWARE,
    HOSTS,
    MIXTRAL_8X7B,
    CostModel,
    HostPreset,
    ModelPreset,
)
from fmoe_jax.offload.hybrid import (
    FixedHostCost,
    HybridPlanner,
    MeasuredHostCost,
    ModelledHostCost,
)
from fmoe_jax.offload.policies import POLICIES, Fiddler, PolicyContext, StaticSplit
from fmoe_jax.offload.policies.fiddler import expert_usage
from fmoe_jax.offload.simulator import SimulatedLink, simulate
from serving import served
from test_lossless import OneTokenOnHost, Subject, check_lossless, subject_loader
from toy_costs import TOY_HARDWARE, TOY_MODEL, toy_trace

import fmoe_jax as fj
from fmoe_jax.engines.offload import router_weights
from fmoe_jax.trace import RoutingTrace


# -- the planner ---------------------------------------------------------------------------------------------
class StandInCache:
    """`entry` and `copy_eta` of a device cache: resident keys, arriving keys with their remaining seconds,
    and an on-demand load that waits `wait` seconds and takes `copy` seconds each."""

    def __init__(self, ready=(), arriving=None, copy=3.0, wait=0.0):
        self.ready, self.arriving = set(ready), dict(arriving or {})
        self.copy, self.wait = copy, wait
        self.asked: list[tuple] = []

    def entry(self, key):
        if key in self.ready:
            return Entry(ready=True)
        return Entry(ready=False) if key in self.arriving else None

    def copy_eta(self, key, ahead=0):
        self.asked.append((key, ahead))
        if key in self.ready:
            return 0.0
        if key in self.arriving:
            return self.arriving[key]
        return self.wait + (ahead + 1) * self.copy


def test_planner_sends_a_miss_where_it_finishes_first():
    cache = StandInCache(ready={(0, 0)}, arriving={(0, 1): 2.0, (0, 2): 0.5}, copy=3.0)
    keys = [(0, e) for e in range(4)]
    planner = HybridPlanner(FixedHostCost(per_expert_s=1.0, call_overhead_s=0.1))
    # (0, 1): host done at 1.1 s < its copy's 2.0 s; (0, 2): lands at 0.5 s < 2.1; (0, 3): 2.1 s < 3.0.
    assert planner.split([(cache, keys)], {e: 1 for e in range(4)}, valid=4) == [(0, 1), (0, 3)]
    assert (0, 0) not in [key for key, _ in cache.asked]  # a hit is not even weighed


def test_planner_takes_few_tokens_first_and_queues_on_demand_loads():
    cache = StandInCache(copy=2.5)
    keys = [(0, 0), (0, 1), (0, 2), (0, 3)]
    tokens = {0: 10, 1: 1, 2: 1, 3: 1}
    planner = HybridPlanner(FixedHostCost(per_expert_s=1.0))
    # Fewest tokens first: (0,1) done at 1 s, (0,2) at 2 s (both before a 2.5 s copy); (0,3) would finish at
    # 3 s: it loads; (0,0) would take 10 s more: it loads behind (0,3) (ahead=1: lands at 5 s).
    assert planner.split([(cache, keys)], tokens, valid=10) == [(0, 1), (0, 2)]
    assert cache.asked[-2:] == [((0, 3), 0), ((0, 0), 1)]


def test_planner_never_uses_a_host_slower_than_every_copy():
    cache = StandInCache(arriving={(1, 2): 0.2}, copy=0.1, wait=0.05)
    planner = HybridPlanner(FixedHostCost(per_expert_s=1.0))
    assert planner.split([(cache, [(1, 0), (1, 2)])], {0: 1, 2: 1}, valid=2) == []


class FixedDeviceCost:
    """A device that takes `per_expert_s` per expert, whatever its tokens."""

    def __init__(self, per_expert_s: float):
        self.per_expert_s = per_expert_s

    def expert_s(self, tokens: int) -> float:
        return self.per_expert_s

    def __repr__(self) -> str:
        return f"FixedDeviceCost({self.per_expert_s})"


def test_planner_balances_resident_experts_only_while_the_layer_ends_sooner():
    """Given the device's cost, hits go to the host too, fewest tokens first, while the later of the two
    finishing times drops; without it (or with a device much faster than the host) hits stay."""
    keys = [(0, e) for e in range(4)]
    tokens = {0: 3, 1: 1, 2: 1, 3: 2}
    cache = StandInCache(ready=set(keys))
    host = FixedHostCost(per_expert_s=1.0, call_overhead_s=0.5)
    assert HybridPlanner(host).split([(cache, keys)], tokens, valid=4) == []
    # Device 2 s an expert: 8 s on the device alone. Host costs 0.5 + 1 s per token: (0,1) -> host 1.5,
    # device 6; (0,2) -> 2.5 / 4; (0,3) -> 4.5 / 2 (max 4.5 > 4: stop).
    assert HybridPlanner(host, FixedDeviceCost(2.0)).split([(cache, keys)], tokens, valid=4) == [
        (0, 1),
        (0, 2),
    ]
    assert HybridPlanner(host, FixedDeviceCost(0.1)).split([(cache, keys)], tokens, valid=4) == []


def test_planner_balances_against_the_copies_the_device_waits_for():
    """The device computes its hits while a copy lands (at 5 s), then the copied expert: a hit moves to the
    host only if that ends the layer sooner than the device would."""
    cache = StandInCache(ready={(0, 0), (0, 1)}, copy=5.0)
    keys, tokens = [(0, 0), (0, 1), (0, 2)], {0: 1, 1: 1, 2: 1}
    host = FixedHostCost(per_expert_s=5.5)  # slower than the copy: (0, 2) loads
    # Device 1 s an expert: the layer ends at max(2, 5) + 1 = 6 s; a hit on the host (5.5 s) leaves it at
    # max(1, 5) + 1 = 6: no sooner, so nothing moves.
    assert HybridPlanner(host, FixedDeviceCost(1.0)).split([(cache, keys)], tokens, valid=3) == []
    # Device 3 s an expert: max(6, 5) + 3 = 9 s; one hit on the host: max(5.5, max(3, 5) + 3) = 8; a second
    # would keep the host until 11 s.
    assert HybridPlanner(host, FixedDeviceCost(3.0)).split([(cache, keys)], tokens, valid=3) == [(0, 0)]


def test_device_cost_of_an_expert_is_the_cost_models():
    """An H100 expert at Qwen3-30B-A3B sizes: 30 us of kernel tails beside 9 MiB read at 88 % of 3.35 TB/s."""
    from fmoe_jax.offload.cost_model import MODELS

    h100, model = HARDWARE["h100_sxm"], MODELS["qwen3_moe"]
    cost = CostModel(model, h100, 128)
    assert cost.expert_s(1) == pytest.approx(30e-6 + model.expert_bytes / (3.35e12 * 0.88), rel=1e-9)
    assert cost.expert_s(7) == cost.experts_s([7])


def test_modelled_decode_goes_to_the_host_and_a_large_prefill_copies():
    """Mixtral-8x7B beside an RTX 3090 and a DDR5 desktop: one token of an expert on the host takes about
    352 MB / (89.6 GB/s x 0.7) = 5.6 ms against a 14 ms copy; 256 tokens take 256 x 2 x 176 MFLOP at half
    of 4.4 TFLOPS = 41 ms, so the copy wins."""
    rtx = HARDWARE["rtx_3090"]
    cost = ModelledHostCost(MIXTRAL_8X7B, HOSTS["desktop_ddr5"], rtx.link_effective)
    copy = MIXTRAL_8X7B.expert_bytes / rtx.link_effective
    assert copy == pytest.approx(13.97e-3, rel=1e-3)
    back = 4096 * 4 / rtx.link_effective  # one token's float32 output, per token
    assert cost.expert_s(1) == pytest.approx(MIXTRAL_8X7B.expert_bytes / (89.6e9 * 0.7) + back, rel=1e-9)
    flops = 256 * 2 * MIXTRAL_8X7B.expert_params
    assert cost.expert_s(256) == pytest.approx(flops / (16 * 4.3e9 * 64 * 0.5) + 256 * back, rel=1e-9)
    planner = HybridPlanner(cost)
    cache = StandInCache(copy=copy)
    assert planner.split([(cache, [(0, 0)])], {0: 1}, valid=1) == [(0, 0)]
    assert planner.split([(cache, [(0, 0)])], {0: 256}, valid=256) == []


def test_measured_host_cost_learns_per_token_bucket():
    cost = MeasuredHostCost(decay=0.5)
    assert cost.expert_s(1) == 0.0  # nothing measured: the host is tried
    cost.record([1, 1], 4e-3)  # two one-token experts in 4 ms: 2 ms each
    assert cost.expert_s(1) == pytest.approx(2e-3, rel=1e-12)
    assert cost.expert_s(6) == pytest.approx(12e-3, rel=1e-12)  # bucket 8 unmeasured: 2 ms x 6 tokens
    cost.record([1], 4e-3)
    assert cost.expert_s(1) == pytest.approx(3e-3, rel=1e-12)  # 0.5 x 2 + 0.5 x 4
    cost.record([30, 2], 20e-3)  # bucket 32
    assert cost.expert_s(20) == pytest.approx(10e-3, rel=1e-12)
    assert (cost.calls, cost.seconds) == (3, pytest.approx(28e-3, rel=1e-12))
    with pytest.raises(ValueError, match="decay must be in"):
        MeasuredHostCost(decay=1.0)


def test_config_and_preset_errors_name_the_values():
    with pytest.raises(ValueError, match="'gpu'"):
        OffloadConfig(execution="gpu")
    with pytest.raises(ValueError, match="host_threads must be None or a positive int, got 0"):
        OffloadConfig(execution="hybrid", host_threads=0)
    with pytest.raises(ValueError, match="mem_efficiency must be in"):
        HostPreset("bad", mem_bytes_per_s=1e9, flops_per_s=1e9, mem_efficiency=1.5)
    with pytest.raises(ValueError, match="host=, a HostPreset"):
        simulate(toy_trace(), OffloadConfig(execution="hybrid"), model=TOY_MODEL, hardware=TOY_HARDWARE)


# -- fixed placements ----------------------------------------------------------------------------------------
def bound(policy, capacity: int, layers: int = 2, experts: int = 4):
    cache = RecordingCache(capacity)
    ctx = PolicyContext(
        num_layers=layers, num_experts=experts, top_k=1, embed_dim=2, prefetch_distance=1, capacity=capacity
    )
    policy.bind(ctx, cache)
    return cache


def test_fiddler_places_the_most_popular_and_keeps_a_placeholder():
    popularity = np.asarray([[1, 9, 0, 3], [5, 0, 7, 2]])
    fiddler = Fiddler(popularity)
    bound(fiddler, capacity=4)
    assert fiddler.initial_experts() == [(0, 1), (1, 2), (1, 0)]  # 3 of 4 slots: one stays the placeholder
    assert fiddler.keep_score((0, 1), Entry()) > fiddler.keep_score((1, 0), Entry())
    assert fiddler.keep_score((0, 2), Entry()) == -np.inf  # a copied-in expert goes first
    with pytest.raises(ValueError, match=r"profile is \(1, 4\)"):
        bound(Fiddler(popularity[:1]), capacity=4)


def test_fiddler_profile_counts_routed_tokens():
    trace = RoutingTrace.from_external(
        [[{"ids": np.asarray([[[1], [2]], [[1], [0]]])}, {"ids": np.asarray([[[3], [2]]])}]], num_experts=4
    )
    np.testing.assert_array_equal(expert_usage([trace]), [[0, 2, 0, 1], [1, 0, 2, 0]])
    policy = Fiddler.from_traces([trace], prefetch_distance=1, store_capacity=1)
    bound(policy, capacity=3)
    assert policy.initial_experts() == [(0, 1), (1, 2)]


def test_static_split_places_whole_layers_and_restores_them():
    first, last = StaticSplit(), StaticSplit(device_layers="last")
    bound(first, capacity=9, layers=4)
    cache = bound(last, capacity=9, layers=4)
    assert first.initial_experts() == [(m, e) for m in (0, 1) for e in range(4)]  # 9 // 4 = 2 layers
    assert last.initial_experts() == [(m, e) for m in (2, 3) for e in range(4)]
    for key in last.initial_experts()[1:]:  # (2, 0) was evicted by a copy
        cache.book.add(key, prefetched=False)
    layer_routed(last, 0, np.ones((1, 4)) / 4, [[1]], [[True]])
    assert cache.requests == [([((2, 0), 0.0)], {"replace": False})]
    assert last.keep_score((0, 1), Entry()) == -np.inf
    with pytest.raises(ValueError, match="'middle'"):
        StaticSplit(device_layers="middle")


def test_a_failing_host_call_leaves_the_cache_usable():
    from fmoe_jax.offload.cache import DeviceExpertCache
    from fmoe_jax.offload.driver import Driver, Functions, Routed
    from fmoe_jax.offload.policies import OnDemandLRU
    from fmoe_jax.offload.simulator import SimulatedLink

    policy = OnDemandLRU()
    cache = DeviceExpertCache(SimulatedLink(100, 1e3), 2, 100, policy)
    policy.bind(
        PolicyContext(num_layers=1, num_experts=4, top_k=1, embed_dim=2, prefetch_distance=1, capacity=2),
        cache,
    )
    driver = Driver(policy, cache, HybridPlanner(FixedHostCost(0.0)))

    def host(layer, keys):
        raise RuntimeError("host backend gone")

    route = lambda layer: Routed(np.asarray([[1]], np.int32))  # noqa: E731
    with pytest.raises(RuntimeError, match="host backend gone"):
        driver.iteration(np.ones((1, 1), bool), None, Functions(route, lambda *a: None, host))
    assert cache.protected == set() and cache.serving is None
    assert cache.stats.host_computed == 1  # it was planned, and counted, before the call failed
    driver.planner = None  # copy-only afterwards: a miss
    driver.iteration(np.ones((1, 1), bool), None, Functions(route, lambda *a: None))
    assert (cache.stats.misses, cache.stats.loads) == (2, 1)


# -- the simulator's host ------------------------------------------------------------------------------------
# On the round-number TOY_HARDWARE and TOY_MODEL of tests/toy_costs.py (an expert: 300,000 bytes, D = 100).
# Per host call 10 us + 5 us each way; per expert its 300,000 bytes at `mem` bytes/s, FLOPs free.
INSTANT_HOST = HostPreset(
    "instant", mem_bytes_per_s=1e30, flops_per_s=1e30, mem_efficiency=1.0, flops_efficiency=1.0,
    call_latency_s=10e-6, transfer_latency_s=5e-6,
)  # fmt: skip


def test_host_timeline_by_hand():
    r = simulate(
        toy_trace(),
        OffloadConfig(policy="on_demand_lfu", cache_experts=2, execution="hybrid"),
        model=TOY_MODEL,
        hardware=TOY_HARDWARE,
        host=INSTANT_HOST,
    )
    # Each layer: attention (40.6 us prefill, 40.8 decode), then the device waits for the host's call:
    # 10 + 2 x 5 us, the token (200 B) over to it and its output (400 B float32) back: 20.6 us. LM head 200.
    assert (r.hits, r.misses, r.host_computed, r.bytes_to_device) == (0, 4, 4, 0)
    assert r.ttft_s == [pytest.approx((2 * (40.6 + 20.6) + 200) * 1e-6, rel=1e-9)]
    assert r.tpot_s == [pytest.approx((2 * (40.8 + 20.6) + 200) * 1e-6, rel=1e-9)]
    assert r.host_compute_s == pytest.approx(4 * 20.6e-6, rel=1e-9)
    assert r.host_wait_s == pytest.approx(4 * 20.6e-6, rel=1e-9)
    assert r.total_s == pytest.approx(r.compute_s + r.stall_s + r.host_wait_s, rel=1e-12)
    assert r.stall_s == 0.0 and r.link_busy_share == 0.0


def concurrent_trace() -> RoutingTrace:
    """One layer, a two-token prompt: token 0 to expert 0 (placed on the device), token 1 to expert 1."""
    return RoutingTrace.from_external([[{"ids": np.asarray([[[0]], [[1]]], np.int32)}]], num_experts=2)


@pytest.mark.parametrize(("mem", "host_s", "wait_s"), [(2e9, 171.6e-6, 0.0), (0.6e9, 521.6e-6, 221.6e-6)])
def test_host_runs_beside_the_device(mem, host_s, wait_s):
    """Fiddler places expert 0; expert 1 misses. The link is slowed to 0.5 GB/s (a 600 us copy), so the host
    takes it: 20 us fixed, 2 tokens (400 B) there and one output (400 B) back at 0.8 us each, 300,000 B at
    `mem`. The device computes expert 0 for 300 us meanwhile and waits only for the rest of the host's call.
    Before: attention of 2 tokens, 40.8 us; after: the LM head, 200 us."""
    hardware = dataclasses.replace(TOY_HARDWARE, link_bytes_per_s=0.5e9)
    host = dataclasses.replace(INSTANT_HOST, mem_bytes_per_s=mem)
    r = simulate(
        concurrent_trace(),
        OffloadConfig(policy=Fiddler(np.asarray([[1.0, 0.0]])), cache_experts=2, execution="hybrid"),
        model=TOY_MODEL,
        hardware=hardware,
        host=host,
    )
    assert (r.hits, r.host_computed, r.bytes_to_device) == (1, 1, 0)
    assert r.ttft_s == [pytest.approx(40.8e-6 + max(300e-6, host_s) + 200e-6, rel=1e-9)]
    assert r.host_compute_s == pytest.approx(host_s, rel=1e-9)
    assert r.host_wait_s == pytest.approx(wait_s, rel=1e-9, abs=1e-12)


def test_the_chunked_link_answers_the_planner_as_it_then_copies():
    """An expert goes over in 3 pieces of 100 s; on-demand loads go before a prefetch's unsent pieces. The
    planner's estimates (`landing_in`, `load_in`) are the times the link then delivers."""
    link = SimulatedLink(expert_bytes=300, bytes_per_s=1.0, chunks=3)
    prefetch = link.start((0, 0))
    link.compute(50.0)  # the first piece is under way until 100
    assert link.load_in() == pytest.approx(50 + 300)  # after that piece, before the prefetch's other two
    assert link.load_in(ahead=1) == pytest.approx(50 + 600)
    assert link.landing_in(prefetch) == pytest.approx(50 + 200)
    assert link.landing_in(prefetch, ahead=1) == pytest.approx(50 + 300 + 200)
    load = link.start((0, 1), urgent=True)
    assert link.landing_in(load) == pytest.approx(350)
    assert link.landing_in(prefetch) == pytest.approx(550)
    link.wait([load])
    assert link.clock == pytest.approx(400)
    link.wait([prefetch])
    assert link.clock == pytest.approx(600)
    assert link.landing_in(prefetch) == 0.0


def test_a_host_slower_than_the_link_changes_nothing():
    slow = dataclasses.replace(INSTANT_HOST, mem_bytes_per_s=1.0)
    copy = simulate(
        toy_trace(),
        OffloadConfig(policy="on_demand_lru", cache_experts=1),
        model=TOY_MODEL,
        hardware=TOY_HARDWARE,
    )
    hybrid = simulate(
        toy_trace(),
        OffloadConfig(policy="on_demand_lru", cache_experts=1, execution="hybrid"),
        model=TOY_MODEL,
        hardware=TOY_HARDWARE,
        host=slow,
    )
    assert hybrid.host_computed == 0 and hybrid.host_compute_s == 0.0
    assert (hybrid.hits, hybrid.misses, hybrid.bytes_to_device) == (
        copy.hits,
        copy.misses,
        copy.bytes_to_device,
    )
    assert hybrid.ttft_s == copy.ttft_s and hybrid.tpot_s == copy.tpot_s


# -- the live engine -----------------------------------------------------------------------------------------
# Every engine serves the weights and compiled programs of one `Subject` per family (test_lossless.py's
# fixture, module-scoped here): compiling the per-layer programs of each batch shape is most of these tests'
# time. Mixtral's batches here have the shape of BATCH_OF_3 below (3 rows padded to 24 tokens, 32 cache
# positions).
BATCHES = [
    [[3, 14, 15, 92, 65], list(range(30, 50)), [7, 7, 7]],
    [[9, 8, 7, 6, 5, 4, 3, 2, 1, 10], [4] * 17, [100]],
]


@pytest.fixture(scope="module")
def subjects(hf_dirs):
    return subject_loader(hf_dirs)


@pytest.fixture
def mixtral(subjects) -> fj.Model:
    return subjects(("mixtral", "bfloat16")).offloaded


def hybrid_model(base: fj.Model, offload: OffloadConfig, host_cost=None, device_cost=None) -> fj.Model:
    return served(base, offload, host_cost=host_cost, device_cost=device_cost)


@pytest.mark.parametrize(
    ("policy", "options"), [("on_demand_lru", {}), ("fiddler", {}), ("static_split", {}), ("fmoe", None)]
)
def test_replay_counts_equal_live_hybrid_engine(policy, options, mixtral):
    """Synchronous copies, every miss on the host in both (a free host live, an instant one replayed), and
    every hit too (the planner balances layers by the preset's device cost, here a second per expert, given
    live as well): the replay's hits, misses, host-computed experts and loads (fills, restored placements)
    equal the engine's."""
    options = {"asynchronous": False, "admission": 0.1} if options is None else options
    offload = OffloadConfig(
        policy=policy,
        cache_experts=4,
        transfer="synchronous",
        prefetch_distance=1,
        execution="hybrid",
        policy_options=options,
    )
    preset = ModelPreset.from_config(mixtral.config)
    hardware = dataclasses.replace(HARDWARE["rtx_3090"], expert_kernel_s=1.0)  # far slower than the host
    device = CostModel(preset, hardware, mixtral.config.num_experts)
    model = hybrid_model(mixtral, offload, FixedHostCost(0.0), device)
    try:
        outs = [fj.generate(model, b, max_new_tokens=5, record_trace=True) for b in BATCHES]
        live = model.engine.cache.book.stats
        weights = router_weights(model.engine.module)
    finally:
        model.close()
    sim = simulate(
        [out.trace for out in outs],
        offload,
        model=preset,
        hardware=hardware,
        host=dataclasses.replace(INSTANT_HOST, call_latency_s=0.0, transfer_latency_s=0.0),
        router_weights=weights,
    )
    assert sim.host_computed == live.host_computed == sum(o.stats.host_computed for o in outs) > 0, policy
    assert live.host_computed == live.hits + live.misses, policy  # every needed expert, hits balanced off
    assert (sim.hits, sim.misses, sim.prefetches) == (live.hits, live.misses, live.prefetches), policy
    assert sim.bytes_to_device // sim.expert_bytes == live.loads, policy
    assert sim.layer_needed == [live.layer_needed.get(m, 0) for m in range(len(sim.layer_needed))], policy


def test_live_statistics_and_measured_decisions(mixtral):
    """Costs measured online (the default), the host's experts split over two programs: generation equals
    copy-only serving's, every counter is consistent, and the host's programs come in a few widths (powers
    of two up to J for decode, J for prefill), as the device's chunks do, so compilations stay bounded.
    Until the host is measured it costs nothing, so the first call computes misses there; whether later
    ones do depends on this machine's timings."""
    prompts = BATCHES[0]
    copy = hybrid_model(mixtral, OffloadConfig(policy="on_demand_lru", cache_experts=3))
    with copy:
        reference = fj.generate(copy, prompts, max_new_tokens=6, stop_at_eos=False)
    offload = OffloadConfig(policy="on_demand_lru", cache_experts=3, execution="hybrid", host_threads=2)
    with hybrid_model(mixtral, offload) as model:
        outs = [fj.generate(model, prompts, max_new_tokens=6, stop_at_eos=False) for _ in range(2)]
    labels = [k for k in mixtral.engine.programs.compilations if k.startswith("host_parts_")]
    num_experts = mixtral.config.num_experts
    widths = {int(label.rsplit("_n", 1)[1]) for label in labels}
    assert widths and widths <= {1, 2, 4, 8, num_experts}, labels
    first = outs[0].stats
    assert 0 < first.host_computed and first.extra["host_calls"] > 0
    assert {"host_dispatch", "host_wait", "hybrid_planning"} <= set(first.overhead_s)
    assert sum(out.stats.host_compute_s for out in outs) > 0  # calls that compiled are left out
    for out in outs:
        s = out.stats
        assert out.tokens == reference.tokens
        assert s.host_computed <= s.misses and 0.0 <= s.link_busy_share <= 1.0
        assert s.extra["host_copies_alias_pinned"] is True  # one host copy: the CPU view shares pinned memory


# -- lossless ------------------------------------------------------------------------------------------------
# Hybrid execution compiles the per-layer programs of each shape it serves, and those dominate these tests'
# time: the policies share one batch shape of one family, the other families one other shape each.
BATCH_OF_3 = [[3, 14, 15], list(range(20, 44)), [7, 7, 7, 7, 7, 7]]
BATCH_OF_1 = [[5, 100, 200, 31, 47, 17, 9]]
HYBRID_NEW_TOKENS = 4


def quarter(subject: Subject) -> int:
    cfg = subject.resident.config
    return max(1, cfg.num_moe_layers * cfg.num_experts // 4)


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"resident"}))
def test_hybrid_execution_is_bit_identical_for_every_policy(policy, subjects):
    """Mixtral, budgets of one slot and 25 %, a batch of 3: every miss on the host, and the host taking the
    single-token experts while the device computes the rest of the same layers. Compared bit for bit with
    copy-only serving (which tests/test_lossless.py holds to resident serving). `resident` is left out: it
    holds every expert, so nothing misses and each of its steps is one launch, which hybrid execution does
    not touch."""
    subject = subjects(("mixtral", "bfloat16"))
    host_computed = 0
    for slots in (1, quarter(subject)):
        for host_cost in (FixedHostCost(0.0), OneTokenOnHost()):
            host_computed += check_lossless(
                subject, policy, slots, BATCH_OF_3, HYBRID_NEW_TOKENS, host_cost, against_copy=True
            )
    assert host_computed > 0, f"{policy}: the host computed nothing; the test compares little"


@pytest.mark.parametrize("policy", ["on_demand_lru", "fmoe"])
def test_hybrid_balancing_is_bit_identical(policy, subjects):
    """Resident experts given to the host to balance a layer (a device cost far above the host's): every
    needed expert, hits included, runs on the host, or the single-token ones while the device computes
    the rest; generation bit-identical to copy-only serving."""
    subject = subjects(("mixtral", "bfloat16"))
    for host_cost in (FixedHostCost(0.0), OneTokenOnHost()):
        host_computed = check_lossless(
            subject,
            policy,
            quarter(subject),
            BATCH_OF_3,
            HYBRID_NEW_TOKENS,
            host_cost,
            against_copy=True,
            device_cost=FixedDeviceCost(1.0),
        )
        assert host_computed > 0, f"{policy}, {host_cost}: the host computed nothing"


@pytest.mark.parametrize("family", ["qwen2_moe", "phimoe", "deepseek_v2", "qwen3_next"])
def test_hybrid_execution_is_bit_identical_for_every_family(family, subjects):
    """The other families' expert kernels and layer layouts on the host: Qwen1.5-MoE (a dense layer, the
    gated shared expert), Phi-3.5-MoE, DeepSeek-V2 (dense first layer, ungated shared experts, routing
    weights scaled by 2.5) and Qwen3-Next (linear-attention layers between the MoE blocks); Qwen3-MoE and
    OLMoE run Mixtral's kernel. Batch 1 at one slot: the prefill mixes
    host and device in each layer, decode sends every miss to the host."""
    subject = subjects((family, "bfloat16"))
    host_computed = check_lossless(
        subject, "on_demand_lru", 1, BATCH_OF_1, HYBRID_NEW_TOKENS, OneTokenOnHost(), against_copy=True
    )
    assert host_computed > 0, f"{family}: the host computed nothing; the test compares little"
