"""The replay's fast paths give what the general ones give: a batch of one request laid out from its routing
counted once (`replay_steps.Counted`) as the padded layout does, the array victim scores of LFU and
Mixtral-Offloading as their per-expert scores, the driver's events for a policy that hears layers, and a
layer's use of the cache in one pass (`CacheBook.use_least_recent`, with the link landing copies at once) as
the general ensure, and without protection at routing where nothing could prefetch."""

from __future__ import annotations

import dataclasses

import numpy as np
from fmoe_jax.offload.cache import DeviceExpertCache, Mover
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.events import needed_experts
from fmoe_jax.offload.policies import Policy, PolicyContext
from fmoe_jax.offload.policies.mixtral_offload import MixtralOffload
from fmoe_jax.offload.policies.on_demand import OnDemandLFU, OnDemandLRU
from fmoe_jax.offload.replay_steps import Counted, layout
from fmoe_jax.offload.resources import SimulatedLink
from fmoe_jax.offload.simulator import simulate
from toy_costs import TOY_HARDWARE, TOY_MODEL

from fmoe_jax.trace import Iteration, RequestTrace, RoutingTrace


class ReadsEverything(Policy):
    needs_probs = needs_semantic = needs_hidden = True


def one_request(rng: np.random.Generator, layers: int = 3, experts: int = 6, k: int = 2) -> RoutingTrace:
    """A prefill of 3 tokens, then 5 decode steps, with probabilities, embeddings and router inputs."""
    iterations = []
    for t in [3] + [1] * 5:
        ids = np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(t)])
        iterations.append(
            Iteration(
                ids=ids.astype(np.int32),
                probs=rng.random((t, layers, experts), np.float32),
                embeds=rng.random((t, 4)),  # float64: the layout hands the policy float32
                hidden=rng.random((t, layers, 5), np.float32),
            )
        )
    meta = dict(num_layers=layers, num_experts=experts, top_k=k, embed_dim=4)
    return RoutingTrace(meta, [RequestTrace(prompt=[], iterations=iterations)])


def test_a_one_request_batch_is_laid_out_as_the_padded_layout_does():
    trace = one_request(np.random.default_rng(0))
    request, policy = trace.requests[0], ReadsEverything()
    past = [np.cumsum([0] + [it.num_tokens for it in request.iterations]).tolist()]
    counted = Counted(request, trace.meta)
    for i in range(len(request.iterations)):
        fast, general = counted.layout(i, policy, past), layout(trace, i, policy, past)
        for name in ("valid", "ids", "probs", "embeds", "hidden", "new_tokens", "past_tokens"):
            a, b = getattr(fast, name), getattr(general, name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b, err_msg=name)
        np.testing.assert_array_equal(fast.routed, general.routed)
        assert fast.counts == general.counts
        assert general.counts == [general.tokens(m, [(m, e) for e in general.needed[m]]) for m in range(3)]
        rows = general.valid.reshape(-1)
        assert fast.needed == general.needed
        assert general.needed == [needed_experts(general.ids[:, m], rows) for m in range(3)]


def bound(policy: Policy, layers: int = 3, experts: int = 4, capacity: int = 6) -> DeviceExpertCache:
    cache = DeviceExpertCache(SimulatedLink(1, 1.0), capacity, 1, policy)
    policy.bind(PolicyContext(layers, experts, 1, 4, 1, capacity), cache)
    return cache


def test_lfu_and_mixtral_offload_score_arrays_as_they_score_each_expert():
    rng = np.random.default_rng(1)
    for policy in (OnDemandLFU(), MixtralOffload(speculate=False)):
        cache = bound(policy)
        for _ in range(40):  # uses, loads and evictions: frequencies and holdings per layer vary
            layer = int(rng.integers(3))
            keys = [(layer, int(e)) for e in rng.choice(4, 2, replace=False)]
            cache.ensure(layer, keys)
            cache.release(keys)
            entries = cache.entries()
            layers = np.asarray([key[0] for key, _ in entries], np.int64)
            experts = np.asarray([key[1] for key, _ in entries], np.int64)
            expected = [policy.keep_score(key, entry) for key, entry in entries]
            np.testing.assert_array_equal(policy.keep_scores(layers, experts), expected)


def test_the_driver_tells_layers_to_a_policy_that_defines_the_hook():
    class Hears(OnDemandLRU):
        def on_layer_routed(self, event):
            self.heard.append((event.layer, event.needed))

    assert not OnDemandLRU.hears_layers and not Policy.hears_layers and Hears.hears_layers
    policy = Hears()
    policy.heard = []
    trace = one_request(np.random.default_rng(2))
    simulate(trace, OffloadConfig(policy=policy, cache_experts=4), model=TOY_MODEL, hardware=TOY_HARDWARE)
    request = trace.requests[0]
    expected = [
        (m, tuple(sorted(set(it.ids[:, m].ravel().tolist())))) for it in request.iterations for m in range(3)
    ]
    assert policy.heard == expected


