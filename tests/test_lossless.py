"""Offloading is lossless: under every policy and every budget from one slot to all routed experts, in
bfloat16 and float32, offloaded logits are bit-identical to the resident model's and greedy tokens equal
(with hybrid execution too: tests/test_hybrid.py, on these helpers).

The models: the shipped trained checkpoints (bfloat16, as they ship) and a tiny random model of each family
in both dtypes. A layer that needs more experts than the cache holds runs in chunks; these tests are the
ones that catch a chunk rounding its partial sum (which moved logits by up to 1.1 on fmoe-tiny-mixtral).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fmoe_jax.models import Layout
from fmoe_jax.offload import predictors
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.hybrid import HostCost
from fmoe_jax.offload.policies import POLICIES, DuoServe, FMoE, Oracle, ProMoE
from fmoe_jax.research import predictor_training
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from serving import served

import fmoe_jax as fj
from fmoe_jax.generation import bucket_length

SHIPPED = ["fmoe-tiny-mixtral", "fmoe-tiny-qwen-moe", "fmoe-tiny-qwen3-moe"]
# Known failure, kept out of the draw and pinned by test_deepseek_v2_lite_float32_decode below. DeepSeek-V3's
# tiny model (latent attention too) also decodes up to 1 ulp (7e-8) apart in float32 once a step ran as
# per-layer programs; in bfloat16, the dtype both ship in, it is identical (tested by name below).
KNOWN_DIFFERENT = {("deepseek_v2_lite", "float32"), ("deepseek_v3", "float32")}
NEW_FAMILIES = ("gpt_oss", "deepseek_v3", "glm4_moe")  # also held to resident by name below (issue 55)
RANDOM = [
    (family, dtype)
    for family in (
        "mixtral",
        "qwen2_moe",
        "phimoe",
        "qwen3_moe",
        "olmoe",
        "deepseek_v2_lite",
        "deepseek_v2",
        *NEW_FAMILIES,
        "qwen3_next",
        "qwen3_5_moe",
    )
    for dtype in ("bfloat16", "float32")
    if (family, dtype) not in KNOWN_DIFFERENT
]
WARMUP_PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [26, 53, 58, 97, 93], list(range(40, 70))]


@dataclasses.dataclass
class Subject:
    resident: fj.Model
    offloaded: fj.Model  # its experts in pinned host memory; each test serves it with a fresh engine
    _predictors: dict[str, predictors.Predictor] = dataclasses.field(default_factory=dict)
    references: dict = dataclasses.field(default_factory=dict)  # copy-only results of `reference`

    def predictor(self, kind: str, traces=None) -> predictors.Predictor:
        """ProMoE's, DuoServe's or fmoe's reuse predictor, trained on first use from `traces` (by default
        the resident model's routing of WARMUP_PROMPTS): a few seconds of training is enough to make them
        act (their accuracy is not under test here)."""
        if kind not in self._predictors:
            if traces is None:
                record = dict(stop_at_eos=False, record_trace=True, record_hidden=True)
                traces = [fj.generate(self.resident, [p], 4, **record).trace for p in WARMUP_PROMPTS]
            quick = dict(epochs=2, batch_size=32, progress=False)
            train = {
                "promoe": lambda: predictor_training.train_promoe(traces, stride=1, hidden=(16,), **quick),
                "duoserve": lambda: predictor_training.train_duoserve(traces, hidden=(16,), **quick),
                "reuse": lambda: predictor_training.train_reuse(traces, horizon=1, l2=(1e-3,), **quick),
            }
            self._predictors[kind] = train[kind]()
        return self._predictors[kind]


def _load(source, dtype=None, **quantization) -> Subject:
    """`quantization`: load_model's expert_quantization / quantization_group_size (test_quant_lossless.py)."""
    resident = fj.load_model(source, dtype=dtype, **quantization)
    offloaded = fj.load_model(source, dtype=dtype, offload=OffloadConfig(cache_experts=1), **quantization)
    offloaded.close()
    return Subject(resident, offloaded)


def subject_loader(hf_dirs) -> Callable[[Any], Subject]:
    """`get(name or (family, dtype))`: a shipped model or a tiny random one, loaded on first use and kept."""
    cache: dict = {}

    def get(key) -> Subject:
        if key not in cache:
            cache[key] = _load(key) if isinstance(key, str) else _load(hf_dirs[key[0]], key[1])
        return cache[key]

    return get


@pytest.fixture(scope="module")
def subjects(hf_dirs):
    """Loaded on first use (hypothesis draws the model), kept for the module."""
    return subject_loader(hf_dirs)


