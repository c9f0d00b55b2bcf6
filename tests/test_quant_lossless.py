"""Offloading a quantized model is lossless too: with routed experts stored int8 or int4, generation under
every policy, at one expert slot and at 25 % of the experts, is token-identical (log-probabilities and every
MoE layer's router input bit-identical) to resident generation of the same quantized model. The quantized
arrays travel through the offload engine's step program, stopping at misses and running through a full
cache (the `resident` policy preloads every expert), as `ExpertWeights` of `QuantizedMatrix`es.

The models are `test_lossless.py`'s tiny random ones, in bfloat16 with groups of 8 inputs (the newer
families' experts have 24 intermediate units). A family costs 20-35 s of compilation on a 2-core CPU,
whatever the number of policies (those cost milliseconds each), so one run checks Mixtral in int4 over
prefill and two decode steps, and one other family and kind drawn by hypothesis over prefill and its token
(one compiled shape less): every family's routed experts are the same `Expert`s, and the offload engine
never looks inside them. Their quantized numerics are tested in `test_quant.py` and `test_quant_loading.py`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fmoe_jax.models.quant import KINDS
from fmoe_jax.offload.hybrid import HostCost
from fmoe_jax.offload.policies import POLICIES
from fmoe_jax.research import predictor_training
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_lossless import Subject, _load, serve

import fmoe_jax as fj

ALWAYS = "mixtral"
DRAWN = [
    *("qwen2_moe", "phimoe", "qwen3_moe", "olmoe", "deepseek_v2"),
    *("gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe"),
]
PROMPTS = [[5, 100, 200, 30, 41, 17, 9], [3, 14, 15, 92, 65]]
NEW_TOKENS = 3
# Every MoE layer's router input is recorded: bit-equal router inputs at every layer and step, plus equal
# tokens and log-probabilities, is `check_lossless`'s bit-identity, through `generate`'s few compiled shapes
# (the reference and every engine share them; each extra shape costs a compilation of every program).
RECORD = dict(stop_at_eos=False, record_trace=True, record_hidden=True, return_logprobs=True)


@pytest.fixture(scope="module")
def subjects(hf_dirs):
    """(family, kind, new tokens) -> the tiny model quantized that way (resident and offloaded) and the
    resident model's generation of PROMPTS; loaded on first use."""
    cache: dict = {}

    def get(family: str, kind: str, new_tokens: int = NEW_TOKENS) -> tuple[Subject, fj.GenerateOutput]:
        if (family, kind, new_tokens) not in cache:
            subject = _load(hf_dirs[family], "bfloat16", expert_quantization=kind, quantization_group_size=8)
            reference = fj.generate(subject.resident, PROMPTS, new_tokens, **RECORD)
            # ProMoE's and DuoServe's predictors from the reference's routing: no generation of other shapes
            # to compile (their accuracy is not under test).
            quick = dict(epochs=1, batch_size=32, progress=False, hidden=(16,))
            trained = {
                "promoe": predictor_training.train_promoe([reference.trace], stride=1, **quick),
                "duoserve": predictor_training.train_duoserve([reference.trace], **quick),
            }
            subject = dataclasses.replace(subject, _predictors=trained)
            cache[family, kind, new_tokens] = subject, reference
        return cache[family, kind, new_tokens]

    return get


def budgets(subject: Subject, policy: str) -> tuple[int, ...]:
    """One slot and a quarter of the routed experts (`resident` preloads every expert whatever the budget)."""
    cfg = subject.resident.config
    return (1,) if policy == "resident" else (1, max(2, cfg.num_moe_layers * cfg.num_experts // 4))


def check_generation(
    subject: Subject, reference: fj.GenerateOutput, policy: str, slots: int, host_cost=None
) -> fj.GenerateOutput:
    label = f"{policy} at {slots} slots, host {host_cost}"
    # The oracle serves the reference's routing; a `host_cost` serves hybrid, deciding by it.
    model = serve(subject, policy, slots, reference.trace, host_cost)
    try:
        out = fj.generate(model, PROMPTS, len(reference.tokens[0]), **RECORD)
    finally:
        model.close()
    assert out.tokens == reference.tokens, label
    assert out.logprobs == reference.logprobs, label  # bit-identical: no tolerance
    for a, b in zip(reference.trace.requests, out.trace.requests, strict=True):
        for x, y in zip(a.iterations, b.iterations, strict=True):
            np.testing.assert_array_equal(x.hidden, y.hidden, err_msg=label)
    return out


def check_every_policy(subject: Subject, reference: fj.GenerateOutput) -> None:
    for policy in sorted(POLICIES):
        for slots in budgets(subject, policy):
            check_generation(subject, reference, policy, slots)


def test_offloaded_int4_mixtral_equals_resident(subjects):
    check_every_policy(*subjects(ALWAYS, "int4"))


# One draw per run (a family compiles for 20-35 s); no shrinking: a failure names its family and kind.
@settings(
    max_examples=1,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(family=st.sampled_from(DRAWN), kind=st.sampled_from(KINDS))
def test_offloaded_drawn_family_equals_resident(family, kind, subjects):
    check_every_policy(*subjects(family, kind, new_tokens=1))


class _AllOnHost(HostCost):
    """Hybrid execution's host cost when the host is free: every missed expert is computed there."""

    def overhead_s(self, tokens: int) -> float:
        return 0.0

    def expert_s(self, tokens: int) -> float:
        return 0.0

    def __repr__(self) -> str:
        return "AllOnHost()"


@pytest.mark.parametrize("kind", KINDS)
def test_hybrid_execution_of_quantized_experts_equals_resident(kind, subjects):
    """Misses computed on the host from the quantized experts in host memory (dequantized inside the host's
    expert program, as on the device): token-identical to the resident quantized model, at one slot and
    25 %, with LRU and fmoe."""
    subject, reference = subjects(ALWAYS, kind)
    host_computed = 0
    for policy in ("on_demand_lru", "fmoe"):
        for slots in budgets(subject, policy):
            out = check_generation(subject, reference, policy, slots, _AllOnHost())
            host_computed += out.stats.host_computed
    assert host_computed > 0, "the host computed nothing; the test compares little"
