"""fMoE's learned forecasts: calibrated need probabilities and reuse a few iterations ahead."""

from __future__ import annotations

import numpy as np
import pytest
from fmoe_jax.offload.policies.fmoe.forecast import GAP_EDGES, Calibration, ReuseForecast


def test_calibration_starts_as_the_raw_probability_and_learns_outcomes():
    cal = Calibration(prior_strength=4.0)
    p = np.array([0.1, 0.5, 0.9])
    np.testing.assert_allclose(cal.predict(p, np.full(3, 0.8), np.ones(3)), p, rtol=0, atol=1e-12)
    # Maps that say 0.9 at similarity 0.6, two layers ahead, are right only a fifth of the time.
    rng = np.random.default_rng(0)
    n = 500
    outcomes = rng.random(n) < 0.2
    cal.observe(np.full(n, 0.9), np.full(n, 0.6), np.full(n, 2), outcomes)
    q = cal.predict(np.array([0.9]), np.array([0.6]), np.array([2]))[0]
    assert q == pytest.approx(outcomes.mean(), abs=0.02)
    # Other bins (another distance, another similarity) are untouched.
    assert cal.predict(np.array([0.9]), np.array([0.6]), np.array([1]))[0] == pytest.approx(0.9)
    assert cal.predict(np.array([0.9]), np.array([0.99]), np.array([2]))[0] == pytest.approx(0.9)
    restored = Calibration()
    restored.load(cal.state())
    assert restored.predict(np.array([0.9]), np.array([0.6]), np.array([2]))[0] == pytest.approx(q)


def test_calibration_bins_index_the_tables_by_probability_similarity_distance_and_recency():
    """The flat bins `observe_binned` and `predict_binned` take (the fmoe policy keeps its guides' bins)."""
    from fmoe_jax.offload.policies.fmoe.forecast import MAX_DISTANCE, P_EDGES, S_EDGES

    cal = Calibration()
    p, s, d = np.array([0.0, 0.07, 0.99, 0.5]), np.array([0.2, 0.9, 1.0, 0.7]), np.array([1, 3, 9, 2])
    recency = np.array([0, 6, 2, 1])
    bins = cal.bins(p, s, d, recency)
    distance = np.minimum(d, MAX_DISTANCE) - 1
    want = (np.searchsorted(P_EDGES, p), np.searchsorted(S_EDGES, s), distance, recency)
    np.testing.assert_array_equal(np.unravel_index(bins, cal.seen.shape), want)
    cal.observe_binned(p, bins, np.array([True, False, True, False]))
    assert cal.seen[want].tolist() == [1.0] * 4 and cal.needed[want].tolist() == [1.0, 0.0, 1.0, 0.0]
    np.testing.assert_array_equal(cal.predict_binned(p, bins), cal.predict(p, s, d, recency))


def test_calibration_learns_recency_and_falls_back_to_the_pooled_rate():
    """Maps giving an expert p 0.1 are right half the time when the request used the expert a token ago
    (recency bin 0) and never otherwise; a recency bin never seen answers the rate pooled over recency,
    not the raw 0.1."""
    cal = Calibration(prior_strength=4.0)
    n = 400
    p, s, d = np.full(n, 0.1), np.full(n, 0.8), np.full(n, 2)
    recent = np.arange(n) % 2 == 0
    needed = recent & (np.arange(n) % 4 == 0)
    cal.observe(p, s, d, needed, np.where(recent, 0, 3))
    one = (np.array([0.1]), np.array([0.8]), np.array([2]))
    assert cal.predict(*one, np.array([0]))[0] == pytest.approx(0.5, abs=0.02)
    assert cal.predict(*one, np.array([3]))[0] == pytest.approx(0.0, abs=0.02)
    assert cal.predict(*one, np.array([5]))[0] == pytest.approx(needed.mean(), abs=0.01)


def test_reuse_forecast_learns_that_recent_experts_come_back():
    """A request whose every iteration reuses expert 0 of layer 0 and picks expert 1 or 2 at random: after
    some iterations expert 0 scores far above an expert unused for long."""
    forecast = ReuseForecast(1, 4, horizon=2)
    rng = np.random.default_rng(0)
    for _ in range(400):
        forecast.begin_iteration()
        used = np.zeros((1, 4), bool)
        used[0, 0] = True
        used[0, rng.integers(1, 3)] = True
        forecast.end_iteration(used)
    forecast.begin_iteration()
    scores = forecast.scores[0]
    assert scores[0] > 0.9  # used every iteration
    assert 0.5 < scores[1] < 1.0 and 0.5 < scores[2] < 1.0  # half the time, two chances in the horizon
    assert scores[3] < 0.4  # never used: no evidence it comes back
    assert scores[0] >= max(scores[1], scores[2]) > scores[3]  # (an expert just used shares expert 0's bin)


def test_reuse_forecast_learns_from_each_iteration_not_from_the_callers_array():
    """The fmoe policy refills one `used` array every iteration: the forecast must learn reuse within its
    horizon from what each iteration used, as if handed a fresh array each time (it once kept the caller's
    array, so every snapshot learned from the latest iteration alone)."""
    rng = np.random.default_rng(1)
    fresh, shared = ReuseForecast(2, 5, horizon=2), ReuseForecast(2, 5, horizon=2)
    used = np.zeros((2, 5), bool)
    for _ in range(50):
        routing = rng.random((2, 5)) < 0.3
        fresh.begin_iteration()
        fresh.end_iteration(routing.copy())
        shared.begin_iteration()
        used[:] = routing
        shared.end_iteration(used)
        used[:] = False  # the policy's next iteration starts from nothing
    np.testing.assert_array_equal(shared.reused, fresh.reused)
    np.testing.assert_array_equal(shared.seen, fresh.seen)
    assert fresh.reused.sum() > 0


