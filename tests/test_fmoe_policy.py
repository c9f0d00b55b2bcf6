"""The fMoE policy in the engine: selection, priorities, eviction order, matcher thread, persistence."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from fakes import RecordingCache, iteration_start, layer_routed
from fmoe_jax.offload.cache import Entry
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.policies import FMoE, PolicyContext, store_from_traces
from fmoe_jax.offload.policies.fmoe import auto_reuse_horizon
from fmoe_jax.offload.policies.fmoe.budget import COST_WARMUP
from fmoe_jax.offload.policies.fmoe.matcher import Context
from fmoe_jax.offload.policies.fmoe.store import ExpertMapStore

import fmoe_jax as fj


def bound_policy(
    store: ExpertMapStore,
    execution: str = "copy",
    copy_chunks: int = 1,
    top_k: int = 1,
    matcher_s: float | None = None,
    **options,
) -> tuple[FMoE, RecordingCache]:
    ctx = PolicyContext(
        matcher_s=matcher_s,
        num_layers=store.num_layers,
        num_experts=store.num_experts,
        top_k=top_k,
        embed_dim=store.embed_dim,
        prefetch_distance=store.prefetch_distance,
        capacity=4,
        copy_chunks=copy_chunks,
        execution=execution,
    )
    policy = FMoE(store=store, asynchronous=False, learn=False, **options)
    cache = RecordingCache()
    policy.bind(ctx, cache)
    return policy, cache


def one_map_store() -> ExpertMapStore:
    """L=4, J=4, H=3, d=1, holding one map whose layers prefer experts 0, 1, 2, 3 respectively."""
    store = ExpertMapStore(capacity=4, num_layers=4, num_experts=4, embed_dim=3, prefetch_distance=1)
    maps = np.full((1, 4, 4), 0.1, np.float32)
    for layer in range(4):
        maps[0, layer, layer] = 0.7
    store.add(np.array([[1.0, 0.0, 0.0]], np.float32), maps)
    return store


def test_semantic_match_prefetches_first_d_layers_with_priority_p_over_distance():
    policy, cache = bound_policy(one_map_store())
    valid = np.ones((1, 1), bool)
    iteration_start(policy, np.array([[2.0, 0.0, 0.0]], np.float32), valid)  # same direction: score 1
    ((items, kwargs),) = cache.requests
    assert items == [((0, 0), pytest.approx(0.7 / 1))]  # score 1 -> delta 0 -> top-1 only, layer 0 (d=1)
    assert kwargs["replace"] is True


def test_trajectory_match_guides_layers_d_ahead_and_low_scores_take_more_experts():
    policy, cache = bound_policy(one_map_store())
    valid = np.ones((1, 1), bool)
    iteration_start(policy, np.array([[0.0, 1.0, 0.0]], np.float32), valid)  # orthogonal: score 0
    ((items, _),) = cache.requests
    assert {key for key, _ in items} == {(0, 0), (0, 1), (0, 2), (0, 3)}  # delta 1: all the mass
    cache.requests.clear()
    probs = np.array([[0.7, 0.1, 0.1, 0.1]], np.float32)  # equals the stored layer 0: trajectory score 1
    layer_routed(policy, 0, probs, np.array([[0]]), valid)
    ((items, kwargs),) = cache.requests
    # band mode: layers 1..3 (l + d onwards), top-1 each, priority p / (layer - 0)
    assert items == [
        ((1, 1), pytest.approx(0.7)),
        ((2, 2), pytest.approx(0.35)),
        ((3, 3), pytest.approx(0.7 / 3)),
    ]
    assert kwargs["stale_before"] == 1


def test_a_search_the_last_match_foresaw_is_skipped_where_a_chance_match_is_rare():
    def searches(num_experts, top_k, depart=None, **options):
        """Trajectory searches and skips over one decode iteration (L = 6, d = 1) whose routing follows
        stored map 0 at every layer but `depart`, where it follows map 1."""
        rng = np.random.default_rng(0)
        store = ExpertMapStore(
            capacity=4, num_layers=6, num_experts=num_experts, embed_dim=3, prefetch_distance=1
        )
        maps = rng.dirichlet(np.ones(num_experts), size=(4, 6)).astype(np.float32)
        store.add(rng.standard_normal((4, 3)).astype(np.float32), maps)
        policy, cache = bound_policy(store, top_k=top_k, **options)
        valid = np.ones((1, 1), bool)
        iteration_start(policy, np.ones((1, 3), np.float32), valid)
        for layer in range(6):
            probs = maps[1 if layer == depart else 0, layer]
            top = np.argsort(-probs)[:top_k]
            assert layer != depart or set(top) != set(np.argsort(-maps[0, layer])[:top_k])
            layer_routed(policy, layer, probs[None], top[None], valid)
        stats = policy.stats()
        return stats.get("trajectory_matches", 0), stats.get("confirmed_layers", 0)

    # 4 of 16 experts (log2 C(16, 4) = 10.8 bits): after the search at layer 0 finds map 0, layers 1-4
    # confirm it (layer 5, the last, is searched after by no one).
    assert searches(16, 4) == (1, 4)
    assert searches(16, 4, depart=2) == (2, 3)  # layer 2 departs: searched again, and confirmed after
    # Without confirmation the search after layer 1 finds map 0 again, and the later ones rest (`_resting`);
    # resting="doubling" rests 1 layer after that first repeat (layer 2) and 2 after the second (layer 4).
    assert searches(16, 4, skip_confirmed=False) == (2, 0)
    assert searches(16, 4, skip_confirmed=False, resting="doubling") == (3, 0)
    assert searches(8, 2) == (2, 0)  # 2 of 8 (4.8 bits) agree by chance too often to confirm anything
    assert searches(16, 4, traj_target="single") == (5, 0)  # each search guides one layer: none is skipped


def test_a_match_confirms_only_the_layers_after_its_search():
    """`SearchSkips.confirmed`: a layer routed as the match's top k foresaw confirms it, row by row; the
    layers that had routed when the match was made, another iteration, or other routing do not."""
    from fmoe_jax.offload.policies.fmoe.options import FMoEOptions
    from fmoe_jax.offload.policies.fmoe.select import SortedMaps
    from fmoe_jax.offload.policies.fmoe.skips import SearchSkips

    rng = np.random.default_rng(3)
    maps = rng.dirichlet(np.ones(16), size=(2, 6)).astype(np.float32)  # two rows' matched maps [B, L, J]
    tops = np.sort(np.argsort(-maps, axis=-1, kind="stable")[..., :4], axis=-1)  # [B, L, k]
    skips = SearchSkips(FMoEOptions(), num_experts=16, top_k=4, num_layers=6)
    skips.foresee(7, maps[:1], 2, SortedMaps())
    one = np.array([0])
    assert all(skips.confirmed(layer, tops[0, layer][None, ::-1], one, 7, True) for layer in (3, 4, 5))
    assert not any(skips.confirmed(layer, tops[0, layer][None], one, 7, True) for layer in (0, 1, 2))
    assert not skips.confirmed(3, tops[0, 3][None], one, 8, True)  # another iteration's routing
    assert not skips.confirmed(3, tops[1, 3][None], one, 7, True)  # other experts
    assert not skips.confirmed(3, tops[0, 3][None], one, 7, False)  # prefill: never
    skips.foresee(7, maps, 2, SortedMaps())  # a batch of two rows: each row's own top k
    rows = np.array([0, 1])
    assert skips.confirmed(4, tops[:, 4], rows, 7, True)
    assert not skips.confirmed(4, tops[::-1, 4], rows, 7, True)
    assert not skips.confirmed(4, tops[0, 4][None], one, 7, True)  # one row of the two: not this match


def test_searches_rest_after_they_find_the_same_map_again():
    """After the first repeated match of an iteration its later layers' searches are left out (their routing
    still counts); resting="doubling" leaves out the next 2 ** (n - 1) layers' after n repeats in a row. A
    new iteration searches after every layer again."""
    rng = np.random.default_rng(0)
    layers = 12
    store = ExpertMapStore(capacity=4, num_layers=layers, num_experts=8, embed_dim=3, prefetch_distance=1)
    maps = rng.dirichlet(np.ones(8), size=(4, layers)).astype(np.float32)
    store.add(rng.standard_normal((4, 3)).astype(np.float32), maps)
    valid = np.ones((1, 1), bool)

    def searched_layers(**options) -> tuple[list[int], dict]:
        policy, _ = bound_policy(store, top_k=2, **options)  # 2 of 8: no layer is skipped as confirmed
        searched = []
        for _ in range(2):
            iteration_start(policy, np.ones((1, 3), np.float32), valid)
            for layer in range(layers):
                probs = maps[0, layer]  # the routing of stored map 0 throughout: every search finds it
                matches = policy.stats().get("trajectory_matches", 0)
                layer_routed(policy, layer, probs[None], np.argsort(-probs)[:2][None], valid)
                if policy.stats().get("trajectory_matches", 0) > matches:
                    searched.append(layer)
            policy.on_iteration_end()
        return searched, policy.stats()

    # Layer 0 finds map 0, layer 1 repeats it: layers 2-10 rest (layer 11 guides nothing).
    searched, stats = searched_layers()
    assert searched == [0, 1, 0, 1]
    assert stats["rested_layers"] == 2 * (layers - 1 - 2)
    # Doubling: layer 1 repeats (rest 1 layer: 2), 3 repeats (rest 2: 4, 5), 6 repeats (rest 4: 7-10).
    searched, stats = searched_layers(resting="doubling")
    assert searched == [0, 1, 3, 6, 0, 1, 3, 6]
    assert stats["rested_layers"] == 2 * (1 + 2 + 4)
    with pytest.raises(ValueError, match="resting must be"):
        FMoE(resting="halving")


def test_a_search_that_finds_the_same_map_again_keeps_the_prefetches_it_asked_for():
    """Band targets: a search that finds the map the search before it found (same iteration) selects
    nothing new (that one selected for every layer this one would guide); it only drops requests gone
    stale. A search that finds another map selects from it as usual."""
    rng = np.random.default_rng(0)
    store = ExpertMapStore(capacity=4, num_layers=6, num_experts=8, embed_dim=3, prefetch_distance=1)
    maps = rng.dirichlet(np.ones(8), size=(4, 6)).astype(np.float32)
    maps[1, :2] = maps[0, :2]  # maps 0 and 1 agree on layers 0 and 1, then part
    store.add(rng.standard_normal((4, 3)).astype(np.float32), maps)
    # Doubling rests one layer after the first repeat, so a later search can find another map ("settle"
    # would rest for the rest of the iteration).
    policy, cache = bound_policy(store, top_k=2, resting="doubling")
    valid = np.ones((1, 1), bool)
    iteration_start(policy, np.ones((1, 3), np.float32), valid)
    cache.requests.clear()
    for layer in range(6):  # routing follows map 1: the first searches find map 0 (the lower slot of a tie)
        probs = maps[1, layer]
        layer_routed(policy, layer, probs[None], np.argsort(-probs)[:2][None], valid)
    (first, f_kw), (again, a_kw), rested, (changed, c_kw), _ = cache.requests  # after layers 0..4
    assert f_kw["replace"] is True and {layer for (layer, _), _ in first} == {1, 2, 3, 4, 5}
    assert (again, a_kw) == ([], {"drop_before": 2})  # map 0 again
    assert rested == ([], {"drop_before": 3})  # after a repeat, layer 2 rests
    assert c_kw["replace"] is True and {layer for (layer, _), _ in changed} == {4, 5}  # map 1 now
    stats = policy.stats()
    assert (stats["trajectory_matches"], stats["repeated_matches"], stats["rested_layers"]) == (4, 2, 1)


def test_the_matcher_works_only_while_the_link_time_it_could_save_pays_for_it():
    def counts(hits=0, misses=0, **options):
        """One decode iteration (L = 4, d = 1, one expert a layer, T = 1 ms), after a cache history of
        `hits` and `misses`: what the matcher did."""
        policy, cache = bound_policy(one_map_store(), copy_s=1e-3, layer_s=1e-3, **options)
        cache.book.stats.hits, cache.book.stats.misses = hits, misses
        valid = np.ones((1, 1), bool)
        iteration_start(policy, np.ones((1, 3), np.float32), valid)
        for layer in range(4):
            layer_routed(policy, layer, np.full((1, 4), 0.25, np.float32), np.array([[layer]]), valid)
        policy.on_iteration_end()
        stats = policy.stats()
        kinds = (
            "semantic_matches",
            "trajectory_matches",
            "unpaid_semantic",
            "unpaid_trajectory",
            "unpaid_update",
        )
        return tuple(stats.get(kind, 0) for kind in kinds)

    # Each routed layer could have cost one 1 ms copy; a search costs 2.5 ms of host time. Nothing is banked
    # at the start (no semantic search); after layers 0 and 1 the credit (1, 2 ms) is short; after layer 2
    # (3 ms) one search is paid; the update at the end finds 1.5 ms. Layer 3, the last, has no search.
    assert counts(matcher_s=2.5e-3) == (0, 1, 1, 2, 1)
    # A cache that misses 1 access in 4 puts a quarter of that at stake: 0.25 ms a layer pays for a
    # 0.5 ms search after layer 1 (not 0 or 2), and for the update at the end.
    assert counts(hits=3, misses=1, matcher_s=0.5e-3) == (0, 1, 1, 2, 0)
    # The simulator's hint: the matcher costs nothing (layer 1's search finds layer 0's map again: 2 rests).
    assert counts(matcher_s=0.0) == (1, 2, 0, 0, 0)
    assert counts(matcher_s=2.5e-3, pay_for_matching=False) == (1, 2, 0, 0, 0)
    # Unmeasured costs: everything goes, and each kind's host time is measured from the work itself.
    assert counts() == (1, 2, 0, 0, 0)
    # Each kind's host time is known once the first context (cold: not timed) and `_COST_WARMUP` more are.
    policy, _ = bound_policy(one_map_store(), copy_s=1e-3, layer_s=1e-3)
    valid = np.ones((1, 1), bool)
    timed = []
    for _ in range(1 + COST_WARMUP):
        iteration_start(policy, np.ones((1, 3), np.float32), valid)
        layer_routed(policy, 0, np.full((1, 4), 0.25, np.float32), np.array([[0]]), valid)
        timed.append("semantic_host_ms" in policy.stats())
    assert timed == [False] * COST_WARMUP + [True]
    stats = policy.stats()
    assert stats["semantic_host_ms"] > 0 and stats["trajectory_host_ms"] > 0


@pytest.mark.parametrize(("copy_s", "records"), [(1e-9, False), (1.0, True)])
def test_live_fmoe_wants_maps_copied_out_only_when_a_paid_context_can_use_them(copy_s, records):
    """Live, once every kind of context is priced, an iteration's embeddings and router probabilities are
    wanted (`needs_semantic`, `needs_probs`) only while the credit covers a context that would use them;
    the iterations without them search nothing and add nothing to the store."""
    policy, _ = bound_policy(one_map_store(), copy_s=copy_s, layer_s=1e-3)
    valid = np.ones((1, 1), bool)
    wanted, matches = [], []
    for _ in range(4 + COST_WARMUP):
        wanted.append((policy.needs_semantic, policy.needs_probs))
        iteration_start(policy, np.ones((1, 3), np.float32) if policy.needs_semantic else None, valid)
        for layer in range(4):
            probs = np.full((1, 4), 0.25, np.float32) if wanted[-1][1] else None  # as the engine gives them
            layer_routed(policy, layer, probs, np.array([[layer]]), valid)
        policy.on_iteration_end()
        stats = policy.stats()
        matches.append(stats.get("semantic_matches", 0) + stats.get("trajectory_matches", 0))
    assert wanted[0] == (True, True)  # unpriced: everything goes
    assert wanted[-1] == (records, records)
    if not records:  # resting: the last iterations came without maps, and did no work
        assert matches[-1] == matches[-3] and stats["unrecorded_iterations"] >= 2
        # What they left out is counted as unpaid work: the searches the credit refused, then whole
        # iterations of bookkeeping (resting: `test_live_fmoe_rests_while_copies_cost_less_than_its_...`).
        assert stats["unpaid_trajectory"] >= 2 * 3 and stats["unpaid_bookkeeping"] >= 2
    else:
        # Each iteration: two trajectory searches (the third layer rests after a repeat, `_resting`); no
        # semantic search after the first (the last iteration's next-token guess guided layer 0).
        assert "unrecorded_iterations" not in stats and matches[-1] == matches[-2] + 2
        assert stats["semantic_matches"] == 1


def test_live_fmoe_rests_while_copies_cost_less_than_its_bookkeeping():
    """Live, once its event handlers' host time per decode iteration is measured, fmoe pays it from the same
    credit as its searches: where copies are next to free it rests through the iterations (no forecast, no
    guide, no search), evicts the least recently used expert (every keep score ties) and drops the waiting
    prefetches as rest begins; when the credit covers its bookkeeping again it wakes, its request's routing
    features started over. In the simulator (handlers unpriced by default) it never rests."""

    def decode(policy, iterations):
        valid = np.ones((1, 1), bool)
        rested = []
        for _ in range(iterations):
            iteration_start(policy, np.ones((1, 3), np.float32), valid)
            for layer in range(4):
                layer_routed(policy, layer, np.full((1, 4), 0.25, np.float32), np.array([[layer]]), valid)
            policy.on_iteration_end()
            rested.append(policy._resting)
        return rested

    policy, cache = bound_policy(one_map_store(), copy_s=1e-9, layer_s=1e-3)
    rested = decode(policy, 2 + COST_WARMUP)
    assert rested == [False] * COST_WARMUP + [True, True]  # priced after COST_WARMUP iterations
    assert policy.stats()["unpaid_bookkeeping"] == 2 and policy.stats()["bookkeeping_ms"] > 0
    assert ([], {"drop_before": 4}) in cache.requests  # rest began: nothing waits
    for key in [(0, 0), (1, 1), (2, 2)]:
        cache.book.add(key, prefetched=False)
        cache.book.mark_ready(key)
    layers, experts = np.array([0, 1, 2]), np.array([0, 1, 2])
    assert policy.evicts_least_recent  # the cache takes the least recently used, or scores every one alike:
    assert np.array_equal(policy.keep_scores(layers, experts), np.zeros(3))
    assert policy.admit_prefetch((3, 3), 1.0, (0, 0))
    assert policy.forecast.iteration == COST_WARMUP  # the iterations it followed
    policy.budget.credit = 1.0  # the credit covers the bookkeeping: fmoe wakes, its features start over
    assert decode(policy, 1) == [False] and policy.forecast.iteration == 1
    assert policy.keep_scores(layers, experts).any() and not policy.evicts_least_recent
    simulated, _ = bound_policy(one_map_store(), copy_s=1e-9, layer_s=1e-3, matcher_s=0.0)
    assert not any(decode(simulated, 2 + COST_WARMUP)) and "bookkeeping_ms" not in simulated.stats()


def test_slow_first_contexts_do_not_price_the_matcher_out(monkeypatch):
    """A context's host time is the median of the recent ones: the slow first few (cold caches, first
    allocations) do not stick. With an average from the first, an estimate 10x too high made every later
    context unpaid, and unpaid contexts are never timed again."""
    spent_ms = [20.0, 9.0, 7.0, 0.5, 0.6, 0.4]  # one semantic search per iteration, the first not timed
    clock = []
    for ms in spent_ms:  # each context reads the thread's CPU time as it starts and as it ends
        start = clock[-1] if clock else 0.0
        clock += [start, start + ms / 1e3]
    readings = iter(clock)
    monkeypatch.setattr(time, "thread_time", lambda: next(readings))
    policy, _ = bound_policy(one_map_store(), copy_s=1e-3, layer_s=1e-3)
    for _ in spent_ms:
        iteration_start(policy, np.ones((1, 3), np.float32), np.ones((1, 1), bool))
    assert COST_WARMUP == len(spent_ms) - 1
    assert policy.stats()["semantic_host_ms"] == pytest.approx(0.6)


def test_single_target_mode_and_fixed_top_k():
    policy, cache = bound_policy(one_map_store(), traj_target="single", dynamic_delta=False, semantic=False)
    valid = np.ones((1, 1), bool)
    iteration_start(policy, np.zeros((1, 3), np.float32), valid)
    assert cache.requests == []  # semantic search switched off
    probs = np.array([[0.1, 0.1, 0.1, 0.7]], np.float32)  # unlike the stored map: low score
    layer_routed(policy, 1, probs, np.array([[3]]), valid)  # observed layers 0..1 (layer 0 all zeros)
    ((items, kwargs),) = cache.requests
    assert [key for key, _ in items] == [(2, 2)]  # only layer l + d = 2, and only top-1 without dynamic delta
    assert list(kwargs["replace"]) == [2]


def test_cost_admission_prefetches_only_what_pays_for_its_copy():
    """p >= T / (T + min(T, W)) with W = (layer - current) * layer time: the stored map's p = 0.7 is not
    worth a 3 ms copy for the next layer (threshold 0.75), is for layers 2 and 3 ahead (0.6, 0.5)."""
    valid = np.ones((1, 1), bool)
    probs = np.array([[0.7, 0.1, 0.1, 0.1]], np.float32)  # trajectory score 1 with the stored map

    def prefetched(**options):
        policy, cache = bound_policy(one_map_store(), semantic=False, **options)
        iteration_start(policy, np.zeros((1, 3), np.float32), valid)
        layer_routed(policy, 0, probs, np.array([[0]]), valid)
        ((items, _),) = cache.requests
        return policy, [key for key, _ in items]

    policy, keys = prefetched(copy_s=3e-3, layer_s=1e-3)
    assert [policy.threshold(layer, 0) for layer in (1, 2, 3)] == pytest.approx([0.75, 0.6, 0.5])
    assert keys == [(2, 2), (3, 3)]
    assert policy.stats()["not_admitted"] == 1
    assert policy.stats()["copy_ms"] == pytest.approx(3.0)
    assert prefetched(copy_s=1e-2, layer_s=1e-3)[1] == []  # the link is the bottleneck: cache only
    # Hybrid execution: misses go to the host, a wasted copy delays no miss, every selected expert goes.
    assert prefetched(copy_s=1e-2, layer_s=1e-3, execution="hybrid")[1] == [(1, 1), (2, 2), (3, 3)]
    assert prefetched(admission="all", copy_s=1e-2, layer_s=1e-3)[1] == [(1, 1), (2, 2), (3, 3)]
    assert prefetched(admission=0.8)[1] == []
    assert prefetched()[1] == [(1, 1), (2, 2), (3, 3)]  # nothing measured yet: the paper's behaviour
    with pytest.raises(ValueError, match="admission"):
        FMoE(admission="sometimes")


def test_cost_admission_and_credit_count_the_relaunch_a_miss_costs():
    """Where the engine stops at a layer that misses (`CacheView.stops`, `.stop_s`), a miss also costs its
    share S of the relaunch (one stop's price times the stops per miss): admission asks p >= T / (T + min(T,
    W) + S) and the credit banks T + S per expert at stake, with `price_stops`. The default (off) and hybrid
    execution keep the bare copy; a cache that reports no stop changes nothing."""
    valid = np.ones((1, 1), bool)

    def priced(**options):
        options = {"price_stops": True} | options
        policy, cache = bound_policy(one_map_store(), semantic=False, copy_s=3e-3, layer_s=1e-3, **options)
        cache.book.stats.misses = 4
        cache.record_stop(lambda: 1e-3)
        cache.record_stop(lambda: 2e-3)  # the latest price holds: S = 2 ms x 2 stops / 4 misses
        iteration_start(policy, np.zeros((1, 3), np.float32), valid)
        layer_routed(policy, 0, np.array([[0.7, 0.1, 0.1, 0.1]], np.float32), np.array([[0]]), valid)
        ((items, _),) = cache.requests
        return policy, [key for key, _ in items]

    policy, keys = priced()
    assert cache_stops(policy) == (2, 2e-3)
    assert [policy.threshold(layer, 0) for layer in (1, 2, 3)] == pytest.approx([0.6, 0.5, 3 / 7])
    assert keys == [(1, 1), (2, 2), (3, 3)]  # p = 0.7 now pays for the next layer's copy too
    assert policy.admission.miss_s() == pytest.approx(4e-3)
    assert policy.budget.credit == pytest.approx(4e-3)  # one needed expert, all at stake (no access yet)
    assert policy.stats()["stop_share_ms"] == pytest.approx(1.0)
    bare, keys = priced(price_stops=False)
    assert [bare.threshold(layer, 0) for layer in (1, 2, 3)] == pytest.approx([0.75, 0.6, 0.5])
    assert keys == [(2, 2), (3, 3)] and bare.budget.credit == pytest.approx(3e-3)
    assert "stop_share_ms" not in bare.stats()
    default, _ = bound_policy(one_map_store(), copy_s=3e-3, layer_s=1e-3)
    default.cache.book.stats.misses = 4
    default.cache.record_stop(lambda: 2e-3)
    assert default.admission.miss_s() == 3e-3  # off by default
    hybrid, _ = priced(execution="hybrid")
    assert hybrid.admission.miss_s() == pytest.approx(3e-3)
    plain, _ = bound_policy(one_map_store(), copy_s=3e-3, layer_s=1e-3)
    assert plain.admission.miss_s() == 3e-3 and plain.threshold(1, 0) == 0.75


def test_credit_banks_the_stops_prediction_removed_measured_paid_against_rested():
    """With `price_stops` the credit banks, per needed expert, one stop's price times the stops per needed
    expert rested iterations made beyond paid ones (the first iteration of each run not counted); until both
    are measured, S per expert at stake. Where fmoe never rests, a rested probe measures the other rate."""
    from fmoe_jax.offload.policies.fmoe.admission import PROBE_EVERY, PROBE_RUN, STALE_AFTER

    policy, cache = bound_policy(one_map_store(), copy_s=3e-3, layer_s=1e-3, price_stops=True)
    admission, stats = policy.admission, cache.book.stats
    stats.misses = 4
    cache.record_stop(lambda: 2e-3)  # S = 2 ms x 1 stop / 4 misses = 0.5 ms

    def iteration(paid: bool, stops: int, hits: int = 6, misses: int = 2) -> None:
        admission.begin_iteration(True, paid=paid)
        stats.hits, stats.misses = stats.hits + hits, stats.misses + misses
        for _ in range(stops):
            cache.record_stop(lambda: 2e-3)

    assert admission.stop_credit_s(0.5) == pytest.approx(0.25e-3)  # the prior: S x at stake
    for _ in range(3):
        iteration(paid=True, stops=1)  # 1 stop per 8 needed experts, the first not counted
    assert admission.savings.removed is None and admission.stop_credit_s(0.5) > 0  # no rested rate yet
    for _ in range(3):
        iteration(paid=False, stops=3)  # 3 stops per 8: the first (from a paid cache) not counted
    admission.begin_iteration(False)  # a prefill closes the last; it is not a sample
    assert admission.savings.removed == pytest.approx(0.25)
    assert admission.stop_credit_s(0.5) == pytest.approx(2e-3 * 0.25)  # at stake no longer counts
    assert policy.stats()["stops_removed_per_expert"] == pytest.approx(0.25)
    for _ in range(4):
        iteration(paid=True, stops=5)  # paid iterations now stop more than rested ones: nothing banked
    admission.begin_iteration(False)
    assert admission.stop_credit_s(0.5) == 0.0
    # S over the last STOP_WINDOW decode iterations: the 5 stops before them drop out.
    for _ in range(70):
        iteration(paid=True, stops=0, hits=7, misses=1)
    stops, misses = admission.savings.since_window()
    assert (stops, misses) == (0, 64) and admission.stop_share_s() == 0.0
    for _ in range(STALE_AFTER):  # a long rest: the paid rate, older than STALE_AFTER, is forgotten
        iteration(paid=False, stops=0)
    assert admission.savings.removed == 0.0
    iteration(paid=False, stops=0)
    iteration(paid=False, stops=0)
    assert admission.savings.removed is None

    # Probes: a policy that pays every decode iteration rests PROBE_RUN after PROBE_EVERY in a row; none
    # where the engine reports no stop.
    def rested(policy: FMoE, cache: RecordingCache, n: int) -> list[bool]:
        out = []
        for _ in range(n):
            iteration_start(policy, np.zeros((1, 3), np.float32), np.ones((1, 1), bool))
            cache.book.stats.hits += 1
            out.append(policy._resting)
        return out

    on = {"semantic": False, "copy_s": 3e-3, "layer_s": 1e-3, "price_stops": True}
    policy, cache = bound_policy(one_map_store(), **on)
    assert not any(rested(policy, cache, PROBE_EVERY + 4))  # no stop reported: no probe
    policy, cache = bound_policy(one_map_store(), **on)
    cache.record_stop(lambda: 2e-3)
    first = rested(policy, cache, 2 * (PROBE_EVERY + PROBE_RUN))
    probe = ([False] * PROBE_EVERY + [True] * PROBE_RUN) * 2
    assert first == probe and policy.stats()["stop_probes"] == 2
    off, off_cache = bound_policy(
        one_map_store(), semantic=False, copy_s=3e-3, layer_s=1e-3, price_stops=False
    )
    off_cache.record_stop(lambda: 2e-3)
    assert not any(rested(off, off_cache, PROBE_EVERY + 4)) and off.admission.stop_credit_s(1.0) == 0.0


def cache_stops(policy: FMoE) -> tuple[int, float]:
    return policy.cache.stops, policy.cache.stop_s


def test_live_engine_reports_its_stops_and_their_price_to_fmoe(hf_dirs):
    """The live engine tells the cache of each layer it stopped at for a miss, at the price it measures
    (`StopPrice`, held fixed here), and fmoe's admission and credit read it."""
    from fmoe_jax.engines.stop_price import StopPrice

    options = {"asynchronous": False, "price_stops": True}
    offload = OffloadConfig(policy="fmoe", cache_experts=4, policy_options=options)
    with fj.load_model(hf_dirs["mixtral"], offload=offload) as model:
        engine = model.engine
        engine.stop_price = StopPrice(min_steps=10**6)  # never fit: the price stays the one set
        engine.stop_price.seconds = 5e-3
        out = fj.generate(model, [[5, 6, 7, 8, 9]], max_new_tokens=8, stop_at_eos=False)
        cache, admission = engine.cache, engine.policy.admission
        assert cache.stops > 0 and cache.stop_s == 5e-3
        assert cache.stops <= sum(n - 1 for n in out.stats.step_launches)
        share = 5e-3 * cache.stops / cache.stats.misses
        assert out.stats.extra["stop_share_ms"] == pytest.approx(1e3 * share)
        assert admission.miss_s() == pytest.approx(admission.copy_s + share)


