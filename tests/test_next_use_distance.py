"""Eviction by expected next-use distance (`distance.py`, `FMoEOptions.reuse_distance`)."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import skewed_routing
from fmoe_jax.offload.policies.fmoe.distance import CELLS, DistanceForecast, fit_counts, request_cells


def sticky_requests(count: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Requests `[T, 3, 6]` that keep using three experts of their own per layer and pass by the others."""
    out = []
    for _ in range(count):
        own = rng.random((3, 6)) < 0.5
        out.append(np.where(own, rng.random((steps, 3, 6)) < 0.8, rng.random((steps, 3, 6)) < 0.05))
    return out


def test_online_cells_are_the_offline_ones():
    """The chances the forecast keeps up layer by layer are the table's at the cells the offline fit computes
    for the whole request: before a layer routes this iteration's, after it the next iteration's."""
    rng = np.random.default_rng(0)
    counts = fit_counts(sticky_requests(4, 60, rng))
    used = sticky_requests(1, 60, rng)[0]
    offline = request_cells(np.concatenate([used, np.zeros((1, 3, 6), bool)]))  # [T + 1, L, J]
    forecast = DistanceForecast(3, 6, 2, counts)
    for t in range(used.shape[0]):
        forecast.begin_iteration()
        rate = forecast._rates()
        np.testing.assert_allclose(forecast.chance, rate[offline[t]])
        forecast.mark_used(1, np.flatnonzero(used[t, 1]))
        np.testing.assert_allclose(forecast.chance[1], rate[offline[t + 1, 1]])
        np.testing.assert_allclose(forecast.chance[2], rate[offline[t, 2]])
        forecast.end_iteration(used[t])


def test_a_requests_own_experts_are_kept_and_the_next_layers_before_the_last():
    rng = np.random.default_rng(1)
    forecast = DistanceForecast(3, 6, 2, fit_counts(sticky_requests(20, 40, rng)))
    used = sticky_requests(1, 40, rng)[0]
    for t in range(30):
        forecast.begin_iteration()
        forecast.end_iteration(used[t])
    flat = np.arange(18)
    keep = forecast.keep_scores(flat, np.zeros((3, 6)), current=-1).reshape(3, 6)
    share = used[:30].mean(0)
    assert keep[share > 0.5].mean() > keep[share < 0.2].mean()
    # The same chance one layer step away is kept over one a whole iteration away.
    forecast.chance[:] = 0.3
    forecast.scores = np.zeros((3, 6))
    keep = forecast.keep_scores(np.array([0, 6, 12]), np.zeros((3, 6)), current=0)
    assert keep[1] > keep[2] > keep[0]
    # A guide's need raises the chance of its layer's expert.
    need = np.zeros((3, 6))
    need[0, 0] = 0.9
    assert forecast.keep_scores(np.array([0]), need, 0)[0] > keep[0]
    # So does the reuse forecast's own score (the store's hint), where it beats the table's chance.
    forecast.scores[0, 0] = 0.9
    assert forecast.keep_scores(np.array([0]), np.zeros((3, 6)), 0)[0] > keep[0]


def test_bad_inputs_are_refused_with_their_values():
    from fmoe_jax.offload.policies.fmoe import FMoEOptions

    with pytest.raises(ValueError, match="expected"):
        DistanceForecast(1, 4, 2, np.zeros((2, CELLS - 1)))
    with pytest.raises(ValueError, match="reuse_distance"):
        FMoEOptions(reuse_distance=True, eviction="lru")


def test_from_traces_fits_the_table_and_the_replay_uses_it():
    from fmoe_jax.offload import OffloadConfig
    from fmoe_jax.offload.cost_model import MIXTRAL_8X7B, RTX_3090
    from fmoe_jax.offload.policies import FMoE
    from fmoe_jax.offload.simulator import simulate

    rng = np.random.default_rng(2)

    def trace(requests: int):
        return skewed_routing(rng, requests)

    options = dict(prefetch_distance=1, store_capacity=64, semantic=False, asynchronous=False)
    policy = FMoE.from_traces([trace(3)], reuse_distance=True, **options)
    fitted = policy._distance_counts[1].sum()
    assert fitted == 3 * 20 * 4 * 8
    replayed = trace(1)
    result = simulate(
        replayed, OffloadConfig(policy=policy, cache_experts=8), model=MIXTRAL_8X7B, hardware=RTX_3090
    )
    assert isinstance(policy.forecast, DistanceForecast) and policy.evictor.distance is policy.forecast
    assert result.hits + result.misses > 0
    assert policy.forecast.counts[1].sum() > fitted  # and learned online
