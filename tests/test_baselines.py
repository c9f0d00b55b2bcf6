"""Baseline policies (mixtral_offload, moe_infinity, oracle): lossless in the engine under every budget, and
their rules on hand-made event sequences (speculative gate, EAM matching and proximity weights, Belady)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from fakes import RecordingCache, iteration_start, layer_routed, request_start
from fmoe_jax.offload.cache import DeviceExpertCache, Mover
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.driver import Driver, Functions, Routed
from fmoe_jax.offload.policies import FMoE, OnDemandLFU, OnDemandLRU, Policy, PolicyContext
from fmoe_jax.offload.policies.mixtral_offload import MixtralOffload, layer_quotas
from fmoe_jax.offload.policies.moe_infinity import ActivationMatrixCollection, MoEInfinity, eamc_from_traces
from fmoe_jax.offload.policies.oracle import Oracle
from serving import served

import fmoe_jax as fj
from fmoe_jax.trace import RoutingTrace

# Routing shapes, not attention, matter to a policy: top-2 of 4, shared experts beside a dense layer, a dense
# first layer with top-k of many (every family under every policy: tests/test_lossless.py draws them).
FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v2_lite"]
PROMPTS = {1: [[3, 14, 15, 92, 65, 35, 89, 79]], 3: [[3, 14, 15], list(range(20, 60)), [7, 7, 7, 7, 7, 7]]}
NEW_TOKENS = 4


# -- the live engine ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(hf_dirs):
    """Per family: a model loaded for offloading (new engines reuse its module) and the resident model's
    outputs with routing traces, per batch size."""
    out = {}
    for family in FAMILIES:
        resident = fj.load_model(hf_dirs[family])
        refs = {
            batch: fj.generate(resident, prompts, NEW_TOKENS, stop_at_eos=False, record_trace=True)
            for batch, prompts in PROMPTS.items()
        }
        out[family] = (fj.load_model(hf_dirs[family], offload=OffloadConfig(cache_experts=1)), refs)
    return out


def serve(base: fj.Model, policy: Policy, slots: int, *, synchronous: bool = False) -> fj.Model:
    """`base`'s weights served by a fresh offload engine (no reload); d = 1 (the tiny models have 2 MoE
    layers)."""
    offload = OffloadConfig(
        policy=policy,
        cache_experts=slots,
        transfer="synchronous" if synchronous else "direct",
        prefetch_distance=1,
    )
    return served(base, offload)


def budgets(cfg) -> dict[str, int]:
    """One slot (every layer in chunks) and 25 %; random budgets up to all experts: tests/test_lossless.py."""
    total = cfg.num_moe_layers * cfg.num_experts
    return {"one_slot": 1, "quarter": max(1, total // 4)}


def build_policy(name: str, refs) -> Policy:
    if name == "mixtral_offload":
        return MixtralOffload()
    if name == "moe_infinity":
        return MoEInfinity()
    return Oracle([refs[batch].trace for batch in PROMPTS])  # one trace per generate call, in call order


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["mixtral_offload", "moe_infinity", "oracle"])
def test_lossless_for_every_budget_and_batch(family, name, loaded):
    base, refs = loaded[family]
    for budget, slots in budgets(base.config).items():
        model = serve(base, build_policy(name, refs), slots)
        prefetches = 0
        for batch, prompts in PROMPTS.items():
            out = fj.generate(model, prompts, NEW_TOKENS, stop_at_eos=False)
            assert out.tokens == refs[batch].tokens, (family, name, budget, batch)
            assert out.stats.peak_cache_bytes <= slots * out.stats.extra["expert_bytes"]
            assert out.stats.hits + out.stats.misses > 0
            prefetches += out.stats.prefetches
        model.close()
        if name == "moe_infinity":
            assert out.stats.extra["eamc_prefill"] == 4  # both calls' prompts, learned online
        if budget == "quarter":  # every policy here prefetches something
            assert prefetches > 0, (family, name)


def test_oracle_hit_count_bounds_every_policy(loaded):
    """Synchronous transfers: hits measure prediction and eviction alone, and nobody beats the oracle, at
    budgets where no layer runs in chunks (one layer's experts and one and a half layers'). In a chunked
    layer the oracle's held-back prefetches wait for the next layer's loads, and a policy that admits
    prefetches freely can get more hits (see the `Oracle` docstring)."""
    base, refs = loaded["qwen2_moe"]
    cfg = base.config
    prompts, ref = PROMPTS[3], refs[3]
    for slots in (cfg.num_experts, cfg.num_experts + cfg.num_experts // 2):
        policies = {
            "on_demand_lru": OnDemandLRU(),
            "on_demand_lfu": OnDemandLFU(),
            "fmoe": FMoE(asynchronous=False),
            "mixtral_offload": MixtralOffload(),
            "moe_infinity": MoEInfinity(eamc=eamc_from_traces([ref.trace], capacity=8), learn=False),
            "belady": Oracle(ref.trace, prefetch=False),
            "oracle": Oracle(ref.trace),
        }
        hits = {}
        for name, policy in policies.items():
            model = serve(base, policy, slots, synchronous=True)
            out = fj.generate(model, prompts, NEW_TOKENS, stop_at_eos=False)
            model.close()
            assert out.tokens == ref.tokens, (name, slots)
            hits[name] = out.stats.hits
        assert all(hits["oracle"] >= h for h in hits.values()), (slots, hits)
        assert max(h for name, h in hits.items() if name != "oracle") > 0, (slots, hits)  # not vacuous
        assert hits["belady"] >= max(hits["on_demand_lru"], hits["on_demand_lfu"]), (slots, hits)


def test_oracle_refuses_a_different_generation(loaded):
    base, refs = loaded["mixtral"]
    model = serve(base, Oracle(refs[1].trace), 4)
    with pytest.raises(RuntimeError, match="diverges.*batch has 3 requests, the trace 1"):
        fj.generate(model, PROMPTS[3], NEW_TOKENS, stop_at_eos=False)
    model = serve(base, Oracle(refs[1].trace), 4)
    with pytest.raises(RuntimeError, match=r"diverges.*valid tokens per row \[5\], the trace has \[8\]"):
        fj.generate(model, [PROMPTS[1][0][:5]], NEW_TOKENS, stop_at_eos=False)
    model = serve(base, Oracle(refs[1].trace), 4)
    with pytest.raises(RuntimeError, match="diverges.*MoE layer 0 needs experts"):
        fj.generate(model, [[9, 9, 9, 9, 9, 9, 9, 9]], NEW_TOKENS, stop_at_eos=False)
    model = serve(base, Oracle(refs[1].trace), 4)
    fj.generate(model, PROMPTS[1], NEW_TOKENS, stop_at_eos=False)
    with pytest.raises(RuntimeError, match="generate call 2 started but the oracle has traces of 1 calls"):
        fj.generate(model, PROMPTS[1], NEW_TOKENS, stop_at_eos=False)


# -- hand-made event sequences ------------------------------------------------------------------------------


class InstantMover(Mover):
    """Copies that land as they start (synchronous transfers)."""

    def start(self, key, *, urgent=False):
        return key

    def is_ready(self, handle):
        return True

    def wait(self, handles):
        pass


def context(num_layers: int, num_experts: int, capacity: int, top_k: int = 1, **kw) -> PolicyContext:
    return PolicyContext(
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        embed_dim=1,
        prefetch_distance=1,
        capacity=capacity,
        **kw,
    )


def padded_ids(iteration: list[list[int]]) -> np.ndarray:
    """One iteration's needed experts per layer -> ids `[t, L, 1]`, one token per needed expert (shorter
    layers repeat their first expert, which changes no set)."""
    t = max(len(experts) for experts in iteration)
    return np.array(
        [[[e] for e in experts + experts[:1] * (t - len(experts))] for experts in iteration]
    ).swapaxes(0, 1)


def trace_of(iterations: list[list[list[int]]], num_experts: int) -> RoutingTrace:
    return RoutingTrace.from_external(
        [[{"ids": padded_ids(it)} for it in iterations]], num_experts=num_experts
    )


def replay(policy: Policy, iterations, *, num_layers: int, num_experts: int, capacity: int, watch=None):
    """Drives `policy` through the iteration driver, as the engine does (batch 1, synchronous transfers);
    `iterations` lists per iteration and MoE layer the experts needed. `watch(iteration, layer, cache)` runs
    once each layer's experts are in."""
    cache = DeviceExpertCache(InstantMover(), capacity, 1, policy, synchronous=True)
    policy.bind(context(num_layers, num_experts, capacity), cache)
    driver = Driver(policy, cache)
    driver.begin(1)
    for i, iteration in enumerate(iterations):
        ids = padded_ids(iteration)  # [t, L, 1]

        def compute(layer, chunk, arrays, is_last, i=i):
            if is_last and watch is not None:
                watch(i, layer, cache)

        route = functools.partial(lambda m, ids: Routed(ids[:, m]), ids=ids)
        driver.iteration(np.ones((1, ids.shape[0]), bool), None, Functions(route, compute))
    return cache.book.stats