def prefetched_after_layer_0(arriving=(), hits=0, misses=0, **options) -> tuple[FMoE, list]:
    """The prefetches a policy over `one_map_store` asks for after layer 0 routes like the stored map (p =
    0.7 for layers 1..3), with `arriving` copies on the link and the cache's hit and miss counts set."""
    valid = np.ones((1, 1), bool)
    policy, cache = bound_policy(one_map_store(), semantic=False, **options)
    for key in arriving:
        cache.book.add(key, prefetched=True)  # not ready: still on the link
    cache.book.stats.hits, cache.book.stats.misses = hits, misses
    iteration_start(policy, np.zeros((1, 3), np.float32), valid)
    layer_routed(policy, 0, np.array([[0.7, 0.1, 0.1, 0.1]], np.float32), np.array([[0]]), valid)
    ((items, _),) = cache.requests
    return policy, [key for key, _ in items]


def test_stalls_admission_wants_a_copy_that_lands_in_time_and_pays_for_the_misses_it_delays():
    """link="stalls": a prefetch advances c + s per layer (c = 1 ms of compute; s = m * r, the stall its
    piece under way adds to the next layer's misses, m the chance a layer misses) and is admitted when it
    lands before its layer and q = 0.7 >= f = s / (c + s), the share of its time taken from misses."""

    def prefetched(copy_s=3e-3, hits=0, misses=0, copy_chunks=1):
        return prefetched_after_layer_0(
            hits=hits, misses=misses, copy_s=copy_s, layer_s=1e-3, copy_chunks=copy_chunks, link="stalls"
        )

    # No misses: f = 0, and a 3 ms copy needs 3 layers of compute: only layer 3's lands in time.
    policy, keys = prefetched()
    assert keys == [(3, 3)] and policy.stats()["not_admitted"] == 2
    assert policy.threshold(3, 0) == 0.0 and policy.threshold(2, 0) == np.inf
    # Half the layers miss, r = 3 - 1 = 2 ms: s = 1 ms, f = 0.5, 2 ms a layer: layers 2 and 3.
    policy, keys = prefetched(hits=1, misses=1)
    assert keys == [(2, 2), (3, 3)] and policy.threshold(2, 0) == pytest.approx(0.5)
    # A 6 ms whole copy when every layer misses: r = 5 ms, f = 5 / 6 > 0.7: nothing pays.
    assert prefetched(copy_s=6e-3, misses=1)[1] == []
    # The same copy in 3 pieces of 2 ms: r = 1 ms, f = 0.5, 2 ms a layer: only layer 3's lands in time.
    assert prefetched(copy_s=6e-3, misses=1, copy_chunks=3)[1] == [(3, 3)]
    with pytest.raises(ValueError, match="link"):
        FMoE(link="busy")


