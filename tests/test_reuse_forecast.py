"""`benchmarks.reuse_forecast`: the features and outcomes it replays, and how it scores forecasts."""

from __future__ import annotations

import argparse
import types

import numpy as np
import pytest

import fmoe_jax as fj
from benchmarks import reuse_forecast as rf
from fmoe_jax.trace import Iteration, RequestTrace

LAYERS, EXPERTS = 1, 3


def request(route: list[int], rng: np.random.Generator) -> types.SimpleNamespace:
    """A batch-1 request whose only MoE layer picks `route[t]` (top 1) at iteration t, one token each."""
    iterations = []
    for expert in route:
        probs = np.full((1, LAYERS, EXPERTS), 0.05, np.float32)
        probs[0, 0, expert] = 0.9
        ids = np.array([[[expert]]], np.int32)
        iterations.append(
            Iteration(ids=ids, probs=probs, embeds=rng.standard_normal((1, 4)).astype(np.float32))
        )
    meta = dict(num_layers=LAYERS, num_experts=EXPERTS, top_k=1, embed_dim=4)
    return types.SimpleNamespace(trace=fj.RoutingTrace(meta, [RequestTrace([0], iterations)]))


def workload(eval_routes: list[list[int]]) -> types.SimpleNamespace:
    rng = np.random.default_rng(0)
    return types.SimpleNamespace(
        store=[request([0, 1] * 4, rng)],
        eval=[request(route, rng) for route in eval_routes],
        args=argparse.Namespace(store_capacity=64, prefetch_distance=1),
    )


def test_auc_counts_every_pair_and_ties_as_half():
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 4, 60).astype(float)  # many ties
    labels = rng.random(60) < 0.4
    pos, neg = scores[labels], scores[~labels]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert rf.auc(scores, labels) == pytest.approx(pairs / (len(pos) * len(neg)), abs=1e-12)


def test_collect_lines_features_up_with_the_iterations_after_them():
    # Expert 0 at even iterations, 1 at odd ones, 2 once at iteration 5.
    route = [0, 1, 0, 1, 0, 2, 0, 1]
    data = rf.collect(workload([route]), neighbours=2)
    rows = range(1, len(route) - rf.HORIZON)  # iterations with a gap before and two after
    assert data["reused"].shape == (len(rows), EXPERTS)
    for row, t in enumerate(rows):
        for expert in range(EXPERTS):
            before = [s for s in range(t) if route[s] == expert]
            gap = t - 1 - before[-1] if before else rf.GAP_NEVER
            assert data["gap"][row, expert] == gap, (t, expert)
            assert data["reused"][row, expert] == (expert in route[t + 1 : t + 1 + rf.HORIZON]), (t, expert)
            assert data["used_next"][row, expert] == (route[t + 1] == expert)
            assert data["used_now"][row, expert] == (route[t] == expert)
        # The hint is what followed maps like the previous token's: a distribution over the experts.
        assert data["hint"][row].min() >= 0 and data["hint"][row].sum() == pytest.approx(1.0, abs=1e-5)


def test_a_forecast_that_knows_the_pattern_ranks_perfectly():
    """After a prompt that routes to experts 0 and 1, they alternate: each is always reused within two
    iterations, expert 2 never. Recency (gap, share) separates them perfectly on the held-out half."""
    data = rf.collect(workload([[[0, 1]] + [0, 1] * 6] * 4), neighbours=2)
    rows = {row["forecast"]: row for row in rf.evaluate(data, budget=2 / 3)}
    assert rows["gap, share"]["auc"] == pytest.approx(1.0)
    assert rows["gap, share"]["next_token_hit"] == pytest.approx(1.0)
    # Nothing is left between recency and foresight here, so no share of it is reported.
    assert np.isnan(rows["ceiling: next token known"]["to_ceiling"])


def test_foresight_beats_recency_when_routing_is_random():
    rng = np.random.default_rng(3)
    data = rf.collect(workload([rng.integers(0, EXPERTS, 16).tolist() for _ in range(6)]), neighbours=2)
    rows = {row["forecast"]: row for row in rf.evaluate(data, budget=1 / 3)}
    ceiling, recency = rows["ceiling: next token known"], rows["gap, share"]
    assert ceiling["next_token_hit"] == pytest.approx(1.0)
    assert ceiling["auc"] > recency["auc"] and ceiling["log_loss"] < recency["log_loss"]
    assert ceiling["to_ceiling"] == pytest.approx(1.0) and recency["to_ceiling"] == 0.0
