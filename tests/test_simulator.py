"""The trace-replay simulator: equal hit/miss counts to the live engine with synchronous transfers, for every
policy; the replayed event layout; the cost model on hand-computed cases; presets against published sizes."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.cost_model import (
    DEEPSEEK_V2_LITE,
    HARDWARE,
    MIXTRAL_8X7B,
    MODELS,
    OLMOE_1B_7B,
    PHI35_MOE,
    PRESETS,
    QWEN3_30B_A3B,
    QWEN3_NEXT_80B_A3B,
    QWEN15_MOE_A27B,
    QWEN35_35B_A3B,
    QWEN35_122B_A10B,
    CostModel,
    ModelPreset,
)
from fmoe_jax.offload.policies import POLICIES, FMoE, Policy, store_from_traces
from fmoe_jax.offload.simulator import SimulatedLink, simulate
from serving import served
from toy_costs import TOY_HARDWARE, TOY_MODEL, toy_trace

import fmoe_jax as fj
from fmoe_jax.engines.offload import router_weights
from fmoe_jax.trace import Iteration, RequestTrace, RoutingTrace


# Options that make a policy deterministic (matching inline on the engine thread), or a function of the
# HF model directory that builds them (for a policy that needs an artifact). A policy registered in POLICIES
# with a thread of its own or required arguments adds its entry here; the invariant test runs every one.
def trained_predictor(kind: str) -> Callable[[Path], dict]:
    """Options for a learned policy: a small predictor trained on a trace of the model (stride 1)."""

    def build(hf_dir: Path) -> dict:
        from fmoe_jax.models import model_identity
        from fmoe_jax.research import predictor_training

        path = hf_dir.parent / f"{hf_dir.name}-{kind}-predictor"
        if not path.with_suffix(".json").exists():
            resident = fj.load_model(hf_dir)
            out = fj.generate(
                resident,
                [[5, 6, 7, 8], [9, 10, 11]],
                4,
                stop_at_eos=False,
                record_trace=True,
                record_hidden=True,
            )
            quick = dict(epochs=3, hidden=(16,), progress=False, model_id=model_identity(resident.config))
            train = predictor_training.train_promoe if kind == "promoe" else predictor_training.train_duoserve
            extra = {"stride": 1} if kind == "promoe" else {}
            train([out.trace], **extra, **quick).save(path)
        return {"predictor": path}

    return build


@functools.cache  # one resident generation per model, for every budget that asks
def future_traces(hf_dir: Path) -> dict:
    """The oracle's knowledge: the routing of the very generations the test will run."""
    resident = fj.load_model(hf_dir)
    outs = [fj.generate(resident, batch, max_new_tokens=5, record_trace=True) for batch in BATCHES]
    return {"traces": [out.trace for out in outs]}


DETERMINISTIC_OPTIONS: dict[str, dict | Callable[[Path], dict]] = {
    # A fixed admission threshold: by default fmoe's admission uses timings measured live (the simulator's
    # cost model gives others); 0.1 filters some of the random models' choices and keeps others.
    "fmoe": {"asynchronous": False, "admission": 0.1},
    "oracle": future_traces,
    "promoe": trained_predictor("promoe"),
    "duoserve": trained_predictor("duoserve"),
}


def policy_options(policy: str, hf_dir: Path) -> dict:
    options = DETERMINISTIC_OPTIONS.get(policy, {})
    return dict(options(hf_dir)) if callable(options) else options  # a copy: `future_traces` is cached