def test_one_layers_threshold_is_the_same_double_as_an_arrays():
    """Admission prices one prefetch with Python floats (`_threshold`) and a search's selection with arrays:
    for every rule and state they give the same numbers, bit for bit."""
    layers = np.arange(6)
    cases = [
        dict(copy_s=3e-3, layer_s=1e-3),
        dict(copy_s=3e-3, layer_s=7e-4, link="stalls", hits=3, misses=5),
        dict(copy_s=6e-3, layer_s=1e-3, link="stalls", copy_chunks=3, misses=1),
        dict(copy_s=1e-2, layer_s=1e-3, execution="hybrid"),
        dict(admission=0.8),
        dict(),
    ]
    for case in cases:
        hits, misses = case.pop("hits", 0), case.pop("misses", 0)
        store = ExpertMapStore(capacity=2, num_layers=6, num_experts=4, embed_dim=3, prefetch_distance=1)
        policy, cache = bound_policy(store, semantic=False, **case)
        cache.book.stats.hits, cache.book.stats.misses = hits, misses
        for current in range(-1, 6):
            arrays = policy.threshold(layers, current)
            singles = [policy.threshold(int(layer), current) for layer in layers]
            assert all(type(t) is float for t in singles)
            np.testing.assert_array_equal(np.array(singles), arrays, err_msg=str(case))


