"""Offloading a quantized model is lossless too: with routed experts stored int8 or int4, generation under
every policy, at one expert slot and at 25 % of the experts, is token-identical (log-probabilities and every
MoE layer's router input bit-identical) to resident generation of the same quantized model, for every
family. The quantized arrays travel through the offload engine's jitted per-layer steps and its full-cache
fast path (the `resident` policy preloads every expert), as `ExpertWeights` of `QuantizedMatrix`es.

The models are `test_lossless.py`'s tiny random ones, in bfloat16 with groups of 32 inputs (compiling the
shipped models' programs for every budget would cost minutes; their quantized numerics are tested in
`test_quant_loading.py`).
"""

from __future__ import annotations

import numpy as np
import pytest
from fmoe_jax.offload.policies import POLICIES
from test_lossless import Subject, _load, serve

import fmoe_jax as fj

FAMILIES = ["mixtral", "qwen2_moe", "phimoe"]
PROMPTS = [[5, 100, 200, 30, 41, 17, 9], [3, 14, 15, 92, 65]]
NEW_TOKENS = 3
# Every MoE layer's router input is recorded: bit-equal router inputs at every layer and step, plus equal
# tokens and log-probabilities, is `check_lossless`'s bit-identity, through `generate`'s few compiled shapes
# (the reference and every engine share them; each extra shape costs a compilation of every program).
RECORD = dict(stop_at_eos=False, record_trace=True, record_hidden=True, return_logprobs=True)


@pytest.fixture(scope="module")
def subjects(hf_dirs):
    """(family, kind) -> the tiny model quantized that way (resident and offloaded) and the resident model's
    generation of PROMPTS; loaded on first use."""
    cache: dict = {}

    def get(family: str, kind: str) -> tuple[Subject, fj.GenerateOutput]:
        if (family, kind) not in cache:
            subject = _load(hf_dirs[family], "bfloat16", expert_quantization=kind, quantization_group_size=32)
            cache[family, kind] = subject, fj.generate(subject.resident, PROMPTS, NEW_TOKENS, **RECORD)
        return cache[family, kind]

    return get


def budgets(subject: Subject, policy: str) -> tuple[int, ...]:
    """One slot and a quarter of the routed experts (`resident` preloads every expert whatever the budget)."""
    cfg = subject.resident.config
    return (1,) if policy == "resident" else (1, max(2, cfg.num_moe_layers * cfg.num_experts // 4))


def check_generation(subject: Subject, reference: fj.GenerateOutput, policy: str, slots: int) -> None:
    label = f"{policy} at {slots} slots"
    model = serve(subject, policy, slots, reference.trace)  # the oracle serves the reference's routing
    try:
        out = fj.generate(model, PROMPTS, NEW_TOKENS, **RECORD)
    finally:
        model.close()
    assert out.tokens == reference.tokens, label
    assert out.logprobs == reference.logprobs, label  # bit-identical: no tolerance
    for a, b in zip(reference.trace.requests, out.trace.requests, strict=True):
        for x, y in zip(a.iterations, b.iterations, strict=True):
            np.testing.assert_array_equal(x.hidden, y.hidden, err_msg=label)


@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_int4_equals_resident_int4(family, subjects):
    subject, reference = subjects(family, "int4")
    for policy in sorted(POLICIES):
        for slots in budgets(subject, policy):
            check_generation(subject, reference, policy, slots)


def test_offloaded_int8_equals_resident_int8(subjects):
    subject, reference = subjects("qwen2_moe", "int8")
    for policy in ("on_demand_lru", "fmoe", "resident"):
        for slots in budgets(subject, policy):
            check_generation(subject, reference, policy, slots)