# Two `generate` calls (the policy and cache carry over), rows of different lengths; one prefill bucket
# (T = 16) and batch size for both, so the live engine compiles few shapes.
BATCHES = [
    [[3, 14, 15, 92, 65], [7, 7, 7]],
    [[9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [100, 101]],
]


def live_and_replayed(hf_dir, policy: str, cache_experts: int | None, base: fj.Model | None = None):
    """Live generation with synchronous transfers recording traces, then the replay of those traces. With
    `base` (a model loaded from `hf_dir` with any offload config), its weights and compiled programs serve
    behind a fresh engine: no reload, nothing compiled twice."""
    offload = OffloadConfig(
        policy=policy,
        cache_experts=cache_experts,
        transfer="synchronous",
        prefetch_distance=1,
        policy_options=policy_options(policy, hf_dir),
    )
    if base is None:
        serving = fj.load_model(hf_dir, offload=offload)
    else:
        serving = served(base, offload)
    with serving as model:
        outs = [
            fj.generate(model, batch, max_new_tokens=5, record_trace=True, record_hidden=True)
            for batch in BATCHES
        ]
        engine = model.engine
        live = engine.cache.book.stats
        weights = router_weights(engine.module)
        preset = ModelPreset.from_config(model.config)
    sim = simulate(
        [out.trace for out in outs],
        offload,
        model=preset,
        hardware=HARDWARE["h100_sxm"],
        router_weights=weights,
    )
    return outs, live, sim


def with_early_eos(hf_dir: Path, out: Path) -> Path:
    """A copy of the model whose EOS is a token that one row of the first batch, and no other row of it,
    generates at a later step: that row finishes early and its decode rows go invalid, as in serving."""
    with fj.load_model(hf_dir, offload=OffloadConfig(policy="resident")) as model:
        tokens = fj.generate(model, BATCHES[0], max_new_tokens=5, stop_at_eos=False).tokens
    for row, generated in enumerate(tokens):
        others = {t for r, g in enumerate(tokens) if r != row for t in g}
        for step in range(1, len(generated) - 1):
            eos = generated[step]
            if eos not in others and eos not in generated[:step]:
                shutil.copytree(hf_dir, out)
                (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
                return out
    raise AssertionError(f"no generated token stops exactly one row early ({tokens}); change BATCHES")


# Top-2 of 4; Qwen1.5's dense layer and shared expert; DeepSeek's dense first layer and top-6 of 16. (Qwen3's
# tiny model is left out: its quarter budget is exactly top-8, where fmoe admits no prefetch to compare.)
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2_lite"])  # top-2 of 4; dense + shared experts
def test_replay_counts_equal_live_engine_for_every_policy(family, hf_dirs, tmp_path):
    hf_dir = with_early_eos(hf_dirs[family], tmp_path / family)
    base = fj.load_model(hf_dir, offload=OffloadConfig(cache_experts=1))  # weights and programs for every run
    base.close()
    cfg = base.config
    total = cfg.num_moe_layers * cfg.num_experts
    budgets = {"one_slot": 1, "top_k": cfg.top_k, "quarter": None, "half": total // 2}
    for policy, policy_cls in POLICIES.items():
        some_hits = False
        for budget, slots in budgets.items():
            if policy_cls.preload_all and budget != "quarter":
                continue  # the budget does not apply
            outs, live, sim = live_and_replayed(hf_dir, policy, slots, base)
            where = f"{family} {policy} {budget}"
            lengths = {len(r.iterations) for r in outs[0].trace.requests}
            assert len(lengths) > 1, f"{where}: no row finished early ({lengths})"
            assert sim.hits == live.hits == sum(o.stats.hits for o in outs), where
            assert sim.misses == live.misses == sum(o.stats.misses for o in outs), where
            layers = range(cfg.num_moe_layers)
            assert sim.layer_hits == [live.layer_hits.get(m, 0) for m in layers], where
            assert sim.layer_needed == [live.layer_needed.get(m, 0) for m in layers], where
            assert sim.prefetches == live.prefetches, where
            assert sim.wasted_prefetches == live.wasted_prefetches, where
            assert sim.bytes_to_device // sim.expert_bytes == live.loads, where
            assert sim.late_prefetches == 0, where  # synchronous: every copy lands as it is issued
            if policy == "fmoe" and budget == "quarter":
                assert sim.prefetches > 0, where  # the comparison covers prefetching, not only misses
            some_hits |= sim.hits > 0 and (sim.misses > 0 or policy_cls.preload_all)
        assert some_hits, f"{family} {policy}: no budget with both hits and misses; the test compares little"


class Recorder(Policy):
    """Logs every event with copies of what it was given."""

    name = "recorder"
    needs_semantic = True
    needs_probs = True

    def __init__(self):
        self.events = []

    def on_request_start(self, event):
        self.events.append(("request", event.batch))

    def on_iteration_start(self, event):
        self.events.append(("iteration", event.embeds.copy(), event.valid.copy()))

    def on_layer_routed(self, event):
        self.events.append(("layer", event.layer, event.probs.copy(), event.ids.copy(), event.valid.copy()))

    def on_iteration_end(self):
        self.events.append(("end",))


def hand_trace(meta_extra=None) -> RoutingTrace:
    """Two requests of one batch: prompts of 3 and 1 tokens; request 1 finishes after one decode step.
    L=2 MoE layers, J=4 experts, top-1; embeddings of width 2 hold (request, iteration)."""

    def it(request, index, tokens, experts):
        ids = np.asarray(experts, np.int32).reshape(tokens, 2, 1)
        probs = np.zeros((tokens, 2, 4), np.float32)
        np.put_along_axis(probs, ids, 1.0, axis=-1)
        embeds = np.tile(np.asarray([request + 1, index + 1], np.float32), (tokens, 1))
        return Iteration(ids=ids, probs=probs, embeds=embeds)

    r0 = RequestTrace(
        [1, 2, 3], [it(0, 0, 3, [[0, 1], [0, 1], [2, 3]]), it(0, 1, 1, [1, 2]), it(0, 2, 1, [3, 3])]
    )
    r1 = RequestTrace([4], [it(1, 0, 1, [1, 1]), it(1, 1, 1, [2, 0])])
    meta = dict(num_layers=2, num_experts=4, top_k=1, embed_dim=2, **(meta_extra or {}))
    return RoutingTrace(meta, [r0, r1])


def test_replay_lays_out_iterations_like_the_engine():
    policy = Recorder()
    simulate(
        hand_trace(),
        OffloadConfig(policy=policy, cache_experts=2),
        model=MIXTRAL_8X7B,
        hardware=HARDWARE["rtx_3090"],
    )
    kinds = [e[0] for e in policy.events]
    assert kinds == ["request"] + ["iteration", "layer", "layer", "end"] * 3
    assert policy.events[0] == ("request", 2)
    iterations = [e for e in policy.events if e[0] == "iteration"]
    layers = [e for e in policy.events if e[0] == "layer"]
    # Prefill: T = 3, request 1 left padded by two invalid (zero) rows.
    _, embeds, valid = iterations[0]
    np.testing.assert_array_equal(valid, [[True, True, True], [False, False, True]])
    np.testing.assert_array_equal(embeds, [[1, 1], [1, 1], [1, 1], [0, 0], [0, 0], [2, 1]])
    _, layer, probs, ids, _ = layers[1]
    assert layer == 1
    np.testing.assert_array_equal(ids[:, 0], [1, 1, 3, 0, 0, 1])
    np.testing.assert_array_equal(probs.argmax(-1), [1, 1, 3, 0, 0, 1])
    assert probs[3:5].sum() == 0
    # Decode step 1: both rows; step 2: request 1 has finished, its row is invalid and zero.
    np.testing.assert_array_equal(iterations[1][2], [[True], [True]])
    _, embeds, valid = iterations[2]
    np.testing.assert_array_equal(valid, [[True], [False]])
    np.testing.assert_array_equal(embeds, [[1, 3], [0, 0]])
    np.testing.assert_array_equal(layers[4][3][:, 0], [3, 0])


# -- cost model ----------------------------------------------------------------------------------------
# On the round-number TOY_HARDWARE and TOY_MODEL of tests/toy_costs.py, whose sizes it works out.


def test_toy_sizes():
    assert TOY_MODEL.expert_bytes == 300_000
    assert TOY_MODEL.kv_bytes_per_token == 200
    costs = CostModel(TOY_MODEL, TOY_HARDWARE, num_experts=2)
    assert costs.attention_s(np.asarray([1]), np.asarray([0])) == pytest.approx(40_600e-9, rel=1e-12)
    assert costs.attention_s(np.asarray([1]), np.asarray([1])) == pytest.approx(40_800e-9, rel=1e-12)
    assert costs.experts_s([1]) == pytest.approx(300e-6, rel=1e-12)
    assert costs.head_s(1) == pytest.approx(200e-6, rel=1e-12)
    assert costs.shared_s(1) == 0.0


def test_on_demand_stall_and_bytes_by_hand():
    r = simulate(
        toy_trace(),
        OffloadConfig(policy="on_demand_lru", cache_experts=2),
        model=TOY_MODEL,
        hardware=TOY_HARDWARE,
    )
    # Prefill: per layer attention 40.6 us, a miss (300 us on the idle link), the expert 300 us; head 200.
    # Decode: attention 40.8 us (one cached token more), two hits, head 200 us.
    assert (r.hits, r.misses, r.bytes_to_device) == (2, 2, 600_000)
    assert r.stall_s == pytest.approx(600e-6, rel=1e-9)
    assert r.ttft_s == [pytest.approx((2 * 40.6 + 2 * 300 + 2 * 300 + 200) * 1e-6, rel=1e-9)]
    assert r.tpot_s == [pytest.approx((2 * 40.8 + 2 * 300 + 200) * 1e-6, rel=1e-9)]
    assert r.total_s == pytest.approx(r.compute_s + r.stall_s, rel=1e-12)
    assert r.total_s == pytest.approx(r.ttft_s[0] + r.tpot_s[0], rel=1e-9)
    assert r.link_busy_s == pytest.approx(600e-6, rel=1e-9)


class NextLayer(Policy):
    """Prefetches each layer's expert (known in advance) one layer ahead: overlap by hand."""

    name = "next_layer"

    def __init__(self, plan: dict[int, int]):
        self.plan = plan  # layer -> expert

    def on_iteration_start(self, event):
        self.cache.request_prefetch([((0, self.plan[0]), 1.0)])

    def on_layer_routed(self, event):
        if event.layer + 1 in self.plan:
            self.cache.request_prefetch([((event.layer + 1, self.plan[event.layer + 1]), 1.0)])


def test_prefetch_overlaps_compute_by_hand():
    r = simulate(
        toy_trace(),
        OffloadConfig(policy=NextLayer({0: 0, 1: 1}), cache_experts=2),
        model=TOY_MODEL,
        hardware=TOY_HARDWARE,
    )
    # Prefill. t=0: prefetch (0,0) on the link until 300. Attention to 40.6; layer 0 routed: prefetch (1,1)
    # queues behind it (300 -> 600). Layer 0's expert is still arriving: a late prefetch, stall 259.4 to 300.
    # Expert 0 computes to 600, (1,1) has landed; attention to 640.6: a hit; expert to 940.6; head to 1140.6.
    # Decode: the experts are cached (prefetches of cached experts are skipped): two hits.
    assert (r.hits, r.misses, r.late_prefetches, r.prefetches) == (3, 1, 1, 2)
    assert r.stall_s == pytest.approx(259.4e-6, rel=1e-9)
    assert r.ttft_s == [pytest.approx(1140.6e-6, rel=1e-9)]


def test_simulated_link_serves_prefetches_in_order_and_counts_stall():
    link = SimulatedLink(expert_bytes=300, bytes_per_s=1000.0)  # 0.3 s per copy, 3 chunks of 0.1 s
    a, b = link.start((0, 0)), link.start((0, 1))  # prefetches: back to back
    link.compute(0.35)
    assert link.is_ready(a) and not link.is_ready(b)
    assert a.done_s == pytest.approx(0.3) and b.done_s == math.inf  # b's last chunk has not started
    link.wait([a, b])
    assert b.done_s == pytest.approx(0.6)
    assert link.clock == pytest.approx(0.6) and link.stall_s == pytest.approx(0.25)
    c = link.start((0, 2))  # the link is idle: starts now
    link.wait([c])
    assert c.done_s == pytest.approx(0.9) and link.busy_s == pytest.approx(0.9)


def test_each_chunk_of_a_copy_pays_the_links_fixed_cost():
    """What the H200 showed (`benchmarks/link_compute.py`): a copy costs a fixed time beside its bytes, and
    an expert sent one matrix at a time pays it once per matrix."""
    whole = SimulatedLink(expert_bytes=300, bytes_per_s=1000.0, chunks=1, chunk_latency_s=0.05)
    chunked = SimulatedLink(expert_bytes=300, bytes_per_s=1000.0, chunks=3, chunk_latency_s=0.05)
    for link, expected in ((whole, 0.35), (chunked, 0.45)):
        copy = link.start((0, 0), urgent=True)
        link.wait([copy])
        assert copy.done_s == pytest.approx(expected) and link.copy_s == pytest.approx(expected)
    hardware = dataclasses.replace(HARDWARE["rtx_3090"], copy_latency_s=1e-3)
    assert hardware.copy_s(1e9, chunks=3) == pytest.approx(3e-3 + 1e9 / hardware.link_effective)
    with pytest.raises(ValueError, match="copy_latency_s"):
        dataclasses.replace(hardware, copy_latency_s=-1.0)


def test_the_simulator_copies_whole_experts_where_chunks_would_mostly_pay_fixed_costs():
    """`simulate(chunks=None)` asks the preset (`HardwarePreset.copy_chunks`): one chunk per matrix where a
    matrix's bytes take at least 10 per-copy fixed costs (none on the RTX 3090 preset), whole otherwise (the
    Hopper presets, even at Mixtral-8x7B's 117 MB matrices: 2.3 ms against 0.29). The policy's copy time
    hint counts the chunks chosen."""
    rtx, h100 = HARDWARE["rtx_3090"], HARDWARE["h100_sxm"]
    assert [rtx.copy_chunks(m.expert_bytes) for m in MODELS.values()] == [3] * len(MODELS)
    assert [h100.copy_chunks(m.expert_bytes) for m in MODELS.values()] == [1] * len(MODELS)
    matrix_s = 10 * h100.copy_latency_s  # a matrix at the threshold
    assert h100.copy_chunks(1.01 * 3 * matrix_s * h100.link_effective) == 3
    assert h100.copy_chunks(0.99 * 3 * matrix_s * h100.link_effective) == 1
    fmoe = OffloadConfig(policy="fmoe", policy_options={"asynchronous": False})
    for hardware, chunks in ((rtx, 3), (h100, 1)):
        chosen = simulate(hand_trace(), fmoe, model=MIXTRAL_8X7B, hardware=hardware)
        copy_s = hardware.copy_s(MIXTRAL_8X7B.expert_bytes, chunks)
        assert chosen.extra["copy_ms"] == pytest.approx(1e3 * copy_s)
        given = simulate(hand_trace(), fmoe, model=MIXTRAL_8X7B, hardware=hardware, chunks=chunks)
        assert given.median_tpot_s == chosen.median_tpot_s
    with pytest.raises(ValueError, match="at least one chunk"):
        simulate(hand_trace(), model=MIXTRAL_8X7B, hardware=h100, chunks=0)


def test_decode_kernels_fixed_costs_add_to_the_roofline():
    """Batch-1 decode on Hopper costs a fixed time per expert and per attention block beside the bytes."""
    ideal = dataclasses.replace(HARDWARE["h100_sxm"], expert_kernel_s=0.0, attention_kernel_s=0.0)
    fixed = dataclasses.replace(ideal, expert_kernel_s=30e-6, attention_kernel_s=65e-6)
    base, real = CostModel(QWEN15_MOE_A27B, ideal, 60), CostModel(QWEN15_MOE_A27B, fixed, 60)
    one = np.ones(1)
    assert real.experts_s([1] * 4) - base.experts_s([1] * 4) == pytest.approx(4 * 30e-6)
    assert real.shared_s(1) - base.shared_s(1) == pytest.approx(30e-6)
    assert real.attention_s(one, one) - base.attention_s(one, one) == pytest.approx(65e-6)
    # Measured on an H200: a Qwen1.5-MoE layer's routed experts took 0.23 ms, its roofline 0.03 ms.
    measured = HARDWARE["h100_sxm"]
    assert measured.expert_kernel_s > 0 and measured.copy_latency_s > 0
    assert CostModel(QWEN15_MOE_A27B, measured, 60).experts_s([1] * 4) > 3 * base.experts_s([1] * 4)


def test_on_demand_load_waits_behind_one_chunk_and_prefetches_cancel_between_chunks():
    link = SimulatedLink(expert_bytes=300, bytes_per_s=1000.0, finish_started=False)  # 3 chunks of 0.1 s
    first, second = link.start((1, 0)), link.start((1, 1))  # two prefetches queue (0.6 s of link)
    link.compute(0.05)  # the first prefetch's first chunk is under way
    miss = link.start((0, 3), urgent=True)
    link.wait([miss])
    # It waited for the chunk under way (to 0.1), then took the link: 0.1 + 0.3.
    assert miss.done_s == pytest.approx(0.4) and link.stall_s == pytest.approx(0.35)
    assert link.cancel(second) == pytest.approx(1.0)  # not started: nothing of it was sent
    link.compute(0.05)  # t = 0.45: the first prefetch resumed at 0.4, its second chunk is under way
    assert link.cancel(first) == pytest.approx(1 / 3)  # stops before its last chunk
    link.compute(1.0)
    assert link.busy_s == pytest.approx(0.1 + 0.3 + 0.1)  # two chunks of the first, the whole miss
    assert link.cancel(miss) is None  # done: nothing to cancel


def test_a_started_prefetch_lands_by_default_and_only_unstarted_ones_cancel():
    link = SimulatedLink(expert_bytes=300, bytes_per_s=1000.0)  # 3 chunks of 0.1 s
    first, second = link.start((1, 0)), link.start((1, 1))
    link.compute(0.15)  # the first prefetch's second chunk is under way, the second's not begun
    assert link.cancel(first) is None and link.cancel(second) == pytest.approx(1.0)
    link.compute(1.0)
    assert link.is_ready(first) and first.done_s == pytest.approx(0.3) and link.busy_s == pytest.approx(0.3)


def random_trace(seed: int, requests: int = 1, decode: int = 40, layers: int = 4, experts: int = 8):
    """Top-2 routing with a skew towards low expert ids; a one-token prompt per request."""
    rng = np.random.default_rng(seed)
    weights = np.linspace(2.0, 1.0, experts)
    data = []
    for _ in range(requests):
        iterations = []
        for _ in range(decode + 1):
            ids = np.stack(
                [rng.choice(experts, 2, replace=False, p=weights / weights.sum()) for _ in range(layers)]
            )
            iterations.append({"ids": ids[None]})  # [t=1, L, 2]
        data.append(iterations)
    return RoutingTrace.from_external(data, num_experts=experts)


def test_faster_link_stalls_less_with_the_same_hits():
    trace = random_trace(0, requests=2)
    results = {}
    for gbps in (10, 50):
        hardware = dataclasses.replace(HARDWARE["h100_sxm"], link_bytes_per_s=gbps * 1e9)
        results[gbps] = simulate(
            trace,
            OffloadConfig(policy="on_demand_lru", cache_experts=8),
            model=MIXTRAL_8X7B,
            hardware=hardware,
        )
    slow, fast = results[10], results[50]
    assert (slow.hits, slow.misses) == (fast.hits, fast.misses)
    assert slow.misses > 0
    assert fast.stall_s < slow.stall_s
    assert fast.mean_tpot_s < slow.mean_tpot_s and fast.mean_ttft_s < slow.mean_ttft_s


def test_bigger_cache_never_loses_lru_hits():
    trace = random_trace(1)
    hits = [
        simulate(
            trace,
            OffloadConfig(policy="on_demand_lru", cache_experts=c),
            model=PHI35_MOE,
            hardware=HARDWARE["a100_sxm"],
        ).hits
        for c in range(2, 33)
    ]
    assert all(a <= b for a, b in zip(hits, hits[1:], strict=False)), hits
    assert hits[0] < hits[-1]
    # Everything fits (32 experts): each is copied once, on its first use or filled in before it.
    full = simulate(
        trace,
        OffloadConfig(policy="on_demand_lru", cache_experts=32),
        model=PHI35_MOE,
        hardware=HARDWARE["a100_sxm"],
    )
    assert full.bytes_to_device == 32 * PHI35_MOE.expert_bytes and full.prefetches > 0
    assert full.hits + full.misses == 41 * 4 * 2


def test_cache_bytes_budget_uses_the_preset_expert_size():
    r = simulate(
        random_trace(2, decode=3),
        OffloadConfig(cache_bytes=3 * MIXTRAL_8X7B.expert_bytes + 1),
        model=MIXTRAL_8X7B,
        hardware=HARDWARE["h100_sxm"],
    )
    assert r.capacity == 3
    assert r.device_bytes == 3 * MIXTRAL_8X7B.expert_bytes + MIXTRAL_8X7B.resident_bytes(4, 8)
    assert r.fits_device


# -- presets and errors --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "preset, published",
    [
        (MIXTRAL_8X7B, 46.7e9),
        (QWEN15_MOE_A27B, 14.3e9),
        (PHI35_MOE, 41.9e9),
        (QWEN3_30B_A3B, 30.5e9),
        (OLMOE_1B_7B, 6.9e9),
        (DEEPSEEK_V2_LITE, 15.7e9),
        (PRESETS["gpt-oss-20b"], 20.9e9),
        (PRESETS["gpt-oss-120b"], 116.8e9),
        (PRESETS["DeepSeek-V3"], 671e9),
        (PRESETS["Kimi-K2"], 1.026e12),
        (QWEN3_NEXT_80B_A3B, 80e9),
        (QWEN35_122B_A10B, 122e9),
    ],  # model cards
)
def test_model_presets_match_published_parameter_counts(preset, published):
    np.testing.assert_allclose(preset.total_params, published, rtol=0.005)


@pytest.mark.parametrize("name, published", [("GLM-4.5-Air", 106e9), ("GLM-4.5", 355e9)])
def test_glm_presets_match_their_rounded_parameter_counts(name, published):
    """GLM-4.5's cards give whole billions (and may count the multi-token-prediction layer): within 1 %."""
    np.testing.assert_allclose(PRESETS[name].total_params, published, rtol=0.01)


def test_gpt_oss_experts_are_charged_at_mxfp4():
    """4.25 bits per weight (e2m1 values, one e8m0 scale per 32) plus the bf16 biases that travel along."""
    d = f = 2880
    for name in ("gpt-oss-20b", "gpt-oss-120b"):
        assert PRESETS[name].expert_bytes == 3 * d * f * 17 // 32 + (2 * f + d) * 2


def test_presets_are_registered_and_sane():
    assert MIXTRAL_8X7B.expert_bytes == 3 * 4096 * 14336 * 2
    assert set(MODELS) == {
        *("mixtral", "qwen2_moe", "phimoe", "qwen3_moe", "olmoe", "deepseek_v2"),
        *("gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe"),
    }
    assert set(MODELS.values()) <= set(PRESETS.values())
    # DeepSeek-V2-Lite's latent cache: 512 + 64 numbers per token and layer, not 16 heads x (192 + 128).
    assert DEEPSEEK_V2_LITE.kv_bytes_per_token == (512 + 64) * 2
    for name, hardware in HARDWARE.items():
        if name != "cpu_2core_vm":  # a PCIe link; the CPU preset's is a memcpy (benchmarks/engine_costs.py)
            assert 20e9 < hardware.link_effective < hardware.link_bytes_per_s < 70e9
            assert hardware.launch_s == hardware.sync_s == hardware.layer_host_s == 0  # replays as before
    assert HARDWARE["h100_sxm"].link_effective > 2 * HARDWARE["a100_sxm"].link_effective  # Gen5 vs Gen4


def test_hybrid_presets_charge_the_linear_layers_state():
    """Qwen3.5-35B-A3B's text model has 34.7 B parameters (the model card's 35 B counts its vision tower). Its
    linear layers (30 of 40) read and write a 2 MiB float32 state per sequence at every step instead of a
    KV cache that grows: a decode layer costs the kinds' times weighted by their shares, and a second row
    adds its state's traffic to the linear layers only."""
    np.testing.assert_allclose(QWEN35_35B_A3B.total_params, 34.66e9, rtol=0.001)
    assert QWEN35_35B_A3B.linear_state_bytes == 32 * 128 * 128 * 4 + 3 * (2 * 16 * 128 + 32 * 128) * 2
    hardware = dataclasses.replace(HARDWARE["h100_sxm"], attention_kernel_s=0.0)
    costs = CostModel(QWEN35_35B_A3B, hardware, 256)
    one, long, short = np.array([1]), np.array([4096]), np.array([64])
    softmax, linear = costs.softmax_attention_s(one, long), costs.linear_attention_s(one)
    assert costs.attention_s(one, long) == pytest.approx(0.25 * softmax + 0.75 * linear)
    longer = costs.attention_s(one, long) - costs.attention_s(one, short)  # only the KV cache grows
    assert longer == pytest.approx(0.25 * (softmax - costs.softmax_attention_s(one, short))) and longer > 0
    second_row = costs.linear_attention_s(np.array([1, 1])) - linear
    state_read_and_written = 2 * QWEN35_35B_A3B.linear_state_bytes / (3.35e12 * hardware.hbm_efficiency)
    assert second_row == pytest.approx(state_read_and_written, rel=1e-6)


def test_replay_gives_policies_the_cost_model_hints():
    """The simulator tells a policy T (one expert over the link) and one decode layer's compute, which
    fmoe's admission uses; for Mixtral-8x7B over PCIe 4 a copy takes over ten layers."""
    hardware = HARDWARE["rtx_3090"]
    result = simulate(
        hand_trace(),
        OffloadConfig(policy="fmoe", policy_options={"asynchronous": False}),
        model=MIXTRAL_8X7B,
        hardware=hardware,
    )
    extra = result.extra
    assert extra["copy_ms"] == pytest.approx(1e3 * hardware.copy_s(MIXTRAL_8X7B.expert_bytes, chunks=3))
    assert 10 < extra["copy_ms"] / extra["layer_ms"] < 30


def test_a_slow_matcher_requests_its_prefetches_later_and_a_stalled_one_none():
    """`simulate(matcher_s=...)`: fmoe's searches take simulated host time. A matcher slower than the whole
    replay finishes no search in it (no prefetch), and `pay_for_matching` sees it cannot pay for one; a
    free matcher is the default's replay exactly. (A trace without embeddings: semantic=False.)"""
    trace = random_trace(3)

    def run(matcher_s=None, **options):
        offload = OffloadConfig(
            policy="fmoe",
            policy_options={"asynchronous": False, "semantic": False, "admission": "all", **options},
            cache_experts=8,
            prefetch_distance=1,
        )
        kwargs = {} if matcher_s is None else {"matcher_s": matcher_s}
        return simulate(trace, offload, model=MIXTRAL_8X7B, hardware=HARDWARE["h100_sxm"], **kwargs)

    free, default = run(0.0), run()
    assert (free.tpot_s, free.hits, free.prefetches) == (default.tpot_s, default.hits, default.prefetches)
    assert free.prefetches > 0 and free.extra["trajectory_matches"] > 0
    stalled = run(1e6, pay_for_matching=False)
    assert stalled.prefetches == 0 and "unpaid_trajectory" not in stalled.extra
    assert run(1e6).extra["unpaid_trajectory"] > 0
    with pytest.raises(ValueError, match="matcher_s must be >= 0"):
        run(-1.0)


def test_a_priced_bookkeeping_makes_fmoe_rest_and_charges_only_what_it_does():
    """`simulate(bookkeeping_s=...)`: fmoe's budget prices its decode iterations' bookkeeping, as live. Dearer
    than the copies its credit can hold, fmoe rests through every iteration and serves as LRU (the same hits,
    no prefetch, no charge); at price 0 it never rests, and the replay is the default's exactly; paid every
    iteration (`pay_for_matching` off), each of a decode iteration's layers is charged its price."""
    trace = random_trace(3)
    hardware, layers = HARDWARE["h100_sxm"], 4

    def run(policy="fmoe", **kw):
        options = {"asynchronous": False, "semantic": False, "admission": "all", **kw.pop("options", {})}
        offload = OffloadConfig(policy=policy, policy_options=options if policy == "fmoe" else {})
        offload = dataclasses.replace(offload, cache_experts=8, prefetch_distance=1)
        return simulate(trace, offload, model=MIXTRAL_8X7B, hardware=hardware, **kw)

    default, free, lru = run(), run(bookkeeping_s=0.0), run("on_demand_lru")
    assert (free.tpot_s, free.hits, free.prefetches) == (default.tpot_s, default.hits, default.prefetches)
    assert "unpaid_bookkeeping" not in free.extra and default.prefetches > 0
    copy_s = hardware.copy_s(MIXTRAL_8X7B.expert_bytes, 1)
    rested = run(bookkeeping_s=10 * copy_s)  # a layer's price above its top-2 copies: never covered
    assert rested.extra["unpaid_bookkeeping"] == 41  # every iteration: the one-token prompt, 40 decode steps
    assert rested.hits == lru.hits and rested.prefetches == 0
    assert rested.tpot_s == pytest.approx(lru.tpot_s)
    price = 1.0  # seconds per layer, far above the rest of a decode iteration
    paid = run(bookkeeping_s=price, options={"pay_for_matching": False})
    assert "unpaid_bookkeeping" not in paid.extra
    assert min(paid.tpot_s) >= layers * price > max(default.tpot_s)
    with pytest.raises(ValueError, match="bookkeeping_s must be >= 0"):
        run(bookkeeping_s=-1.0)


def test_fmoe_learns_offline_from_routing_recorded_elsewhere():
    """Routing without embeddings (`from_external`, top-k ids only): `FMoE.from_traces` builds its store of
    trajectories and its popularity profile from it, and replays each request after the others with
    trajectory matching alone, its searches guiding the layers ahead."""
    traces = [random_trace(seed, requests=1) for seed in range(4)]
    store = store_from_traces(traces, capacity=200, prefetch_distance=1)
    assert len(store) == 4 * 41 and store.embed_dim == 1  # 4 requests of 41 iterations, one token each
    policy = FMoE.from_traces(
        traces[1:], prefetch_distance=1, store_capacity=200, semantic=False, asynchronous=False
    )
    result = simulate(
        traces[0],
        OffloadConfig(policy=policy, cache_experts=8, prefetch_distance=1),
        model=MIXTRAL_8X7B,
        hardware=HARDWARE["h100_sxm"],
    )
    assert result.extra["trajectory_matches"] > 0 and result.extra["store_size"] >= 3 * 41
    assert result.hits + result.misses == 41 * 4 * 2  # 41 iterations x 4 layers x top 2
    with pytest.raises(ValueError, match="has no embeddings, though the trace's embed_dim is 3"):
        store_from_traces(
            [dataclasses.replace(traces[0], meta={**traces[0].meta, "embed_dim": 3})],
            capacity=8,
            prefetch_distance=1,
        )


def test_offline_store_links_each_map_to_what_followed_it():
    """`store_from_traces(followers=1)`: the reuse hint of a stored map is the map that followed it in its
    request; the request's last map has no follower, and without `followers` no map has one."""
    trace = random_trace(0, requests=1)
    maps = np.concatenate([it.probs for it in trace.requests[0].iterations])  # [T, L, J]
    store = store_from_traces([trace], capacity=200, prefetch_distance=1, followers=1)
    np.testing.assert_allclose(store.future_of(maps[3:4]), maps[4:5], rtol=1e-6, atol=1e-7)
    assert store.future_of(maps[-1:]).any()  # its nearest map with a follower answers
    plain = store_from_traces([trace], capacity=200, prefetch_distance=1)
    assert not plain.future_of(maps[3:4]).any()


def test_actionable_errors():
    trace = hand_trace()
    with pytest.raises(ValueError, match="asynchronous.: False"):
        simulate(trace, OffloadConfig(policy="fmoe"), model=MIXTRAL_8X7B, hardware=HARDWARE["h100_sxm"])

    class Speculative(Policy):
        name = "speculative"
        needs_hidden = True

    with pytest.raises(ValueError, match="needs each MoE layer's router weights"):
        simulate(
            trace, OffloadConfig(policy=Speculative()), model=MIXTRAL_8X7B, hardware=HARDWARE["h100_sxm"]
        )
    weights = [np.zeros((2, 4), np.float32)] * 2
    with pytest.raises(ValueError, match="trace 0 request 0 iteration 0 has no 'hidden'"):
        simulate(
            trace,
            OffloadConfig(policy=Speculative()),
            model=MIXTRAL_8X7B,
            hardware=HARDWARE["h100_sxm"],
            router_weights=weights,
        )
    external = RoutingTrace.from_external([[{"ids": np.zeros((1, 2, 1), np.int32)}]], num_experts=4)
    with pytest.raises(ValueError, match="needs semantic embeddings.*'semantic': False"):
        simulate(
            external,
            OffloadConfig(policy="fmoe", policy_options={"asynchronous": False}),
            model=MIXTRAL_8X7B,
            hardware=HARDWARE["h100_sxm"],
        )
    with pytest.raises(ValueError, match="replay traces of one model together"):
        simulate([trace, random_trace(0)], model=MIXTRAL_8X7B, hardware=HARDWARE["h100_sxm"])
    with pytest.raises(ValueError, match="one device behind one host link"):
        simulate(trace, OffloadConfig(devices=2), model=MIXTRAL_8X7B, hardware=HARDWARE["h100_sxm"])
    with pytest.raises(ValueError, match="must be in"):
        dataclasses.replace(HARDWARE["h100_sxm"], link_efficiency=1.5)


def _token_routing(rng: np.random.Generator, requests: int, steps: int, tokens: bool):
    """One-row requests over 4 layers of 8 experts, top-2, whose fed tokens cycle through a request's own
    four, each token routed the same way every time it is fed (its experts drawn once)."""
    vocab = {t: np.argsort(rng.random((1, 4, 8)), -1)[..., :2] for t in range(16)}
    routed = []
    for _ in range(requests):
        own = rng.choice(16, 4, replace=False)
        cycle = [int(own[s % 4]) for s in range(steps)]
        routed.append([{"ids": vocab[t], **({"tokens": np.array([t])} if tokens else {})} for t in cycle])
    return [RoutingTrace.from_external([r], num_experts=8) for r in routed]


def test_fmoe_reads_the_tokens_fed_where_a_trace_has_them():
    """fmoe's token contexts learn from the store traces' tokens and the replayed ones': a token that
    foretells the next tokens' experts makes more hits; switched off, or on a trace without tokens, the
    tokens are not read (the same outcome as a trace without them)."""
    rng = np.random.default_rng(0)
    store = _token_routing(rng, 6, 24, tokens=True)
    replay_rng = np.random.default_rng(1)
    with_tokens = _token_routing(replay_rng, 4, 24, tokens=True)
    without = _token_routing(np.random.default_rng(1), 4, 24, tokens=False)

    def run(traces, **options):
        policy = FMoE.from_traces(store, prefetch_distance=1, store_capacity=64, semantic=False, **options)
        offload = OffloadConfig(policy=policy, cache_experts=12, prefetch_distance=1)
        result = simulate(traces, offload, model=TOY_MODEL, hardware=TOY_HARDWARE)
        return result, policy

    on, policy = run(with_tokens, asynchronous=False)
    assert policy.needs_tokens and len(policy.token_contexts) > 0
    off, quiet = run(with_tokens, asynchronous=False, token_contexts=False)
    assert not quiet.needs_tokens and quiet.token_contexts is None
    blind, _ = run(without, asynchronous=False)
    assert (off.median_tpot_s, off.hit_rate) == (blind.median_tpot_s, blind.hit_rate)
    assert on.hit_rate > off.hit_rate + 0.01, (on.hit_rate, off.hit_rate)