def test_the_calibration_learns_from_guides_made_every_distance_ahead():
    """A stored map says expert 0 (p 0.9) at every layer; the request always routes to expert 3. With d = 1
    the latest guide a layer has when it routes was made one layer before, but admission decides up to L - 1
    layers ahead: the calibration learns from the latest guide of every distance, so after some iterations
    no distance's guide of expert 0 passes a 0.5 admission (an empty bin would answer the raw 0.9)."""
    store = ExpertMapStore(capacity=4, num_layers=6, num_experts=4, embed_dim=3, prefetch_distance=1)
    maps = np.full((1, 6, 4), 1 / 30, np.float32)
    maps[0, :, 0] = 0.9
    store.add(np.ones((1, 3), np.float32), maps)
    policy, cache = bound_policy(store, semantic=False, admission=0.5)
    valid = np.ones((1, 1), bool)
    routed = np.array([[0.02, 0.02, 0.02, 0.94]], np.float32)
    for _ in range(20):
        cache.requests.clear()
        iteration_start(policy, np.zeros((1, 3), np.float32), valid)
        for layer in range(6):
            layer_routed(policy, layer, routed, np.array([[3]]), valid)
        policy.on_iteration_end()
    seen_by_distance = policy.calibration.seen.sum(axis=(0, 1, 3))
    assert (seen_by_distance > 0).all()  # distances 1, 2, 3 and 4+ all learned
    # No expert 0 of any layer is admitted now (the next token's guess at the end is the expert 3 it used).
    assert not any(expert == 0 for items, _ in cache.requests for (_, expert), _ in items)
    first, _ = cache.requests[0]
    assert first == []