def optimal_misses(steps: list[frozenset], capacity: int) -> int:
    """Brute force: the fewest misses of on-demand loading over every eviction choice."""

    @functools.cache
    def best(step: int, held: frozenset) -> int:
        if step == len(steps):
            return 0
        need = steps[step]
        misses = need - held
        evict = max(0, len(held) + len(misses) - capacity)
        return len(misses) + min(
            best(step + 1, (held - set(out)) | need)
            for out in itertools.combinations(sorted(held - need), evict)
        )

    return best(0, frozenset())


def test_layer_quotas_share_the_budget():
    assert layer_quotas(8, 3) == [3, 3, 2]
    assert layer_quotas(1, 2) == [1, 0]
    assert sum(layer_quotas(37, 5)) == 37


def test_mixtral_offload_prefetches_the_next_gate_top_k():
    rng = np.random.default_rng(0)
    layers, experts, dim = 3, 6, 5
    weights = tuple(rng.normal(size=(dim, experts)).astype(np.float32) for _ in range(layers))
    policy = MixtralOffload()
    cache = RecordingCache()
    policy.bind(context(layers, experts, capacity=18, top_k=2, router_weights=weights), cache)
    hidden = rng.normal(size=(4, dim)).astype(np.float32)  # B=2 rows, T=2 tokens
    valid = np.array([[True, False], [True, True]])  # token 1 is padding
    ids = np.zeros((4, 2), np.int32)
    iteration_start(policy, None, valid)
    layer_routed(policy, 0, None, ids, valid, hidden=hidden)
    ((items, kwargs),) = cache.requests
    logits = hidden[[0, 2, 3]] @ weights[1]
    top2 = np.argsort(logits, axis=1)[:, -2:]
    assert {key for key, _ in items} == {(1, int(e)) for e in top2.ravel()}
    gate = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    weight = (gate * (top2[:, :, None] == np.arange(experts)).any(axis=1)).sum(axis=0)  # [J] over choosers
    assert dict(items) == pytest.approx({(1, int(e)): float(weight[e]) for e in np.flatnonzero(weight)})
    assert kwargs["replace"] is True
    layer_routed(policy, 1, None, ids, valid, hidden=hidden)
    assert {key[0] for key, _ in cache.requests[1][0]} == {2}
    layer_routed(policy, 2, None, ids, valid, hidden=hidden)  # the last layer has nothing ahead
    assert len(cache.requests) == 2

    capped = MixtralOffload()  # 3 slots over 3 layers: one per layer, so one guess, the likeliest
    capped_cache = RecordingCache()
    capped.bind(context(layers, experts, capacity=3, top_k=2, router_weights=weights), capped_cache)
    layer_routed(capped, 0, None, ids, valid, hidden=hidden)
    ((items, _),) = capped_cache.requests
    assert [key for key, _ in items] == [(1, int(np.argmax(weight)))]