def test_reuse_forecast_recency_is_the_gap_since_each_experts_last_use():
    """`recency` (Calibration's recency bin, and the forecast's own gap feature) bins the iterations since
    the request last used each expert: 0 for the last iteration, up to "9 or more", and "never" for an
    expert the request has not used; a new request starts over."""
    rng = np.random.default_rng(2)
    forecast = ReuseForecast(3, 4, horizon=2)
    never = len(GAP_EDGES) + 1
    for request in range(2):
        last = np.full((3, 4), -1)
        for t in range(30):
            gap = np.where(last < 0, never, np.searchsorted(GAP_EDGES, t - 1 - last, side="right"))
            np.testing.assert_array_equal(forecast.recency, gap, err_msg=f"request {request}, iteration {t}")
            forecast.begin_iteration()
            used = rng.random((3, 4)) < (0.05 if t < 20 else 0.4)  # long gaps, then short ones
            forecast.end_iteration(used)
            last = np.where(used, t, last)
        forecast.start_request()
        np.testing.assert_array_equal(forecast.recency, np.full((3, 4), never))


def test_reuse_forecast_marks_experts_used_in_the_current_iteration():
    forecast = ReuseForecast(2, 3, horizon=1)
    for _ in range(20):
        forecast.begin_iteration()
        used = np.zeros((2, 3), bool)
        used[:, 0] = True
        forecast.end_iteration(used)
    forecast.start_request()  # a new request: nothing used yet, expert 0 is not special any more
    forecast.begin_iteration()
    before = forecast.scores[1, 0]
    forecast.mark_used(1, np.array([0]))
    assert forecast.scores[1, 0] > before  # used now: scored as used in the previous iteration
    with pytest.raises(ValueError, match="horizon must be >= 1"):
        ReuseForecast(2, 3, horizon=0)


def test_reuse_forecast_rescores_the_experts_a_routed_layer_passed_by():
    """Experts come in runs of 6 iterations: just used, an expert is often used again within 2 iterations,
    unless the run has ended, which the layer routing without it says. Once the layer has routed without
    it, its score falls to the table of experts their own iteration missed; the expert it used scores as
    just used. State round-trips with both tables."""
    forecast = ReuseForecast(1, 8, horizon=2)
    rng = np.random.default_rng(0)
    current = 0
    for t in range(600):
        if t % 6 == 0:
            current = int(rng.integers(0, 8))
        forecast.begin_iteration()
        used = np.zeros((1, 8), bool)
        used[0, current] = True
        forecast.end_iteration(used)
    forecast.begin_iteration()
    before = forecast.scores[0, current]
    assert before > 0.45  # used by the previous iteration: the run may go on
    other = (current + 1) % 8
    forecast.mark_used(0, np.array([other]))
    assert forecast.scores[0, current] < 0.25  # the layer routed without it: the run has ended
    assert forecast.scores[0, other] > 0.45
    restored = ReuseForecast(1, 8, horizon=2)
    restored.load(forecast.state())
    np.testing.assert_array_equal(restored.reused_missed, forecast.reused_missed)
    assert restored.seen_missed.sum() > 0


def test_reuse_tables_load_only_into_a_forecast_of_the_same_horizon():
    """A store saved beside a cache of another size (`reuse_horizon="auto"`) carries tables counted over
    another horizon: those are left out, not mixed in. A state without a horizon (saved before it was
    recorded) counted over 2 iterations."""
    forecast = ReuseForecast(1, 4, horizon=3)
    for t in range(40):
        forecast.begin_iteration()
        forecast.end_iteration(np.eye(4, dtype=bool)[[t % 4]])
    state = forecast.state()
    assert int(state["reuse_horizon"]) == 3 and forecast.seen.sum() > 0
    same, other = ReuseForecast(1, 4, horizon=3), ReuseForecast(1, 4, horizon=2)
    same.load(state)
    other.load(state)
    np.testing.assert_array_equal(same.seen, forecast.seen)
    assert other.seen.sum() == 0
    legacy = {k: v for k, v in state.items() if k != "reuse_horizon"}
    other.load(legacy)
    np.testing.assert_array_equal(other.seen, forecast.seen)


def test_sticky_forecast_tells_a_requests_own_experts_from_a_passing_one():
    """Two experts with the same gap and the same recent share, one used for most of the request and one
    once: only the sticky feature (the long-run share) puts them in different bins, and each bin learns its
    own reuse rate."""

    def replay(sticky: bool) -> ReuseForecast:
        forecast = ReuseForecast(1, 2, sticky=sticky)
        for t in range(60):
            forecast.begin_iteration()
            forecast.end_iteration(np.array([[t < 40 or t == 59, t == 59]]))
        return forecast

    plain, sticky = replay(False).bins(), replay(True).bins()
    assert plain[0, 0] == plain[0, 1]
    assert sticky[0, 0] != sticky[0, 1]
    assert replay(True).reused.shape == (*replay(False).reused.shape[:2], 6, replay(False).reused.shape[3])