def test_cost_admission_counts_the_copies_queued_ahead_on_the_link():
    """With the link's queue counted, a prefetch starts after the copies ahead of it: layer 3's (3 ms,
    after layer 2's 3 ms copy) would land 3 ms after layer 3 is due, so only layer 2's goes; a copy already
    arriving, or the misses the layers in between will load, push layer 2's past its layer too."""

    def prefetched(arriving=(), hits=0, misses=0):
        return prefetched_after_layer_0(arriving, hits, misses, copy_s=3e-3, layer_s=1e-3, link="queue")

    policy, keys = prefetched()
    assert keys == [(2, 2)] and policy.stats()["not_admitted"] == 2
    assert prefetched(arriving=[(0, 3)])[1] == []
    # Half of the accesses miss (top_k = 1): layer 1's miss takes the link 0.5 * 3 ms before layer 2's copy.
    assert prefetched(hits=1, misses=1)[1] == []
    assert prefetched(hits=9, misses=1)[1] == [(2, 2)]  # 0.3 ms: still in time to save 1.7 ms (p >= 0.64)


def test_cost_admission_measures_copy_and_layer_time_live(hf_dirs):
    offload = OffloadConfig(policy="fmoe", cache_experts=4, policy_options={"asynchronous": False})
    with fj.load_model(hf_dirs["mixtral"], offload=offload) as model:
        out = fj.generate(model, [[5, 6, 7, 8, 9]], max_new_tokens=8, stop_at_eos=False)
    assert out.stats.misses > 0
    assert out.stats.extra["copy_ms"] > 0 and out.stats.extra["layer_ms"] > 0


def test_paper_eviction_keeps_highest_p_times_freq():
    policy, cache = bound_policy(one_map_store(), eviction="fmoe")
    policy.guides.latest_p[1, :3] = [
        0.9,
        0.1,
        0.5,
    ]  # the guides of layer 1 in this iteration (p 0 for expert 3)
    policy.guides.latest[1] = True
    cache.book.freq.update({(1, 0): 1, (1, 1): 10, (1, 2): 0})
    scores = {key: policy.keep_score(key, Entry()) for key in [(1, 0), (1, 1), (1, 2), (1, 3)]}
    assert scores[(1, 3)] == 0.0  # not in any map: evicted first
    assert scores[(1, 2)] == pytest.approx(0.5)  # freq 0 counts its arrival as one visit
    assert scores[(1, 1)] == pytest.approx(1.1) and scores[(1, 0)] == pytest.approx(1.8)
    lru, _ = bound_policy(one_map_store(), eviction="lru")
    assert lru.keep_score((1, 0), Entry(last_use=7)) == 7


def test_reuse_eviction_keeps_what_this_iteration_or_the_next_ones_need():
    policy, _ = bound_policy(one_map_store())  # eviction="reuse", the default
    iteration_start(policy, np.ones((1, 3), np.float32), np.ones((1, 1), bool))
    layer_routed(policy, 0, np.full((1, 4), 0.25, np.float32), np.array([[3]]), np.ones((1, 1), bool))
    policy.guides.need[2, 1] = (
        0.6  # a guide says layer 2, still to route, needs expert 1 with probability 0.6
    )
    policy.guides.need[2, 2] = 0.0
    reuse = policy.forecast.scores
    assert policy.keep_score((2, 1), Entry()) == pytest.approx(1 - 0.4 * (1 - reuse[2, 1]))
    assert policy.keep_score((2, 1), Entry()) > policy.keep_score((2, 2), Entry())  # no guide for (2, 2)
    # Expert 3 of layer 0 was just used: the forecast counts it as used in the previous iteration.
    assert policy.keep_score((0, 3), Entry()) > policy.keep_score((0, 2), Entry())
    layer_routed(policy, 1, np.full((1, 4), 0.25, np.float32), np.array([[0]]), np.ones((1, 1), bool))
    layer_routed(policy, 2, np.full((1, 4), 0.25, np.float32), np.array([[0]]), np.ones((1, 1), bool))
    # Layer 2 has routed: what is left of (2, 1) is its chance of reuse in the next iterations.
    assert policy.keep_score((2, 1), Entry()) == pytest.approx(policy.forecast.scores[2, 1])


def test_reuse_eviction_keeps_popular_experts_from_the_profile():
    popularity = np.array([[9, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [3, 1, 0, 0]], np.float64)
    # top_k = 1 of J = 4: an expert's share of its layer's tokens counts above the uniform 1/4, scaled to 1.
    policy, _ = bound_policy(one_map_store(), popularity=popularity)
    plain, _ = bound_policy(one_map_store())
    for p in (policy, plain):
        iteration_start(p, np.ones((1, 3), np.float32), np.ones((1, 1), bool))
    reuse = policy.forecast.scores
    assert not policy.guides.need[3].any()  # layer 3 has no guide: only the forecast and the profile speak
    excess = (0.75 - 0.25) / (1 - 0.25)  # expert 0 has 3 of layer 3's 4 tokens
    assert policy.keep_score((3, 0), Entry()) == pytest.approx(1 - (1 - reuse[3, 0]) * (1 - excess))
    assert policy.keep_score((3, 0), Entry()) > policy.keep_score((3, 1), Entry())
    for expert in range(4):  # a uniform share (layer 3's expert 1, every expert of layer 1) counts nothing
        key = (1, expert)
        assert policy.keep_score(key, Entry()) == pytest.approx(plain.keep_score(key, Entry()))
    assert policy.keep_score((3, 1), Entry()) == pytest.approx(plain.keep_score((3, 1), Entry()))
    assert plain.keep_score((3, 0), Entry()) == pytest.approx(plain.keep_score((3, 1), Entry()))
    assert policy.keep_score((2, 0), Entry()) == pytest.approx(plain.keep_score((2, 0), Entry()))  # no uses
    policy.guides.need[3, 1] = 0.3  # a guide for a layer still to route: the third factor
    keys = [(layer, expert) for layer in range(4) for expert in range(4)]
    for p in (policy, plain):  # the cache's victim choice scores every resident expert at once
        layers, experts = (np.array(column) for column in zip(*keys, strict=True))
        assert p.keep_scores(layers, experts).tolist() == [p.keep_score(key, Entry()) for key in keys]
    with pytest.raises(ValueError, match="popularity profile"):
        bound_policy(one_map_store(), popularity=np.ones((4, 3)))


def test_a_prefetch_and_its_victim_are_scored_alike():
    # Layer 0: experts 0 and 1 each take half the profiled tokens; layer 3: expert 0 three quarters.
    popularity = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [3, 1, 0, 0]], np.float64)
    policy, _ = bound_policy(one_map_store(), popularity=popularity)
    iteration_start(policy, np.array([[2.0, 0.0, 0.0]], np.float32), np.ones((1, 1), bool))  # guides layer 0
    need, forecast = policy.guides.need[0, 0], policy.forecast.scores
    incoming = 1 - (1 - need) * (1 - forecast[0, 0]) * (1 - 0.5)
    victim = policy.keep_score((3, 0), Entry())
    assert need < victim < incoming  # its need alone would lose to the victim's forecast and popularity
    assert policy.admit_prefetch((0, 0), 0.7, victim=(3, 0))
    assert not policy.admit_prefetch((0, 2), 0.1, victim=(3, 0))  # unguided and never used: worth less


def test_a_prefetch_evicts_only_a_victim_worth_less_than_it_net_of_its_price():
    """Eviction "reuse" with cost admission: the incoming expert's score less the admission threshold
    (`threshold`) must beat the victim's. T = 2 ms, 1 ms of compute a layer. With the default rule (the link
    free) a copy for the next layer costs T / (T + min(T, W)) = 2 / 3. With link="stalls" and every layer
    missing, the link delays the next layer's misses by half of what the prefetch moves: f = 0.5."""

    def policy_and_cache(**options):
        policy, cache = bound_policy(one_map_store(), copy_s=2e-3, layer_s=1e-3, popularity=False, **options)
        iteration_start(policy, np.ones((1, 3), np.float32), np.ones((1, 1), bool))
        policy.forecast.scores[:] = 0.0  # no reuse forecast: the scores are the need probabilities alone
        policy.guides.need[3, 0] = 0.1  # the victim, an expert of a layer still to route
        assert policy.keep_score((3, 0), Entry()) == pytest.approx(0.1)
        return policy, cache

    policy, _ = policy_and_cache()
    for need, admitted in ((0.7, False), (0.8, True)):  # 0.7 - 2/3 < 0.1 < 0.8 - 2/3
        policy.guides.need[0, 0] = need
        assert policy.threshold(0, -1) == pytest.approx(2 / 3)
        assert policy.admit_prefetch((0, 0), need, victim=(3, 0)) is admitted
    policy, cache = policy_and_cache(link="stalls")
    for need, misses, admitted in ((0.4, 1, False), (0.7, 1, True), (0.4, 0, True)):
        # No misses: nothing delays the copy, which then cannot land before layer 0 (inf); asked again when
        # it leaves the queue, a prefetch already admitted is not priced for that (0).
        cache.book.stats.misses = misses
        policy.guides.need[0, 0] = need
        assert policy.threshold(0, -1) == (0.5 if misses else np.inf)
        assert policy.admit_prefetch((0, 0), need, victim=(3, 0)) is admitted