def test_mixtral_offload_evicts_lru_within_the_layer_over_quota():
    """4 slots over 2 layers: 2 each. The global LRU expert is (0, 0), but layer 1 is at quota when (1, 2)
    arrives, so its own LRU expert (1, 0) goes, as in the original's per-layer cache."""
    iterations = [[[0], [0]], [[1], [0]], [[1], [1]], [[1], [2]]]
    held = {}
    replay(
        MixtralOffload(speculate=False),
        iterations,
        num_layers=2,
        num_experts=4,
        capacity=4,
        watch=lambda i, layer, cache: held.__setitem__((i, layer), set(cache.book.entries)),
    )
    assert held[3, 1] == {(0, 0), (0, 1), (1, 1), (1, 2)}
    lru = {}
    replay(
        OnDemandLRU(),
        iterations,
        num_layers=2,
        num_experts=4,
        capacity=4,
        watch=lambda i, layer, cache: lru.__setitem__((i, layer), set(cache.book.entries)),
    )
    assert lru[3, 1] == {(0, 1), (1, 0), (1, 1), (1, 2)}  # global LRU differs


def test_mixtral_offload_gives_borrowed_slots_back():
    """Layer 0 borrows layer 1's unused slot while the cache warms up and gives it back, LRU first."""
    held = {}
    replay(
        MixtralOffload(speculate=False),
        [[[0, 1, 2], [0]], [[0], [1]]],
        num_layers=2,
        num_experts=4,
        capacity=4,
        watch=lambda i, layer, cache: held.__setitem__((i, layer), set(cache.book.entries)),
    )
    assert held[0, 1] == {(0, 0), (0, 1), (0, 2), (1, 0)}
    assert held[1, 1] == {(0, 0), (0, 2), (1, 0), (1, 1)}


