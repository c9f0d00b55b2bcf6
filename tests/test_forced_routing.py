"""Live runs on recorded routing: `random_model` (random weights at given sizes, experts in pinned host
memory) and `generate(..., forced_routing=trace)`, whose policy events equal the simulator's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.cost_model import HARDWARE, MIXTRAL_8X7B, ModelPreset
from fmoe_jax.offload.simulator import simulate
from serving import served

import fmoe_jax as fj
from fmoe_jax.random_model import preset_hf_config, shrunk_hf_config
from fmoe_jax.trace import RequestTrace, RoutingTrace

TINY = dict(
    model_type="mixtral",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12]]
STEPS = 5


def permuted(trace: RoutingTrace, seed: int = 1) -> RoutingTrace:
    """`trace` with each layer's expert ids (and probability columns) permuted: routing the model's own
    routers would not choose, with its probabilities and embeddings kept in step."""
    rng = np.random.default_rng(seed)
    layers, experts = trace.meta["num_layers"], trace.meta["num_experts"]
    perms = np.stack([rng.permutation(experts) for _ in range(layers)])  # [L, J]
    inverse = np.argsort(perms, axis=1)
    requests = []
    for request in trace.requests:
        its = []
        for it in request.iterations:
            ids = perms[np.arange(layers)[None, :, None], it.ids].astype(np.int32)
            probs = np.take_along_axis(it.probs, inverse[None].repeat(len(it.probs), 0), axis=2)
            weights = np.full(ids.shape, 0.5, np.float32)
            its.append(dataclasses.replace(it, ids=ids, probs=probs, weights=weights))
        requests.append(RequestTrace(request.prompt, its))
    return RoutingTrace(dict(trace.meta), requests)


@pytest.fixture(scope="module")
def tiny():
    """The same random weights (one seed) resident, and offloaded (closed: `served` puts engines on it)."""
    offloaded = fj.random_model(TINY, OffloadConfig(cache_experts=1), seed=3)
    offloaded.close()
    return fj.random_model(TINY, None, seed=3), offloaded


def test_random_model_sizes_placement_and_refusals():
    from fmoe_jax.offload.model_presets import DEEPSEEK_V3, GPT_OSS_20B

    hf = shrunk_hf_config(preset_hf_config(GPT_OSS_20B), layers=2, width_scale=0.1)
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]) == (
        2,
        256,
        256,
        64,
    )
    hf.update(vocab_size=256, num_local_experts=4)
    with fj.random_model(hf, OffloadConfig(cache_experts=2, expert_quantization="int4")) as model:
        expert = model.module.experts[1][3]
        assert expert.gate.values.get_value().sharding.memory_kind == "pinned_host"
        assert model.module.layers[0].router.weight.get_value().sharding.memory_kind == "device"
        assert model.engine.expert_bytes < 3 * 256 * 256  # int4 values and their scales
        fj.generate(model, [[1, 2, 3]], max_new_tokens=2)
    with fj.random_model(hf, None, expert_quantization="mxfp4") as model:  # resident, gpt-oss's format
        assert model.module.expert_quantization.kind == "mxfp4"
    with pytest.raises(ValueError, match="shared experts, latent attention"):
        fj.random_model(DEEPSEEK_V3, None, layers=1)
    with pytest.raises(ValueError, match="width_scale"):
        fj.random_model(MIXTRAL_8X7B, None, width_scale=2.0)


def test_forced_routing_bad_traces_are_refused(tiny):
    resident = tiny[0]
    recorded = fj.generate(resident, PROMPTS, max_new_tokens=2, record_trace=True, stop_at_eos=False).trace
    with pytest.raises(ValueError, match="has 2 iterations, but generate runs up to max_new_tokens=4"):
        fj.generate(resident, PROMPTS, max_new_tokens=4, forced_routing=permuted(recorded))
    with pytest.raises(ValueError, match="2 requests for 1 prompts"):
        fj.generate(resident, PROMPTS[:1], max_new_tokens=2, forced_routing=recorded)
    wrong = RoutingTrace(dict(recorded.meta, num_experts=16), recorded.requests)
    with pytest.raises(ValueError, match="num_experts=16 but the model has 8"):
        fj.generate(resident, PROMPTS, max_new_tokens=2, forced_routing=wrong)


def test_forced_routing_is_used_lossless_and_equals_the_simulator(tiny):
    """Every MoE layer uses the forced experts (recorded back as they were forced), the offload engine at
    partial budgets is bit-identical to the resident one under them, and the policy's events equal the
    simulator's for the same trace: hit, miss and prefetch counts, per layer."""
    resident, offloaded = tiny
    run = dict(max_new_tokens=STEPS, stop_at_eos=False, record_trace=True, return_logprobs=True)
    natural = fj.generate(resident, PROMPTS, **run)
    trace = permuted(natural.trace)
    forced = fj.generate(resident, PROMPTS, forced_routing=trace, **run)
    assert forced.logprobs != natural.logprobs  # the forced routing changed the computation
    for got, want in zip(forced.trace.requests, trace.requests, strict=True):
        for a, b in zip(got.iterations, want.iterations, strict=True):
            np.testing.assert_array_equal(a.ids, b.ids)
    preset = ModelPreset.from_config(resident.config)
    options = {"on_demand_lru": {}, "fmoe": {"asynchronous": False, "admission": 0.1}}
    for policy, policy_options in options.items():
        counts = []
        for slots in (2, 12):
            offload = OffloadConfig(
                policy=policy, cache_experts=slots, transfer="synchronous", policy_options=policy_options
            )
            with served(offloaded, offload) as model:
                live = fj.generate(model, PROMPTS, forced_routing=trace, **run)
            sim = simulate(trace, offload, model=preset, hardware=HARDWARE["h100_sxm"])
            where = f"{policy} {slots} slots"
            assert (live.tokens, live.logprobs) == (forced.tokens, forced.logprobs), where  # bit-identical
            assert (sim.hits, sim.misses) == (live.stats.hits, live.stats.misses), where
            assert sim.prefetches == live.stats.prefetches, where
            assert sim.layer_hit_rate == live.stats.layer_hit_rate, where
            counts.append((sim.hits, sim.misses))
        assert all(h > 0 for h, _ in counts[1:]) and all(m > 0 for _, m in counts), (policy, counts)
