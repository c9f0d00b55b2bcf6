"""`python -m benchmarks.gpu_check --cpu-smoke`: every section of the GPU check runs at tiny sizes on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import gpu_check


def test_gpu_check_cpu_smoke_writes_every_section(tmp_path):
    """From the packed routing a lent machine is given (`--pack-routing`), as it runs there."""
    gpu_check.main(["--pack-routing", str(tmp_path / "pack")])
    payload = gpu_check.main(
        ["--cpu-smoke", "--out", str(tmp_path), "--routing-data", str(tmp_path / "pack")]
    )
    assert payload["errors"] == {}, payload["errors"]
    saved = json.loads((tmp_path / "gpu_check_cpu_smoke.json").read_text())
    host = saved["host"]["rows"]  # experiment 7's real-size rows of the two models the budget names
    assert len(host) == 3  # gpt-oss-20b with MXFP4 and with bf16 experts, Qwen1.5-MoE
    assert {r["model"].split(" (")[0] for r in host} == {"gpt-oss-20b", "Qwen1.5-MoE-A2.7B"}
    for r in host:
        assert r["fmoe_host_ms"] > 0 and r["matcher_share"] == r["fmoe_host_ms"] / r["compute_ms"]
    assert saved["link"]["latency"]["fit"]["rate_gbs"] > 0
    assert set(saved["link"]["control_flow"]["us_each"]) == {"cond", "switch", "loop"}
    select = saved["link"]["expert_select"]
    assert set(select["ms_per_layer"]) == {"switch", "pool"}
    assert select["max_abs_difference"] == 0.0  # a stacked pool computes what the engine's switch does
    rows = saved["offload_overhead"]["rows"]
    assert set(rows) == {"resident", "warm (cache = all)", "on_demand_lru 25%", "fmoe 25%"}
    assert rows["warm (cache = all)"]["launches_per_token"] == 1.0  # every expert resident: one launch
    replay = saved["live_replay"]["rows"]
    assert {(r["policy"], r["mode"]) for r in replay} == {
        (p, m) for p in ("on_demand_lru", "fmoe", "oracle") for m in ("copy", "hybrid")
    }
    assert all(r["live_tpot_ms"] > 0 and r["sim_tpot_ms"] > 0 for r in replay)
    text = (tmp_path / "gpu_check_cpu_smoke.md").read_text()
    assert "| live_replay |" in text and "fMoE's host work per decode iteration" in text


def test_link_fit_recovers_a_line_and_bounds_an_unresolved_rate():
    from benchmarks.link_compute import fit_link

    size = [1e6, 4e6, 16e6]
    exact = fit_link(size, [3e-4 + s / 50e9 for s in size])
    assert exact["resolved"] and abs(exact["rate_gbs"] - 50) < 1e-6 and abs(exact["latency_ms"] - 0.3) < 1e-9
    noisy = fit_link(size, [5e-4, 4e-4, 4.5e-4])  # larger copies no slower: noise, no slope
    assert not noisy["resolved"]
    assert noisy["rate_gbs"] == pytest.approx(16e6 / 4.5e-4 / 1e9)
    assert noisy["latency_ms"] == pytest.approx(0.4)
    origin = fit_link(size, [1e-4, 5e-4, 2.1e-3])  # intercept below zero: a line through the origin
    assert origin["resolved"] and origin["latency_ms"] == 0.0 and origin["rate_gbs"] > 0


def test_packed_routing_replays_the_same_requests_and_a_missing_set_is_refused(tmp_path, capsys):
    """`--pack-routing` keeps exactly what `live_replay.routing_requests` reads, of each split packed: the
    same requests, steps and weights as from the whole set; a check pointed at no routing set stops before any
    section runs."""
    from benchmarks import live_replay

    written = live_replay.write_subset(tmp_path, 3, 32, splits=("evaluation", "store"))
    assert written < 100_000  # tens of kB: it travels beside a 64 MiB working tree
    # gpu_check's replays, and engine_costs' relaunch (3 store requests of 32 steps)
    wanted = [("evaluation", *pair) for pair in gpu_check.REPLAYED.values()] + [("store", 3, 32)]
    for split, count, steps in wanted:
        whole = live_replay.routing_requests(count, steps, 24, split=split)
        packed = live_replay.routing_requests(count, steps, 24, tmp_path, split=split)
        assert [t.meta["requests"] for t in packed] == [t.meta["requests"] for t in whole]
        for a, b in zip(whole, packed, strict=True):
            pairs = zip(a.requests[0].iterations, b.requests[0].iterations, strict=True)
            assert all(np.array_equal(x.ids, y.ids) and np.array_equal(x.probs, y.probs) for x, y in pairs)
    with pytest.raises(SystemExit):
        gpu_check.main(["--routing-data", str(tmp_path / "absent")])
    assert "no routing set" in capsys.readouterr().err


def test_the_warm_up_request_is_never_among_the_measured(tmp_path):
    """`live_replay` warms the cache and the policy on one request and measures others: the warm-up (the
    split's last) is left out of the evenly spaced choice at every count, and a saved run's own names are what
    `routing_requests(names=...)` (`--resimulate`) replays, whatever the choice rule is now."""
    from benchmarks import live_replay
    from benchmarks.real_routing import request_names

    names = request_names("evaluation")
    for count in (1, 2, 3, 5, len(names) - 1, len(names) + 4):
        *measured, warmup = live_replay.chosen_requests(count)
        assert warmup == names[-1] and warmup not in measured
        assert len(measured) == min(count, len(names) - 1) == len(set(measured))
    saved = [names[0], names[-1], names[5]]  # as an older run chose them: the warm-up measured too
    traces = live_replay.routing_requests(2, 4, 24, names=saved)
    assert [t.meta["requests"][0] for t in traces] == saved