def eam(rows: list[list[float]]) -> np.ndarray:
    return np.array(rows, np.float64)


def test_eam_collection_replaces_the_most_similar():
    collection = ActivationMatrixCollection(2, num_layers=2, num_experts=3)
    a, b = eam([[5, 0, 0], [0, 5, 0]]), eam([[0, 0, 5], [5, 0, 0]])
    collection.add(a)
    collection.add(b)
    collection.add(np.zeros((2, 3)))  # an empty request is not stored
    assert len(collection) == 2
    near_a = eam([[4, 1, 0], [0, 5, 0]])
    collection.add(near_a)
    np.testing.assert_array_equal(collection.stored, [near_a, b])
    np.testing.assert_allclose(
        collection.similarity(eam([[1, 0, 0], [0, 0, 0]]), np.array([True, False])),
        [4 / np.sqrt(17), 0.0],
        rtol=1e-12,
        atol=0,
    )


def two_pattern_policy(**options) -> tuple[MoEInfinity, RecordingCache, np.ndarray, np.ndarray]:
    """L=4, J=4; stored EAM A routes layer i mostly to expert i, EAM B mostly to expert 3 - i."""
    a = np.ones((4, 4))
    b = np.ones((4, 4))
    for i in range(4):
        a[i, i] = 5
        b[i, 3 - i] = 5
    collections = {p: ActivationMatrixCollection(4, 4, 4) for p in ("prefill", "decode")}
    for c in collections.values():
        c.add(a)
        c.add(b)
    policy = MoEInfinity(eamc=collections, learn=False, **options)
    cache = RecordingCache()
    policy.bind(context(4, 4, capacity=16), cache)
    request_start(policy, 1)
    return policy, cache, a, b


@pytest.mark.parametrize("expert, match", [(0, 0), (3, 1)])
def test_moe_infinity_matches_the_most_similar_eam_and_weights_by_proximity(expert, match):
    policy, cache, a, b = two_pattern_policy()
    valid = np.ones((1, 1), bool)
    iteration_start(policy, None, valid)
    ((start_items, _),) = cache.requests  # before any routing: the collection's mean, weights 1 - (i + 1) / L
    mean = (a + b) / 2
    mean /= mean.sum(axis=1, keepdims=True)
    assert dict(start_items) == pytest.approx(
        {(i, j): mean[i, j] * (1 - (i + 1) / 4) for i in range(3) for j in range(4)}
    )
    layer_routed(policy, 0, None, np.array([[expert]]), valid)
    assert policy.last_match == [match]
    items, kwargs = cache.requests[-1]
    matched = (a, b)[match] / (a, b)[match].sum(axis=1, keepdims=True)
    expected = {(i, j): matched[i, j] * (1 - (i - 0) / 4) for i in range(1, 4) for j in range(4)}
    assert dict(items) == pytest.approx(expected)
    assert [p for _, p in items] == sorted((p for _, p in items), reverse=True)  # the queue's order
    assert kwargs == {"replace": True, "stale_before": 1}
    layer_routed(policy, 1, None, np.array([[(1, 2)[match]]]), valid)  # after layer 1: layers 2, 3 only
    items, _ = cache.requests[-1]
    assert dict(items) == pytest.approx(
        {(i, j): matched[i, j] * (1 - (i - 1) / 4) for i in range(2, 4) for j in range(4)}
    )


