"""The simulator's engine charges (`offload/engine_model.py`) and trace projection (`projection.py`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fmoe_jax.offload.config import OffloadConfig
from fmoe_jax.offload.cost_model import HARDWARE, MIXTRAL_8X7B
from fmoe_jax.offload.projection import project
from fmoe_jax.offload.simulator import simulate

from fmoe_jax.trace import RoutingTrace


def _trace(layers: int = 4, experts: int = 8, steps: int = 12, seed: int = 0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    data = [[{"ids": np.argsort(rng.random((1, layers, experts)), -1)[..., :2]} for _ in range(steps)]]
    return RoutingTrace.from_external(data, num_experts=experts)


def test_projection_maps_layers_in_runs_and_permutes_copies():
    trace = _trace(layers=4)
    out = project(trace, 10)
    assert out.meta["num_layers"] == 10 and out.meta["trace_layers"] == 4
    source = [m * 4 // 10 for m in range(10)]  # 0 0 0 1 1 2 2 2 3 3
    for it, new in zip(trace.requests[0].iterations, out.requests[0].iterations, strict=True):
        assert new.ids.shape == (1, 10, 2)
        for m, s in enumerate(source):
            first = source.index(s) == m
            if first:  # a trace layer's first copy is itself
                np.testing.assert_array_equal(new.ids[:, m], it.ids[:, s])
            # probabilities follow their experts: each chosen expert keeps its probability
            np.testing.assert_array_equal(
                np.take_along_axis(new.probs[:, m], new.ids[:, m], -1),
                np.take_along_axis(it.probs[:, s], it.ids[:, s], -1),
            )
    copies = np.stack([it.ids[:, 1] for it in out.requests[0].iterations])  # layer 1: copy 1 of layer 0
    firsts = np.stack([it.ids[:, 0] for it in out.requests[0].iterations])
    assert not np.array_equal(copies, firsts)


def test_simulate_projects_refuses_or_keeps_the_trace_layers():
    trace = _trace(layers=4)
    preset = dataclasses.replace(MIXTRAL_8X7B, num_layers=8)
    hardware = HARDWARE["h100_sxm"]
    own = simulate(trace, OffloadConfig(cache_experts=4), model=preset, hardware=hardware)
    whole = simulate(trace, OffloadConfig(cache_experts=8), model=preset, hardware=hardware, layers="project")
    assert len(own.layer_hits) == 4 and len(whole.layer_hits) == 8
    assert whole.mean_tpot_s > 1.5 * own.mean_tpot_s  # twice the layers at the same share of the experts
    with pytest.raises(ValueError, match="layers='project'"):
        simulate(trace, model=preset, hardware=hardware, layers="refuse")


def test_engine_costs_charge_launches_syncs_and_layers():
    """With engine costs, a step whose experts are all resident is one launch and one sync; a miss adds one
    of each; zero costs (the GPU presets, `without_engine`) keep the replay as it was."""
    trace = _trace(layers=4, steps=16)
    costly = dataclasses.replace(HARDWARE["h100_sxm"], launch_s=1e-3, sync_s=1e-4, layer_host_s=1e-5)
    preset = dataclasses.replace(MIXTRAL_8X7B, num_layers=4, num_experts=8)
    everything = OffloadConfig(cache_experts=32)
    warm = simulate(trace, everything, model=preset, hardware=costly, warmup=[trace])
    assert (warm.launches, warm.syncs) == (16, 16)  # one each per step: nothing missed
    plain = simulate(trace, everything, model=preset, hardware=costly.without_engine(), warmup=[trace])
    assert plain.launches == 0
    per_step = 1e-3 + 1e-4 + 4 * 1e-5
    np.testing.assert_allclose(warm.total_s - plain.total_s, 16 * per_step, rtol=1e-9)
    partial = simulate(trace, OffloadConfig(cache_experts=4), model=preset, hardware=costly)
    assert partial.launches == partial.syncs > 16  # relaunches after the layers that missed
    assert partial.launches <= 16 * (1 + 4)


def test_simulated_stops_reach_fmoe_as_the_presets_relaunch_price():
    """The simulator's engine tells the cache of each stop at the preset's relaunch price (launch and sync),
    as the live engine does, and fmoe prices its misses with it; without engine costs nothing is reported."""
    from fmoe_jax.offload.policies import FMoE

    trace = _trace(layers=4, steps=16)
    costly = dataclasses.replace(HARDWARE["h100_sxm"], launch_s=1e-3, sync_s=1e-4)
    preset = dataclasses.replace(MIXTRAL_8X7B, num_layers=4, num_experts=8)

    def run(hardware, **options):
        policy = FMoE(semantic=False, asynchronous=False, **options)
        offload = OffloadConfig(policy=policy, cache_experts=8)
        result = simulate(trace, offload, model=preset, hardware=hardware)
        return policy, result

    policy, result = run(costly, price_stops=True)
    cache = policy.cache
    assert cache.stops == result.launches - 16 > 0 and cache.stop_s == pytest.approx(1.1e-3)
    share = 1.1e-3 * cache.stops / cache.stats.misses
    assert result.extra["stop_share_ms"] == pytest.approx(1e3 * share)
    assert policy.admission.miss_s() == pytest.approx(policy.admission.copy_s + share)
    bare, _ = run(costly, price_stops=False)
    assert "stop_share_ms" not in bare.stats() and bare.admission.miss_s() == bare.admission.copy_s
    free, _ = run(costly.without_engine(), price_stops=True)
    assert free.cache.stops == 0 and free.admission.miss_s() == free.admission.copy_s


def test_stop_price_is_the_slope_through_the_median_step_at_each_stop_count():
    """The live stop price: 0 until two stop counts have `MIN_STEPS` steps, then the slope of the line
    through their medians (an outlier step moves no median), never below 0."""
    from fmoe_jax.engines.stop_price import MIN_STEPS, StopPrice

    price = StopPrice()
    for _ in range(MIN_STEPS):
        price.add(1, 0.017)
    assert price.seconds == 0.0  # one count alone fits no line
    for seconds in [0.024, 0.5] + [0.024] * (MIN_STEPS - 1):
        price.add(2, seconds)
    for _ in range(MIN_STEPS):
        price.add(0, 0.010)
    assert price.seconds == pytest.approx(7e-3)
    falling = StopPrice()
    for stops, seconds in [(0, 0.02), (1, 0.01)] * MIN_STEPS:
        falling.add(stops, seconds)
    assert falling.seconds == 0.0


def test_relaunch_fit_takes_the_median_round_and_checks_the_resident_step():
    """`engine_costs.relaunch_fit` on synthetic steps: a round slowed by load (a dearer launch) moves neither
    the median slope nor the intercept; a line whose step at one launch is far from the resident step (a
    loaded fit) is unresolved, as is the first round alone against the others."""
    from benchmarks.engine_costs import relaunch_fit

    def round_(fixed, per_launch, counts=(4, 8, 12, 16)):
        launches = [c for c in counts for _ in range(3)]
        return [fixed + per_launch * n + 1e-4 * (i % 3 - 1) for i, n in enumerate(launches)], launches

    clean = [round_(0.1, 0.008) for _ in range(4)]
    loaded = round_(0.05, 0.02)
    steps, launches = zip(*[loaded, *clean], strict=True)
    resident = [[0.108] * 5] * 5
    fit = relaunch_fit(list(steps), list(launches), resident)
    assert fit["per_launch_s"] == pytest.approx(0.008) and fit["step_fixed_s"] == pytest.approx(0.1)
    assert fit["resolved"] and fit["one_launch_s"] == pytest.approx(0.108)
    assert fit["single_pass"]["per_launch_s"] == pytest.approx(0.02)  # the loaded round alone: as before
    below = relaunch_fit([loaded[0]], [loaded[1]], [[0.108]])  # its line at one launch: 0.07 s
    assert not below["resolved"]
    with pytest.raises(ValueError, match="no round has two launch counts"):
        relaunch_fit([[0.1, 0.2]], [[4, 8]], resident)
