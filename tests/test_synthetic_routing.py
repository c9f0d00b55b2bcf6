"""Synthetic routing regimes (`fmoe_jax.research.synthetic_routing`) and the held-out protocol benchmark that
replays them (`benchmarks/external_routing.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fmoe_jax.research import synthetic_routing as sr

ROOT = Path(__file__).resolve().parents[1]


def decode_ids(traces) -> list[np.ndarray]:
    """Per request, the decode iterations' ids `[T, L, k]`."""
    return [np.concatenate([it.ids for it in t.requests[0].iterations[1:]]) for t in traces]


def repeat_rate(ids: np.ndarray) -> float:
    """Share of (token, layer) choices that the previous token also made at that layer."""
    same = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(-1)
    return float(same.mean())


def test_regimes_have_the_structure_they_are_named_for():
    kw = dict(requests=6, num_layers=8, num_experts=8, top_k=2, seed=1)
    traces = sr.generate(sr.REGIMES["recency"], **kw)
    assert len(traces) == 6 and all(len(t.requests) == 1 for t in traces)
    first = traces[0].requests[0].iterations
    assert first[0].ids.shape == (16, 8, 2) and all(it.ids.shape == (1, 8, 2) for it in first[1:])
    assert first[0].embeds is None and first[0].weights is not None
    np.testing.assert_allclose(first[1].weights.sum(-1), 1.0, rtol=0, atol=1e-6)
    assert all((np.sort(it.ids, -1)[..., 0] != np.sort(it.ids, -1)[..., 1]).all() for it in first)
    # Persistence: a choice of the previous token comes back 0.3 + 0.7 x 2/8 of the time, not 2/8.
    sticky = np.mean([repeat_rate(ids) for ids in decode_ids(traces)])
    uniform = sr.Regime(popularity=50.0, topic=50.0, persistence=0.0)
    loose = np.mean([repeat_rate(ids) for ids in decode_ids(sr.generate(uniform, **kw))])
    assert sticky == pytest.approx(0.3 + 0.7 * 0.25, abs=0.03) and loose == pytest.approx(0.25, abs=0.03)

    # Topic: each request concentrates on experts of its own, unlike the uniform recency regime.
    def concentration(traces) -> float:
        counts = [np.bincount(ids[:, 0].ravel(), minlength=8) for ids in decode_ids(traces)]
        return float(np.mean([np.sort(c)[-2:].sum() / c.sum() for c in counts]))

    assert concentration(sr.generate(sr.REGIMES["topic"], **kw)) > concentration(traces) + 0.2
    again = sr.generate(sr.REGIMES["recency"], **kw)
    assert all(np.array_equal(a, b) for a, b in zip(decode_ids(traces), decode_ids(again), strict=True))
    with pytest.raises(ValueError, match="persistence"):
        sr.Regime(popularity=1.0, topic=1.0, persistence=1.5)
    with pytest.raises(ValueError, match="top_k"):
        sr.generate(sr.REGIMES["topic"], requests=1, num_experts=4, top_k=5)


def test_shares_are_each_requests_choice_rates_and_leave_the_traces_as_they_were():
    """`generate_with_shares` returns `generate`'s very traces, and each request's shares are how often its
    tokens choose each expert (without persistence: tokens drawn independently), summing to k per layer."""
    kw = dict(requests=2, num_layers=3, num_experts=6, top_k=2, decode_tokens=(3000, 3001), seed=4)
    regime = sr.REGIMES["topic"]
    traces, shares = sr.generate_with_shares(regime, **kw)
    plain = sr.generate(regime, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(decode_ids(traces), decode_ids(plain), strict=True))
    assert len(shares) == 2 and all(s.shape == (3, 6) for s in shares)
    for ids, share in zip(decode_ids(traces), shares, strict=True):
        np.testing.assert_allclose(share.sum(-1), 2.0, atol=1e-9)
        rate = np.stack([np.bincount(ids[:, layer].ravel(), minlength=6) for layer in range(3)]) / len(ids)
        np.testing.assert_allclose(rate, share, atol=0.04)  # 3000 tokens: ~0.009 standard error
    assert not np.allclose(shares[0], shares[1], atol=0.05)  # each request its own experts


def test_external_routing_replays_each_request_after_the_others(tmp_path):
    """The benchmark on a saved trace and a synthetic regime: every policy row, LRU's ratio 1, and the
    oracle and Belady with the whole future at least as fast as on-demand LRU."""
    traces = sr.generate(sr.REGIMES["heldout_like"], requests=3, num_layers=4, decode_tokens=(6, 8), seed=2)
    import fmoe_jax as fj

    saved = tmp_path / "mine"
    fj.RoutingTrace(traces[0].meta, [t.requests[0] for t in traces]).save(saved)
    out = tmp_path / "results"
    command = [sys.executable, "-m", "benchmarks.external_routing", "--trace", str(saved)]
    command += ["--regimes", "topic", "--requests", "3", "--warm", "1", "--out", str(out)]
    subprocess.run(command, cwd=ROOT, check=True, timeout=600)
    rows = json.loads((out / "external_routing.json").read_text())["rows"]
    assert {r["routing"] for r in rows} == {"mine", "topic"}
    for name in ("mine", "topic"):
        mine = {r["policy"]: r for r in rows if r["routing"] == name}
        # Synthetic routing adds the bound of knowing each request's expert shares.
        assert len(mine) == (8 if name == "mine" else 9) and mine["on_demand_lru"]["tpot_vs_lru"] == 1.0
        assert mine["fmoe"]["requests"] == 3
        lru = mine["on_demand_lru"]["median_tpot_s"]
        assert mine["Belady, whole future"]["median_tpot_s"] <= lru and mine["oracle"]["median_tpot_s"] <= lru
    topic = {r["policy"]: r for r in rows if r["routing"] == "topic"}
    # Each request keeps to experts of its own: knowing them keeps more than recency does.
    assert topic["request's shares known"]["hit_rate"] > topic["on_demand_lru"]["hit_rate"] + 0.05
    assert (out / "external_routing.png").stat().st_size > 10_000


def test_readme_states_fmoe_and_the_known_shares_bound_per_routing_set():
    """The benchmarks README's sentence on `external_routing`: fMoE's ratio to LRU per routing set, where it
    is slower, and the known-shares bound where the routing is synthetic."""
    from benchmarks.make_readme import _external_sentence

    def row(routing, policy, ratio):
        return dict(routing=routing, policy=policy, tpot_vs_lru=ratio)

    rows = [row("mine", "fmoe", 0.9), row("topic", "fmoe", 1.05), row("topic", "request's shares known", 0.8)]
    text = _external_sentence({"rows": rows})
    assert "0.90x on mine, 1.05x on topic" in text and "slower than LRU on topic." in text
    assert "true expert shares" in text and "runs at 0.80x on topic:" in text
    assert "true expert shares" not in _external_sentence({"rows": rows[:2]})