def test_moe_infinity_requests_at_most_the_slots_and_protects_them():
    policy, cache, _, _ = two_pattern_policy(prefetch_limit=3)
    valid = np.ones((1, 1), bool)
    iteration_start(policy, None, valid)
    layer_routed(policy, 0, None, np.array([[0]]), valid)
    items, _ = cache.requests[-1]
    assert [key for key, _ in items] == [(1, 1), (2, 2), (3, 3)]  # 5/8 * (3/4, 1/2, 1/4) > 1/8 * 3/4
    entry = type("E", (), {})()
    wanted, other_early, other_late = (1, 1), (0, 0), (3, 0)
    assert policy.keep_score(wanted, entry) > policy.keep_score(other_early, entry)
    assert policy.keep_score(other_early, entry) > policy.keep_score(other_late, entry)  # early-layer boost
    assert policy.keep_score((0, 0), entry) > policy.keep_score((0, 1), entry)  # used by the request: kept
    assert not policy.admit_prefetch((3, 3), 0.01, victim=(2, 2))  # a wanted expert of higher priority
    assert policy.admit_prefetch((1, 1), 0.5, victim=(2, 2))
    layer_routed(policy, 1, None, np.array([[1]]), valid)
    layer_routed(policy, 2, None, np.array([[2]]), valid)
    layer_routed(policy, 3, None, np.array([[3]]), valid)
    assert cache.requests[-1] == ([], {"replace": True})  # nothing ahead: waiting requests dropped
    assert policy.keep_score(wanted, entry) < 1e12  # no longer protected


def test_moe_infinity_learns_request_eams_per_phase():
    policy = MoEInfinity(capacity=8)
    policy.bind(context(2, 3, capacity=2), RecordingCache())
    for prompt_expert in (0, 1):
        request_start(policy, 1)
        for tokens, expert in ((3, prompt_expert), (1, 2), (1, 2)):
            valid = np.ones((1, tokens), bool)
            iteration_start(policy, None, valid)
            for layer in range(2):
                layer_routed(policy, layer, None, np.full((tokens, 1), expert), valid)
            policy.on_iteration_end()
    policy.close()
    np.testing.assert_array_equal(policy.collections["prefill"].stored, [[[3, 0, 0]] * 2, [[0, 3, 0]] * 2])
    np.testing.assert_array_equal(policy.collections["decode"].stored, [[[0, 0, 2]] * 2, [[0, 0, 2]] * 2])


def test_oracle_evicts_the_expert_needed_farthest_ahead():
    """One layer, 2 slots, experts A B C A B: Belady keeps A (needed next) when C arrives."""
    iterations = [[[e]] for e in (0, 1, 2, 0, 1)]
    held = {}
    stats = replay(
        Oracle(trace_of(iterations, 4), prefetch=False),
        iterations,
        num_layers=1,
        num_experts=4,
        capacity=2,
        watch=lambda i, layer, cache: held.__setitem__(i, set(cache.book.entries)),
    )
    assert held[2] == {(0, 0), (0, 2)}
    assert stats.misses == 4 == optimal_misses([frozenset({(0, e)}) for e in (0, 1, 2, 0, 1)], 2)
    lru = replay(OnDemandLRU(), iterations, num_layers=1, num_experts=4, capacity=2)
    assert lru.misses == 5


