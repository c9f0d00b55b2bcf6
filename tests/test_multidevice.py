"""Expert-parallel serving over 4 emulated CPU devices: lossless, placement and per-device budgets.

JAX fixes the number of CPU devices when its backend starts, so under a normal (one-device) test run this
file re-runs itself in a subprocess with `FMOE_TEST_CPU_DEVICES=4` (read by conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from fmoe_jax.offload.placement import round_robin
from serving import loaded_once

import fmoe_jax as fj

DEVICES = 4

if len(jax.devices()) < DEVICES:

    @pytest.mark.timeout(1300)
    def test_in_subprocess_with_emulated_devices():
        env = dict(os.environ, FMOE_TEST_CPU_DEVICES=str(DEVICES))
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            cwd=Path(__file__).parent.parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
        assert " passed" in result.stdout

else:
    PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 40)), [3, 3, 3]]
    POLICY_OPTIONS = {"fmoe": {"asynchronous": False}}

    @pytest.fixture(scope="module")
    def references(hf_dirs):
        return {
            family: fj.generate(
                fj.load_model(hf_dirs[family]), PROMPTS, max_new_tokens=6, stop_at_eos=False
            ).tokens
            for family in ("mixtral", "qwen2_moe")
        }

    @pytest.fixture(scope="module")
    def four_devices(hf_dirs):
        """`four_devices(family, offload)`: the family's weights, loaded once over the 4 devices, and the
        programs every engine before it compiled, behind a fresh engine for `offload` (tests/serving.py);
        with no `offload`, the closed model they come from (for its config)."""
        config = fj.OffloadConfig(cache_experts=DEVICES, devices=DEVICES)
        return loaded_once(lambda family: fj.load_model(hf_dirs[family], offload=config))

    @pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
    @pytest.mark.parametrize("policy", ["resident", "on_demand_lru", "fmoe"])
    def test_lossless_on_four_devices(family, policy, references, four_devices):
        cfg = four_devices(family).config
        total = cfg.num_moe_layers * cfg.num_experts
        # resident holds every expert whatever the budget; the others at the smallest and half budget
        for slots in (total,) if policy == "resident" else (DEVICES, total // 2):
            offload = fj.OffloadConfig(
                policy=policy,
                cache_experts=slots,
                devices=DEVICES,
                policy_options=POLICY_OPTIONS.get(policy, {}),
            )
            with four_devices(family, offload) as model:
                out = fj.generate(model, PROMPTS, max_new_tokens=6, stop_at_eos=False)
            assert out.tokens == references[family], (family, policy, slots)
            per_device = out.stats.extra["per_device"]
            assert len(per_device) == DEVICES
            assert sum(d["hits"] + d["misses"] for d in per_device) == out.stats.hits + out.stats.misses

    def test_hybrid_on_four_devices(hf_dirs, references):
        """The host's share of a layer joins the first device's partial sum; tokens stay the resident ones.
        Costs are measured online: until the host is measured it costs nothing, so it computes the first
        misses. One family, the one with a dense layer and a shared expert (test_lossless covers the others
        on one device)."""
        family = "qwen2_moe"
        offload = fj.OffloadConfig(
            policy="on_demand_lru", cache_experts=DEVICES, devices=DEVICES, execution="hybrid"
        )
        with fj.load_model(hf_dirs[family], offload=offload) as model:
            out = fj.generate(model, PROMPTS, max_new_tokens=6, stop_at_eos=False)
        assert out.tokens == references[family], family
        assert 0 < out.stats.host_computed <= out.stats.misses

    def test_placement_and_per_device_budgets(hf_dirs):
        offload = fj.OffloadConfig(policy="on_demand_lru", cache_experts=6, devices=DEVICES)
        with fj.load_model(hf_dirs["mixtral"], offload=offload) as model:
            fj.generate(model, PROMPTS, max_new_tokens=6, stop_at_eos=False)
            group = model.engine.cache
            assert [c.book.capacity for c in group.caches] == [2, 2, 1, 1]  # 6 slots over 4 devices
            place = round_robin(model.config.num_experts, DEVICES)
            for index, cache in enumerate(group.caches):
                assert cache.book.stats.peak_bytes <= cache.book.capacity * cache.book.expert_bytes
                for key, arrays in cache.arrays.items():
                    assert place(key) == index
                    assert {a.sharding.device_set.pop() for a in arrays} == {jax.devices()[index]}
            layer0 = model.module.layers[0].attn.q_proj.weight[...]
            arguments = model.engine.arguments  # the step program's parameters
            routed = {i for leaves in arguments.leaves.values() for i in leaves}
            dense = [p for i, p in enumerate(arguments.params) if i not in routed]
            assert all(len(p.sharding.device_set) == DEVICES for p in dense)  # replicated
            assert layer0.sharding.memory_kind == "device"

    def test_custom_placement_map_and_errors(hf_dirs):
        cfg = fj.load_model(hf_dirs["mixtral"]).config
        table = {(m, e): 3 for m in range(cfg.num_moe_layers) for e in range(cfg.num_experts)}
        offload = fj.OffloadConfig(cache_experts=8, devices=DEVICES, placement=table)
        with fj.load_model(hf_dirs["mixtral"], offload=offload) as model:
            out = fj.generate(model, PROMPTS, max_new_tokens=4, stop_at_eos=False)
            loads = [d["bytes_to_device"] for d in out.stats.extra["per_device"]]
            assert loads[3] > 0 and loads[:3] == [0, 0, 0]
        with pytest.raises(ValueError, match="cannot give each of 4 devices one"):
            fj.load_model(hf_dirs["mixtral"], offload=fj.OffloadConfig(cache_experts=3, devices=DEVICES))
        with pytest.raises(ValueError, match="devices=9"):
            fj.load_model(hf_dirs["mixtral"], offload=fj.OffloadConfig(devices=9))

    def test_two_devices_match_one(hf_dirs):
        one = fj.OffloadConfig(policy="on_demand_lfu", cache_experts=4, transfer="synchronous")
        two = fj.OffloadConfig(policy="on_demand_lfu", cache_experts=4, devices=2, transfer="synchronous")
        with (
            fj.load_model(hf_dirs["qwen2_moe"], offload=one) as a,
            fj.load_model(hf_dirs["qwen2_moe"], offload=two) as b,
        ):
            out_a = fj.generate(a, PROMPTS, max_new_tokens=6, stop_at_eos=False)
            out_b = fj.generate(b, PROMPTS, max_new_tokens=6, stop_at_eos=False)
        assert out_a.tokens == out_b.tokens

    def test_sampler_inputs_cross_the_mesh(hf_dirs):
        """The repetition penalty's seen-token mask travels beside the sampler's key (`sampler_key`), so a
        sampled, penalised generation on 4 devices equals the resident one."""
        kwargs = dict(max_new_tokens=6, stop_at_eos=False, seed=3, temperature=0.8, repetition_penalty=1.5)
        expected = fj.generate(fj.load_model(hf_dirs["mixtral"]), PROMPTS, **kwargs).tokens
        offload = fj.OffloadConfig(policy="on_demand_lru", cache_experts=DEVICES, devices=DEVICES)
        with fj.load_model(hf_dirs["mixtral"], offload=offload) as model:
            assert fj.generate(model, PROMPTS, **kwargs).tokens == expected