def test_a_mover_with_results_of_its_own_is_asked_for_them():
    class Boxed(SimulatedLink):
        def result(self, handle):
            return ("arrays", handle.key)

    assert SimulatedLink.handle_is_result and not Boxed.handle_is_result
    policy = OnDemandLRU()
    cache = DeviceExpertCache(Boxed(1, 1.0), 4, 1, policy)
    policy.bind(PolicyContext(1, 4, 1, 4, 1, 4), cache)
    assert cache.ensure(0, [(0, 1)]) == {(0, 1): ("arrays", (0, 1))}
    assert isinstance(Mover(), Mover) and Mover.handle_is_result


class Queued(SimulatedLink):
    """The link without its landing at once: the cache takes the general path (start, wait, mark ready)."""

    loads_now = False


def cache_state(cache: DeviceExpertCache) -> tuple:
    """Everything the cache and its link hold that a later step or a result could read."""
    book, link = cache.book, cache.mover
    entries = [(key, dataclasses.astuple(entry)) for key, entry in book.entries.items()]
    copies = {key: (h.submitted_s, h.chunks_left, h.done_s) for key, h in cache.arrays.items()}
    slots = (book._slot_layer.tolist(), book._slot_expert.tolist(), book._slot_use, bytes(book._can_evict))
    return (
        entries,
        list(book.recency),
        list(book.arriving),
        dict(book.freq),
        book.clock,
        list(book._free),
        slots,
        dataclasses.asdict(book.stats),
        copies,
        (link.clock, link.free_at, link.busy_s, link.stall_s, len(link.urgent), len(link.background)),
        sorted(cache.queue),
    )


def test_a_layer_used_in_one_pass_changes_the_cache_as_the_general_path_does():
    """Both paths, each also asked for no arrays (the simulator's `ensure(arrays=False)`): the same state."""
    rng = np.random.default_rng(3)
    caches = []
    for link in (SimulatedLink, Queued) * 2:
        policy = OnDemandLRU()
        cache = DeviceExpertCache(link(4, 1.0, chunks=3), 7, 4, policy, max_inflight=2)
        policy.bind(PolicyContext(4, 6, 2, 4, 1, 7), cache)
        caches.append(cache)
    fast, general = caches[:2]
    quiet = 0
    for step in range(300):
        layer = int(rng.integers(4))
        keys = [(layer, int(e)) for e in sorted(rng.choice(6, int(rng.integers(1, 5)), replace=False))]
        if (
            step % 7 == 3
        ):  # prefetches now and then: copies arriving, so both take the general path for a while
            wanted = [((int(rng.integers(4)), int(rng.integers(6))), float(rng.random())) for _ in range(3)]
            for cache in caches:
                cache.request_prefetch(wanted)
        quiet += not fast.book.arriving
        for i, cache in enumerate(caches):
            cache.protect(keys, layer)
            arrays = cache.ensure(layer, keys, arrays=i < 2)
            assert list(arrays) == (keys if i < 2 else [])
            cache.mover.compute(0.25 * len(keys))
            cache.release(keys, unprotect=True)
        assert cache_state(fast) == cache_state(general), step
        assert [cache_state(c) for c in caches[2:]] == [cache_state(fast), cache_state(general)], step
    assert quiet > 80 and fast.book.stats.misses > 100 and fast.book.stats.prefetches > 10


def test_the_link_lands_urgent_copies_at_once_as_starting_and_waiting_for_them():
    for free_at in (0.0, 2.5):  # the link idle, or busy with a piece already under way
        links = [
            SimulatedLink(3, 2.0, chunks=3, chunk_latency_s=0.1),
            Queued(3, 2.0, chunks=3, chunk_latency_s=0.1),
        ]
        for link in links:
            link.compute(1.0)
            link.free_at = free_at
        keys = [(0, 1), (2, 3), (1, 0)]
        at_once = links[0].load_now(keys)
        one_by_one = [links[1].start(key, urgent=True) for key in keys]
        links[1].wait(one_by_one)
        assert [dataclasses.astuple(h) for h in at_once] == [dataclasses.astuple(h) for h in one_by_one]
        a, b = links
        assert (a.clock, a.free_at, a.busy_s, a.stall_s) == (b.clock, b.free_at, b.busy_s, b.stall_s)


def test_a_replay_comes_out_the_same_without_the_one_pass_use_or_without_protection_at_routing(monkeypatch):
    class Hears(OnDemandLRU):  # protected at routing: the policy hears of each layer
        def on_layer_routed(self, event):
            pass

    rng = np.random.default_rng(4)
    requests = [one_request(rng).requests[0] for _ in range(4)]
    meta = one_request(rng).meta
    traces = [RoutingTrace(meta, requests[:3]), RoutingTrace(meta, requests[3:])]  # a batch of 3, then of 1
    results = []
    for policy, lands_now in ((OnDemandLRU(), True), (Hears(), True), (OnDemandLRU(), False)):
        monkeypatch.setattr(SimulatedLink, "loads_now", lands_now)
        for slots in (3, 9):  # 3: the prefill's layers run in chunks
            offload = OffloadConfig(policy=policy if slots == 3 else type(policy)(), cache_experts=slots)
            result = simulate(traces, offload, model=TOY_MODEL, hardware=TOY_HARDWARE)
            results.append((slots, result.as_dict()))
    assert results[1][1]["misses"] > 0 and results[1][1]["hits"] > 0
    assert results[:2] == results[2:4] == results[4:]