def test_oracle_reaches_the_brute_force_optimum():
    rng = np.random.default_rng(1)
    beaten = fewer = 0
    for case in range(24):
        layers, experts, capacity = 2, 3, int(rng.integers(2, 4))
        width = int(rng.integers(1, 3))  # experts per layer and iteration
        iterations = [
            [sorted(rng.choice(experts, size=width, replace=False).tolist()) for _ in range(layers)]
            for _ in range(6)
        ]
        steps = [
            frozenset((layer, e) for e in layer_experts)
            for it in iterations
            for layer, layer_experts in enumerate(it)
        ]
        optimum = optimal_misses(steps, capacity)
        kw = dict(num_layers=layers, num_experts=experts, capacity=capacity)
        belady = replay(Oracle(trace_of(iterations, experts), prefetch=False), iterations, **kw)
        assert belady.misses == optimum, (case, iterations, capacity)
        full = replay(Oracle(trace_of(iterations, experts)), iterations, **kw)
        assert full.misses <= optimum and full.wasted_prefetches == 0, (case, iterations, capacity)
        # Prefetching as far as fits also misses nothing Belady would, but brings experts in early enough
        # to evict ones that come back: never fewer copies than one layer ahead (the default).
        far = replay(Oracle(trace_of(iterations, experts), prefetch_ahead=None), iterations, **kw)
        assert far.misses <= optimum, (case, iterations, capacity)
        copies, far_copies = full.misses + full.prefetches, far.misses + far.prefetches
        assert copies <= far_copies, (case, iterations, capacity)
        fewer += copies < far_copies
        lru = replay(OnDemandLRU(), iterations, **kw)
        assert lru.misses >= optimum
        beaten += lru.misses > optimum
    assert beaten > 0  # the sequences are hard enough for LRU to lose somewhere
    assert fewer > 0  # and for reaching far ahead to cost copies somewhere


def test_oracle_prefetch_turns_misses_into_hits():
    """Two layers, 2 slots, each layer a different expert every iteration: on demand nearly every use
    misses; the oracle loads each layer's expert beside the one computing (at iteration start for layer 0)."""
    iterations = [[[i % 3], [(i + 1) % 3]] for i in range(5)]
    steps = [frozenset({(layer, e)}) for it in iterations for layer, (e,) in enumerate(it)]
    kw = dict(num_layers=2, num_experts=3, capacity=2)
    belady = replay(Oracle(trace_of(iterations, 3), prefetch=False), iterations, **kw)
    full = replay(Oracle(trace_of(iterations, 3)), iterations, **kw)
    assert belady.misses == optimal_misses(steps, 2) == 9
    assert (full.hits, full.misses, full.wasted_prefetches) == (10, 0, 0)


def test_mixtral_offload_reads_router_inputs_only_to_speculate():
    """Without speculation (its cache rule alone) mixtral_offload replays routing recorded elsewhere, which
    holds no router inputs; with it, the replay is refused for want of them."""
    from fmoe_jax.offload.cost_model import MIXTRAL_8X7B, RTX_3090
    from fmoe_jax.offload.simulator import simulate

    from fmoe_jax.trace import RoutingTrace

    rng = np.random.default_rng(0)
    steps = [{"ids": np.argsort(rng.random((1, 4, 8)), -1)[..., :2]} for _ in range(12)]
    trace = RoutingTrace.from_external([steps], num_experts=8)
    assert MixtralOffload().needs_hidden and not MixtralOffload(speculate=False).needs_hidden
    offload = OffloadConfig(policy=MixtralOffload(speculate=False), cache_experts=8)
    result = simulate(trace, offload, model=MIXTRAL_8X7B, hardware=RTX_3090)
    assert result.hits + result.misses == sum(len(set(s["ids"][0, m])) for s in steps for m in range(4))
    speculating = OffloadConfig(policy=MixtralOffload(), cache_experts=8)
    with pytest.raises(ValueError, match="router weights"):
        simulate(trace, speculating, model=MIXTRAL_8X7B, hardware=RTX_3090)


class _BisectingOracle(Oracle):
    """The oracle's choices worked out the long way, as it did before it kept next uses: every expert's next
    use bisected at each prefetch request, and a victim scored one candidate at a time."""

    keep_scores = None

    def _request(self, exclude):
        import bisect
        import heapq
        import math

        room = self.ctx.capacity if len(exclude) > self.ctx.capacity else self.ctx.capacity - len(exclude)
        last = math.inf if self.prefetch_ahead is None else self._now + self.prefetch_ahead
        upcoming = []
        for key, steps in self.uses.items():
            i = bisect.bisect_right(steps, self._now)
            if i < len(steps) and key not in exclude and steps[i] <= last:
                upcoming.append((steps[i], key))
        soonest = heapq.nsmallest(room, upcoming)
        self.cache.request_prefetch([(key, -float(step)) for step, key in soonest], replace=True)


