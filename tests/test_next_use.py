"""The reuse forecast learned offline (`offload/policies/fmoe/next_use.py`, `FMoEOptions.learned_reuse`)."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import skewed_routing
from fmoe_jax.offload.policies.fmoe.next_use import (
    LearnedReuseForecast,
    fit_next_use,
    request_features,
    reused_within,
)


def sticky_requests(count: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Requests `[T, 2, 6]` that keep using three experts of their own per layer and pass by the others."""
    out = []
    for _ in range(count):
        own = rng.random((2, 6)) < 0.5
        out.append(np.where(own, rng.random((steps, 2, 6)) < 0.8, rng.random((steps, 2, 6)) < 0.05))
    return out


def test_online_features_are_the_offline_ones():
    """The forecast's scores, kept up iteration by iteration, are the heads applied to the features the fit
    computes for the whole request at once: training and serving see the same numbers."""
    rng = np.random.default_rng(0)
    requests = sticky_requests(4, 50, rng)
    popularity = rng.standard_normal((2, 6))
    weights = fit_next_use(requests, popularity, horizon=2)
    used = requests[0]
    heads = 1.0 / (1.0 + np.exp(-(request_features(used, popularity) @ weights)))  # [T, L, J, 3]
    forecast = LearnedReuseForecast(2, 6, weights, popularity, horizon=2)
    for t in range(used.shape[0]):
        forecast.begin_iteration()
        np.testing.assert_allclose(forecast.scores, heads[t, ..., 0], rtol=1e-5, atol=1e-6)
        forecast.mark_used(1, np.flatnonzero(used[t, 1]))
        want = np.where(used[t, 1], heads[t, 1, :, 1], heads[t, 1, :, 2])
        np.testing.assert_allclose(forecast.scores[1], want, rtol=1e-5, atol=1e-6)
        forecast.end_iteration(used[t])


def test_the_fit_ranks_a_requests_own_experts_above_passing_ones():
    rng = np.random.default_rng(1)
    weights = fit_next_use(sticky_requests(20, 40, rng), np.zeros((2, 6)), horizon=2)
    used = sticky_requests(1, 40, rng)[0]
    forecast = LearnedReuseForecast(2, 6, weights, np.zeros((2, 6)), horizon=2)
    scores, outcomes = [], reused_within(used, 2)
    for t in range(used.shape[0] - 2):
        forecast.begin_iteration()
        scores.append(forecast.scores.copy())
        forecast.end_iteration(used[t])
    scores = np.array(scores[10:])  # once the request has shown its experts
    reused = outcomes[10:]
    assert scores[reused].mean() > 0.7 > 0.3 > scores[~reused].mean()


def test_reused_within_looks_at_the_iterations_after_each_one():
    used = np.array([1, 0, 0, 1, 0], bool)[:, None, None]
    np.testing.assert_array_equal(reused_within(used, 2)[:, 0, 0], [False, True, True])


def test_bad_inputs_are_refused_with_their_values():
    from fmoe_jax.offload.policies.fmoe import FMoEOptions

    with pytest.raises(ValueError, match="longer than the reuse horizon"):
        fit_next_use([np.zeros((2, 1, 4), bool)], np.zeros((1, 4)), horizon=2)
    with pytest.raises(ValueError, match="expected"):
        LearnedReuseForecast(1, 4, np.zeros((3, 3)), np.zeros((1, 4)), horizon=2)
    with pytest.raises(ValueError, match="'lru'"):
        FMoEOptions(learned_reuse=True, eviction="lru")


def test_from_traces_fits_the_forecast_for_the_caches_horizon():
    """`FMoE.from_traces(learned_reuse=True)` fits at `bind`, for the horizon the cache's size gives, and a
    replay with it is served by the learned forecast (without traces: the online tables)."""
    from fmoe_jax.offload import OffloadConfig
    from fmoe_jax.offload.cost_model import MIXTRAL_8X7B, RTX_3090
    from fmoe_jax.offload.policies import FMoE
    from fmoe_jax.offload.simulator import simulate

    rng = np.random.default_rng(2)

    def trace(requests: int):
        return skewed_routing(rng, requests)

    options = dict(prefetch_distance=1, store_capacity=64, semantic=False, asynchronous=False)
    policy = FMoE.from_traces([trace(3)], learned_reuse=True, **options)
    replayed = trace(1)
    config = OffloadConfig(policy=policy, cache_experts=8)
    result = simulate(replayed, config, model=MIXTRAL_8X7B, hardware=RTX_3090)
    assert isinstance(policy.forecast, LearnedReuseForecast)
    assert policy.forecast.horizon == policy.reuse_horizon == 2
    assert result.hits + result.misses > 0
    plain = FMoE.from_traces([], learned_reuse=True, **options)
    simulate(replayed, OffloadConfig(policy=plain, cache_experts=8), model=MIXTRAL_8X7B, hardware=RTX_3090)
    assert not isinstance(plain.forecast, LearnedReuseForecast)


def test_counted_eviction_rows_lie_between_lru_and_belady():
    """`benchmarks.next_use_eviction`: Belady's misses are the fewest any rule can have, so every forecast's
    share of the LRU-to-Belady gap is at most 1, and LRU's and Belady's are 0 and 1 by definition."""
    from benchmarks.next_use_eviction import rows_for

    rng = np.random.default_rng(3)
    store, requests = sticky_requests(6, 30, rng), sticky_requests(2, 30, rng)
    rows = rows_for(store, requests, np.zeros((2, 6)), [0.5], top_k=2)
    closed = {r["rule"]: r["gap_closed"] for r in rows}
    assert closed["lru"] == 0.0 and closed["belady"] == 1.0
    assert {"table (h 3)", "learned h 1", "learned h 2", "learned h 4", "distance"} <= set(closed)
    assert max(closed.values()) <= 1.0