def test_without_a_profile_fmoe_profiles_what_it_serves_and_saves_it_with_the_store(tmp_path):
    path = tmp_path / "store.npz"
    counting, _ = bound_policy(one_map_store(), store_path=path)
    none, _ = bound_policy(one_map_store(), popularity=False)
    profile = np.ones((4, 4))
    profile[3] = [1, 3, 0, 0]  # expert 0 at the uniform share (no credit), expert 1 above it
    profiled, _ = bound_policy(one_map_store(), popularity=profile)
    valid = np.ones((1, 2), bool)
    for p in (counting, none, profiled):
        for _ in range(3):  # two tokens an iteration, both routed to expert 0 of layer 3
            iteration_start(p, np.ones((2, 3), np.float32), valid)
            layer_routed(p, 3, np.full((2, 4), 0.25, np.float32), np.array([[0], [0]]), valid)
            p.on_iteration_end()
        iteration_start(p, np.ones((1, 3), np.float32), np.ones((1, 1), bool))
    # The same events, so the same forecast: only the counted popularity (6 of layer 3's 6 tokens) differs.
    assert counting.forecast.scores[3, 0] == none.forecast.scores[3, 0]
    assert counting.keep_score((3, 0), Entry()) == pytest.approx(1.0)
    assert none.keep_score((3, 0), Entry()) < 1.0
    assert counting.keep_score((3, 1), Entry()) == pytest.approx(none.keep_score((3, 1), Entry()))
    assert counting.keep_score((2, 0), Entry()) == pytest.approx(none.keep_score((2, 0), Entry()))
    # A given profile is used as given: the served tokens (all to expert 0) do not move it.
    scores = profiled.forecast.scores
    assert profiled.keep_score((3, 0), Entry()) == pytest.approx(scores[3, 0])
    assert profiled.keep_score((3, 1), Entry()) == pytest.approx(1 - (1 - scores[3, 1]) * (1 - 2 / 3))

    counting.close()  # saves the counts with the store; a policy loading that store starts from them
    reloaded = FMoE(store_path=path, asynchronous=False, learn=False)
    reloaded.bind(counting.ctx, RecordingCache())
    iteration_start(reloaded, np.ones((1, 3), np.float32), np.ones((1, 1), bool))
    assert reloaded.keep_score((3, 0), Entry()) == pytest.approx(1.0)
    assert reloaded.keep_score((3, 1), Entry()) < 1.0


def test_a_failing_context_is_dropped_and_reported_not_fatal():
    class Broken(ExpertMapStore):
        calls = 0

        def match_embed(self, embeds):
            Broken.calls += 1
            if Broken.calls == 1:
                raise ZeroDivisionError("boom")
            return super().match_embed(embeds)

    store = Broken(capacity=4, num_layers=4, num_experts=4, embed_dim=3, prefetch_distance=1)
    ctx = PolicyContext(num_layers=4, num_experts=4, top_k=1, embed_dim=3, prefetch_distance=1, capacity=4)
    policy = FMoE(store=store)
    policy.bind(ctx, RecordingCache())
    with pytest.warns(RuntimeWarning, match="fmoe matcher dropped a semantic context: ZeroDivisionError"):
        iteration_start(policy, np.ones((1, 3), np.float32), np.ones((1, 1), bool))
        policy.wait_idle()
    assert policy.matcher.alive  # the matcher goes on
    layer_routed(policy, 0, np.full((1, 4), 0.25, np.float32), np.array([[0]]), np.ones((1, 1), bool))
    policy.on_iteration_end()
    iteration_start(policy, np.ones((1, 3), np.float32), np.ones((1, 1), bool))  # matched this time
    policy.wait_idle()
    stats = policy.stats()
    assert stats["failed_contexts"] == 1 and "ZeroDivisionError('boom')" in stats["last_error"]
    assert stats["semantic_matches"] == 1 and len(policy.store) == 1
    policy.close()

    healthy = FMoE()
    healthy.bind(ctx, RecordingCache())
    iteration_start(healthy, np.ones((1, 3), np.float32), np.ones((1, 1), bool))
    healthy.close()
    assert not healthy.matcher.alive


def test_the_simulators_matcher_takes_its_host_time_in_order_and_skips_as_the_thread():
    """With `PolicyContext.clock` and `matcher_s` (the simulator's model of the matcher thread), each context
    finishes `matcher_s` after it could start, behind the earlier ones; a prediction that a newer one waits
    behind is skipped, as `_run` skips it; an update never is, and `close` finishes the updates left."""
    now = [0.0]
    ctx = PolicyContext(
        num_layers=4,
        num_experts=4,
        top_k=1,
        embed_dim=3,
        prefetch_distance=1,
        capacity=4,
        matcher_s=0.5,
        clock=lambda: now[0],
    )
    policy = FMoE(asynchronous=False, pay_for_matching=False)
    policy.bind(ctx, RecordingCache())
    done = []
    policy.matcher.work = lambda context: done.append((context.layer, now[0]))
    for t, layer in ((0.0, 0), (0.1, 1), (0.2, 2)):
        now[0] = t
        policy.matcher.publish(Context("trajectory", layer=layer))
    now[0] = 0.45
    policy.matcher.catch_up()
    assert done == []  # the first finishes at 0.5
    now[0] = 0.6
    policy.matcher.catch_up()
    # layer 0's search ran 0 -> 0.5; by then layers 1 and 2 had come, so layer 1's is skipped.
    assert done == [(0, 0.6)] and policy.counts["skipped_contexts"] == 1
    policy.matcher.publish(Context("update", layer=-7))  # at 0.6: behind layer 2's search (0.5 -> 1.0)
    now[0] = 1.2
    policy.matcher.publish(Context("trajectory", layer=3))  # behind the update (1.0 -> 1.5)
    assert done == [(0, 0.6), (2, 1.2)]
    policy.close()
    assert done[-1] == (-7, 1.2) and policy.counts["skipped_contexts"] == 1


def test_lossless_and_learns_online(hf_dirs):
    resident = fj.load_model(hf_dirs["qwen2_moe"])
    prompts = [[5, 9, 13, 17, 21, 25], [7, 7, 8, 8, 9]]
    ref = fj.generate(resident, prompts, max_new_tokens=8, stop_at_eos=False)
    cfg = resident.config
    for slots in (
        1,
        cfg.top_k,
        cfg.num_moe_layers * cfg.num_experts // 4,
        cfg.num_moe_layers * cfg.num_experts,
    ):
        for asynchronous in (False, True):
            offload = OffloadConfig(
                policy="fmoe",
                cache_experts=slots,
                prefetch_distance=1,
                policy_options={"asynchronous": asynchronous},
            )
            with fj.load_model(hf_dirs["qwen2_moe"], offload=offload) as model:
                out = fj.generate(model, prompts, max_new_tokens=8, stop_at_eos=False)
                assert out.tokens == ref.tokens, (slots, asynchronous)
                model.engine.policy.wait_idle()
                assert len(model.engine.policy.store) > 0
                assert out.stats.peak_cache_bytes <= slots * out.stats.extra["expert_bytes"]


def test_store_persistence_and_mismatch(hf_dirs, tmp_path):
    path = str(tmp_path / "maps.npz")
    offload = OffloadConfig(
        policy="fmoe", cache_experts=2, prefetch_distance=1, policy_options={"store_path": path}
    )
    with fj.load_model(hf_dirs["mixtral"], offload=offload) as model:
        fj.generate(model, [[1, 2, 3, 4]], max_new_tokens=4)
        policy = model.engine.policy
    stored = len(policy.store)  # after close: the matcher thread has applied every update it had
    with fj.load_model(hf_dirs["mixtral"], offload=offload) as warm:
        assert len(warm.engine.policy.store) == stored > 0  # warm start
        warm.engine.policy.learn = False
    other = OffloadConfig(
        policy="fmoe", cache_experts=2, prefetch_distance=2, policy_options={"store_path": path}
    )
    with pytest.raises(ValueError, match="prefetch_distance"):
        fj.load_model(hf_dirs["mixtral"], offload=other)
    with pytest.raises(ValueError, match="model"):
        fj.load_model(hf_dirs["phimoe"], offload=offload)
    # The deprecated OffloadConfig fields still reach the policy, with a warning.
    with pytest.warns(DeprecationWarning, match="policy_options"):
        alias = OffloadConfig(policy="fmoe", cache_experts=2, prefetch_distance=1, store_path=path)
    with fj.load_model(hf_dirs["mixtral"], offload=alias) as warm:
        assert warm.engine.policy.store_path == path and len(warm.engine.policy.store) == stored


def _fmoe_at(path) -> OffloadConfig:
    return OffloadConfig(
        policy="fmoe", cache_experts=2, prefetch_distance=1, policy_options={"store_path": path}
    )