def serve(
    subject: Subject, policy: str, slots: int, reference_trace=None, host_cost=None, device_cost=None
) -> fj.Model:
    """The subject's weights behind a fresh offload engine for `policy` at `slots` (no reload); with a
    `host_cost`, hybrid execution deciding by it (and by `device_cost`, if given). `reference_trace`: the
    oracle's generation, and the predictors' training data if they are not trained yet."""
    traces = None if reference_trace is None else [reference_trace]
    if policy == "oracle":
        policy_obj = Oracle(reference_trace)
    elif policy == "promoe":
        policy_obj = ProMoE(predictor=subject.predictor("promoe", traces))
    elif policy == "duoserve":
        policy_obj = DuoServe(predictor=subject.predictor("duoserve", traces))
    elif policy == "fmoe+reuse":  # fmoe with its learned reuse predictor (the engine passes router inputs)
        policy_obj = FMoE(reuse_predictor=subject.predictor("reuse", traces))
    else:
        policy_obj = policy
    execution = "copy" if host_cost is None else "hybrid"
    offload = OffloadConfig(policy=policy_obj, cache_experts=slots, prefetch_distance=1, execution=execution)
    return served(subject.offloaded, offload, host_cost=host_cost, device_cost=device_cost)


def run_steps(model: fj.Model, prompts: list[list[int]], new_tokens: int):
    """Prefill + greedy decode through the engine's `step`; each step's tokens `[B]` and logits `[B, V]`.
    Padding and cache length are bucketed as `generate` buckets them, so few shapes compile."""
    engine = model.engine
    b, t_pad = len(prompts), bucket_length(max(len(p) for p in prompts))
    tokens = np.zeros((b, t_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, t_pad - len(p) :] = p
    key_start = np.asarray([t_pad - len(p) for p in prompts], np.int32)
    active = np.ones((b,), bool)
    kv = engine.init_cache(b, bucket_length(t_pad + new_tokens))
    key = jax.random.key(0)
    layout = Layout(np.int32(0), key_start, active, t_pad)
    out, kv = engine.step(jnp.asarray(tokens), kv, layout, key, fj.Greedy())
    logits, generated = [np.asarray(out.logits)], [np.asarray(out.tokens)]
    for step in range(new_tokens - 1):
        layout = Layout(np.int32(t_pad + step), key_start, active, 1)
        out, kv = engine.step(np.asarray(out.tokens)[:, None], kv, layout, key, fj.Greedy())
        logits.append(np.asarray(out.logits))
        generated.append(np.asarray(out.tokens))
    return np.stack(generated, 1), np.stack(logits, 1)


def reference(subject: Subject, prompts: list[list[int]], new_tokens: int, *, oracle: bool, copy: bool):
    """What `check_lossless` compares with: `run_steps`'s tokens and logits, or for the oracle a `generate`
    output with its trace and router inputs; of the resident model, or (`copy`) of copy-only serving at one
    slot, computed once per subject and prompts (tests/test_hybrid.py compares many runs with it)."""
    key = (tuple(map(tuple, prompts)), new_tokens, oracle)
    if copy and key in subject.references:
        return subject.references[key]
    model = serve(subject, "on_demand_lru", 1) if copy else subject.resident
    try:
        if oracle:
            record = dict(stop_at_eos=False, record_trace=True, record_hidden=True)
            out = fj.generate(model, prompts, new_tokens, **record)
        else:
            out = run_steps(model, prompts, new_tokens)
    finally:
        if copy:
            model.close()
    if copy:
        subject.references[key] = out
    return out


def check_lossless(
    subject: Subject,
    policy: str,
    slots: int,
    prompts: list[list[int]],
    new_tokens: int,
    host_cost=None,
    *,
    against_copy: bool = False,
    device_cost=None,
) -> int:
    """Asserts generation bit-identical to the resident model's (plus a full forward of the first prompt),
    or with `against_copy` to copy-only serving's (no resident programs to compile; the tests above hold
    copy-only serving to resident); returns how many experts the host computed (hybrid)."""
    label = f"{policy} at {slots} slots, prompts {[len(p) for p in prompts]}, host {host_cost} {device_cost}"
    if policy == "oracle":
        # The oracle serves exactly the generation it was given: compare `generate` calls, tokens and every
        # MoE layer's router input bit for bit (run_steps would be a different generation).
        ref = reference(subject, prompts, new_tokens, oracle=True, copy=against_copy)
        model = serve(subject, policy, slots, ref.trace, host_cost, device_cost)
        try:
            out = fj.generate(
                model, prompts, new_tokens, stop_at_eos=False, record_trace=True, record_hidden=True
            )
        finally:
            model.close()
        assert out.tokens == ref.tokens, label
        for a, b in zip(ref.trace.requests, out.trace.requests, strict=True):
            for x, y in zip(a.iterations, b.iterations, strict=True):
                np.testing.assert_array_equal(x.hidden, y.hidden, err_msg=label)
        return out.stats.host_computed
    ref_tokens, ref_logits = reference(subject, prompts, new_tokens, oracle=False, copy=against_copy)
    trace = None
    if policy in ("promoe", "duoserve") and against_copy:  # their predictors learn from copy-only serving
        trace = reference(subject, prompts, new_tokens, oracle=True, copy=True).trace
    model = serve(subject, policy, slots, trace, host_cost=host_cost, device_cost=device_cost)
    try:
        tokens, logits = run_steps(model, prompts, new_tokens)
        full = None if against_copy else np.asarray(fj.forward(model, [prompts[0]]))
        book = model.engine.cache.book
        assert book.stats.peak_bytes <= book.capacity * book.expert_bytes, label
    finally:
        model.close()
    np.testing.assert_array_equal(tokens, ref_tokens, err_msg=label)
    np.testing.assert_array_equal(logits, ref_logits, err_msg=label)  # bit-identical: no tolerance
    if full is not None:
        resident_full = np.asarray(fj.forward(subject.resident, [prompts[0]]))
        np.testing.assert_array_equal(full, resident_full, err_msg=label)
    return book.stats.host_computed


MODELS = [*SHIPPED[:1], *RANDOM]  # the other shipped models: test_shipped_models_chunked_budgets


# No shrinking: each example loads engines and compiles, and a failure already names its model, policy,
# budget and prompts.
@settings(
    max_examples=4,  # each example compiles a model's programs: the suite's time budget
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    model=st.sampled_from(MODELS),
    policy=st.sampled_from(sorted(POLICIES)),
    fraction=st.floats(0.0, 1.0),
    data=st.data(),
)
def test_offloading_is_bit_identical_to_resident(model, policy, fraction, data, subjects):
    subject = subjects(model)
    cfg = subject.resident.config
    total = cfg.num_moe_layers * cfg.num_experts
    slots = 1 + round(fraction * (total - 1))  # 1 slot .. every routed expert
    prompts = data.draw(
        st.lists(
            st.lists(st.integers(3, cfg.vocab_size - 1), min_size=1, max_size=24), min_size=1, max_size=3
        )
    )
    check_lossless(subject, policy, slots, prompts, data.draw(st.integers(1, 5)))


@pytest.mark.parametrize("name", SHIPPED[:1])  # the bug report's model; the others: property test
@pytest.mark.parametrize("policy", ["on_demand_lru", "fmoe"])
def test_shipped_models_chunked_budgets(name, policy, subjects):
    """Budgets the bug report named (1 and 4 slots, below one layer's experts), 2, and all experts, on the
    report's own prompt, plus greedy text generation of its code prompt at 4 slots."""
    subject = subjects(name)
    cfg = subject.resident.config
    prompt = [5, 100, 200, 300, 400, 17, 9]
    reference = fj.generate(subject.resident, ["def fibonacci(n):"], 24, stop_at_eos=False)
    for slots in (1, 2, 4, cfg.num_moe_layers * cfg.num_experts):
        check_lossless(subject, policy, slots, [prompt], 4)
    model = serve(subject, policy, 4)
    try:
        assert fj.generate(model, ["def fibonacci(n):"], 24, stop_at_eos=False).tokens == reference.tokens
    finally:
        model.close()


@pytest.mark.parametrize("name", SHIPPED[:1])
def test_fmoe_with_its_reuse_predictor_is_lossless(name, subjects):
    """fmoe reading router inputs for its learned reuse predictor, at 1, 2 and 4 slots and every expert."""
    subject = subjects(name)
    cfg = subject.resident.config
    for slots in (1, 2, 4, cfg.num_moe_layers * cfg.num_experts):
        check_lossless(subject, "fmoe+reuse", slots, [[5, 100, 200, 300, 400, 17, 9], [44, 3, 81]], 5)


def test_fmoe_lossless_while_it_stops_wanting_contexts(subjects):
    """Copies priced at next to nothing: once its work is priced (a few contexts in), fmoe stops asking the
    engine for router inputs, probabilities and embeddings part way through decoding (`needs_hidden`,
    `needs_probs`, `needs_semantic`); every budget's logits stay bit-identical to resident."""
    subject = subjects(SHIPPED[0])
    cfg = subject.resident.config
    prompts, new_tokens = [[5, 100, 200, 300, 400, 17, 9]], 20
    ref_tokens, ref_logits = reference(subject, prompts, new_tokens, oracle=False, copy=False)
    for slots in (1, 2, 4, cfg.num_moe_layers * cfg.num_experts):
        policy = FMoE(reuse_predictor=subject.predictor("reuse"), copy_s=1e-9, layer_s=1e-3)
        offload = OffloadConfig(policy=policy, cache_experts=slots, prefetch_distance=1)
        model = served(subject.offloaded, offload)
        try:
            tokens, logits = run_steps(model, prompts, new_tokens)
            stats = policy.stats()
        finally:
            model.close()
        np.testing.assert_array_equal(tokens, ref_tokens, err_msg=f"{slots} slots")
        np.testing.assert_array_equal(logits, ref_logits, err_msg=f"{slots} slots")
        if slots < cfg.num_moe_layers * cfg.num_experts:  # with every expert resident nothing is at stake
            assert stats["unrecorded_iterations"] > 0 and stats["unpaid_reuse"] > 0, (slots, stats)


class OneTokenOnHost(HostCost):
    """A host cost under which the host takes every missed expert that one token uses and the device the
    others: layers computed on both at once (a padded prefill, a batch's decode step)."""

    def overhead_s(self, tokens: int) -> float:
        return 0.0

    def expert_s(self, tokens: int) -> float:
        return 0.0 if tokens <= 1 else math.inf

    def __repr__(self) -> str:
        return "OneTokenOnHost()"


@pytest.mark.parametrize("name", ["gpt_oss_mxfp4", "deepseek_v3", "glm4_moe"])
def test_new_families_are_lossless_copy_only_and_hybrid(name, subjects, mxfp4_dir):
    """gpt-oss (its experts in MXFP4 as published; with float experts it is one of the property test's
    draws), DeepSeek-V3 and GLM-4.5 in bfloat16: on_demand_lru at one slot and fmoe at 25 % of the experts,
    copy-only serving is bit-identical to resident serving, and hybrid serving (the host taking each
    single-token miss while the device computes the rest) to copy-only serving; a left-padded batch of
    two."""
    subject = _load(mxfp4_dir, "bfloat16") if name == "gpt_oss_mxfp4" else subjects((name, "bfloat16"))
    cfg = subject.resident.config
    prompts = [[5, 100, 200, 31, 47, 17, 9], [3, 14, 15]]
    hosted = 0
    for policy, slots in (("on_demand_lru", 1), ("fmoe", max(1, cfg.num_moe_layers * cfg.num_experts // 4))):
        check_lossless(subject, policy, slots, prompts, 3)
        hosted += check_lossless(subject, policy, slots, prompts, 3, OneTokenOnHost(), against_copy=True)
    assert hosted > 0, f"{name}: the host computed nothing; the hybrid half compares little"


def test_linear_attention_model_at_one_slot_and_a_quarter(subjects):
    """Hybrid models (`models/gated_deltanet.py`): each linear layer's recurrent state and convolution window
    ride beside the full layers' KV cache through the per-layer programs. bfloat16 as models ship, a
    left-padded batch of two, on-demand LRU at one slot and fmoe at a quarter of the routed experts, on
    Qwen3-Next (Qwen3.5-MoE, whose linear layers differ only in their projections, is drawn above)."""
    subject = subjects(("qwen3_next", "bfloat16"))
    cfg = subject.resident.config
    prompts = [[5, 100, 200, 30, 41, 17, 9, 12, 250, 77, 3], [44, 3, 81]]
    for policy, slots in (("on_demand_lru", 1), ("fmoe", cfg.num_moe_layers * cfg.num_experts // 4)):
        check_lossless(subject, policy, slots, prompts, 4)


@pytest.mark.xfail(
    strict=True,
    reason="open bug: the tiny DeepSeek-V2-Lite (no q LoRA) in float32 decodes logits 1 ulp (6e-8) away from "
    "the resident engine's when the offload engine's step program stops at layers (one slot). Cause found "
    "(per-layer programs, before the step program): the rotated keys the prefill caches already differ by 1 "
    "ulp, because XLA:CPU fuses `x * cos + rotated * sin` as a multiply-add and contracts it to FMA "
    "differently in the whole-model program and in the offload engine's (an optimization barrier does not "
    "stop it; the cos/sin tables are equal). bf16, the dtype the model ships in, is identical. A fix turns "
    "this into an XPASS, which fails: then drop it and KNOWN_DIFFERENT.",
)
def test_deepseek_v2_lite_float32_decode(subjects):
    prompts = [[20, 254, 157, 255, 91, 39], [3, 201, 83, 107, 235], [9, 57, 174]]  # found by hypothesis
    check_lossless(subjects(("deepseek_v2_lite", "float32")), "on_demand_lru", 1, prompts, 4)