@pytest.mark.parametrize(
    "options", [{}, {"prefetch_ahead": 2}, {"horizon": 1}, {"prefetch": False, "horizon": 2}]
)
def test_oracle_kept_next_uses_choose_as_bisecting_them(options):
    """Same replay, to the last float, with next uses kept per expert as with bisecting them each time
    (two requests in a batch, top-2 of 6 experts: layers that run in chunks at 3 slots)."""
    from fmoe_jax.offload.cost_model import MIXTRAL_8X7B, RTX_3090
    from fmoe_jax.offload.simulator import simulate

    rng = np.random.default_rng(len(options))
    calls = []
    for _ in range(3):
        steps = [{"ids": np.argsort(rng.random((2, 3, 6)), -1)[..., :2]} for _ in range(8)]
        calls.append(RoutingTrace.from_external([steps[:6], steps], num_experts=6))
    for slots in (3, 5, 9):
        results = [
            simulate(
                calls,
                OffloadConfig(policy=cls(calls, **options), cache_experts=slots),
                model=MIXTRAL_8X7B,
                hardware=RTX_3090,
            ).as_dict()
            for cls in (Oracle, _BisectingOracle)
        ]
        assert results[0] == results[1], slots


class _CopyingCollection(ActivationMatrixCollection):
    """MoE-Infinity's EAM collection as it matched before: the stored EAMs copied and normed at each match."""

    def similarity(self, query, observed):
        stored = self.stored[:, observed].reshape(self.size, -1)
        q = query[observed].ravel()
        norms = np.linalg.norm(stored, axis=1) * np.linalg.norm(q)
        return np.divide(stored @ q, norms, out=np.zeros(self.size), where=norms > 0)


class _LoopingMoEInfinity(MoEInfinity):
    """MoE-Infinity's prefetch list built in a Python loop and sorted, and victims scored one at a time."""

    keep_scores = None

    def _predict(self, layer):
        num_layers = self.ctx.num_layers
        probs = self.predicted_activation(layer)
        items = []
        for target in range(layer + 1, num_layers):
            proximity = 1.0 - (target - layer) / num_layers
            for expert in np.flatnonzero(probs[target]):
                items.append(((target, int(expert)), float(probs[target, expert] * proximity)))
        items.sort(key=lambda item: (-item[1], item[0]))
        limit = self.ctx.capacity if self.prefetch_limit is None else self.prefetch_limit
        items = [item for item in items[:limit] if item[1] > 0]
        self._want(items)
        self.cache.request_prefetch(items, replace=True, stale_before=layer + 1)


@pytest.mark.parametrize("options", [{}, {"prefetch_limit": 2}, {"prefetch_at_start": False}])
def test_moe_infinity_arrays_choose_as_its_loops(options):
    """Same replay, to the last float, with the kept norms, the sorted arrays and victims scored as arrays
    as with the loops (EAMs learned online into a collection of 3, so that stored EAMs get replaced)."""
    from fmoe_jax.offload.cost_model import MIXTRAL_8X7B, RTX_3090
    from fmoe_jax.offload.simulator import simulate

    rng = np.random.default_rng(7)
    calls = []
    for _ in range(5):
        skew = rng.normal(size=(1, 3, 6))
        steps = [{"ids": np.argsort(-(rng.normal(size=(2, 3, 6)) + skew), -1)[..., :2]} for _ in range(6)]
        calls.append(RoutingTrace.from_external([steps[:4], steps], num_experts=6))

    kept, copied = ActivationMatrixCollection(3, 3, 6), _CopyingCollection(3, 3, 6)
    for _ in range(6):  # the kept norms follow each EAM stored or replaced
        eam = rng.integers(0, 3, size=(3, 6)).astype(float)
        kept.add(eam)
        copied.add(eam)
        for observed in (np.ones(3, bool), np.array([True, False, True])):
            assert (
                kept.similarity(eam[::-1], observed).tolist()
                == copied.similarity(eam[::-1], observed).tolist()
            )

    def empty(cls):
        return {"prefill": cls(3, 3, 6), "decode": cls(3, 3, 6)}

    for slots in (3, 5, 9):
        results = [
            simulate(
                calls,
                OffloadConfig(policy=cls(capacity=3, eamc=empty(collection), **options), cache_experts=slots),
                model=MIXTRAL_8X7B,
                hardware=RTX_3090,
            ).as_dict()
            for cls, collection in (
                (MoEInfinity, ActivationMatrixCollection),
                (_LoopingMoEInfinity, _CopyingCollection),
            )
        ]
        assert results[0] == results[1], slots