def test_store_path_refused_at_load_not_after_serving(hf_dirs, tmp_path):
    """A store path that could not be saved at close, or a file that is not a store, is an error when the
    model loads, naming the path and the reason; nothing is written or deleted."""
    with pytest.raises(
        ValueError, match=r"store_path .*missing/store.npz: its folder .*missing does not exist"
    ):
        fj.load_model(hf_dirs["mixtral"], offload=_fmoe_at(tmp_path / "missing" / "store.npz"))
    with pytest.raises(ValueError, match=r"store_path .*: is a directory; the learned store is saved there"):
        fj.load_model(hf_dirs["mixtral"], offload=_fmoe_at(tmp_path))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: nothing to test then
            pytest.skip("this user can write anywhere")
        with pytest.raises(ValueError, match=r"store_path .*locked/store.npz: cannot write to .*locked"):
            fj.load_model(hf_dirs["mixtral"], offload=_fmoe_at(locked / "store.npz"))
    finally:
        locked.chmod(0o700)
    for name, content in (("garbage.npz", b"not a zip at all"), ("other.npz", None)):
        bad = tmp_path / name
        if content is None:
            np.savez(bad, weights=np.zeros(3))  # a valid .npz, but not a store
        else:
            bad.write_bytes(content)
        before = bad.read_bytes()
        with pytest.raises(
            ValueError, match=rf"expert map store {bad} cannot be read \(.*\): it is not a file"
        ):
            fj.load_model(hf_dirs["mixtral"], offload=_fmoe_at(bad))
        assert bad.read_bytes() == before  # left as it was


def test_store_path_unwritable_as_root_is_caught_too(hf_dirs, tmp_path):
    """Root may write anywhere, but not into a path under a regular file."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="does not exist"):
        fj.load_model(hf_dirs["mixtral"], offload=_fmoe_at(blocker / "store.npz"))


def test_offline_store_from_traces(hf_dirs):
    resident = fj.load_model(hf_dirs["mixtral"])
    out = fj.generate(resident, [[3, 4, 5, 6], [9, 8, 7]], max_new_tokens=5, record_trace=True)
    store = store_from_traces([out.trace], capacity=64, prefetch_distance=1)
    tokens = sum(it.num_tokens for req in out.trace.requests for it in req.iterations)
    assert len(store) == min(64, tokens)
    embeds = out.trace.requests[0].iterations[0].embeds
    scores, _ = store.match_embed(embeds[:1])
    np.testing.assert_allclose(scores, [1.0], rtol=0, atol=1e-5)
    offload = OffloadConfig(
        policy="fmoe", cache_experts=3, prefetch_distance=1, policy_options={"store": store, "learn": False}
    )
    with fj.load_model(hf_dirs["mixtral"], offload=offload) as model:
        again = fj.generate(model, [[3, 4, 5, 6], [9, 8, 7]], max_new_tokens=5)
        assert again.tokens == out.tokens
        assert len(model.engine.policy.store) == len(store)  # offline: the store does not learn


@pytest.mark.parametrize("requests", [None, ((7, 8), (8, 9))])
def test_follower_links_join_the_tokens_of_one_request(requests):
    """Two decode iterations of two rows. Under continuous batching (request ids given) row 0's request 7
    leaves and row 1's request 8 moves to row 0: its second token follows its first, whatever the rows.
    Without ids the rows are the requests."""
    store = ExpertMapStore(capacity=8, num_layers=4, num_experts=4, embed_dim=3, prefetch_distance=1)
    ctx = PolicyContext(num_layers=4, num_experts=4, top_k=1, embed_dim=3, prefetch_distance=1, capacity=4)
    policy = FMoE(store=store, asynchronous=False, learn=True)
    policy.bind(ctx, RecordingCache())
    valid = np.ones((2, 1), bool)
    rng = np.random.default_rng(0)
    for step in range(2):
        iteration_start(
            policy, rng.random((2, 3), np.float32), valid, None if requests is None else requests[step]
        )
        for layer in range(4):
            probs = rng.dirichlet(np.ones(4), 2).astype(np.float32)
            layer_routed(policy, layer, probs, probs.argmax(1)[:, None], valid)
        policy.on_iteration_end()
    # Slots 0 and 1: the first iteration's rows; 2 and 3: the second's.
    followers = store._future_count[:4].tolist()
    assert followers == ([1.0, 1.0, 0.0, 0.0] if requests is None else [0.0, 1.0, 0.0, 0.0])
    policy.close()


def test_auto_reuse_horizon_looks_further_ahead_in_a_bigger_cache():
    """Horizon "auto": ceil(slots per layer / top_k) + 1 iterations, at most 4; resolved when the policy is
    bound to a cache, and used by the forecast and the follower links alike."""
    assert auto_reuse_horizon(8, 8, 2) == 2  # tiny Mixtral at 12.5 %: half a token per layer
    assert auto_reuse_horizon(64, 8, 4) == 3  # tiny Qwen-MoE at 25 %: 2 tokens' experts
    assert auto_reuse_horizon(128, 8, 4) == 4  # 4 tokens' experts: 5, capped
    for capacity, horizon in ((1, 2), (4, 2), (8, 3), (16, 4)):
        ctx = PolicyContext(
            num_layers=4, num_experts=4, top_k=1, embed_dim=3, prefetch_distance=1, capacity=capacity
        )
        policy = FMoE(store=one_map_store(), asynchronous=False, reuse_horizon="auto")
        policy.bind(ctx, RecordingCache())
        assert policy.reuse_horizon == policy.forecast.horizon == horizon
        policy.close()
    fixed, _ = bound_policy(one_map_store(), reuse_horizon=3)
    assert fixed.forecast.horizon == 3
    for bad in (0, "longest", 1.5):
        with pytest.raises(ValueError, match="reuse_horizon"):
            FMoE(reuse_horizon=bad)


def test_the_next_tokens_first_layers_are_guessed_late_in_the_iteration_and_learned_from():
    """d = 2 over L = 4: no search guides the next token's layers 0 and 1 in time, so after layer 2 (when
    it loads nothing) and again at the iteration's end the reuse hint's likeliest expert of each (top_k = 1)
    is prefetched where its chance pays for the copy, kept by eviction as needed at that layer's next
    routing; what the guesses were worth is learned once those layers have routed."""
    valid = np.ones((1, 1), bool)
    probs = np.full((1, 4), 0.25, np.float32)
    hint = np.array([[0.9, 0.6, 0.0, 0.0], [0.2, 0.3, 0.7, 0.0], [0.0] * 4, [0.0] * 4], np.float32)

    def bound(**options):
        store = ExpertMapStore(capacity=4, num_layers=4, num_experts=4, embed_dim=3, prefetch_distance=2)
        # What followed the maps most like a token's: `hint`, whatever the token (the policy's reuse hint).
        store.future_of = lambda maps, neighbours=1: np.repeat(hint[None], len(maps), axis=0)
        # The simulator's free matcher: no host time is measured, so a loaded machine cannot price the
        # guesses (or the bookkeeping, `FMoE._rest`) out part way through.
        return bound_policy(store, semantic=False, matcher_s=0.0, **options)

    def token(policy, cache, loads_at_2=False):
        """A decode iteration routing every layer to expert 3; the guesses after layer 2 and at its end."""
        cache.requests.clear()
        iteration_start(policy, np.zeros((1, 3), np.float32), valid)
        if loads_at_2:
            cache.book.remove((2, 3))
        for layer in range(4):
            layer_routed(policy, layer, probs, np.array([[3]]), valid)
            cache.book.add((layer, 3), prefetched=False) if (layer, 3) not in cache.book else None
        guesses = [items for items, kwargs in cache.requests if kwargs.get("replace") == range(2)]
        policy.on_iteration_end()
        at_end = [items for items, kwargs in cache.requests if kwargs.get("replace") == range(2)]
        return guesses, at_end[len(guesses) :]

    policy, cache = bound(calibrate=False, copy_s=1e-3, layer_s=1e-3)
    # The first token has no hint yet after layer 2; at its end layers 0 and 1 route 1 and 2 layers of
    # compute on (threshold T / (T + min(T, W)) = 0.5): each one's likeliest, (0, 0) at 0.9, (1, 2) at 0.7.
    assert token(policy, cache) == (
        [],
        [[((0, 0), pytest.approx(0.9 / 1)), ((1, 2), pytest.approx(0.7 / 2))]],
    )
    assert policy.guides.need[0, 0] == pytest.approx(0.9)  # eviction keeps the guess for the next token
    assert policy.keep_score((0, 0), Entry()) > policy.keep_score((0, 1), Entry())
    # The next token guesses after layer 2 too (2 and 3 layers of compute ahead), as it loads nothing.
    after_layer_2, _ = token(policy, cache)
    assert after_layer_2 == [[((0, 0), pytest.approx(0.9 / 2)), ((1, 2), pytest.approx(0.7 / 3))]]
    assert token(policy, cache, loads_at_2=True)[0] == []  # layer 2 loads: no guess to delay its copy
    assert policy.stats()["next_token_guesses"] == 6 and policy.stats()["next_token_right"] == 0

    # Calibrated: the hint's guesses are never needed (every token uses expert 3, which the hint gives 0):
    # the guesses move to the expert the last token used (its recency bin), and the hint's lose their need.
    policy, cache = bound(copy_s=1e-3, layer_s=1e-3)
    assert [key for key, _ in token(policy, cache)[1][0]] == [(0, 0), (1, 2)]
    for _ in range(12):
        _, at_end = token(policy, cache)
    assert [key for key, _ in at_end[0]] == [(0, 3), (1, 3)]
    assert policy.guides.need[0, 0] < 0.2 and policy.guides.need[0, 3] > 0.8
    assert policy._guesses_next()
    policy._hinted = policy._iteration - 2  # a hint two iterations old (live: updates left unpaid)
    assert not policy._guesses_next()
    policy._hinted = policy._iteration
    policy.budget.prices["next_token"], policy.budget.credit = (
        1.0,
        0.5,
    )  # live: a guess costs more host time than the credit holds
    assert not policy._guesses_next() and policy.stats()["unpaid_next_token"] == 1
    # Off: nothing is guessed.
    policy, cache = bound(calibrate=False, copy_s=1e-3, layer_s=1e-3, next_token=False)
    assert token(policy, cache) == ([], [])


def test_a_decode_iteration_the_next_token_guess_guided_makes_no_semantic_search():
    """The guess at a decode iteration's end guides the next token's layers [0, d): that iteration starts
    without a semantic search (`decode_semantic=False`, decision "semantic search at decode"). Prefill, a
    decode iteration no guess guided, and `decode_semantic=True` search as before."""
    hint = np.array([[0.9, 0.0, 0.0, 0.0], [0.0, 0.9, 0.0, 0.0], [0.0] * 4, [0.0] * 4], np.float32)
    embed = np.array([[1.0, 0.0, 0.0]], np.float32)
    probs = np.full((1, 4), 0.25, np.float32)

    def run(tokens_per_iteration: list[int], **options) -> list[int]:
        """Each iteration's semantic searches, for iterations of the given lengths (1: decode)."""
        store = ExpertMapStore(capacity=4, num_layers=4, num_experts=4, embed_dim=3, prefetch_distance=2)
        store.add(embed, np.full((1, 4, 4), 0.25, np.float32))
        store.future_of = lambda maps, neighbours=1: np.repeat(hint[None], len(maps), axis=0)
        policy, cache = bound_policy(
            store, matcher_s=0.0, calibrate=False, copy_s=1e-3, layer_s=1e-3, **options
        )
        searches = []
        for tokens in tokens_per_iteration:
            valid = np.ones((1, tokens), bool)
            before = policy.counts["semantic_matches"]
            iteration_start(policy, np.repeat(embed, tokens, axis=0), valid)
            searches.append(policy.counts["semantic_matches"] - before)
            for layer in range(4):
                layer_routed(policy, layer, np.repeat(probs, tokens, axis=0), np.full((tokens, 1), 3), valid)
            policy.on_iteration_end()
        return searches

    # Prefill, then three decode tokens: the first decode token follows prefill (no guess), each later
    # one follows a decode iteration whose end guessed its first layers.
    assert run([3, 1, 1, 1]) == [1, 1, 0, 0]
    assert run([3, 1, 1, 1], decode_semantic=True) == [1, 1, 1, 1]
    assert run([3, 1, 1, 1], next_token=False) == [1, 1, 1, 1]  # no guess: the search guides them
    assert run([1, 1, 3, 1]) == [1, 0, 1, 1]  # a prefill iteration searches even after a guess


