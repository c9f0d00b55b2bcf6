"""The replay's fast paths give what the general ones give: a batch of one request laid out from its routing
counted once (`replay_steps.Counted`) as the padded layout does, the array victim scores of LFU and
Mixtral-Offloading as their per-expert scores, and the driver's events for a policy that hears layers."""

from __future__ import annotations

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