def test_a_paused_policy_learns_no_maps_and_learns_again_after():
    """`Policy.paused_learning` (the batcher's warm-up): the iterations inside add nothing to the store."""
    ctx = PolicyContext(num_layers=4, num_experts=4, top_k=1, embed_dim=3, prefetch_distance=1, capacity=4)
    policy = FMoE(store=one_map_store(), asynchronous=False)
    policy.bind(ctx, RecordingCache())
    valid = np.ones((1, 1), bool)

    def iteration():
        iteration_start(policy, np.ones((1, 3), np.float32), valid)
        for layer in range(4):
            layer_routed(policy, layer, np.full((1, 4), 0.25, np.float32), np.array([[layer]]), valid)
        policy.on_iteration_end()

    with policy.paused_learning():
        iteration()
        assert not policy.learn
    assert policy.learn and len(policy.store) == 1
    iteration()
    assert len(policy.store) == 2
    policy.close()


def test_token_contexts_learn_what_follows_the_last_tokens_fed():
    """Each decode context (the last 3, 2 or 1 tokens a row fed) learns the experts of the `horizon`
    iterations after it; `hint` reads the longest context seen before; rows combine as independent
    chances; a new request forgets the rows, not what was learned; the least recently seen contexts go
    beyond `capacity`."""
    from fmoe_jax.offload.policies.fmoe.token_contexts import TokenContexts

    def used(*flat):
        mask = np.zeros((2, 4), bool)
        mask.reshape(-1)[list(flat)] = True
        return mask

    contexts = TokenContexts(num_layers=2, num_experts=4, horizon=2)
    masks = [used(0), used(1), used(2, 4), used(5), used(6)]
    for token, mask in zip([7, 8, 9, 7, 8], masks, strict=True):
        contexts.observe(0, [token], mask)
    # Now the row fed 9, 7, 8: no (9, 7, 8) seen before; (7, 8) was, followed by the experts of 9 and 7.
    np.testing.assert_array_equal(contexts.hint([0]), (masks[2] | masks[3]).astype(float))
    assert contexts.hint([1]) is None  # a row that fed nothing
    contexts.start_request()
    assert contexts.hint([0]) is None
    contexts.observe(0, [3, 9], None)  # a prefill's tokens: history only
    contexts.observe(0, [7], used(7))
    # (3, 9, 7) was never seen and (9, 7) never learned (the request ended inside its horizon): (7,) was,
    # followed by 8's and 9's experts.
    np.testing.assert_array_equal(contexts.hint([0]), (masks[1] | masks[2]).astype(float))
    contexts.observe(1, [9], used(3))  # another row: after 9 came 7 and 8 ({5} | {6}) before
    both = 1.0 - (1.0 - contexts.hint([0])) * (1.0 - contexts.hint([1]))
    np.testing.assert_array_equal(contexts.hint([0, 1]), both)
    for request in range(10, 15):  # requests passing through a continuous batch's two rows
        contexts.observe(request, [1], used(0))
        contexts.keep_rows([request - 1, request])
    assert sorted(contexts._rows) == [11, 12, 13, 14]  # pruned past twice the batch: 0, 1 and 10 went
    small = TokenContexts(num_layers=2, num_experts=4, horizon=1, capacity=1)
    for token in (1, 2, 3):
        small.observe(0, [token], used(token))
    assert len(small) == 2  # (1, 2) and (2,): (1,) went when (2,) came, beyond one context an order
    small.start_request()
    small.observe(0, [2], used(0))
    np.testing.assert_array_equal(small.hint([0]), used(3).astype(float))
    small.start_request()
    small.observe(0, [1], used(0))
    assert small.hint([0]) is None


def test_the_live_engine_feeds_fmoe_the_tokens_it_feeds_the_model(hf_dirs):
    """Live, fmoe's token contexts hear each row's tokens as the engine feeds them (the prompt, then each
    generated token but the last), and the output stays the resident model's."""
    prompts = [[5, 9, 13, 17, 21, 25], [7, 7, 8, 8, 9]]
    ref = fj.generate(fj.load_model(hf_dirs["qwen2_moe"]), prompts, max_new_tokens=6, stop_at_eos=False)
    options = {"asynchronous": False, "pay_for_matching": False}
    offload = OffloadConfig(policy="fmoe", cache_experts=4, prefetch_distance=1, policy_options=options)
    with fj.load_model(hf_dirs["qwen2_moe"], offload=offload) as model:
        out = fj.generate(model, prompts, max_new_tokens=6, stop_at_eos=False)
        contexts = model.engine.policy.token_contexts
    assert out.tokens == ref.tokens
    for row, (prompt, generated) in enumerate(zip(prompts, out.tokens, strict=True)):
        assert list(contexts._rows[row].recent) == (prompt + generated[:-1])[-3:]
    assert len(contexts) > 0


def test_each_rows_experts_are_those_its_valid_tokens_chose():
    from fmoe_jax.offload.policies.fmoe.token_contexts import used_by_row

    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((6, 5, 8)), -1)[..., :2]  # [B * T, L, k]

    def reference(valid):
        rows, tokens = valid.shape
        out = []
        for b in range(rows):
            mask = np.zeros((5, 8), bool)
            for t in np.flatnonzero(valid[b]):
                for layer in range(5):
                    mask[layer, ids[b * tokens + t, layer]] = True
            out.append(mask)
        return out

    for valid in (
        np.ones((6, 1), bool),
        np.array([[1], [0], [1], [1], [0], [1]], bool),
        np.eye(3, 2, dtype=bool),
    ):
        for got, want in zip(used_by_row(ids, valid, 8), reference(valid), strict=True):
            np.testing.assert_array_equal(got, want)
